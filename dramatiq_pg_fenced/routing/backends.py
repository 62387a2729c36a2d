"""Dramatiq's results and the schedules over a :class:`~.router.RoutedBroker`: each kept in the
database of its queue."""

from __future__ import annotations

from typing import Any, Protocol

from dramatiq.results.backend import Missing, ResultBackend

from ..broker import PostgresBroker
from ..features.schedules import Schedule, Schedules


class Router(Protocol):
    """What the backends here use of a :class:`~.router.RoutedBroker` (which imports them)."""

    shards: dict[str, PostgresBroker]
    actors: dict[str, Any]

    def add_middleware(self, middleware: Any, **where: Any) -> None: ...
    def database_of(self, queue_name: str) -> str: ...
    def shard(self, queue_name: str) -> PostgresBroker: ...


class RoutedResultBackend(ResultBackend):
    """Dramatiq's results over a :class:`RoutedBroker`: a message's result is kept in the database of
    its queue, fenced and written with its ack there as with one database (a
    :class:`~.results.PostgresBackend` per database, on its shard); ``get_result`` reads it there.

    ::

        backend = RoutedResultBackend(broker)
        broker.add_middleware(Results(backend=backend))
    """

    def __init__(self, router: Router, **options: Any) -> None:
        from ..features.results import PostgresBackend, WritePendingResults

        super().__init__()
        self.router = router
        self.backends = {name: PostgresBackend(broker=shard, **options) for name, shard in router.shards.items()}
        # Writes a delivery's pending result before it sends a follow-up (per thread: one is enough).
        router.add_middleware(WritePendingResults(next(iter(self.backends.values()))))

    def of(self, message: Any) -> Any:
        """The backend of *message*'s queue's database."""
        return self.backends[self.router.database_of(message.queue_name)]

    def get_result(self, message: Any, *, block: bool = False, timeout: int | None = None) -> Any:
        return self.of(message).get_result(message, block=block, timeout=timeout)

    def store_result(self, message: Any, result: Any, ttl: int) -> None:
        self.of(message).store_result(message, result, ttl)

    def store_exception(self, message: Any, exception: Exception, ttl: int) -> None:
        self.of(message).store_exception(message, exception, ttl)

    def _get(self, message_key: str) -> Any:
        for backend in self.backends.values():
            data = backend._get(message_key)
            if data is not Missing:
                return data
        return Missing

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


class RoutedSchedules(Schedules):
    """``router.schedules``: each schedule goes to the registry of its queue's database, whose
    scheduler ticks it there, exactly once (see :mod:`.schedules`); names are unique across all."""

    def __init__(self, router: Router) -> None:
        super().__init__(lookup=router.actors.get, where=self._database_of)
        self.router = router

    def _database_of(self, name: str) -> tuple[Any, Any]:
        """Where schedule *name* is kept: its queue's database if declared here, else the one storing it."""
        from ..features.schedules import overview

        scheduled = self.get(name)
        shards = [self.router.shard(scheduled.queue_name)] if scheduled else list(self.router.shards.values())
        for shard in shards:
            if scheduled or any(r["name"] == name for r in overview(shard.database, shard.statements)):
                return shard.database, shard.statements
        return shards[0].database, shards[0].statements

    def add(self, actor: Any, cron: str | None = None, **options: Any) -> Schedule:
        actor_name, queue_name = self._actor(actor)
        name = options.get("name") or actor_name
        if self.get(name) is not None:
            raise ValueError(f"schedule {name!r} is declared twice; give the second one a name of its own (name=...)")
        scheduled = self.router.shard(queue_name).schedules.add(actor, cron, **options)
        self._by_name[scheduled.name] = scheduled
        return scheduled

    def remove(self, name: str) -> None:
        scheduled = self._by_name.pop(name)
        self.router.shard(scheduled.queue_name).schedules.remove(name)
