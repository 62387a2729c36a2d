"""One database as the operators' tools see it: :class:`Site` (a :class:`~.fleet.Fleet` is named sites)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from ..config import Settings
from ..db.database import Database
from ..db.statements import Statements
from . import admin


@dataclasses.dataclass(frozen=True)
class Site:
    """One database of a fleet: what the operator's functions (:mod:`.admin`, ...) are given."""

    name: str  #: ``""`` for the only database of a fleet of one
    database: Database  #: actions (and reads that must see the primary)
    reader: Database  #: the pages' and listings' reads (a replica's, with ``read_url``)
    statements: Statements
    settings: Settings
    declared: Callable[[], Iterable[str]] = tuple  #: the queues of the actors routed here

    @classmethod
    def of(cls, name: str, broker: Any) -> Site:
        """The site of a :class:`~.broker.PostgresBroker` (one database of a ``RoutedBroker``: a shard)."""
        return cls(
            name=name,
            database=broker.database,
            reader=getattr(broker, "reader", None) or broker.database,
            statements=broker.statements,
            settings=broker.settings,
            declared=broker.get_declared_queues,
        )

    @property
    def label(self) -> str:
        """How messages name it: ``database NAME`` (nothing for a fleet of one)."""
        return f"database {self.name}" if self.name else ""

    def known_queues(self) -> set[str]:
        """The queues this database knows (messages, pauses, schedules) or that are declared here."""
        return set(admin.known_queues(self.reader, self.statements)).union(self.declared())
