"""The per-minute samples the console's charts draw (``queue_minute``, migration 013), taken by maintenance.

The maintenance loop of the process on duty (turns.py) takes this minute's sample
(:func:`take_sample`); the charts (``ops/charts.py``) read them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from ..db.statements import OVERVIEW_COLUMNS, Statements
from . import processes

logger = logging.getLogger(__name__)

#: Seconds samples are kept.
KEEP_SAMPLES = 86400
#: Seconds between two tries of the maintenance loop of the process on duty to take this minute's sample,
#: until one takes it (or finds another process took it); then the next is tried as the next minute begins.
SAMPLE_EVERY = 15.0
#: The depth's budget: the overview statement runs under a statement timeout of this many milliseconds.
#: Its scans of the claim index step over every entry an old snapshot keeps dead (a pinned horizon: 1.2 s
#: and 129,000 buffers after 30 minutes at 200 messages/s, docs/performance.md, run 6 of the soak), once a
#: minute beside the claims; past the budget, that minute has no depth in the charts (a gap), its
#: outcomes are sampled all the same, and the next try is in the next minute.
SAMPLE_BUDGET_MS = 250
#: Due and delayed messages are counted up to this many per queue and priority (a backlog of millions
#: is drawn at the cap rather than counted in seconds each minute).
SAMPLE_CAP = 100_000


def until_next_minute(now: float | None = None) -> float:
    """Seconds from *now* (wall clock) to the next minute: a sample taken (or left out) is not tried
    again before it."""
    now = time.time() if now is None else now
    return 60.0 - now % 60.0


def take_sample(conn: psycopg.Connection, statements: Statements) -> bool:
    """Take this minute's sample if no other process has (one transaction on *conn*); returns whether it did.

    Under a transaction-scoped advisory lock: one writer at a time, the others
    skip at once.  Depth: the overview statement (the same figures as
    ``stats``, counted up to :data:`SAMPLE_CAP`), within :data:`SAMPLE_BUDGET_MS`;
    outcomes: the tallies of every minute that is over and not yet copied (so
    a minute without any sampling process is caught up later, within the
    tallies' two hours).  A depth past its budget is left out (logged); the
    sample counts as taken.
    """
    with conn.transaction():
        row = conn.execute(statements.sample_claim).fetchone()
        if not (row and row[0]):
            return False
        conn.execute(statements.no_jit)
        try:
            with conn.transaction():  # a savepoint: a statement past the budget undoes only itself
                conn.execute(statements.sample_budget, {"ms": str(SAMPLE_BUDGET_MS)})
                rows = conn.execute(
                    statements.overview, {"cap": SAMPLE_CAP, "beats": processes.STALE_AFTER_BEATS}
                ).fetchall()
                conn.execute(statements.sample_budget_end)
        except psycopg.errors.QueryCanceled:
            logger.info(
                "This minute's depth sample for the charts was left out: the overview took more than %d ms "
                "(its scans step over the entries of rows an old snapshot keeps dead; see docs/console-data.md).",
                SAMPLE_BUDGET_MS,
            )
            rows = None
        if rows is None:  # the minute's row for all queues, its depth unknown: no other process tries it again
            params: dict[str, list[Any]] = {"queues": [""], "due": [None], "oldest": [None]}
        else:
            at = OVERVIEW_COLUMNS.index
            names = [r[at("queue")] for r in rows]
            due = [int(r[at("due")]) for r in rows]
            oldest = [r[at("oldest_due_seconds")] for r in rows]
            ages = [a for a in oldest if a is not None]
            params = {
                "queues": ["", *names],
                "due": [sum(due), *due],
                "oldest": [max(ages) if ages else None, *oldest],
            }
        conn.execute(statements.sample_depth, params)
        conn.execute(statements.sample_outcomes)
    return True
