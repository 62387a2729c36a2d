"""The operators' console's data, as methods of the broker (:class:`ConsoleMethods`).

Each method calls a plain function over a :class:`~.database.Database` and
the bound statements, which the dashboard and the CLI may call directly:
worker processes (:mod:`.processes`), outcome counters (:mod:`.admin`),
charts' series (:mod:`.charts`), search (:mod:`.search`), bulk actions and
their audit log (:mod:`.bulk`).  docs/console-data.md lists what each returns.

The charts' series, search and bulk actions are imported when first called: a worker process, which never
calls them, does not load them at start-up.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..core.processes import processes
from ..db.database import Database
from ..db.statements import Statements
from . import admin

if TYPE_CHECKING:
    from . import bulk, charts


class ConsoleMethods:
    """The console's reads and bulk actions, as methods of :class:`~.broker.PostgresBroker` (a mixin: it
    needs the broker's ``database``, ``reader``, ``statements``, ``channel``, ``listen`` and per-process
    ``parts``).  Reads go to the ``reader``, actions (and their previews) to the ``database``."""

    database: Database
    reader: Database
    statements: Statements
    channel: str
    listen: bool
    queues: set[str]
    logger: logging.Logger
    _parts: Any

    @property
    def parts(self) -> Any:
        raise NotImplementedError

    def processes(self, *, stale_after: float | None = None) -> list[dict[str, Any]]:
        """Every registered worker process (see :func:`.processes.processes`)."""
        return processes(self.reader, self.statements, stale_after=stale_after)

    def outcome_totals(self) -> dict[str, dict[str, int]]:
        """Per queue, ever: ``finished_total``, ``dead_total``, ``retried_total`` (see :func:`.admin.outcome_totals`)."""
        return admin.outcome_totals(self.reader, self.statements)

    def series(self, *, queue: str | None = None, span: str = "hour") -> charts.Series:
        """A chart's data: per minute over the last hour or day, for *queue* or all queues (see
        :func:`.charts.series`)."""
        from . import charts

        return charts.series(self.reader, self.statements, queue=queue, span=span)

    def search(
        self,
        *,
        message_id: str | None = None,
        queue: str | None = None,
        actor: str | None = None,
        state: str | None = None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        value: str | None = None,
        after: str | None = None,
        limit: int = 50,
    ) -> admin.Page:
        """A keyset page of the messages (message table and history) that match every filter given
        (see :func:`.search.search`)."""
        from . import search

        return search.search(
            self.reader,
            self.statements,
            message_id=message_id,
            queue=queue,
            actor=actor,
            state=state,
            args=args,
            kwargs=kwargs,
            value=value,
            after=after,
            limit=limit,
        )

    def bulk_preview(
        self,
        action: str,
        *,
        ids: list[str] | None = None,
        queue: str | None = None,
        actor: str | None = None,
        state: str | None = None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        value: str | None = None,
    ) -> bulk.Preview:
        """How many messages a bulk *action* would touch now (see :func:`.bulk.bulk_preview`); read on the
        primary, where the action runs."""
        from . import bulk

        return bulk.bulk_preview(
            self.database,
            self.statements,
            action,
            ids=ids,
            queue=queue,
            actor=actor,
            state=state,
            args=args,
            kwargs=kwargs,
            value=value,
        )

    def bulk(
        self,
        action: str,
        *,
        who: str,
        ids: list[str] | None = None,
        queue: str | None = None,
        actor: str | None = None,
        state: str | None = None,
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        value: str | None = None,
    ) -> bulk.BulkResult:
        """Re-drive, cancel, purge or run now (*action*) the selected messages: counted, recorded in the
        audit log as *who*, then done (see :mod:`.bulk`)."""
        from . import bulk

        return bulk.bulk(
            self.database,
            self.statements,
            action,
            who=who,
            channel=self.channel,
            listen=self.listen,
            ids=ids,
            queue=queue,
            actor=actor,
            state=state,
            args=args,
            kwargs=kwargs,
            value=value,
        )

    def audit_log(self, *, after: str | None = None, limit: int = 50) -> admin.Page:
        """The bulk actions done, newest first (see :func:`.bulk.audit_log`)."""
        from . import bulk

        return bulk.audit_log(self.reader, self.statements, after=after, limit=limit)

    def worker_started(self, worker: Any) -> None:
        """A Dramatiq worker booted in this process: register it (its row in ``process``)."""
        whitelist = getattr(worker, "consumer_whitelist", None)
        queues = set(whitelist) if whitelist else set(self.queues)
        self.parts.heartbeat.register(queues, getattr(worker, "worker_threads", 0), self.logger)

    def worker_stopped(self) -> None:
        """The worker of this process shut down cleanly: its row goes."""
        parts = self._parts
        if parts is not None and parts.pid == os.getpid():
            parts.heartbeat.unregister()
