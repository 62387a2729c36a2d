"""A message's id over several databases, for operators: :func:`cancel` and :func:`locate`.

:class:`~.routing.RoutedBroker`, the CLI and the dashboard (through :class:`~.fleet.Fleet`) find a
message by its id in whichever database holds it.  Two things make that more than "ask each in turn":

- **A relay's move.**  A message whose queue lives in another database waits in an outbox until a
  relay moves it (routing.py): the relay deletes the row in the source (its lock held, the delete
  not committed), inserts it in the target and commits there, and only then commits the delete.
  A cancel that asked the target before the insert and the source after the delete would miss it
  everywhere, and the message would run.  So every database is first *peeked at* (a plain read,
  which a relay's uncommitted delete does not hide), and the cancels follow, those that held the id
  first: the source's cancel waits for the relay's lock, and finds the row gone only once the
  target's insert committed, so the target, asked after it, has it.  A relay that fails between its
  two commits leaves the row in both databases (the next move inserts nothing again): the cancel
  goes on through every database, so neither copy runs.  A queued row whose lock outlasts the
  cancel's lock timeout is a relay's move (a fenced transaction locks running rows): the round is
  asked again, for at most :data:`MOVE_WAIT` seconds, then :attr:`~.admin.CancelOutcome.MOVING`.
  A cancelled outbox row is never moved (the relay takes queued rows only).
- **A database that does not answer** (a connection error, as :func:`.errors.lost_connection` says)
  is skipped after its first failure (about a second: the pool's reconnect round) and named in
  ``unreachable``: a message in another database is cancelled or shown there; one found in none of
  those that answered is not "not found" but :class:`Unreachable` for the callers that answer with
  a single outcome (``RoutedBroker.cancel`` and ``inspect``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.errors import ConnectionClosed

from ..core.fencing import State
from ..errors import describe_failure, lost_connection
from . import admin
from .admin import CancelOutcome

if TYPE_CHECKING:
    from .site import Site

logger = logging.getLogger(__name__)

#: Seconds a cancel waits for a relay that holds the message's row (moving it) before it answers ``MOVING``.
MOVE_WAIT = 30.0

#: Which answer wins when the message was found in several databases (a relay's leftover): the one
#: that did most.
_RANK = {
    CancelOutcome.RUNNING: 0,
    CancelOutcome.QUEUED: 1,
    CancelOutcome.IN_FENCED_TRANSACTION: 2,
    CancelOutcome.MOVING: 3,
    CancelOutcome.ALREADY_CANCELLED: 4,
    CancelOutcome.DEAD: 5,
    CancelOutcome.NOT_FOUND: 6,
}


class Unreachable(ConnectionClosed):
    """The message is in none of the databases that answered, and ``databases`` did not answer: it
    may be there.  (A ``ConnectionClosed``: what a database that does not answer raised before.)"""

    def __init__(self, message_id: str, databases: Sequence[str]) -> None:
        self.message_id = message_id
        self.databases = list(databases)
        names = ", ".join(self.databases)
        super().__init__(
            f"message {message_id} is in none of the databases that answered; "
            f"database{'s' if len(self.databases) > 1 else ''} {names} did not answer (it may be there)"
        )


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """What :func:`cancel` did: its outcome, the database where it applied (``None``: found in none),
    and the databases that did not answer."""

    outcome: CancelOutcome
    database: str | None
    unreachable: list[str]

    def checked(self, message_id: str) -> CancelOutcome:
        """The outcome; :class:`Unreachable` instead of a ``NOT_FOUND`` that a missing database leaves open."""
        if self.outcome is CancelOutcome.NOT_FOUND and self.unreachable:
            raise Unreachable(message_id, self.unreachable)
        return self.outcome


@dataclasses.dataclass(frozen=True)
class Located:
    """What :func:`locate` found: the database holding the message and the message as it has it
    (:func:`.admin.inspect`), ``None`` for both if none of those that answered has it; and the
    databases that did not answer."""

    site: Site | None
    info: dict[str, Any] | None
    unreachable: list[str]

    def checked(self, message_id: str) -> Located:
        """Itself; :class:`Unreachable` when the message was not found and a database did not answer."""
        if self.info is None and self.unreachable:
            raise Unreachable(message_id, self.unreachable)
        return self


def unreachable(error: BaseException) -> bool:
    """Does *error* say the database did not answer (rather than refuse the statement)?"""
    return isinstance(error, ConnectionClosed) or (isinstance(error, psycopg.Error) and lost_connection(error))


def _peek(conn: psycopg.Connection, *, statement: bytes, id: str) -> Any:
    """The row's (state, attempt, seq), a plain read: a relay's uncommitted delete does not hide it."""
    return conn.execute(statement, [id]).fetchone()


def _away(site: Site, error: BaseException, away: list[str]) -> None:
    if not unreachable(error):
        raise error
    logger.warning("Database %r did not answer: %s", site.name, describe_failure(error))
    away.append(site.name)


def cancel(
    sites: Sequence[Site],
    message_id: str,
    *,
    seen: str | None = None,
    database: str | None = None,
    wait: float = MOVE_WAIT,
) -> Cancelled:
    """Cancel *message_id* wherever it is, in flight between two databases included (see the module).

    *seen* (:func:`.admin.inspect`'s ``version``, as shown): only the row shown.  With *database*
    (where it was shown) the version is that database's: asked there first, and elsewhere (without
    it) only once that row was cancelled there or moved from there meanwhile.
    """
    message_id = admin.check_message_id(message_id)
    deadline = time.monotonic() + wait
    best, where = CancelOutcome.NOT_FOUND, None
    while True:
        away: list[str] = []
        peeked: dict[str, Any] = {}
        for s in sites:
            try:
                peeked[s.name] = s.database.run(functools.partial(_peek, statement=s.statements.state_of, id=message_id))
            except Exception as e:
                _away(s, e, away)
        # The database named first, then those that hold the id, then the others (see the module).
        order = sorted((s for s in sites if s.name in peeked), key=lambda s: (s.name != database, peeked[s.name] is None))
        follow = database is None or seen is None
        moving = False
        for s in order:
            if not follow and s.name != database:
                continue
            was = peeked[s.name]
            try:
                outcome = admin.cancel(
                    s.database, s.statements, message_id, channel=s.settings.channel,
                    seen=seen if database is None or s.name == database else None,
                )  # fmt: skip
            except Exception as e:
                _away(s, e, away)
                continue
            queued = was is not None and was[0] == State.QUEUED.value
            if outcome is CancelOutcome.IN_FENCED_TRANSACTION and queued:
                moving = True  # a relay holds it (a fenced transaction locks a running row): ask again
                continue
            if s.name == database and (outcome is not CancelOutcome.NOT_FOUND or queued):
                follow = True  # cancelled, or moved away meanwhile: a copy or the move's target elsewhere
            if _RANK[outcome] < _RANK[best]:
                best, where = outcome, s.name
        if moving and time.monotonic() < deadline:
            continue
        if moving and _RANK[best] > _RANK[CancelOutcome.MOVING]:
            best, where = CancelOutcome.MOVING, None
        return Cancelled(best, where, away)


def locate(sites: Sequence[Site], message_id: str) -> Located:
    """The database holding *message_id* and the message as it has it (each database read in turn; a
    second round over those that answered when none had it: a relay may have moved it from one not
    read yet to one read already)."""
    message_id = admin.check_message_id(message_id)
    away: list[str] = []
    answered = list(sites)
    for _ in range(2):
        for s in list(answered):
            try:
                info = admin.inspect(s.reader, s.statements, message_id)
            except Exception as e:
                _away(s, e, away)
                answered.remove(s)
                continue
            if info is not None:
                return Located(s, info, away)
    return Located(None, None, away)


__all__ = ["MOVE_WAIT", "Cancelled", "Located", "Unreachable", "cancel", "locate", "unreachable"]
