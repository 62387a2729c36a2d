"""The parts a broker runs in each process, wired together.

Built by :class:`~.broker.PostgresBroker` on first use in a process, and again
after ``fork`` (the parent's threads are not the child's).  Each part gets the
database, the bound statements and the settings, never the broker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from .config import Settings
from .consumer import LostClaims
from .database import Database
from .fencing import StaleWrites
from .leases import LeaseKeeper, Leases, StartGate
from .maintenance import Maintenance
from .outcomes import OutcomeWriter
from .sql import Statements


class ProcessParts:
    """The lease registry and keeper, the start gate, the maintenance loop and the outcome writer of one process."""

    def __init__(
        self,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        on_dead: Callable[[str, BaseException | None], None],
        writer: str,
    ) -> None:
        self.pid = os.getpid()
        self.stale = StaleWrites(statements, logger)
        self.leases = Leases()
        self.lost_claims = LostClaims()
        self.keeper = LeaseKeeper(self.leases, database, statements, settings, logger)
        self.gate = StartGate(self.leases, database, statements)
        self.maintenance = Maintenance(self.leases, database, statements, settings, logger)
        self.writer = OutcomeWriter(
            database, statements, settings, self.leases, self.stale, logger, on_dead=on_dead, writer=writer
        )
        self.consumers = 0  #: consumers made in this process (each gets an id of its own)

    def close(self) -> None:
        self.writer.stop()
        self.keeper.stop()
        self.maintenance.stop()
