"""``dramatiq-pg-fenced``: migrate, inspect and operate the queues without writing SQL.

Workers are run with Dramatiq's own ``dramatiq`` command; this one
administers the database side.  Options go before or after the command.

Several databases at once: ``--broker app:broker`` (the application's ``RoutedBroker``, whose
routes say where a queue's actions go) or ``--url NAME=postgresql://...`` repeated; the commands
then run in :mod:`.fleet_cli` (every database shown, each row naming its own; each action in its
message's or queue's database, said).

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
import os
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psycopg
from dramatiq.errors import BrokerError

from ..broker import PostgresBroker
from ..config import __version__
from ..core import processes
from ..db.statements import FINISHED_STATES
from ..errors import describe_failure
from ..features import schedules
from ..ops import admin
from .options import allowed_hosts, check_before_serving, dashboard_auth, named_url, schema_of, serve
from .output import (
    DATABASE,
    NOT_APPLIED,
    OK,
    USAGE,
    fail,
    fair_keys_table,
    list_table,
    print_json,
    processes_table,
    schedules_table,
    stats_table,
)


def _common(suppress: bool) -> argparse.ArgumentParser:
    """--url, --read-url, --schema, --broker and --database, accepted before the command and after it."""
    common = argparse.ArgumentParser(add_help=False)
    default = argparse.SUPPRESS
    common.add_argument(
        "--url",
        action="append",
        default=default if suppress else None,
        help="PostgreSQL URL or libpq DSN (default: $DATABASE_URL, else libpq's PG* variables, named on stderr); "
        "NAME=postgresql://... repeated: several databases at once, each row naming its database",
    )
    common.add_argument(
        "--read-url",
        default=default if suppress else os.environ.get("DATABASE_READ_URL"),
        help="a streaming replica for the reads of stats, inspect, list, schedules, metrics and the dashboard's "
        "pages; actions still go to --url (default: $DATABASE_READ_URL, else --url)",
    )
    common.add_argument(
        "--schema",
        action="append",
        default=default if suppress else None,
        help="schema of the tables (default: $DRAMATIQ_PG_SCHEMA, else dramatiq); NAME=SCHEMA for one of several "
        "databases"
        if not suppress
        else "schema of the tables",
    )
    common.add_argument(
        "--broker",
        metavar="MODULE[:ATTRIBUTE]",
        default=default if suppress else None,
        help="the application's broker (ATTRIBUTE defaults to broker), instead of --url: a RoutedBroker's "
        "databases are shown at once and its routes say where a queue's actions go",
    )
    common.add_argument(
        "--database",
        metavar="NAME",
        default=default if suppress else None,
        help="with several databases: only this one (reads), or act there (a queue known in several)",
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
        "stats",
        "per queue: queued (delayed: due later), running, prefetched, dead, cancelled, done, oldest due, expired leases",
    )
    stats.add_argument("--json", action="store_true", help="JSON for scripts instead of a table")
    workers = command("processes", "the worker processes: host, pid, queues, threads, busy, prefetched, heartbeat")
    workers.add_argument("--json", action="store_true")
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
    move = command(
        "move-queue",
        "finish moving a queue to the database its route names (--broker: a RoutedBroker with the new routes): "
        "pause it elsewhere, move its queued rows, wait until none is left there",
    )
    move.add_argument("queue")
    move.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default: %(default)s)")
    move.add_argument("--resume", action="store_true", help="resume the queue in the other databases afterwards")
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
        help="require a login (a page, then a session cookie; or HTTP authentication for scripts): the file holds "
        "user:password, or a token "
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
        return fail(str(e), USAGE)
    pool = 4 if args.command == "dashboard" else 1
    try:
        app_broker = _app_broker(args.broker) if args.broker else None
        urls = args.url or [os.environ.get("DATABASE_URL")]
        if app_broker is not None and (args.url or args.schema):
            raise ValueError("give --broker or --url (and --schema), not both: the app's broker has its own")
        if (app_broker is not None and hasattr(app_broker, "shards")) or any(named_url(u) for u in urls):
            from .fleet import run_several

            return run_several(args, ids, app_broker, [u for u in urls if u], pool)
        if len(urls) > 1:
            raise ValueError("several --url must each be named: --url NAME=postgresql://...")
        if args.command == "move-queue":
            raise ValueError("move-queue needs the routes: --broker MODULE:ATTRIBUTE naming a RoutedBroker")
        if args.database is not None:
            raise ValueError("--database names one of several databases (--url NAME=URL, or --broker)")
        url = urls[0]
        broker = app_broker or PostgresBroker(
            url, schema=schema_of(args, ""), listen=False, pool_max_size=pool, read_url=args.read_url
        )
    except ValueError as e:
        return fail(str(e), USAGE)
    if not url and app_broker is None:
        print(f"note: no --url or $DATABASE_URL; using libpq's defaults: {_libpq_default()}", file=sys.stderr)
    try:
        return _run(broker, args, ids)
    except ValueError as e:
        return fail(str(e), USAGE)
    except BrokerError as e:
        return fail(str(e), DATABASE)
    except psycopg.Error as e:  # e.g. permission denied: one line, not a traceback
        return fail(describe_failure(e), DATABASE)
    finally:
        broker.close()


def _app_broker(spec: str) -> Any:
    """The broker *spec* (``module`` or ``module:attribute``, as the ``dramatiq`` command's) names: a
    ``PostgresBroker`` or a ``RoutedBroker``; ``ValueError`` otherwise."""
    import importlib

    module, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:  # as the dramatiq command: the app's module from here
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), attribute or "broker")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--broker {spec}: {e}") from None
    from ..routing.router import RoutedBroker

    if not isinstance(found, (PostgresBroker, RoutedBroker)):
        raise ValueError(f"--broker {spec} is a {type(found).__name__}, not a PostgresBroker or RoutedBroker")
    return found


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
            return fail(f"no message {ids[0]} (unknown, or acked longer ago than keep_finished)", NOT_APPLIED)
        print_json(info)
        return OK
    if command == "stats":
        queues = admin.overview(reads, st)
        totals = admin.counters(reads, st)
        listed = schedules.overview(reads, st)
        if args.json:
            print_json({"queues": queues, "totals": totals, "schedules": listed})
        else:
            print(stats_table(queues, totals))
            keyed = fair_keys_table(queues)
            if keyed:
                print()
                print(keyed)
            if listed:
                print()
                print(schedules_table(listed))
        return OK
    if command == "processes":
        found = processes.processes(reads, st)
        if args.json:
            print_json({"processes": found})
        else:
            print(processes_table(found))
        return OK
    if command == "schedules":
        if args.forget:
            if not schedules.forget(db, st, args.forget):
                return fail(f"no schedule {args.forget!r}", NOT_APPLIED)
            print(f"{args.forget}: forgotten (a scheduler that still declares its newest definition puts it back)")
            return OK
        listed = schedules.overview(reads, st)
        if args.json:
            print_json({"schedules": listed})
        else:
            print(schedules_table(listed))
        return OK
    if command == "list":
        page = admin.list_messages(
            reads, st, args.queue, args.state, actor=args.actor, after=args.after, limit=args.limit
        )
        if args.json:
            print_json({"messages": page.rows, "next": page.next})
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
        print_json(broker.compact())
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
        return fail(f"cannot import {module!r}: {e}", USAGE)
    broker = dramatiq.broker.global_broker  # (get_broker() would make a RabbitMQ broker when none is set)
    if not isinstance(broker, PostgresBroker):
        return fail(f"{module!r} did not set a PostgresBroker as Dramatiq's broker", USAGE)
    if not len(broker.schedules):
        return fail(f"{module!r} declares no schedule", USAGE)
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
        from ..ops import metrics
    except ImportError as e:
        return fail(str(e), USAGE)
    registry = metrics.registry(broker.reader, broker.statements)
    if args.once:
        sys.stdout.write(metrics.exposition(registry).decode())
        return OK
    check_before_serving(broker, "each scrape answers dramatiq_pg_up 0", broker.reader)
    from prometheus_client import make_wsgi_app

    from ..dashboard import AllowedHosts, host_checked, make_dashboard_server, netloc

    # As the dashboard: a page of another site, its name rebound to this address, reads nothing.
    app = host_checked(make_wsgi_app(registry), AllowedHosts(allowed_hosts(args)))
    server = make_dashboard_server(app, args.host, args.port)
    where = netloc(args.host, server.server_port)
    print(f"metrics of schema {broker.schema!r} on http://{where}/metrics", file=sys.stderr)
    return serve(server, args)


def _dashboard(broker: PostgresBroker, args: argparse.Namespace) -> int:
    from ..dashboard import dashboard_app, make_dashboard_server, netloc

    auth = dashboard_auth(args.auth_file)
    # The pages read from the reader (a replica, with --read-url); the actions write to the primary.
    check_before_serving(broker, "its pages answer 503", broker.reader, *([broker.database] if args.actions else []))
    # With credentials, a browser gets a login page and a session cookie; scripts send Authorization.
    app = dashboard_app(
        broker, actions=args.actions, ring=True, allowed_hosts=allowed_hosts(args), auth=auth, login=True
    )
    server = make_dashboard_server(app, args.host, args.port)  # warns if it exposes actions to anyone
    mode = ("actions on" if args.actions else "read-only") + (", authentication on" if auth else "")
    where = netloc(args.host, server.server_port)
    print(f"dashboard of schema {broker.schema!r} ({mode}) on http://{where}/", file=sys.stderr)
    return serve(server, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
