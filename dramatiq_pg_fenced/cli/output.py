"""How the ``dramatiq-pg-fenced`` commands answer: exit codes, the error line, JSON, the tables.

Shared by :mod:`.cli` (one database) and :mod:`.fleet_cli` (several), which both import it and
neither the other's way up: a table shows a ``database`` column when its rows name one.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..ops import admin

#: Exit codes (see :mod:`.cli`): done; did not apply; bad usage; the database failed.
OK, NOT_APPLIED, USAGE, DATABASE = 0, 1, 2, 3


def fail(text: str, code: int) -> int:
    """One line on stderr, never a traceback; *code* back, for the command to exit with."""
    print(f"error: {text}", file=sys.stderr)
    return code


_STATS_HEADS = (
    ("queue", "queue"), ("paused", "paused_since"), ("queued", "queued"), ("delayed", "delayed"),
    ("running", "running"), ("prefetched", "prefetched"), ("expired", "expired_leases"), ("dead", "dead"), ("cancelled", "cancelled"),
    ("done/1m", "done_last_minute"), ("done/1h", "done_last_hour"), ("dead/1h", "dead_last_hour"),
    ("stale", "stale_writes"), ("oldest due", "oldest_due_seconds"),
)  # fmt: skip


def stats_table(queues: list[dict[str, Any]], totals: dict[str, int]) -> str:
    """The human table of ``stats``."""
    rows = []
    for q in queues:
        row = []
        for _, key in _STATS_HEADS:
            value = q[key]
            if key == "paused_since":
                value = "yes" if value is not None else ""
            elif key == "oldest_due_seconds":
                value = "" if value is None else f"{value:.1f}s"
            row.append(str(value))
        rows.append(row)
    heads = [h for h, _ in _STATS_HEADS]
    table = _columns(*_databased(heads, rows, queues)) if rows else "no messages in any queue"
    footer = (
        f"stale writes: {totals.get('stale_writes', 0)}   redeliveries: {totals.get('redeliveries', 0)}"
        "   (queued includes delayed: due later; running: actors started, as of the workers' last heartbeats;"
        " prefetched: claimed, not started)"
    )
    return f"{table}\n{footer}"


def fair_keys_table(queues: list[dict[str, Any]]) -> str:
    """The fairness keys of ``stats``: per queue with keyed messages due (its ``fair_keys``, see
    :func:`.admin.overview`), its top keys by due messages, then a line for the other keys; ``""``
    when no queue has any."""
    rows, shown = [], []
    for q in queues:
        fair = q.get("fair_keys")
        if not fair:
            continue
        for k in fair["top"]:
            weight = "" if k["weight"] is None else f"{k['weight']:g}"
            rows.append([q["queue"], k["key"] or "(no key)", str(k["due"]), f"{k['oldest_wait_seconds']:.1f}s", weight])
            shown.append(q)
        if fair["other_keys"]:
            rows.append([q["queue"], f"({fair['other_keys']} other keys)", str(fair["other_due"]), "", ""])
            shown.append(q)
    if not rows:
        return ""
    heads = ["queue", "fairness key", "due", "oldest wait", "weight"]
    return (
        _columns(*_databased(heads, rows, shown))
        + f"\n(fairness keys with messages due: the top {admin.FAIR_TOP} of each queue by due messages;"
        " weight: the fairness_weight table's, blank when it has none)"
    )


def processes_table(rows: list[dict[str, Any]]) -> str:
    """The human table of ``processes``."""
    if not rows:
        return "no worker process"
    heads = ["process", "queues", "threads", "busy", "prefetched", "started", "heartbeat", "version", "status"]
    body = [
        [
            r["process_id"],
            ",".join(r["queues"]),
            str(r["threads"]),
            str(r["busy"]),
            str(r["prefetched"]),
            _when(r["started_at"]),
            f"{r['heartbeat_age']:.0f}s ago",
            r["version"],
            "stale" if r["stale"] else "",
        ]
        for r in rows
    ]
    return _columns(*_databased(heads, body, rows))


def schedules_table(rows: list[dict[str, Any]]) -> str:
    """The human table of ``schedules`` (and the end of ``stats``)."""
    heads = ["schedule", "actor", "when", "missed", "last tick", "last message", "next tick", "status"]
    body = [
        [
            r["name"],
            r["actor_name"],
            r["schedule"] + (f" (version {r['version']})" if r["version"] else ""),
            r["missed"],
            _when(r["last_tick"]),
            r["last_message_id"] or "",
            _when(r["next_tick"]),
            _schedule_status(r),
        ]
        for r in rows
    ]
    return _columns(*_databased(heads, body, rows)) + "\n(times in UTC)" if body else "no schedules"


def _schedule_status(row: dict[str, Any]) -> str:
    if row["stale"]:
        return "stale (no scheduler declares it)"
    # Processes with an older definition enqueue nothing: a rolling deploy not over yet.
    return "active; an older definition is still declared" if row["outdated"] else "active"


def list_table(rows: list[dict[str, Any]]) -> str:
    heads = ["message_id", "actor", "state", "attempt", "enqueued", "finished", "last error"]
    body = [
        [
            r["message_id"],
            r["actor_name"],
            r["state"] + (" (still running)" if r["still_running"] else ""),  # cancel requested, the actor runs
            str(r["attempt"]),
            _when(r["enqueued_at"]),
            "" if r["still_running"] else _when(r["finished_at"]),
            admin.error_summary(r["last_error"], limit=80),
        ]
        for r in rows
    ]
    return _columns(*_databased(heads, body, rows)) if body else "no messages"


def _databased(
    heads: list[str], body: list[list[str]], rows: list[dict[str, Any]]
) -> tuple[list[str], list[list[str]]]:
    """*heads* and *body* with a first column naming each row's database, when the rows carry one
    (several databases: :mod:`.fleet_cli`); as they are otherwise."""
    if not rows or "database" not in rows[0]:
        return heads, body
    return ["database", *heads], [[str(r["database"]), *cells] for r, cells in zip(rows, body, strict=True)]


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else ""


def _columns(heads: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    numeric = [all(r[i].replace(".", "").rstrip("s").isdigit() or not r[i] for r in rows) for i in range(len(heads))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    return "\n".join([line(heads), *(line(r) for r in rows)])


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str, ensure_ascii=False)  # text as text: "café", not "caf\u00e9"
    sys.stdout.write("\n")
