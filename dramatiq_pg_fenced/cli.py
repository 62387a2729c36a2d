"""``dramatiq-pg-fenced``: migrate, inspect and operate the queues without writing SQL.

Workers are run with Dramatiq's own ``dramatiq`` command; this one
administers the database side.  Options go before or after the command.

Exit codes: 0 done; 1 the thing asked for did not apply (no such message,
nothing to cancel or re-drive, a queue already paused); 2 bad usage (an
unknown option, a message id that is not a UUID, a bad queue or schema
name, a queue nothing knows of); 3 the database failed (unreachable, refused the statement, schema
missing or out of date).  Output cut short by a closed pipe (``| head``) ends
quietly with 0.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.errors import BrokerError

from . import __version__, admin, schedules, startup
from .broker import PostgresBroker
from .config import DEFAULT_SCHEMA
from .database import Database
from .errors import describe_failure
from .sql import FINISHED_STATES

OK, NOT_APPLIED, USAGE, DATABASE = 0, 1, 2, 3


def _common(suppress: bool) -> argparse.ArgumentParser:
    """--url and --schema, accepted before the command and after it."""
    common = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS
    common.add_argument(
        "--url",
        default=default if suppress else os.environ.get("DATABASE_URL"),
        help="PostgreSQL URL or libpq DSN (default: $DATABASE_URL, else libpq's PG* variables, named on stderr)",
    )
    common.add_argument(
        "--read-url",
        default=default if suppress else os.environ.get("DATABASE_READ_URL"),
        help="a streaming replica for the reads of stats, inspect, list, schedules, metrics and the dashboard's "
        "pages; actions still go to --url (default: $DATABASE_READ_URL, else --url)",
    )
    common.add_argument(
        "--schema",
        default=default if suppress else os.environ.get("DRAMATIQ_PG_SCHEMA", DEFAULT_SCHEMA),
        help="schema of the tables (default: $DRAMATIQ_PG_SCHEMA, else %(default)s)"
        if not suppress
        else "schema of the tables",
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dramatiq-pg-fenced",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="exit codes: 0 done, 1 did not apply, 2 bad usage, 3 database failure",
        parents=[_common(suppress=False)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common(suppress=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    command("migrate", "create or upgrade the schema (idempotent, safe to run concurrently)")
    seen_help = "only if the message is still the one inspect showed with this version (not its id sent again)"
    cancel = command("cancel", "cancel a queued or running message")
    cancel.add_argument("message_id")
    cancel.add_argument("--seen", metavar="VERSION", help=seen_help)
    command("inspect", "a message's state, attempt, lease, timing and last error (JSON)").add_argument("message_id")
    stats = command(
        "stats", "per queue: queued (delayed: due later), running, dead, cancelled, done, oldest due, expired leases"
    )
    stats.add_argument("--json", action="store_true", help="JSON for scripts instead of a table")
    listing = command("list", "list a queue's messages in one state (default: its dead letters, newest first)")
    listing.add_argument("--queue", required=True)
    listing.add_argument("--state", default="dead", choices=admin.LISTABLE)
    listing.add_argument("--actor", help="only this actor's messages")
    listing.add_argument("--limit", type=int, default=50)
    listing.add_argument("--after", help="the cursor printed after the previous page")
    listing.add_argument("--json", action="store_true")
    redrive = command("redrive", "put dead (or cancelled) messages back in their queue with their retry count reset")
    redrive.add_argument("message_ids", nargs="*", metavar="MESSAGE_ID")
    redrive.add_argument("--queue", help="every dead letter of this queue (with --state: cancelled, or all)")
    redrive.add_argument("--state", default="dead", choices=(*FINISHED_STATES, "all"))
    redrive.add_argument("--seen", metavar="VERSION", help=seen_help.replace("still", "still dead or cancelled as"))
    purge = command("purge", "delete a queue's queued, dead, cancelled and done messages (never running ones)")
    purge.add_argument("--queue", required=True)
    purge.add_argument("--state", choices=admin.PURGEABLE, help="only this state (default: all of them)")
    purge.add_argument("--yes", action="store_true", help="required: this deletes messages")
    for bulk in (redrive, purge):
        bulk.add_argument("--actor", help="with --queue: only this actor's messages")
        bulk.add_argument("--verbose", action="store_true", help="with --queue: print every message id, not a count")
    listed = command("schedules", "every schedule: when it ticks, its last tick and message, its next tick, stale ones")
    listed.add_argument("--json", action="store_true")
    listed.add_argument("--forget", metavar="NAME", help="remove a stale schedule's row (a removed schedule)")
    scheduler = command(
        "scheduler", "run the schedules of an app module alone, without consuming (workers run them too)"
    )
    scheduler.add_argument(
        "module", help="the module that declares the broker, its actors and schedules (as for dramatiq)"
    )
    pause = command("pause", "consumers stop claiming from a queue (survives restarts)")
    pause.add_argument("queue")
    pause.add_argument("--create", action="store_true", help="pause a queue no message, pause or schedule names yet")
    command("resume", "consumers claim from a paused queue again").add_argument("queue")
    command("compact", "give back the space a drained backlog left (VACUUM FULL: locks the table briefly; owner)")
    metrics = command("metrics", "serve Prometheus metrics of the queues (or print them once)")
    metrics.add_argument("--host", default="127.0.0.1")
    metrics.add_argument("--port", type=int, default=9191)
    metrics.add_argument("--once", action="store_true", help="print the metrics and exit")
    dashboard = command("dashboard", "serve the web dashboard (read-only unless --actions)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this host only)")
    dashboard.add_argument("--port", type=int, default=8080)
    dashboard.add_argument("--actions", action="store_true", help="allow cancel, re-drive, pause/resume and purge")
    dashboard.add_argument(
        "--auth-file",
        metavar="PATH",
        help="require HTTP authentication: the file holds user:password, or a token "
        "(default: $DRAMATIQ_PG_DASHBOARD_AUTH if set; never given on the command line)",
    )
    for server in (metrics, dashboard):
        server.add_argument(
            "--allow-host",
            action="append",
            default=[],
            metavar="NAME",
            help="answer requests addressed to NAME too (repeat it; NAME:PORT for that port only, "
            ".example.com for a domain and its subdomains); always answered: localhost, 127.0.0.1, [::1] "
            "and the --host address; others get 400",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (| head): no traceback, and none at exit either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return OK
    except KeyboardInterrupt:
        return OK


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")  # a terminal that cannot show a character: escaped, no crash
    if args.command == "scheduler":
        return _scheduler(args.module)
    try:
        ids = [admin.check_message_id(m) for m in _ids(args)]
    except ValueError as e:
        return _fail(str(e), USAGE)
    pool = 4 if args.command == "dashboard" else 1
    try:
        broker = PostgresBroker(args.url, schema=args.schema, listen=False, pool_max_size=pool, read_url=args.read_url)
    except ValueError as e:
        return _fail(str(e), USAGE)
    if not args.url:
        print(f"note: no --url or $DATABASE_URL; using libpq's defaults: {_libpq_default()}", file=sys.stderr)
    try:
        return _run(broker, args, ids)
    except ValueError as e:
        return _fail(str(e), USAGE)
    except BrokerError as e:
        return _fail(str(e), DATABASE)
    except psycopg.Error as e:  # e.g. permission denied: one line, not a traceback
        return _fail(describe_failure(e), DATABASE)
    finally:
        broker.close()


def _libpq_default() -> str:
    """The database libpq's defaults (PGHOST, PGPORT, PGUSER, PGDATABASE...) lead to, password never shown."""
    try:
        with psycopg.connect("", connect_timeout=5) as conn:
            info = conn.info
            return f"postgresql://{info.user}@{info.host}:{info.port}/{info.dbname}"
    except psycopg.Error:
        variables = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k in _PG_VARIABLES]
        return f"({', '.join(variables) or 'no PG* variables set'}; not reachable)"


_PG_VARIABLES = {"PGHOST", "PGHOSTADDR", "PGPORT", "PGUSER", "PGDATABASE", "PGSERVICE"}


def _ids(args: argparse.Namespace) -> list[str]:
    if args.command in ("cancel", "inspect"):
        return [args.message_id]
    return list(getattr(args, "message_ids", []) or [])


def _fail(text: str, code: int) -> int:
    print(f"error: {text}", file=sys.stderr)
    return code


def _run(broker: PostgresBroker, args: argparse.Namespace, ids: list[str]) -> int:
    db, st, ring = broker.database, broker.statements, broker.channel  # NOTIFY works without LISTEN
    reads = broker.reader  # a replica's with --read-url: never for a write
    command = args.command
    queue = getattr(args, "queue", None) if command in _QUEUE_COMMANDS else None
    if queue is not None and not getattr(args, "create", False):
        # A typo must not pause (or list, purge...) a phantom queue: exit 2, naming the known ones.
        hint = "pause --create pauses a queue before its first message" if command == "pause" else ""
        admin.check_known(reads if command == "list" else db, st, queue, hint=hint)
    if command == "migrate":
        applied = broker.migrate()
        done = ", ".join(map(str, applied)) if applied else "nothing to do"
        print(f"schema {broker.schema!r}: {done}")
        return OK
    if command == "cancel":
        outcome = broker.cancel(ids[0], seen=args.seen)
        print(outcome.value)
        return OK if outcome.value.startswith("cancelled") else NOT_APPLIED
    if command == "inspect":
        info = broker.inspect(ids[0])
        if info is None:
            return _fail(f"no message {ids[0]} (unknown, or acked longer ago than keep_finished)", NOT_APPLIED)
        _print_json(info)
        return OK
    if command == "stats":
        queues = admin.overview(reads, st)
        totals = admin.counters(reads, st)
        listed = schedules.overview(reads, st)
        if args.json:
            _print_json({"queues": queues, "totals": totals, "schedules": listed})
        else:
            print(stats_table(queues, totals))
            if listed:
                print()
                print(schedules_table(listed))
        return OK
    if command == "schedules":
        if args.forget:
            if not schedules.forget(db, st, args.forget):
                return _fail(f"no schedule {args.forget!r}", NOT_APPLIED)
            print(f"{args.forget}: forgotten (a scheduler that still declares its newest definition puts it back)")
            return OK
        listed = schedules.overview(reads, st)
        if args.json:
            _print_json({"schedules": listed})
        else:
            print(schedules_table(listed))
        return OK
    if command == "list":
        page = admin.list_messages(
            reads, st, args.queue, args.state, actor=args.actor, after=args.after, limit=args.limit
        )
        if args.json:
            _print_json({"messages": page.rows, "next": page.next})
        else:
            print(list_table(page.rows))
            if page.searched:
                print(f"searched {page.searched} messages for this actor; more may follow")
            if page.next:
                print(f"more: --after '{page.next}'")
        return OK
    if command == "redrive":
        if bool(ids) == bool(args.queue):
            raise ValueError("give message ids or --queue, one of the two")
        if args.seen is not None and len(ids) != 1:
            raise ValueError("--seen is the version of one message: give one MESSAGE_ID")
        if args.actor and not args.queue:
            raise ValueError("--actor goes with --queue")
        if args.queue:
            again = FINISHED_STATES if args.state == "all" else (args.state,)
            result = admin.redrive_queue(db, st, args.queue, again, ring, actor=args.actor)
        else:
            result = admin.redrive(db, st, ids, ring, seen=None if args.seen is None else {ids[0]: args.seen})
        # Ids named on the command line are answered one by one; a whole queue's, counted (--verbose: listed).
        one_by_one = not args.queue or args.verbose
        if one_by_one:
            for message_id in result.redriven:
                print(f"redriven {message_id}")
        _skipped(result.skipped, one_by_one)
        print(
            f"{len(result.redriven)} re-driven, {len(result.skipped)} skipped",
            file=sys.stdout if args.queue else sys.stderr,
        )
        return OK if result.redriven or (args.queue and not result.skipped) else NOT_APPLIED
    if command == "purge":
        if not args.yes:
            raise ValueError("purge deletes messages: add --yes")
        purged = (args.state,) if args.state else admin.PURGEABLE
        gone: list[str] | None = [] if args.verbose else None
        deleted = admin.purge_queue(db, st, args.queue, purged, actor=args.actor, ids=gone)
        for message_id in gone or ():
            print(f"deleted {message_id}")
        print(", ".join(f"{state} {n}" for state, n in deleted.items()))
        return OK
    if command in ("pause", "resume"):
        changed = admin.pause(db, st, args.queue) if command == "pause" else admin.resume(db, st, args.queue, ring)
        print(
            f"{args.queue}: {command}d"
            if changed
            else f"{args.queue}: already {'paused' if command == 'pause' else 'running'}"
        )
        return OK if changed else NOT_APPLIED
    if command == "compact":
        _print_json(broker.compact())
        return OK
    if command == "metrics":
        return _metrics(broker, args)
    if command == "dashboard":
        return _dashboard(broker, args)
    raise AssertionError(command)


#: The commands that name a queue (refused for a queue nothing knows of).
_QUEUE_COMMANDS = ("list", "redrive", "purge", "pause", "resume")


def _skipped(skipped: dict[str, str], one_by_one: bool) -> None:
    """On stderr: each message not re-driven and why, or (a whole queue's) how many for each reason."""
    if one_by_one:
        for message_id, why in skipped.items():
            print(f"skipped {message_id}: {why}", file=sys.stderr)
        return
    for why, n in Counter(skipped.values()).most_common():
        print(f"skipped {n}: {why}", file=sys.stderr)


def _scheduler(module: str) -> int:
    """Import *module* (it sets Dramatiq's broker, declares actors and schedules) and run its scheduler
    until SIGTERM or SIGINT."""
    import importlib
    import signal
    import threading

    import dramatiq.broker

    sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(module)
    except ImportError as e:
        return _fail(f"cannot import {module!r}: {e}", USAGE)
    broker = dramatiq.broker.global_broker  # (get_broker() would make a RabbitMQ broker when none is set)
    if not isinstance(broker, PostgresBroker):
        return _fail(f"{module!r} did not set a PostgresBroker as Dramatiq's broker", USAGE)
    if not len(broker.schedules):
        return _fail(f"{module!r} declares no schedule", USAGE)
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    broker.start_scheduler()
    names = ", ".join(s.name for s in broker.schedules)
    print(f"scheduler of schema {broker.schema!r} running: {names}", file=sys.stderr)
    try:
        stopped.wait()
    finally:
        broker.close()
    return OK


def _metrics(broker: PostgresBroker, args: argparse.Namespace) -> int:
    try:
        from . import metrics
    except ImportError as e:
        return _fail(str(e), USAGE)
    registry = metrics.registry(broker.reader, broker.statements)
    if args.once:
        sys.stdout.write(metrics.exposition(registry).decode())
        return OK
    _check_before_serving(broker, "each scrape answers dramatiq_pg_up 0", broker.reader)
    from prometheus_client import make_wsgi_app

    from .dashboard import AllowedHosts, host_checked, make_dashboard_server, netloc

    # As the dashboard: a page of another site, its name rebound to this address, reads nothing.
    app = host_checked(make_wsgi_app(registry), AllowedHosts(_allowed_hosts(args)))
    server = make_dashboard_server(app, args.host, args.port)
    where = netloc(args.host, server.server_port)
    print(f"metrics of schema {broker.schema!r} on http://{where}/metrics", file=sys.stderr)
    return _serve(server, args)


def _dashboard(broker: PostgresBroker, args: argparse.Namespace) -> int:
    from .dashboard import dashboard_app, make_dashboard_server, netloc

    auth = _dashboard_auth(args.auth_file)
    # The pages read from the reader (a replica, with --read-url); the actions write to the primary.
    _check_before_serving(broker, "its pages answer 503", broker.reader, *([broker.database] if args.actions else []))
    app = dashboard_app(broker, actions=args.actions, ring=True, allowed_hosts=_allowed_hosts(args), auth=auth)
    server = make_dashboard_server(app, args.host, args.port)  # warns if it exposes actions to anyone
    mode = ("actions on" if args.actions else "read-only") + (", authentication on" if auth else "")
    where = netloc(args.host, server.server_port)
    print(f"dashboard of schema {broker.schema!r} ({mode}) on http://{where}/", file=sys.stderr)
    return _serve(server, args)


def _serve(server: Any, args: argparse.Namespace) -> int:
    """Serve until interrupted (after the note on a wildcard bind without --allow-host)."""
    _note_wildcard(args)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return OK


def _check_before_serving(broker: PostgresBroker, meanwhile: str, *databases: Database) -> None:
    """A role, password, database or schema that can never work: fail now (``StartupError``, exit 3).
    A database that cannot be reached now: serve all the same, and say so (as once started).
    *databases*: those the server uses (default: the broker's)."""
    for database in dict.fromkeys(databases or (broker.database,)):
        away = startup.check(database)
        if away is not None:
            print(f"note: {away}; {meanwhile} until it is back", file=sys.stderr)


def _allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The host names the server answers besides the loopback ones: the bound address and --allow-host."""
    return [args.host, *args.allow_host] if args.host else list(args.allow_host)


def _note_wildcard(args: argparse.Namespace) -> None:
    if args.host in ("", "0.0.0.0", "::") and not args.allow_host:
        print(
            "note: requests are answered only when addressed to localhost, 127.0.0.1 or [::1]: "
            "add --allow-host for each name or address it is reached by",
            file=sys.stderr,
        )


def _dashboard_auth(path: str | None) -> str | None:
    """The dashboard's credentials, from *path* (``--auth-file``), else ``$DRAMATIQ_PG_DASHBOARD_AUTH``.

    Never from an argument: a command line is visible to every user of the host (``ps``,
    ``/proc``) and kept in shell histories.  Errors name neither the file nor its content
    (a secret typed where the path goes stays out of the output)."""
    from .dashboard import AUTH_ENV

    if path is not None:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --auth-file: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None
        where = "--auth-file"
    else:
        env = os.environ.get(AUTH_ENV)
        if env is None:
            return None
        text, where = env, f"${AUTH_ENV}"
    text = text.strip()
    if not text or "\n" in text:
        raise ValueError(f"{where} must hold one line: user:password, or a token")
    return text


# -- output ----------------------------------------------------------------------------
_STATS_HEADS = (
    ("queue", "queue"), ("paused", "paused_since"), ("queued", "queued"), ("delayed", "delayed"),
    ("running", "running"), ("expired", "expired_leases"), ("dead", "dead"), ("cancelled", "cancelled"),
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
    table = _columns([h for h, _ in _STATS_HEADS], rows) if rows else "no messages in any queue"
    footer = (
        f"stale writes: {totals.get('stale_writes', 0)}   redeliveries: {totals.get('redeliveries', 0)}"
        "   (queued includes delayed: due later; running includes prefetched messages)"
    )
    return f"{table}\n{footer}"


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
    return _columns(heads, body) + "\n(times in UTC)" if body else "no schedules"


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
    return _columns(heads, body) if body else "no messages"


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


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str, ensure_ascii=False)  # text as text: "café", not "caf\u00e9"
    sys.stdout.write("\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
