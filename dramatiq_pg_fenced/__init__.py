"""dramatiq-pg-fenced: a PostgreSQL broker for Dramatiq with fenced deliveries."""

from .broker import CancelOutcome, PostgresBroker
from .consumer import PostgresMessageProxy
from .errors import DeadLetterError, PayloadTooLarge, SchemaError

__all__ = [
    "CancelOutcome",
    "DeadLetterError",
    "PayloadTooLarge",
    "PostgresBroker",
    "PostgresMessageProxy",
    "SchemaError",
]
__version__ = "0.1.0"
