"""The charts page's wait and run time charts, and the queues page's sparklines (:mod:`..ops.timings`).

Percentiles of several databases cannot be added: with all databases shown together, each
minute's point is the largest of the databases' (the worst database's), and the page says so.
"""

from __future__ import annotations

from datetime import datetime

from ..ops import timings
from ..ops.fleet import Fleet, Site
from . import svg
from .render import age_text, esc


def _seconds(v: float) -> str:
    return age_text(v) if v else "0"


def _worst(each: list[timings.Timings], minutes: list[datetime]) -> timings.Timings:
    """One database's timings, or of several the largest percentile per minute (and over the span)."""
    if len(each) == 1:
        return each[0]

    def worst(lists: list[list[float | None]]) -> list[float | None]:
        out: list[float | None] = []
        for i in range(len(minutes)):
            seen = [x for v in lists if (x := v[i]) is not None]
            out.append(max(seen) if seen else None)
        return out

    def overall(found: list[dict[str, float] | None]) -> dict[str, float] | None:
        known = [o for o in found if o]
        return {p: max(o[p] for o in known) for p in timings.PERCENTILES} if known else None

    first = each[0]
    return timings.Timings(
        queue=first.queue, span=first.span, minutes=minutes,
        count=[sum(t.count[i] for t in each) for i in range(len(minutes))],
        wait={p: worst([t.wait[p] for t in each]) for p in timings.PERCENTILES},
        run={p: worst([t.run[p] for t in each]) for p in timings.PERCENTILES},
        overall_wait=overall([t.overall_wait for t in each]), overall_run=overall([t.overall_run for t in each]),
    )  # fmt: skip


def timing_charts(
    fleet: Fleet, shown: list[Site], queue: str | None, span: str, minutes: list[datetime]
) -> tuple[str, str, str, list[str]]:
    """The wait and run time charts (p50, p95, p99 per minute), a line of their percentiles over the span,
    a note of what they measure; and the databases that did not answer."""
    read, away = fleet.each(
        lambda s: timings.timings(s.reader, s.statements, queue=queue, span=span, minutes=minutes), shown
    )
    if not read:
        return "", "", "", away
    data = _worst([t for _, t in read], minutes)
    kept = [s for s, _ in read if s.settings.keep_finished > 0]
    charts = "".join(
        svg.line_chart(
            title,
            minutes,
            [(p, values[p]) for p in timings.PERCENTILES],
            unit=_seconds,
            chart_id=chart_id,
            y_label="seconds",
        )  # fmt: skip
        for chart_id, title, values in (
            ("wait", "Wait time (send to claim)", data.wait),
            ("run", "Run time (claim to finish)", data.run),
        )
    )

    def said(values: dict[str, float] | None) -> str:
        if not values:
            return "none finished"
        return ", ".join(f"{p} {esc(age_text(values[p]) or '0')}" for p in timings.PERCENTILES)

    several = len(read) > 1
    line = (
        f"<p id=timings>Of the {data.finished:,} messages finished in the last {span} and kept in the history: "
        f"wait {said(data.overall_wait)}; run {said(data.overall_run)}"
        + (" (the slowest database's, per minute)" if several else "")
        + ".</p>"
    )
    if not kept:
        line = (
            "<p id=timings class=note>Wait and run times come from the history of finished messages, which is off "
            "(keep_finished=0): set keep_finished to see them.</p>"
        )
    note = (
        "<p class=note>Wait: from the send to the claim by a worker (a delayed message's delay, and a retried "
        "message's earlier attempts, included). Run: from the claim to the ack (time in the worker's prefetch "
        "included). Of messages finished and kept in the history (keep_finished), not of dead-lettered ones. "
        "Hover over a chart for the values of a minute.</p>"
    )
    return charts, line, note, away


def queue_sparkline(done: list[int] | None) -> str:
    """A queue's cell on the queues page: messages finished per minute over the last hour."""
    values = done or [0] * 60
    total, peak = sum(values), max(values)
    return svg.sparkline(values, f"finished per minute, last hour: {total:,} in all, at most {peak:,} a minute")
