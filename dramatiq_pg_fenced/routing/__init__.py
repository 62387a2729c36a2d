"""Queues over several PostgreSQL databases: :class:`RoutedBroker` (``router``), the relay of the
outbox (``relay``), results and schedules per database (``backends``), sends inside a transaction
(``sends``) and group barriers (``groups``)."""

from .backends import RoutedResultBackend, RoutedSchedules
from .relay import RELAY_BATCH, RELAY_GROUP, RELAY_POLL, RELAYED_KEEP, Relay
from .router import RoutedBroker, RouteError

__all__ = [
    "RELAYED_KEEP",
    "RELAY_BATCH",
    "RELAY_GROUP",
    "RELAY_POLL",
    "Relay",
    "RouteError",
    "RoutedBroker",
    "RoutedResultBackend",
    "RoutedSchedules",
]
