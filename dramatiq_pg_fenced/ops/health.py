"""The database's health, as a queue's operator needs it: what holds back cleanup, and what it costs.

A queue's rows are deleted (acks) and updated (claims, leases) all day; a transaction left
open anywhere in the database (an application's "idle in transaction", a long report, a
prepared transaction, a standby's ``hot_standby_feedback`` slot) keeps vacuum from removing
any row deleted after it began, and the queue tables and their indexes grow until claims
slow down.  :func:`health` reads, with statistics views and catalogs any role may read
(``db/queries/health.py``):

- the oldest transactions of this database (``pg_stat_activity``: pid, role, application,
  state, ages, query start), replication slots and prepared transactions that pin the
  horizon;
- the schema's tables: live and dead rows, size, autovacuum's last runs and counts;
- the history's size, its oldest row and its retention (``keep_finished``);

and says, per finding, what it calls for (:class:`Finding`), by the thresholds below.  A
role not in ``pg_read_all_stats`` sees no other role's transaction: the sessions hidden are
counted and the grant that shows them named.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from ..db.database import Database
from ..db.statements import Statements

#: A transaction (or snapshot, or prepared transaction) open this long is a warning: a queue deletes and
#: updates rows every second, and none of those deleted after it began can be vacuumed while it stays.
TRANSACTION_WARN = 60.0
#: ... and this long an alert.
TRANSACTION_ALERT = 600.0
#: A queue table's dead rows are a warning above this many *and* :data:`DEAD_SHARE` of its live rows
#: (a table of 100 rows with 1,500 dead is bloated; one of 10 million with 1,500 dead is not).
DEAD_ROWS_WARN = 10_000
DEAD_SHARE = 0.2
#: The history's oldest row this long past ``keep_finished`` is a warning: its purge is behind.
HISTORY_LATE = 600.0
#: The oldest transactions listed.
LISTED = 5


@dataclasses.dataclass
class Finding:
    """One thing the page says: ``level`` ``"ok"``, ``"warn"`` or ``"alert"``, ``text`` (what is
    seen) and ``action`` (what it calls for; empty when nothing)."""

    level: str
    text: str
    action: str = ""


@dataclasses.dataclass
class Health:
    """What :func:`health` read of one database (rows as dicts, named as the views name them)."""

    transactions: list[dict[str, Any]]
    slots: list[dict[str, Any]]
    prepared: list[dict[str, Any]]
    tables: list[dict[str, Any]]
    hidden: int  #: other roles' sessions this role may not see
    role: str
    sees_all: bool  #: a member of pg_read_all_stats (or a superuser)
    history_oldest: float | None  #: seconds since the history's oldest row finished
    keep_finished: int
    findings: list[Finding]

    @property
    def level(self) -> str:
        """The worst finding's level."""
        levels = [f.level for f in self.findings]
        return "alert" if "alert" in levels else "warn" if "warn" in levels else "ok"

    @property
    def dead_rows(self) -> int:
        return sum(t["n_dead_tup"] for t in self.tables)


_ACTIVITY = ("pid", "usename", "application_name", "state", "backend_type", "xact_age", "query_age", "state_age",
             "xmin_age", "xid_age", "query", "query_start")  # fmt: skip
_TABLES = ("relname", "n_live_tup", "n_dead_tup", "size", "last_autovacuum", "last_vacuum", "last_autoanalyze",
           "autovacuum_count", "autoanalyze_count", "n_mod_since_analyze")  # fmt: skip


def health(database: Database, statements: Statements, *, keep_finished: int) -> Health:
    """Read the database's health (a handful of catalog reads, one index probe of the history) and judge it."""

    def read(conn: Any) -> dict[str, Any]:
        got: dict[str, Any] = {}
        got["activity"] = conn.execute(statements.health_activity, {"limit": LISTED}).fetchall()
        got["visibility"] = conn.execute(statements.health_visibility).fetchone()
        got["slots"] = conn.execute(statements.health_slots).fetchall()
        got["prepared"] = conn.execute(statements.health_prepared).fetchall()
        got["tables"] = conn.execute(statements.health_tables).fetchall()
        got["history"] = conn.execute(statements.health_history).fetchone()[0]
        return got

    got = database.run(read)
    hidden, role, sees_all = got["visibility"]
    found = Health(
        transactions=[dict(zip(_ACTIVITY, r, strict=True)) for r in got["activity"]],
        slots=[dict(zip(("slot_name", "slot_type", "active", "xmin_age", "catalog_xmin_age"), r, strict=True))
               for r in got["slots"]],
        prepared=[dict(zip(("gid", "owner", "age", "xid_age"), r, strict=True)) for r in got["prepared"]],
        tables=[dict(zip(_TABLES, r, strict=True)) for r in got["tables"]],
        hidden=int(hidden), role=role, sees_all=bool(sees_all), history_oldest=got["history"],
        keep_finished=keep_finished, findings=[],
    )  # fmt: skip
    found.findings = judge(found)
    return found


def age_words(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _level(seconds: float) -> str:
    return "alert" if seconds >= TRANSACTION_ALERT else "warn" if seconds >= TRANSACTION_WARN else "ok"


def judge(h: Health) -> list[Finding]:
    """The findings of *h*, the most urgent first, each with the action it calls for (see the thresholds)."""
    out: list[Finding] = []
    dead = f"{h.dead_rows:,} dead rows in the queue tables"
    for t in h.transactions:
        age = t["xact_age"]
        pins = t["xmin_age"] is not None or t["xid_age"] is not None
        if age is None or age < TRANSACTION_WARN:
            continue
        who = f"transaction of pid {t['pid']} (role {t['usename']}, application {t['application_name'] or '(none)'})"
        if t["state"] and t["state"].startswith("idle in transaction"):
            what = f"{who} idle in transaction for {age_words(t['state_age'] or age)}, open {age_words(age)}"
            fix = (f"end it (SELECT pg_terminate_backend({t['pid']})) or fix the application, which leaves a "
                   "transaction open; idle_in_transaction_session_timeout ends such sessions by itself")  # fmt: skip
        else:
            what = f"{who} {t['state'] or 'running'} for {age_words(age)}"
            fix = (f"if it is not expected to run this long, cancel it (SELECT pg_cancel_backend({t['pid']})) or end "
                   f"it (pg_terminate_backend({t['pid']})); statement_timeout bounds such statements")  # fmt: skip
        if pins:
            what += f": it holds back the cleanup of {dead}, and of every row deleted while it stays open"
        else:
            what += ": it holds no snapshot (it does not hold back cleanup) but keeps its locks"
        out.append(Finding(_level(age), what, fix))
    for s in h.slots:
        if s["xmin_age"] is not None:
            out.append(Finding(
                "warn" if s["active"] else "alert",
                f"replication slot {s['slot_name']} ({s['slot_type']}, {'active' if s['active'] else 'inactive'}) "
                f"holds back cleanup by {s['xmin_age']:,} transactions (its standby's hot_standby_feedback)",
                "an inactive slot pins the horizon for ever: drop it if nothing will use it "
                f"(SELECT pg_drop_replication_slot('{s['slot_name']}')), or start its standby",
            ))  # fmt: skip
    for p in h.prepared:
        if p["age"] >= TRANSACTION_WARN:
            out.append(Finding(
                _level(p["age"]),
                f"prepared transaction {p['gid']!r} of role {p['owner']}, prepared {age_words(p['age'])} ago, holds "
                f"back the cleanup of {dead}",
                f"let its transaction manager finish it, or by hand: COMMIT PREPARED '{p['gid']}' or "
                f"ROLLBACK PREPARED '{p['gid']}'",
            ))  # fmt: skip
    for t in h.tables:
        if t["n_dead_tup"] > DEAD_ROWS_WARN and t["n_dead_tup"] > DEAD_SHARE * t["n_live_tup"]:
            last = t["last_autovacuum"]
            out.append(Finding(
                "warn",
                f"table {t['relname']} has {t['n_dead_tup']:,} dead rows for {t['n_live_tup']:,} live ones; "
                + (f"autovacuum last ran {_ago(last)}" if last else "autovacuum has not run on it"),
                "find what holds back cleanup (above); if nothing does, autovacuum is behind: look at "
                "autovacuum_max_workers and the cost limits, or VACUUM it (its owner may)",
            ))  # fmt: skip
    if h.keep_finished > 0 and h.history_oldest is not None and h.history_oldest > h.keep_finished + HISTORY_LATE:
        out.append(Finding(
            "warn",
            f"the history's oldest row finished {age_words(h.history_oldest)} ago, though it keeps "
            f"{age_words(h.keep_finished)} (keep_finished)",
            "its purge runs in the workers' maintenance loop: is a worker running? Purges are bounded batches, "
            "so a large backlog takes a while",
        ))  # fmt: skip
    if not h.sees_all and h.hidden:
        out.append(Finding(
            "warn",
            f"{h.hidden} session{'s' if h.hidden != 1 else ''} of other roles in this database: role {h.role} may "
            "not see their transactions, so any of them may be the one holding back cleanup",
            f"GRANT pg_read_all_stats TO {h.role} (as a superuser) shows them here",
        ))  # fmt: skip
    order = {"alert": 0, "warn": 1, "ok": 2}
    out.sort(key=lambda f: order[f.level])
    return out


def _ago(when: datetime) -> str:
    from datetime import timezone

    return f"{age_words((datetime.now(timezone.utc) - when).total_seconds())} ago"
