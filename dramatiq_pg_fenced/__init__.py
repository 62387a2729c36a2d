"""dramatiq-pg-fenced: a PostgreSQL broker for Dramatiq with fenced deliveries."""

from typing import TYPE_CHECKING

from .broker import PostgresBroker
from .config import __version__ as __version__
from .core.delivery import PostgresMessageProxy
from .db.startup import StartupError
from .errors import DeadLetterError, PayloadTooLarge, SchemaError

if TYPE_CHECKING:
    from .ops.messages import CancelOutcome

__all__ = [
    "CancelOutcome",
    "DeadLetterError",
    "PayloadTooLarge",
    "PostgresBroker",
    "PostgresMessageProxy",
    "SchemaError",
    "StartupError",
]


def __getattr__(name: str) -> object:
    """``PostgresResultBackend``, ``PostgresRateLimiterBackend`` and ``CancelOutcome`` (the operators'
    code), imported on first use: a worker loads none of them at start-up."""
    if name == "CancelOutcome":
        from .ops.messages import CancelOutcome

        return CancelOutcome
    if name == "PostgresResultBackend":
        from .features.results import PostgresBackend

        return PostgresBackend
    if name == "PostgresRateLimiterBackend":
        from .features.rate_limits import PostgresBackend as RateLimiterBackend

        return RateLimiterBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
