"""The ``dramatiq-pg-fenced`` commands over several databases (:mod:`.fleet`): ``--url NAME=URL``
repeated, or ``--broker app:broker`` naming a :class:`~.routing.RoutedBroker`.

Every read (stats, processes, schedules, list, inspect, metrics, the dashboard) shows every
database, each row naming its own (``--database NAME``: one of them only); every action goes to
one database and says which: a message's (the one that holds it), a queue's (its route with
``--broker``, else the one database that knows it; ``--database`` to choose).  A queue of no
route, or one no database knows, is bad usage (exit 2), as with one database.  Exit codes are the
one-database command's (:mod:`.cli`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

import psycopg
from dramatiq.errors import BrokerError, QueueJoinTimeout

from ..broker import PostgresBroker
from ..core import processes
from ..db.statements import FINISHED_STATES
from ..errors import describe_failure
from ..features import schedules
from ..ops import admin
from ..ops.fleet import Fleet, Site
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


def run_several(args: argparse.Namespace, ids: list[str], app_broker: Any, urls: list[str], pool: int) -> int:
    """The command *args* over the databases of *app_broker* (a ``RoutedBroker``) or of *urls*
    (``NAME=URL`` each)."""
    brokers: dict[str, PostgresBroker] = {}
    try:
        if args.read_url:
            raise ValueError("--read-url goes with one database; give each shard its read_url in the app's broker")
        if app_broker is not None:
            fleet = Fleet.of(app_broker)
            brokers = dict(app_broker.shards)
        else:
            for url in urls:
                named = named_url(url)
                if named is None:
                    raise ValueError(f"with several databases every --url is NAME=postgresql://..., not {url!r}")
                name, plain = named
                if name in brokers:
                    raise ValueError(f"database {name!r} is named twice")
                brokers[name] = PostgresBroker(plain, schema=schema_of(args, name), listen=False, pool_max_size=pool)
            fleet = Fleet.of_brokers(brokers)
        if args.database is not None:
            fleet.site(args.database)  # a name that is not one: exit 2, naming them
    except ValueError as e:
        _close(app_broker, brokers)
        return fail(str(e), USAGE)
    try:
        return _run(fleet, brokers, args, ids)
    except ValueError as e:
        return fail(str(e), USAGE)
    except BrokerError as e:
        return fail(str(e), DATABASE)
    except psycopg.Error as e:
        return fail(describe_failure(e), DATABASE)
    finally:
        _close(app_broker, brokers)


def _close(app_broker: Any, brokers: dict[str, PostgresBroker]) -> None:
    if app_broker is not None:
        app_broker.close()
    else:
        for broker in brokers.values():
            broker.close()


def _reads(fleet: Fleet, args: argparse.Namespace) -> list[Site]:
    """The databases a read shows: all, or ``--database``'s."""
    return [fleet.site(args.database)] if args.database is not None else list(fleet)


def _each(fleet: Fleet, args: argparse.Namespace, read: Any) -> tuple[list[tuple[Site, Any]], list[str]]:
    """*read* of each database shown; one that fails is named on stderr, and the others are still shown
    (the command then exits 3)."""
    done, away = Fleet(_reads(fleet, args)).each(read)
    for name in away:
        print(f"error: database {name} did not answer; its rows are missing", file=sys.stderr)
    return done, away


def _run(fleet: Fleet, brokers: dict[str, PostgresBroker], args: argparse.Namespace, ids: list[str]) -> int:
    command = args.command
    if command == "migrate":
        for site in _reads(fleet, args):
            applied = brokers[site.name].migrate()
            done = ", ".join(map(str, applied)) if applied else "nothing to do"
            print(f"database {site.name}, schema {site.settings.schema!r}: {done}")
        return OK
    if command in ("cancel", "inspect"):
        # Every database is asked (a relay's move waited for); one that does not answer is named.
        cancelled = located = None
        if command == "cancel":
            cancelled = fleet.cancel(ids[0], seen=args.seen, database=args.database)
            holder = None if cancelled.database is None else fleet.site(cancelled.database)
            away = cancelled.unreachable
        else:
            located = fleet.locate(ids[0])
            holder, away = located.site, located.unreachable
        for name in away:
            print(f"error: database {name} did not answer; the message may be there", file=sys.stderr)
        if cancelled is not None:
            print(cancelled.outcome.value + (f" ({holder.label})" if holder is not None else ""))
            if cancelled.outcome.value.startswith("cancelled"):
                return OK
            return DATABASE if away and holder is None else NOT_APPLIED
        if holder is None or located is None or located.info is None:
            where = "in any database" if not away else "in the databases that answered"
            return fail(
                f"no message {ids[0]} {where} (unknown, or acked longer ago than keep_finished)",
                DATABASE if away else NOT_APPLIED,
            )
        print_json({**located.info, "database": holder.name})
        return OK
    if command == "stats":
        read, away = _each(fleet, args, lambda site: {
            "queues": admin.overview(site.reader, site.statements),
            "totals": admin.counters(site.reader, site.statements),
            "schedules": schedules.overview(site.reader, site.statements),
        })  # fmt: skip
        per: dict[str, Any] = {site.name: figures for site, figures in read}
        if args.json:
            print_json({"databases": per, **({"away": away} if away else {})})
            return DATABASE if away else OK
        queues = [{**q, "database": name} for name, figures in per.items() for q in figures["queues"]]
        totals: Counter[str] = Counter()
        for figures in per.values():
            totals.update(figures["totals"])
        print(stats_table(queues, dict(totals)) + f" (summed over {len(per)} database{'' if len(per) == 1 else 's'})")
        keyed = fair_keys_table(queues)
        if keyed:
            print()
            print(keyed)
        listed = [{**r, "database": name} for name, figures in per.items() for r in figures["schedules"]]
        if listed:
            print()
            print(schedules_table(listed))
        return DATABASE if away else OK
    if command == "processes":
        read, away = _each(fleet, args, lambda site: processes.processes(site.reader, site.statements))
        found_processes = [{**p, "database": site.name} for site, rows in read for p in rows]
        if args.json:
            print_json({"processes": found_processes})
        else:
            print(processes_table(found_processes))
        return DATABASE if away else OK
    if command == "schedules":
        if args.forget:
            for site in _reads(fleet, args):
                if schedules.forget(site.database, site.statements, args.forget):
                    print(f"{args.forget}: forgotten in {site.label} (a scheduler that still declares its newest "
                          "definition puts it back)")  # fmt: skip
                    return OK
            return fail(f"no schedule {args.forget!r} in any database", NOT_APPLIED)
        read, away = _each(fleet, args, lambda site: schedules.overview(site.reader, site.statements))
        listed = [{**r, "database": site.name} for site, rows in read for r in rows]
        if args.json:
            print_json({"schedules": listed})
        else:
            print(schedules_table(listed))
        return DATABASE if away else OK
    if command == "list":
        site = fleet.queue_site(args.queue, database=args.database)
        page = admin.list_messages(
            site.reader, site.statements, args.queue, args.state, actor=args.actor, after=args.after, limit=args.limit
        )
        if args.json:
            print_json({"database": site.name, "messages": page.rows, "next": page.next})
            return OK
        print(list_table([{**r, "database": site.name} for r in page.rows]))
        if page.searched:
            print(f"searched {page.searched} messages for this actor; more may follow")
        if page.next:
            print(f"more: --after '{page.next}' --database {site.name}")
        return OK
    if command == "redrive":
        return _redrive(fleet, args, ids)
    if command == "purge":
        if not args.yes:
            raise ValueError("purge deletes messages: add --yes")
        site = fleet.queue_site(args.queue, database=args.database)
        purged = (args.state,) if args.state else admin.PURGEABLE
        gone: list[str] | None = [] if args.verbose else None
        deleted = admin.purge_queue(site.database, site.statements, args.queue, purged, actor=args.actor, ids=gone)
        for message_id in gone or ():
            print(f"deleted {message_id}")
        print(f"{site.label}: " + ", ".join(f"{state} {n}" for state, n in deleted.items()))
        return OK
    if command in ("pause", "resume"):
        create = command == "pause" and args.create
        site = fleet.queue_site(args.queue, database=args.database, create=create)
        if command == "pause":
            changed = admin.pause(site.database, site.statements, args.queue)
        else:
            changed = admin.resume(site.database, site.statements, args.queue, site.settings.channel)
        state = f"{command}d" if changed else f"already {'paused' if command == 'pause' else 'running'}"
        print(f"{args.queue}: {state} ({site.label})")
        return OK if changed else NOT_APPLIED
    if command == "compact":
        print_json({s.name: admin.compact(s.database, s.statements, lock_timeout=5.0) for s in _reads(fleet, args)})
        return OK
    if command == "move-queue":
        return _move_queue(fleet, args)
    if command == "metrics":
        return _metrics(fleet, args)
    if command == "dashboard":
        return _dashboard(fleet, args)
    raise AssertionError(command)


def _redrive(fleet: Fleet, args: argparse.Namespace, ids: list[str]) -> int:
    """Re-drive ids (each in the database that holds it) or a queue's dead letters (in its database)."""
    if bool(ids) == bool(args.queue):
        raise ValueError("give message ids or --queue, one of the two")
    if args.seen is not None and len(ids) != 1:
        raise ValueError("--seen is the version of one message: give one MESSAGE_ID")
    if args.actor and not args.queue:
        raise ValueError("--actor goes with --queue")
    redriven: list[tuple[str, Site]] = []
    skipped: dict[str, str] = {}
    if args.queue:
        site = fleet.queue_site(args.queue, database=args.database)
        again = FINISHED_STATES if args.state == "all" else (args.state,)
        result = admin.redrive_queue(
            site.database, site.statements, args.queue, again, site.settings.channel, actor=args.actor
        )
        redriven += [(m, site) for m in result.redriven]
        skipped.update(result.skipped)
    else:
        held, missing = fleet.holders(ids)
        for name, mine in held.items():
            site = fleet.site(name)
            seen = {mine[0]: args.seen} if args.seen is not None else None
            result = admin.redrive(site.database, site.statements, mine, site.settings.channel, seen=seen)
            redriven += [(m, site) for m in result.redriven]
            skipped.update(result.skipped)
        skipped.update({m: "no such dead or cancelled message in any database" for m in missing})
    one_by_one = not args.queue or args.verbose
    if one_by_one:
        for message_id, site in redriven:
            print(f"redriven {message_id} ({site.label})")
        for message_id, why in skipped.items():
            print(f"skipped {message_id}: {why}", file=sys.stderr)
    else:
        for why, n in Counter(skipped.values()).most_common():
            print(f"skipped {n}: {why}", file=sys.stderr)
    where = f" in {redriven[0][1].label}" if args.queue and redriven else ""
    print(f"{len(redriven)} re-driven{where}, {len(skipped)} skipped", file=sys.stdout if args.queue else sys.stderr)
    return OK if redriven or (args.queue and not skipped) else NOT_APPLIED


def _move_queue(fleet: Fleet, args: argparse.Namespace) -> int:
    """``move-queue``: :meth:`~.routing.RoutedBroker.move_queue` of the app's router (its routes are the new ones)."""
    router = fleet.router
    if router is None:
        raise ValueError("move-queue needs the routes: --broker MODULE:ATTRIBUTE naming a RoutedBroker")
    target = fleet.queue_site(args.queue, create=True)
    try:
        moved = router.move_queue(args.queue, timeout=args.timeout, keep_paused=not args.resume)
    except QueueJoinTimeout:
        return fail(
            f"queue {args.queue!r} still has rows elsewhere after {args.timeout:g} s: run it again", NOT_APPLIED
        )
    others = ", ".join(s.name for s in fleet if s.name != target.name)
    kept = "resumed" if args.resume else "paused"
    print(f"{args.queue}: {moved} moved to {target.label}; none left in {others} ({kept} there)")
    return OK


def _metrics(fleet: Fleet, args: argparse.Namespace) -> int:
    try:
        from prometheus_client import make_wsgi_app

        from ..ops import metrics
    except ImportError as e:
        return fail(str(e), USAGE)
    registry = fleet.metrics_registry()
    if args.once:
        sys.stdout.write(metrics.exposition(registry).decode())
        return OK
    for site in fleet:
        check_before_serving(None, f"each scrape answers dramatiq_pg_up{{database={site.name!r}}} 0", site.reader)
    from ..dashboard import AllowedHosts, host_checked, make_dashboard_server, netloc

    app = host_checked(make_wsgi_app(registry), AllowedHosts(allowed_hosts(args)))
    server = make_dashboard_server(app, args.host, args.port)
    names = ", ".join(s.name for s in fleet)
    print(f"metrics of databases {names} on http://{netloc(args.host, server.server_port)}/metrics", file=sys.stderr)
    return serve(server, args)


def _dashboard(fleet: Fleet, args: argparse.Namespace) -> int:
    from ..dashboard import dashboard_app, make_dashboard_server, netloc

    auth = dashboard_auth(args.auth_file)
    for site in fleet:
        checked = [site.reader, *([site.database] if args.actions else [])]
        check_before_serving(None, f"its pages of {site.label} answer 503", *checked)
    app = dashboard_app(
        fleet, actions=args.actions, ring=True, allowed_hosts=allowed_hosts(args), auth=auth, login=True
    )
    server = make_dashboard_server(app, args.host, args.port)
    mode = ("actions on" if args.actions else "read-only") + (", authentication on" if auth else "")
    names = ", ".join(s.name for s in fleet)
    print(
        f"dashboard of databases {names} ({mode}) on http://{netloc(args.host, server.server_port)}/", file=sys.stderr
    )
    return serve(server, args)
