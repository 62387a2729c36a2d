"""What operators do to messages and queues: cancel, inspect, re-drive, list,
purge, pause and resume, count, compact.

Functions over a :class:`~.database.Database` and the bound statements; the
broker's methods of the same names call them (:class:`OperatorMethods`), as does the CLI.
They live by concern in :mod:`.messages` (cancel, inspect, re-drive, errors), :mod:`.queues`
(purge, pause, counts, compaction) and :mod:`.listing` (pages of messages); every name is
also here, as ``admin.<name>``, loaded on first use (module ``__getattr__``): the broker's class
is built on :class:`OperatorMethods`, and a worker process, which never calls an operator's
function, does not load them at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..core.fencing import State
from ..db.database import Database
from ..db.statements import OVERVIEW_COLUMNS as OVERVIEW_COLUMNS
from ..db.statements import Statements
from ..db.statements import check_message_id as check_message_id

if TYPE_CHECKING:  # what ``admin.<name>`` gives, loaded by __getattr__ at run time
    from .listing import (  # noqa: F401
        _FIRST,
        _LIST_COLUMNS,
        FILTER_WINDOW,
        LISTABLE,
        Page,
        _stamp,
        list_messages,
        page_cursor,
    )
    from .messages import (  # noqa: F401
        _HISTORY_KEYS,
        _INSPECT_COLUMNS,
        _TRACEBACK,
        BATCH,
        CANCEL_LOCK_TIMEOUT,
        NEWLINE,
        OUTCOMES,
        CancelOutcome,
        Redriven,
        _cut_note,
        _described,
        _fetch,
        _finished_states,
        cancel,
        check_version,
        error_summary,
        inspect,
        redrive,
        redrive_queue,
        reset_payload,
        state_of,
        still_running_note,
        story,
        with_error,
    )
    from .queues import (  # noqa: F401
        FAIR_TOP,
        NAMED_QUEUES,
        PURGEABLE,
        TOTALS,
        UnknownQueue,
        _totals,
        _vacuum_full,
        check_known,
        compact,
        counters,
        fair_keys,
        known_queues,
        outcome_totals,
        overview,
        pause,
        paused,
        purge_counts,
        purge_queue,
        queue_counts,
        resume,
        unknown_queue,
    )

#: Where the operator's functions live, searched in this order by ``admin.<name>``.
_PARTS = ("listing", "messages", "queues")


def __getattr__(name: str) -> Any:
    """``admin.<name>``: the operator's function (or constant, or class) of that name, from the module of
    :data:`_PARTS` that defines it, imported on first use."""
    if not name.startswith("__"):
        for part in _PARTS:
            module = importlib.import_module(f"{__package__}.{part}")
            if name in vars(module):
                return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class OperatorMethods:
    """What operators do, as methods of :class:`~.broker.PostgresBroker` (a mixin: it needs the
    broker's ``database``, ``reader``, ``statements``, ``channel``, ``listen`` and declared ``queues``).
    Reads go to the ``reader`` (a replica's, with the broker's ``read_url``), actions to the ``database``."""

    database: Database
    reader: Database
    statements: Statements
    channel: str
    listen: bool
    queues: set[str]

    def cancel(self, message_id: str, *, seen: str | None = None) -> CancelOutcome:
        """Cancel a message so it never runs (again).

        Queued messages are cancelled whatever their attempt (a retry waiting
        for its backoff included).  A running message is marked cancelled: its
        attempt's ack, nack and retry become no-ops.  Nothing here is fenced on
        an attempt: cancellation is an administrative action on the message.
        *seen* (:meth:`inspect`'s ``version``): only the message shown, not
        its id sent again after it finished.  A message inside a fenced
        transaction is not waited for: ``IN_FENCED_TRANSACTION``, nothing changed.
        """
        from .messages import cancel

        return cancel(self.database, self.statements, message_id, channel=self.channel, seen=seen)

    def is_cancelled(self, message_id: str) -> bool:
        """For actors: was my message cancelled while I run?"""
        from .messages import state_of

        now = state_of(self.database, self.statements, message_id)
        return now is not None and now[0] == State.CANCELLED.value

    def inspect(self, message_id: str) -> dict[str, Any] | None:
        """What operators need to understand a message; ``None`` if unknown."""
        from .messages import inspect

        return inspect(self.reader, self.statements, message_id)

    def redrive(self, message_id: str, *, seen: str | None = None) -> bool:
        """Put a dead or cancelled message back in its queue, due now, with its retry count reset.

        Returns whether it went back (``False``: unknown, not dead or
        cancelled, or changed meanwhile).  Fenced on the row version read,
        or, with *seen* (:meth:`inspect`'s ``version``), on that one.
        """
        from .messages import redrive

        shown = None if seen is None else {message_id: seen}
        return bool(redrive(self.database, self.statements, [message_id], self._ring, seen=shown).redriven)

    def redrive_queue(
        self, queue_name: str, states: tuple[str, ...] = ("dead",), *, actor: str | None = None
    ) -> Redriven:
        """Re-drive every dead (or, with ``states``, cancelled) message of a queue (of *actor* only, if given)."""
        from .messages import redrive_queue

        self._known(queue_name)
        return redrive_queue(self.database, self.statements, queue_name, states, self._ring, actor=actor)

    def purge_queue(
        self,
        queue_name: str,
        states: tuple[str, ...] = ("queued", "dead", "cancelled", "done"),
        *,
        actor: str | None = None,
    ) -> dict[str, int]:
        """Delete a queue's messages in *states* (``done``: its history; of *actor* only, if given), in
        bounded batches; never running ones."""
        from .queues import purge_queue

        self._known(queue_name)
        return purge_queue(self.database, self.statements, queue_name, states, actor=actor)

    def pause(self, queue_name: str, *, create: bool = False) -> bool:
        """Consumers of every process stop claiming from the queue (it survives restarts); running ones finish.

        A queue neither the database nor this broker's actors know of is refused
        (:class:`.admin.UnknownQueue`) unless *create*: paused ahead of its first message.
        """
        from .queues import pause

        if not create:
            self._known(queue_name, hint="pause(queue, create=True) pauses a queue before its first message")
        return pause(self.database, self.statements, queue_name)

    def resume(self, queue_name: str) -> bool:
        """Undo :meth:`pause`; consumers are woken at once."""
        from .queues import resume

        self._known(queue_name)
        return resume(self.database, self.statements, queue_name, self._ring)

    def list_messages(
        self, queue_name: str, state: str, *, actor: str | None = None, after: str | None = None, limit: int = 50
    ) -> Page:
        """A keyset page of a queue's messages in one state (see :func:`.admin.list_messages`)."""
        from .listing import list_messages
        from .queues import check_known

        check_known(self.reader, self.statements, queue_name, declared=self.queues)
        return list_messages(self.reader, self.statements, queue_name, state, actor=actor, after=after, limit=limit)

    def _known(self, queue_name: str, hint: str = "") -> None:
        """Refuse a queue nothing knows of (:func:`.admin.check_known`); this broker's declared queues are known."""
        from .queues import check_known

        check_known(self.database, self.statements, queue_name, declared=self.queues, hint=hint)

    def queue_overview(self, *, cap: int | None = None, fair_top: int | None = None) -> list[dict[str, Any]]:
        """Per queue: the operator's figures, the top *fair_top* fairness keys with messages due
        included (default :data:`.queues.FAIR_TOP`; see :func:`.admin.overview`)."""
        from .queues import FAIR_TOP, overview

        return overview(self.reader, self.statements, cap=cap, fair_top=FAIR_TOP if fair_top is None else fair_top)

    def fair_keys(self, queue_name: str | None = None, *, top: int | None = None) -> dict[str, dict[str, Any]]:
        """Per queue with keyed messages due (*queue_name* only, if given): how many fairness keys have
        messages due, the *top* keys (default :data:`.queues.FAIR_TOP`) by due messages with their oldest
        wait and weight, and the rest summed up (see :func:`.admin.fair_keys`)."""
        from .queues import FAIR_TOP, fair_keys

        return fair_keys(self.reader, self.statements, queue=queue_name, top=FAIR_TOP if top is None else top)

    @property
    def _ring(self) -> str | None:
        return self.channel if self.listen else None

    def compact(self, *, lock_timeout: float = 5.0) -> dict[str, int]:
        """Give back the space a drained backlog left behind (``VACUUM (FULL)``, never queued for its
        lock for more than *lock_timeout* seconds); returns the table's size before and after.
        Needs the table's owner.  See :func:`.admin.compact`."""
        from .queues import compact

        return compact(self.database, self.statements, lock_timeout=lock_timeout)
