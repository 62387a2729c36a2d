"""What ``import dramatiq_pg_fenced`` loads: a worker's start-up imports only what a worker needs.

The public names all import as before; the operators' code (``ops/`` but the broker's two mixins, the
dashboard, the command line), the schedules and their scheduler, cron parsing (cronsim), the results and
rate-limiter backends, and the statements a worker never runs are loaded when first used: not by the
import, not by a broker's construction, not by a worker consuming (asserted by module name, no timing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dramatiq_pg_fenced
from dramatiq_pg_fenced import PostgresBroker

REPO = Path(__file__).resolve().parent.parent

#: Modules a worker never needs at start-up: loaded on first use only.
LAZY = (
    "cronsim",
    "dramatiq_pg_fenced.ops.bulk",
    "dramatiq_pg_fenced.ops.search",
    "dramatiq_pg_fenced.dashboard",
    "dramatiq_pg_fenced.features.results",
    "dramatiq_pg_fenced.features.rate_limits",
    "dramatiq_pg_fenced.cli.command",
    "dramatiq_pg_fenced.integrations.opentelemetry",
    "opentelemetry",  # the optional tracing middleware's: never imported by the package
)

#: What no worker loads: importing the package, making a broker, booting a worker, consuming, acking
#: (each a module, or a package and everything in it).  The broker's operator and console methods are
#: mixins of its class (``ops.admin``, ``ops.console``): those two modules load, and nothing they call.
WORKER_NEVER = (
    *LAZY,
    "dramatiq_pg_fenced.cli",
    "dramatiq_pg_fenced.routing",
    "dramatiq_pg_fenced.integrations",
    "dramatiq_pg_fenced.ops.listing",
    "dramatiq_pg_fenced.ops.messages",
    "dramatiq_pg_fenced.ops.queues",
    "dramatiq_pg_fenced.ops.charts",
    "dramatiq_pg_fenced.ops.timings",
    "dramatiq_pg_fenced.ops.health",
    "dramatiq_pg_fenced.ops.metrics",
    "dramatiq_pg_fenced.ops.fleet",
    "dramatiq_pg_fenced.ops.site",
    "dramatiq_pg_fenced.ops.finding",
    "dramatiq_pg_fenced.features.schedules",
    "dramatiq_pg_fenced.features.scheduler",
    "dramatiq_pg_fenced.features.schedule_control",
    "dramatiq_pg_fenced.db.queries.search",
    "dramatiq_pg_fenced.db.queries.health",
    "dramatiq_pg_fenced.db.queries.timings",
    "dramatiq_pg_fenced.db.queries.schedules",
    "dramatiq_pg_fenced.db.queries.relay",
)

#: Prints the modules of :data:`WORKER_NEVER` loaded so far (as JSON), in a fresh interpreter's code.
LOADED = (
    f"never = {WORKER_NEVER!r}\n"
    "print(json.dumps(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in never))))"
)


def fresh_interpreter(code: str) -> object:
    """What *code* prints as JSON, run in a new interpreter (this checkout first on the path)."""
    done = subprocess.run(
        [sys.executable, "-c", f"import json, sys\n{code}"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_every_public_name_imports() -> None:
    for name in [*dramatiq_pg_fenced.__all__, "PostgresResultBackend", "PostgresRateLimiterBackend"]:
        namespace: dict[str, object] = {}
        exec(f"from dramatiq_pg_fenced import {name}", namespace)
        assert namespace[name] is getattr(dramatiq_pg_fenced, name)
        assert isinstance(namespace[name], type), name


def test_the_import_leaves_out_what_a_worker_does_not_use_until_it_is_used() -> None:
    loaded = fresh_interpreter(
        f"import dramatiq_pg_fenced\nprint(json.dumps([m for m in {LAZY!r} if m in sys.modules]))"
    )
    assert loaded == []
    # ... and each comes when used: a cron schedule parsed, a search made, a backend named
    used = fresh_interpreter(
        "from datetime import datetime, timezone\n"
        "import dramatiq_pg_fenced\n"
        "from dramatiq_pg_fenced import PostgresResultBackend\n"
        "from dramatiq_pg_fenced.features.schedules import Timing\n"
        "Timing.parse(cron='*/5 * * * *').after(datetime.now(timezone.utc))\n"
        "try:\n"
        "    Timing.parse(cron='61 * * * *')\n"
        "except ValueError as e:\n"
        "    bad = str(e)\n"
        "print(json.dumps([[m for m in ('cronsim', 'dramatiq_pg_fenced.features.results') if m in sys.modules], bad]))"
    )
    assert used == [["cronsim", "dramatiq_pg_fenced.features.results"], "bad cron expression '61 * * * *': Bad minute"]


def test_a_broker_made_loads_only_what_a_worker_needs() -> None:
    """Given a fresh interpreter, when it imports the package and makes a broker (no connection: the
    port is closed), I expect none of the operators', dashboard's, command line's or schedules' code loaded."""
    loaded = fresh_interpreter(
        "import dramatiq_pg_fenced\n"
        "broker = dramatiq_pg_fenced.PostgresBroker('postgresql://nobody@127.0.0.1:1/none')\n"
        "assert not broker.started\n" + LOADED
    )
    assert loaded == []
    # ... and the operators' code comes when an operator's name is used
    used = fresh_interpreter(
        "import dramatiq_pg_fenced\n"
        "from dramatiq_pg_fenced.ops import admin\n"
        "admin.list_messages, dramatiq_pg_fenced.CancelOutcome, admin.compact\n" + LOADED
    )
    assert used == [
        "dramatiq_pg_fenced.ops.listing",
        "dramatiq_pg_fenced.ops.messages",
        "dramatiq_pg_fenced.ops.queues",
    ]


def test_a_worker_consuming_loads_only_what_a_worker_needs(
    dramatiq_pg_url: str, dramatiq_pg_broker_factory: Callable[..., PostgresBroker]
) -> None:
    """Given a migrated schema, when a fresh interpreter boots a Dramatiq worker on it (start-up check,
    registration, maintenance, the consumer's claims) and a message is sent, run and acked, I expect none
    of the operators', dashboard's, command line's or schedules' code loaded."""
    schema = dramatiq_pg_broker_factory().schema
    loaded = fresh_interpreter(
        "import time\n"
        "import dramatiq\n"
        "from dramatiq_pg_fenced import PostgresBroker\n"
        f"broker = PostgresBroker({dramatiq_pg_url!r}, schema={schema!r})\n"
        "done = []\n"
        "job = dramatiq.actor(lambda n: done.append(n), broker=broker, actor_name='job', queue_name='q')\n"
        "worker = dramatiq.Worker(broker, worker_threads=1)\n"
        "worker.start()\n"
        "job.send(1)\n"
        "deadline = time.monotonic() + 30\n"
        "while not done and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "broker.join('q', timeout=30_000)\n"
        "worker.stop()\n"
        "broker.close()\n"
        "assert done == [1], done\n" + LOADED
    )
    assert loaded == []


def test_a_statement_is_bound_when_first_read_and_a_worker_never_loads_the_others() -> None:
    """Given the statements of a schema, I expect none bound until read, each bound as it is first read,
    and the templates a worker never runs (the relay's, the schedules', the operators' search, charts'
    timings and health) or rarely (the reindex chore's) imported only when one of them is read."""
    found = fresh_interpreter(
        "from dramatiq_pg_fenced.db.statements import statements\n"
        "s = statements('lazy')\n"
        "first = sorted(vars(s))\n"
        "s.claim, s.ack\n"
        "worker = sorted(vars(s))\n"
        "before = {m for m in sys.modules if m.startswith('dramatiq_pg_fenced.db.queries.')}\n"
        "s.search_live\n"
        "after = {m for m in sys.modules if m.startswith('dramatiq_pg_fenced.db.queries.')}\n"
        "print(json.dumps([first, worker, sorted(after - before)]))"
    )
    assert found == [
        ["_schema"],
        ["_schema", "ack", "claim"],
        [
            f"dramatiq_pg_fenced.db.queries.{name}"
            for name in ("health", "reindex", "relay", "schedules", "search", "timings")
        ],
    ]
