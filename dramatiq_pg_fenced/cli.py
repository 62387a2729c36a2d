"""``dramatiq-pg-fenced``: migrate the schema, cancel, inspect, show stats, compact.

Workers are run with Dramatiq's own ``dramatiq`` command; this one only
administers the database side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import psycopg
from dramatiq.errors import BrokerError

from . import __version__
from .broker import PostgresBroker
from .config import DEFAULT_SCHEMA
from .errors import describe_failure


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dramatiq-pg-fenced", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("DATABASE_URL"),
        help="PostgreSQL URL or libpq DSN (default: $DATABASE_URL, else libpq's PG* variables)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--schema", default=os.environ.get("DRAMATIQ_PG_SCHEMA", DEFAULT_SCHEMA))
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("migrate", help="create or upgrade the schema (idempotent, safe to run concurrently)")
    cancel = commands.add_parser("cancel", help="cancel a queued or running message")
    cancel.add_argument("message_id")
    inspect = commands.add_parser("inspect", help="show a message's state, attempt, lease and last error")
    inspect.add_argument("message_id")
    commands.add_parser("stats", help="queue sizes by state and the stale-write counter")
    commands.add_parser(
        "compact", help="give back the space a drained backlog left (VACUUM FULL: locks the table briefly; owner)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        broker = PostgresBroker(args.url, schema=args.schema, listen=False, pool_max_size=1)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(broker, args)
    except BrokerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except psycopg.Error as e:  # e.g. permission denied: one line, not a traceback
        print(f"error: {describe_failure(e)}", file=sys.stderr)
        return 1
    finally:
        broker.close()


def _run(broker: PostgresBroker, args: argparse.Namespace) -> int:
    if args.command == "migrate":
        applied = broker.migrate()
        done = ", ".join(map(str, applied)) if applied else "nothing to do"
        print(f"schema {broker.schema!r}: {done}")
        return 0
    if args.command == "cancel":
        outcome = broker.cancel(args.message_id)
        print(outcome.value)
        return 0 if outcome.value.startswith("cancelled") else 1
    if args.command == "inspect":
        info = broker.inspect(args.message_id)
        if info is None:
            print(f"no message {args.message_id}", file=sys.stderr)
            return 1
        _print(info)
        return 0
    if args.command == "compact":
        _print(broker.compact())
        return 0
    _print(broker.stats())
    return 0


def _print(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
