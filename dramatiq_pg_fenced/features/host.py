"""What a backend given ``broker=`` uses of the broker that runs the actors.

The broker (``broker.py``) sits above the features and wires them in; a backend
here never imports it.  :class:`HostBroker` names what the results and
rate-limiter backends read of it: its settings, its pool, and the two calls that
tie a result to its delivery's outcome.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.delivery import PostgresMessageProxy, ResultWrite
from ..db.database import Database


class HostBroker(Protocol):
    """A :class:`~dramatiq_pg_fenced.broker.PostgresBroker`, as the backends see it."""

    @property
    def schema(self) -> str: ...
    @property
    def url(self) -> str | None: ...
    @property
    def listen(self) -> bool: ...
    @property
    def poll_interval(self) -> float: ...
    @property
    def database(self) -> Database: ...
    def add_middleware(self, middleware: Any, **where: Any) -> None: ...
    def holds(self, message: Any) -> bool: ...
    def submit_result(self, message: PostgresMessageProxy, write: ResultWrite) -> None: ...
