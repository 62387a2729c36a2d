"""Charts drawn on the server as inline SVG: no script, no library, styled by ``static/style.css``.

:func:`line_chart` draws series that share one time axis (one point per minute) as
polylines; a missing point (``None``: no sample that minute) breaks its line rather
than drawing zero.  Colours come from the CSS classes ``s0``, ``s1``, ... so the
system's dark mode applies to charts too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from .render import esc

WIDTH, HEIGHT = 720, 170
#: Room for the axis labels: left, right, top, bottom.
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 10, 22


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
) -> str:
    """An ``<svg>`` of *series* (``(name, values)``, one value per minute of *minutes*), its y axis from 0 to a
    round maximum labelled with *unit*, its x axis the first and last minute (UTC)."""
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
            f'<text class=axis x="{LEFT - 4}" y="{gy + 4:.1f}" text-anchor=end>{esc(unit(top * fraction))}</text>'
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
    parts.append("</svg>")
    legend = "".join(f'<span class="key s{k}">{esc(name)}</span>' for k, (name, _) in enumerate(series))
    return f"<figure class=chart-box><figcaption>{esc(title)} {legend}</figcaption>{''.join(parts)}</figure>"
