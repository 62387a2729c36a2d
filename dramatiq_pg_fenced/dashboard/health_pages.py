"""The Database page (``/database``) and its summary on the queues page: :mod:`..ops.health` shown.

Read on each database's primary (``site.database``, not a replica's ``reader``): its
sessions, slots and vacuum are the ones that matter for the queue tables.  Of several
databases: a section (and a summary line) per database.
"""

from __future__ import annotations

import logging
from typing import Any

from ..ops import health
from ..ops.fleet import Fleet, Site
from .render import ROOT, age_text, away_note, esc, html_table, none_answered, utc_time

logger = logging.getLogger(__name__)
_LABELS = {"alert": "alert", "warn": "warning", "ok": "ok"}


def _read(fleet: Fleet) -> tuple[list[tuple[Site, health.Health]], list[str]]:
    return fleet.each(lambda s: health.health(s.database, s.statements, keep_finished=s.settings.keep_finished))


def health_summary(fleet: Fleet) -> str:
    """The queues page's line per database: all is well, or the most urgent finding and how many more, linked
    to the Database page.  A database that did not answer is said by the queues table already."""
    try:
        read, _ = _read(fleet)
    except Exception:  # (a fleet of one raises: the page stays, its health line goes, the log says why)
        logger.exception("Dashboard: the database's health could not be read")
        return ""
    lines = []
    for site, h in read:
        where = f"Database {esc(site.name)}" if site.name else "Database"
        if not h.findings:
            text = (
                f"{where}: no long transaction, no table bloated ({h.dead_rows:,} dead rows in the queue tables)."
            )
        else:
            first = h.findings[0]
            more = len(h.findings) - 1
            text = f"{where}: {esc(first.text)}" + (f" (and {more} more)" if more else "") + "."
        lines.append(
            f'<p class="health {h.level}" data-level={h.level}><span class="badge {h.level}">'
            f'{_LABELS[h.level]}</span> {text} <a href="{ROOT.get()}/database">Database health</a></p>'
        )
    return f"<div id=health>{''.join(lines)}</div>"


def database_page(fleet: Fleet) -> str:
    """Each database's findings with the action each calls for, its oldest transactions, slots and prepared
    transactions, the schema's tables (rows, dead rows, size, vacuum) and the history's retention."""
    read, away = _read(fleet)
    if not read:
        raise none_answered(away)
    body = away_note(away)
    for site, h in read:
        body += f"<section class=database-health data-database=\"{esc(site.name)}\">"
        if fleet.several:
            body += f"<h2>Database {esc(site.name)}</h2>"
        body += _findings(h) + _transactions(h) + _tables(h) + _history(h, site)
        body += "</section>"
    return body + _thresholds()


def _findings(h: health.Health) -> str:
    if not h.findings:
        return "<p class='health ok' id=findings><span class='badge ok'>ok</span> Nothing calls for action.</p>"
    items = "".join(
        f"<li class='health {f.level}'><span class='badge {f.level}'>{_LABELS[f.level]}</span> {esc(f.text)}."
        + (f"<br><b>Action:</b> {esc(f.action)}." if f.action else "")
        + "</li>"
        for f in h.findings
    )
    return f"<ul class=findings id=findings>{items}</ul>"


def _transactions(h: health.Health) -> str:
    out = "<h3>Oldest transactions</h3>"
    if h.transactions:
        heads = ["pid", "role", "application", "state", "transaction open", "in this state", "query started",
                 "holds back cleanup", "query"]  # fmt: skip
        rows = [
            [
                str(t["pid"]), esc(t["usename"] or ""), esc(t["application_name"] or ""),
                esc(t["state"] or t["backend_type"] or ""), esc(age_text(t["xact_age"])), esc(age_text(t["state_age"])),
                utc_time(t["query_start"], short=True), _pins(t),
                f"<code>{esc((t['query'] or '')[:160])}</code>",
            ]
            for t in h.transactions
        ]  # fmt: skip
        out += html_table(heads, rows, cls="transactions", cards=True)
    else:
        out += "<p id=no-transactions>No other session of this database has a transaction open.</p>"
    for s in h.slots:
        out += (
            f"<p>Replication slot <b>{esc(s['slot_name'])}</b> ({esc(s['slot_type'])}, "
            f"{'active' if s['active'] else 'inactive'}): xmin {_count(s['xmin_age'])} transactions old, "
            f"catalog xmin {_count(s['catalog_xmin_age'])}.</p>"
        )
    for p in h.prepared:
        out += (
            f"<p>Prepared transaction <b>{esc(p['gid'])}</b> of role {esc(p['owner'])}, prepared "
            f"{esc(age_text(p['age']))} ago.</p>"
        )
    if h.sees_all:
        out += f"<p class=note id=visibility>Role {esc(h.role)} sees every session's transaction.</p>"
    else:
        out += (
            f"<p class=note id=visibility>Role {esc(h.role)} sees only its own sessions' transactions"
            + (f"; {h.hidden} session{'s' if h.hidden != 1 else ''} of other roles hidden" if h.hidden else "")
            + f". <code>GRANT pg_read_all_stats TO {esc(h.role)}</code> (as a superuser) shows them all.</p>"
        )
    return out


def _pins(t: dict[str, Any]) -> str:
    ages = [a for a in (t["xmin_age"], t["xid_age"]) if a is not None]
    return f"yes ({max(ages):,} transactions)" if ages else "no"


def _count(n: int | None) -> str:
    return "none" if n is None else f"{n:,}"


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return ""


def _tables(h: health.Health) -> str:
    heads = ["table", "live rows", "dead rows", "size (with indexes)", "last autovacuum", "autovacuums",
             "last autoanalyze", "autoanalyzes"]  # fmt: skip
    rows = [
        [
            esc(t["relname"]), f"{t['n_live_tup']:,}", f"{t['n_dead_tup']:,}", _size(t["size"]),
            utc_time(t["last_autovacuum"], short=True) or "never", f"{t['autovacuum_count'] or 0:,}",
            utc_time(t["last_autoanalyze"], short=True) or "never", f"{t['autoanalyze_count'] or 0:,}",
        ]
        for t in h.tables
    ]  # fmt: skip
    total = sum(t["size"] for t in h.tables)
    return (
        f"<h3>Queue tables</h3>{html_table(heads, rows, cls='tables')}"
        f"<p class=note>{len(h.tables)} tables, {_size(total)} in all; rows and dead rows as the statistics "
        "collector estimates them.</p>"
    )


def _history(h: health.Health, site: Site) -> str:
    table = next((t for t in h.tables if t["relname"] == "history"), None)
    if h.keep_finished <= 0:
        kept = "The history is off (keep_finished=0): finished messages are deleted at their ack."
    else:
        kept = f"Finished messages are kept {esc(health.age_words(h.keep_finished))} (keep_finished={h.keep_finished})"
        kept += (
            f"; the oldest finished {esc(health.age_words(h.history_oldest))} ago."
            if h.history_oldest is not None
            else "; it is empty."
        )
    size = f" About {table['n_live_tup']:,} rows, {_size(table['size'])}." if table else ""
    return f"<h3>History</h3><p id=history>{kept}{size}</p>"


def _thresholds() -> str:
    return (
        "<p class=note>Warnings: a transaction, prepared transaction or snapshot open "
        f"{health.age_words(health.TRANSACTION_WARN)} or more (an alert from "
        f"{health.age_words(health.TRANSACTION_ALERT)}); a queue table with more than "
        f"{health.DEAD_ROWS_WARN:,} dead rows and more than {health.DEAD_SHARE:.0%} of its live rows; a replication "
        "slot holding an xmin (an alert when inactive); the history's oldest row "
        f"{health.age_words(health.HISTORY_LATE)} past its retention. Read on the primary, from pg_stat_activity, "
        "pg_replication_slots, pg_prepared_xacts and pg_stat_user_tables. Times in UTC.</p>"
    )
