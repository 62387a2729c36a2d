"""The charts' wait and run times: percentiles (p50, p95, p99) per queue and minute, from the history.

No new bookkeeping: a finished message's history row (kept ``keep_finished`` seconds,
migration 005) has its send, its last claim and its ack.  **Wait** is claim - send (a
delayed message's delay and a retried message's earlier attempts and backoff included:
the send is the first one); **run** is ack - claim (the time in the worker's prefetch
included, as the history cannot tell it apart).  Dead-lettered messages and failed
attempts are not in the history: these are the times of messages that finished.

Cost (measured, ``docs/dashboard.md``): one statement over the span's history rows, by
index; with the history on (``keep_finished`` > 0) and nothing finished in the span, all
points are ``None``.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

from ..db.database import Database
from ..db.statements import Statements, check_queue
from .charts import SPANS

#: The percentiles drawn, as the chart names them.
PERCENTILES = ("p50", "p95", "p99")


@dataclasses.dataclass
class Timings:
    """Wait and run time percentiles per minute of the span (oldest first), in seconds.

    ``wait[p]`` and ``run[p]`` (``p`` one of :data:`PERCENTILES`) are lists as long as
    :attr:`minutes`, ``None`` for a minute where no message finished; ``count`` the messages
    finished per minute; ``overall_wait`` / ``overall_run``: the percentiles over the whole span
    (``None``: none finished).
    """

    queue: str | None
    span: str
    minutes: list[datetime]
    count: list[int]
    wait: dict[str, list[float | None]]
    run: dict[str, list[float | None]]
    overall_wait: dict[str, float] | None
    overall_run: dict[str, float] | None

    @property
    def finished(self) -> int:
        return sum(self.count)


def timings(
    database: Database, statements: Statements, *, queue: str | None = None, span: str = "hour",
    minutes: list[datetime] | None = None,
) -> Timings:  # fmt: skip
    """The wait and run time percentiles of *queue* (``None``: all queues) per minute over the last hour or day.

    *minutes*: the chart's minutes (:func:`.charts.series`'s), so both charts share one time axis;
    by default the span's minutes ending with the database's current one."""
    if span not in SPANS:
        raise ValueError(f"span must be one of {', '.join(SPANS)}, not {span!r}")
    if queue is not None:
        check_queue(queue)
    points = SPANS[span]

    def read(conn: Any) -> tuple[list[Any], datetime]:
        rows = conn.execute(statements.timings, {"points": points, "queue": queue}).fetchall()
        (now,) = conn.execute("SELECT date_trunc('minute', now())").fetchone()
        return rows, now

    rows, now = database.run(read)
    if minutes is None:
        minutes = [now - timedelta(minutes=points - 1 - i) for i in range(points)]
    at = {m: i for i, m in enumerate(minutes)}
    count = [0] * len(minutes)
    wait: dict[str, list[float | None]] = {p: [None] * len(minutes) for p in PERCENTILES}
    run: dict[str, list[float | None]] = {p: [None] * len(minutes) for p in PERCENTILES}
    overall_wait = overall_run = None
    for minute, n, waits, runs in rows:
        if minute is None:  # the span's row (GROUPING SETS' ())
            if n:
                overall_wait = dict(zip(PERCENTILES, waits, strict=True))
                overall_run = dict(zip(PERCENTILES, runs, strict=True))
            continue
        i = at.get(minute)
        if i is None:  # (a minute outside the chart's, e.g. another database's clock)
            continue
        count[i] = int(n)
        for p, w, r in zip(PERCENTILES, waits, runs, strict=True):
            wait[p][i], run[p][i] = w, r
    return Timings(queue, span, list(minutes), count, wait, run, overall_wait, overall_run)


def sparklines(database: Database, statements: Statements) -> dict[str, list[int]]:
    """Messages finished per queue and minute over the last hour (60 points, oldest first, 0 when none),
    from the per-minute tallies: the queues page's sparklines (one small statement)."""

    def read(conn: Any) -> tuple[list[Any], datetime]:
        rows = conn.execute(statements.sparklines).fetchall()
        (now,) = conn.execute("SELECT date_trunc('minute', now())").fetchone()
        return rows, now

    rows, now = database.run(read)
    out: dict[str, list[int]] = {}
    for queue, minute, done in rows:
        i = 59 - int((now - minute).total_seconds() // 60)
        if 0 <= i < 60:
            out.setdefault(queue, [0] * 60)[i] += int(done)
    return out
