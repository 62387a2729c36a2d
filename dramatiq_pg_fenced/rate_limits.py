"""Dramatiq's rate-limiter backend on PostgreSQL, at its public path: see :mod:`.features.rate_limits`."""

from .features.rate_limits import FencedGroupCallbacks, PostgresBackend

__all__ = ["FencedGroupCallbacks", "PostgresBackend"]
