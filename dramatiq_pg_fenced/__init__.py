"""dramatiq-pg-fenced: a PostgreSQL broker for Dramatiq with fenced deliveries."""

from .broker import CancelOutcome, PostgresBroker
from .delivery import PostgresMessageProxy
from .errors import DeadLetterError, PayloadTooLarge, SchemaError
from .startup import StartupError

__all__ = [
    "CancelOutcome",
    "DeadLetterError",
    "PayloadTooLarge",
    "PostgresBroker",
    "PostgresMessageProxy",
    "SchemaError",
    "StartupError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``PostgresResultBackend`` and ``PostgresRateLimiterBackend``, imported on first use."""
    if name == "PostgresResultBackend":
        from .results import PostgresBackend

        return PostgresBackend
    if name == "PostgresRateLimiterBackend":
        from .rate_limits import PostgresBackend as RateLimiterBackend

        return RateLimiterBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
