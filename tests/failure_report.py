"""What a failing test prints besides its traceback: the logs of the processes it started and the
rows it looked at (issue 38: read the cause instead of re-running).

A fixture calls :func:`on_failure` with a title and a function that reads something (a worker's
log, a schema's rows); ``conftest.pytest_runtest_makereport`` calls those functions when the test
fails, before the fixtures' teardown ends the processes and drops the schemas, and adds each
answer to the report as a section of its own (printed under the failure, also by pytest-xdist
workers).  Nothing is read when the test passes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

DUMPS = pytest.StashKey[list[tuple[str, Callable[[], str]]]]()
#: The last lines of a log, and the rows of a table, a section shows.
LOG_LINES = 200
ROWS = 100


def on_failure(node: pytest.Item, title: str, read: Callable[[], str]) -> None:
    """On *node*'s failure, add the section *title* with what *read()* returns."""
    node.stash.setdefault(DUMPS, []).append((title, read))


def sections(node: pytest.Item) -> list[tuple[str, str]]:
    """Each registered dump, read now (one that cannot be read says why)."""
    out = []
    for title, read in node.stash.get(DUMPS, []):
        try:
            text = read()
        except Exception as e:  # a dump must never hide the failure it explains
            text = f"(could not read it: {e!r})"
        out.append((title, text))
    return out


def process_log(proc: subprocess.Popen, log_path: Path) -> Callable[[], str]:
    """A reader of *proc*'s exit code and the last lines of its log."""

    def read() -> str:
        lines = log_path.read_text(errors="replace").splitlines()
        cut = f"(the last {LOG_LINES} of {len(lines)} lines)\n" if len(lines) > LOG_LINES else ""
        return f"pid {proc.pid}, exit code {proc.poll()}\n{cut}" + "\n".join(lines[-LOG_LINES:])

    return read


def schema_rows(
    url: str, schema: str, tables: Iterable[str] = ("message", "history"), order: str | None = None
) -> Callable[[], str]:
    """A reader of *schema*'s *tables* (each row as JSON, the payload left out, in the order of the
    column *order* if given), those that exist."""

    def read() -> str:
        out = []
        by = sql.SQL(" ORDER BY {}").format(sql.Identifier(order)) if order else sql.SQL("")
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            for table in tables:
                name = sql.Identifier(schema, table)
                exists = conn.execute("SELECT to_regclass(%s)", [name.as_string(conn)]).fetchone()
                if not exists or exists[0] is None:
                    continue
                rows = conn.execute(
                    sql.SQL("SELECT to_jsonb(t) - 'payload' FROM {} AS t{} LIMIT %s").format(name, by), [ROWS + 1]
                ).fetchall()
                more = f" (the first {ROWS})" if len(rows) > ROWS else ""
                out.append(f"-- {schema}.{table}: {min(len(rows), ROWS)} rows{more}")
                out.extend(str(r[0]) for r in rows[:ROWS])
        return "\n".join(out) or f"(no {', '.join(tables)} table in {schema})"

    return read
