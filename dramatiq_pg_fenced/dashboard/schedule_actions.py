"""The schedules page's actions (issue 42, point 5): pause, resume and "run now", per schedule, each in
the schedule's database and recorded in its audit log (:mod:`..features.schedule_control`).

"Run now" carries a click id made when the page was drawn: the same form sent twice (a double click,
a resent request) asks for one message only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..features import schedule_control
from ..ops.fleet import Fleet, Site
from .render import HTTPError

SCHEDULE_ACTIONS = ("schedule_pause", "schedule_resume", "schedule_run_now")


def _site_of(fleet: Fleet, name: str, database: str | None) -> Site:
    if database is not None or not fleet.several:
        return fleet.site(database or "")
    for site in fleet:
        if any(r["name"] == name for r in _overview(site)):
            return site
    raise HTTPError("404 Not Found", f"no schedule {name!r}")


def _overview(site: Site) -> list[dict[str, Any]]:
    from ..features.schedules import overview

    return overview(site.database, site.statements)


def act_on_schedule(fleet: Fleet, action: str, form: dict[str, str], who: str) -> str:
    """Do one schedule action of a form; returns the note the next page shows."""
    name = form.get("schedule", "")
    site = _site_of(fleet, name, form.get("database") or None)
    try:
        if action == "schedule_pause":
            done = schedule_control.pause(site.database, site.statements, name, who=who)
            return f"schedule {name}: " + ("paused (on every process)" if done else "was paused already")
        if action == "schedule_resume":
            done = schedule_control.resume(site.database, site.statements, name, who=who)
            return f"schedule {name}: " + ("resumed" if done else "was not paused")
        asked = schedule_control.run_now(site.database, site.statements, name, who=who, click=form.get("click"))
    except schedule_control.UnknownSchedule as e:
        raise HTTPError("404 Not Found", str(e)) from None
    if not asked.new:
        return f"schedule {name}: this click was taken already (one message per click)"
    return f"schedule {name}: run now asked (audit #{asked.audit_id}); its scheduler enqueues it within seconds"


def buttons(form: Callable[..., str]) -> Callable[[Site, dict[str, Any], str], str]:
    """The buttons of one schedule (a row of :func:`..features.schedules.overview`), given the page's form."""

    def draw(site: Site, row: dict[str, Any], back: str) -> str:
        fields = {"schedule": row["name"], **({"database": site.name} if site.name else {})}
        toggle = ("schedule_resume", "Resume") if row.get("paused_at") else ("schedule_pause", "Pause")
        run = {**fields, "click": schedule_control.pending_click()}
        return form(toggle[0], toggle[1], fields, back) + form("schedule_run_now", "Run now", run, back)

    return draw
