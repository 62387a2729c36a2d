"""Charts drawn on the server as inline SVG: no script, no library, styled by ``static/style.css``.

:func:`line_chart` draws series that share one time axis (one point per minute) as
polylines; a missing point (``None``: no sample that minute) breaks its line rather
than drawing zero.  Colours come from the CSS classes ``s0``, ``s1``, ... so the
system's dark mode applies to charts too.  Its axes say what they count (*y_label*, its
unit) and that times are UTC; a transparent band per minute (per few minutes on a day's
chart: at most :data:`HOVER_BANDS` bands) carries a ``<title>`` with every series' value
there, which a browser shows on hover (no script).  :func:`sparkline` draws a small one
for a table cell.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from .render import esc

WIDTH, HEIGHT = 720, 170
#: Room for the axis labels: left, right, top, bottom (left: "250 ms" at a phone's larger font).
LEFT, RIGHT, TOP, BOTTOM = 70, 8, 10, 22
#: A tick's value is round: "100.0 s" says "100 s".
ROUND = re.compile(r"\.0(?!\d)")
#: At most this many hover bands per chart (a day's 1,440 minutes: one band per 12 minutes).
HOVER_BANDS = 120


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above *value* (1 for nothing to show)."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= value:
            return float(step * power)
    return float(10 * power)


def line_chart(
    title: str,
    minutes: Sequence[datetime],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    unit: Callable[[float], str] = lambda v: f"{v:g}",
    chart_id: str = "",
    y_label: str = "",
) -> str:
    """An ``<svg>`` of *series* (``(name, values)``, one value per minute of *minutes*), its y axis from 0 to a
    round maximum labelled with *unit* and titled *y_label*, its x axis the first and last minute (UTC)
    and titled "time (UTC)"; hovering shows the values of the minute (or few minutes) under the pointer."""
    n = len(minutes)
    top = nice_ceiling(max((v for _, values in series for v in values if v is not None), default=0.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: int) -> float:
        return LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y(v: float) -> float:
        return TOP + plot_h * (1 - v / top)

    parts = [
        f'<svg class=chart viewBox="0 0 {WIDTH} {HEIGHT}" role=img aria-labelledby="{esc(chart_id)}-t"'
        + (f' id="{esc(chart_id)}"' if chart_id else "")
        + f'><title id="{esc(chart_id)}-t">{esc(title)}</title>',
    ]
    for fraction in (0, 0.5, 1):  # grid and y labels
        gy = y(top * fraction)
        parts.append(f'<line class=grid x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{gy:.1f}" y2="{gy:.1f}"/>')
        parts.append(
            # centred on its line at any font size (a phone's is larger: style.css), without a round value's ".0"
            f'<text class=axis x="{LEFT - 4}" y="{gy:.1f}" dy=".35em" text-anchor=end>'
            f'{esc(ROUND.sub("", unit(top * fraction)))}</text>'
        )
    if y_label:
        mid = TOP + plot_h / 2
        parts.append(
            f'<text class="axis label" x="12" y="{mid:.1f}" text-anchor=middle '
            f'transform="rotate(-90 12 {mid:.1f})">{esc(y_label)}</text>'
        )
    parts.append(
        f'<text class="axis label" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 5}" text-anchor=middle>time (UTC)</text>'
    )
    if n:
        for i, anchor in ((0, "start"), (n - 1, "end")):
            label = minutes[i].astimezone(timezone.utc).strftime("%H:%M" if n <= 60 else "%m-%d %H:%M")
            parts.append(f'<text class=axis x="{x(i):.1f}" y="{HEIGHT - 5}" text-anchor={anchor}>{esc(label)}</text>')
    for k, (name, values) in enumerate(series):
        runs: list[list[str]] = [[]]
        for i, v in enumerate(values[:n]):
            if v is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append(f"{x(i):.1f},{y(v):.1f}")
        for run in runs:
            if len(run) == 1:  # a lone point between gaps: a dot
                cx, cy = run[0].split(",")
                parts.append(f'<circle class="s{k}" cx="{cx}" cy="{cy}" r="2"><title>{esc(name)}</title></circle>')
            elif run:
                parts.append(
                    f'<polyline class="line s{k}" points="{" ".join(run)}"><title>{esc(name)}</title></polyline>'
                )
    parts.extend(_hover_bands(minutes, series, unit, x, plot_w))
    parts.append("</svg>")
    # The series' colour on its swatch, the name in the text's: a light series' colour is no text colour.
    legend = "".join(
        f'<span class=key><span class="swatch s{k}"></span>{esc(name)}</span>' for k, (name, _) in enumerate(series)
    )
    return f"<figure class=chart-box><figcaption>{esc(title)} {legend}</figcaption>{''.join(parts)}</figure>"


def _hover_bands(
    minutes: Sequence[datetime],
    series: Sequence[tuple[str, Sequence[float | None]]],
    unit: Callable[[float], str],
    x: Callable[[int], float],
    plot_w: float,
) -> list[str]:
    """Transparent bands across the plot, each with a ``<title>``: the minute (or minutes) and each series'
    value there (over several minutes: the largest; "none" where no point)."""
    n = len(minutes)
    if not n:
        return []
    step = max(1, math.ceil(n / HOVER_BANDS))
    width = plot_w / max(n - 1, 1) * step
    bands = []
    for start in range(0, n, step):
        end = min(start + step, n) - 1
        when = minutes[start].astimezone(timezone.utc).strftime("%H:%M" if n <= 60 else "%m-%d %H:%M")
        if end > start:
            when += "–" + minutes[end].astimezone(timezone.utc).strftime("%H:%M")
        values = []
        for name, points in series:
            seen = [v for v in points[start : end + 1] if v is not None]
            shown = unit(max(seen)) if seen else "none"
            values.append(f"{name} {'max ' if end > start and seen else ''}{shown}")
        left = max(LEFT, x(start) - width / (2 * step))
        right = min(WIDTH - RIGHT, x(end) + width / (2 * step))
        bands.append(
            f'<rect class=hover x="{left:.1f}" y="{TOP}" width="{max(right - left, 1):.1f}" '
            f'height="{HEIGHT - TOP - BOTTOM}"><title>{esc(when + " UTC: " + ", ".join(values))}</title></rect>'
        )
    return bands


def sparkline(values: Sequence[float], title: str, *, width: int = 120, height: int = 22) -> str:
    """A small ``<svg>`` of *values* (one a minute, oldest first) for a table cell: a line from 0 to its largest
    value, the last point marked, *title* shown on hover (and read by screen readers)."""
    n = len(values)
    top = max(values, default=0) or 1
    points = " ".join(
        f"{(width - 2) * i / max(n - 1, 1) + 1:.1f},{height - 2 - (height - 4) * v / top:.1f}" for i, v in enumerate(values)
    )
    last = (
        f'<circle class=s0 cx="{width - 1}" cy="{height - 2 - (height - 4) * values[-1] / top:.1f}" r="1.8"/>' if n else ""
    )
    return (
        f'<svg class=spark viewBox="0 0 {width} {height}" width="{width}" height="{height}" role=img>'
        f"<title>{esc(title)}</title><polyline class=\"line s0\" points=\"{points}\"/>{last}</svg>"
    )
