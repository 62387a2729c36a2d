"""The ``dramatiq-pg-fenced`` command (the console script ``dramatiq_pg_fenced.cli:main``)."""

from .command import main

__all__ = ["main"]
