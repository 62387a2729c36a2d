"""Dramatiq's result backend on PostgreSQL, at its public path, and :func:`setup`.

The backend is :mod:`.features.results`; :func:`setup` builds a broker with it, so it
lives here, above the broker, where the features may not reach.
"""

from __future__ import annotations

from typing import Any

from .broker import PostgresBroker
from .config import DEFAULT_SCHEMA
from .features.results import PostgresBackend, WritePendingResults


def setup(
    url: str | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    store_results: bool = False,
    result_ttl: int | None = None,
    group_callbacks: bool = True,
    **broker_options: Any,
) -> tuple[PostgresBroker, PostgresBackend]:
    """A broker with the Results middleware (and, by default, GroupCallbacks) on one database.

    Returns ``(broker, backend)``; ``broker_options`` go to
    :class:`PostgresBroker`.  Nothing is set globally: call
    ``dramatiq.set_broker(broker)``.
    """
    from dramatiq.results import Results

    from .features.rate_limits import FencedGroupCallbacks
    from .features.rate_limits import PostgresBackend as RateLimiterBackend

    broker = PostgresBroker(url, schema=schema, **broker_options)
    backend = PostgresBackend(broker=broker)
    if group_callbacks:
        broker.add_middleware(FencedGroupCallbacks(RateLimiterBackend(broker=broker)))
    # Added last, so its after_process_message runs first (Dramatiq runs them
    # in reverse): a member's result is stored before it counts down its group.
    broker.add_middleware(Results(backend=backend, store_results=store_results, result_ttl=result_ttl))
    return broker, backend


__all__ = ["PostgresBackend", "WritePendingResults", "setup"]
