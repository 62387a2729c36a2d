"""What ``import dramatiq_pg_fenced`` loads (issue 25: a worker's start-up imports only what a worker needs).

The public names all import as before; the console's search and bulk actions, cron parsing (cronsim), the
dashboard, the results and rate-limiter backends are loaded when first used, not by the import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dramatiq_pg_fenced

REPO = Path(__file__).resolve().parent.parent

#: Modules a worker never needs at start-up: loaded on first use only.
LAZY = (
    "cronsim",
    "dramatiq_pg_fenced.bulk",
    "dramatiq_pg_fenced.search",
    "dramatiq_pg_fenced.dashboard",
    "dramatiq_pg_fenced.results",
    "dramatiq_pg_fenced.rate_limits",
    "dramatiq_pg_fenced.cli",
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
        "from dramatiq_pg_fenced.schedules import Timing\n"
        "Timing.parse(cron='*/5 * * * *').after(datetime.now(timezone.utc))\n"
        "try:\n"
        "    Timing.parse(cron='61 * * * *')\n"
        "except ValueError as e:\n"
        "    bad = str(e)\n"
        "print(json.dumps([[m for m in ('cronsim', 'dramatiq_pg_fenced.results') if m in sys.modules], bad]))"
    )
    assert used == [["cronsim", "dramatiq_pg_fenced.results"], "bad cron expression '61 * * * *': Bad minute"]
