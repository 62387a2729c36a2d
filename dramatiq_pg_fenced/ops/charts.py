"""The console's charts: per queue and overall, outcomes per minute and depth over the last hour or day.

What the broker keeps anyway (the per-minute ``throughput`` tallies of the
ack, nack and retry statements, two hours) and ``queue_minute`` (migration
013): one sample per queue and minute, kept :data:`KEEP_SAMPLES` seconds (a
day), written by the maintenance loop of one process at a time
(:func:`take_sample`): the queues' due depth and oldest due age as the
minute starts (the overview's figures), and the outcomes of each minute that
is over, copied from the tallies before they are purged.  Its size is bounded:
queues x 1,440 rows, plus one row per minute for all queues together.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..db.database import Database
from ..db.statements import Statements, check_queue

#: Points per span: one per minute.
SPANS = {"hour": 60, "day": 1440}


@dataclasses.dataclass
class Series:
    """A chart's data, one point per minute, oldest first; every list as long as :attr:`minutes`.

    Outcomes are counts in that minute (0 when none); ``due`` (queued and due)
    and ``oldest_due_seconds`` were sampled as the minute began (``None``: no
    sample, e.g. no worker process ran then, or the minute has just begun).
    """

    queue: str | None  #: ``None``: all queues together
    span: str  #: "hour" or "day"
    minutes: list[datetime]
    finished: list[int]
    failed: list[int]  #: dead-lettered
    retried: list[int]
    due: list[int | None]
    oldest_due_seconds: list[float | None]


def series(database: Database, statements: Statements, *, queue: str | None = None, span: str = "hour") -> Series:
    """Per minute over the last hour (60 points) or day (1,440), for *queue* or all queues (``None``):
    finished, failed (dead-lettered) and retried messages, due depth and oldest due age."""
    if span not in SPANS:
        raise ValueError(f"span must be one of {', '.join(SPANS)}, not {span!r}")
    if queue is not None:
        check_queue(queue)
    params: dict[str, Any] = {"points": SPANS[span], "queue": queue}
    rows = database.run(lambda conn: conn.execute(statements.series, params).fetchall())
    columns: list[list[Any]] = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(6)]
    minutes, finished, failed, retried, due, oldest = columns
    return Series(
        queue=queue,
        span=span,
        minutes=minutes,
        finished=[int(n) for n in finished],
        failed=[int(n) for n in failed],
        retried=[int(n) for n in retried],
        due=[None if n is None else int(n) for n in due],
        oldest_due_seconds=[None if a is None else float(a) for a in oldest],
    )
