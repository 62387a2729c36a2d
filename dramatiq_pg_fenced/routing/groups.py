"""Group barriers over several databases (:class:`~.routing.RoutedBroker`): one home, countdowns relayed.

A group's barrier (the countdown ``group([...]).add_completion_callback(...).run()`` creates) lives
in one database, its *home*: the database of the rate-limiter backend given to
:class:`~.rate_limits.FencedGroupCallbacks`, which must be one of the router's databases (with its
schema)::

    backend = rate_limits.PostgresBackend(broker=router.shards["main"])  # "main" is the home
    router.add_middleware(FencedGroupCallbacks(backend))

A member counts the barrier down with its ack, only if that ack applies (a fenced-out member does
not count; a member retried counts once, with the ack of the attempt that succeeded):

- a member whose queue lives in the home counts down in its ack's transaction, as with one
  database (:class:`~.delivery.Countdown`), and the member that clears the barrier writes the
  completion messages there too;
- a member of another database writes, in its ack's transaction, a *countdown row* to its
  database's outbox: a queued row of :data:`COUNTDOWN_QUEUE`, which no worker consumes and which
  the router routes to the home.  The relay (routing.py) takes it like any outbox row (only once
  the member's ack that wrote it is on disk: a countdown moved before a crash undid that ack would
  be applied again by the delivery run again, and clear the barrier early) and, instead
  of inserting a message at the home, applies it there (:func:`count_down_at_home`): in one
  transaction, the row's ``relayed`` row (keyed as a moved message is: its id, the source
  database and its ``seq`` there) and, only if that row is new, the countdown; a relay that dies
  before deleting the row moves it again, and the countdown is not applied twice.

Completion messages are written in the home; one whose queue lives elsewhere is an outbox row
there, relayed once more.  Results stay with each member, in its queue's database
(:class:`~.routing.RoutedResultBackend`): a member's result commits with its ack, before its
countdown row can be moved, so a completion callback reads every member's result.

Cost: a member in the home pays what it pays with one database (one conditional update in its
ack's transaction).  A member elsewhere pays one more row in its ack's insert, and its relay one
take-and-delete there and one transaction at the home (its ``relayed`` row and the update); the
completion waits for the relay (its doorbell: usually milliseconds).  Every countdown of a group
updates one row at the home: a group's members serialise there, as with one database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dramatiq.message import Message

from ..core.delivery import Countdown

if TYPE_CHECKING:
    from ..broker import PostgresBroker

#: The queue of countdown rows (an outbox no worker consumes; routed to the groups' home).
COUNTDOWN_QUEUE = "dramatiq-pg-fenced.countdown"
#: Their actor name (no actor of that name exists: nothing runs them).
COUNTDOWN_ACTOR = "dramatiq_pg_fenced_group_countdown"


def countdown_message(member: Any, key: str, ttl: int, completions: Sequence[Message[Any]]) -> Message[Any]:
    """The countdown row of *member* (a delivery) for the barrier at *key*, with its group's
    completion messages (sent by the member that clears it)."""
    return Message(
        queue_name=COUNTDOWN_QUEUE,
        actor_name=COUNTDOWN_ACTOR,
        args=(),
        kwargs={},
        options={
            "barrier": key,
            "ttl": int(ttl),
            "completions": [m.asdict() for m in completions],
            "member": member.message_id,
        },
    )


def count_down_at_home(
    home: PostgresBroker, source: str, rows: Sequence[tuple[Any, ...]]
) -> tuple[int, list[tuple[tuple[Any, ...], str]]]:
    """Apply countdown rows moved from database *source*'s outbox (rows of ``relay_take``), each once,
    in their order there, in one transaction at *home*.  Returns how many were new, and the rows
    that are no countdown (undecodable, or options that name no barrier), each with why: the relay
    dead-letters those in *source* rather than fail on them forever and hold up the rest."""
    rows = sorted(rows, key=lambda r: r[8])  # seq: the order they were written in
    good: list[tuple[tuple[Any, ...], Countdown]] = []
    bad: list[tuple[tuple[Any, ...], str]] = []
    for row in rows:
        try:
            good.append((row, _countdown(home, bytes(row[5]))))
        except Exception as e:  # whatever a strange payload raises: it is refused, not retried
            bad.append((row, f"not a group countdown: {type(e).__name__}: {e}"))
    if not good:
        return 0, bad
    params = {"source": source, "ids": [r[0] for r, _ in good], "seqs": [r[8] for r, _ in good]}
    with home.database.connection() as conn, conn.transaction():
        fresh = {str(r[0]) for r in conn.execute(home.statements.relay_mark, params).fetchall()}
        # A row not fresh was moved before: its countdown was applied then.
        countdowns = [countdown for row, countdown in good if str(row[0]) in fresh]
        if countdowns:
            home.parts.writer.write_countdowns(conn, countdowns)
    return len(fresh), bad


def _countdown(home: PostgresBroker, payload: bytes) -> Countdown:
    """The countdown a row's *payload* carries (raises on anything else)."""
    options = Message.decode(payload).options
    completions = [home.row(Message(**m), None) for m in options["completions"]]
    barrier, ttl = options["barrier"], int(options["ttl"])
    if not isinstance(barrier, str):
        raise TypeError(f"barrier {barrier!r} is not a key")
    return Countdown(barrier, ttl, completions)


__all__ = ["COUNTDOWN_ACTOR", "COUNTDOWN_QUEUE", "count_down_at_home", "countdown_message"]
