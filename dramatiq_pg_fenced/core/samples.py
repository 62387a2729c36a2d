"""The per-minute samples the console's charts draw (``queue_minute``, migration 013), taken by maintenance.

The maintenance loop of the process on duty (turns.py) takes this minute's sample
(:func:`take_sample`); the charts (``ops/charts.py``) read them.
"""

from __future__ import annotations

import psycopg

from ..db.statements import OVERVIEW_COLUMNS, Statements
from . import processes

#: Seconds samples are kept.
KEEP_SAMPLES = 86400
#: Seconds between two tries of the maintenance loop of the process on duty to take this minute's sample
#: (the first try in a minute takes it; a later one finds it taken: one small statement).
SAMPLE_EVERY = 15.0


def take_sample(conn: psycopg.Connection, statements: Statements) -> bool:
    """Take this minute's sample if no other process has (one transaction on *conn*); returns whether it did.

    Under a transaction-scoped advisory lock: one writer at a time, the others
    skip at once.  Depth: the overview statement (the same figures as
    ``stats``); outcomes: the tallies of every minute that is over and not yet
    copied (so a minute without any sampling process is caught up later,
    within the tallies' two hours).
    """
    with conn.transaction():
        row = conn.execute(statements.sample_claim).fetchone()
        if not (row and row[0]):
            return False
        conn.execute(statements.no_jit)
        rows = conn.execute(statements.overview, {"cap": None, "beats": processes.STALE_AFTER_BEATS}).fetchall()
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
