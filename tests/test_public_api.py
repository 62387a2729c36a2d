"""Every import the README and docs/ show works: the public API, and the paths users may have imported from.

The documented imports are read from the pages themselves (``from dramatiq_pg_fenced... import ...`` and
``import dramatiq_pg_fenced...``), so a page that shows a new import is checked by this file as it is written.
"""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FROM = re.compile(r"^\s*from (dramatiq_pg_fenced[\w.]*) import (\([^)]*\)|[^\n#]+)", re.M)
IMPORT = re.compile(r"^\s*import (dramatiq_pg_fenced[\w.]*)", re.M)


def documented() -> list[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()
    for page in PAGES:
        text = page.read_text()
        for module, names in FROM.findall(text):
            for name in names.strip("()").replace("\n", " ").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    found.add((module, name))
        for module in IMPORT.findall(text):
            found.add((module, None))
    return sorted(found, key=lambda item: (item[0], item[1] or ""))


# Paths users may have imported from before the package had layers: each keeps working.
KEPT = [
    ("dramatiq_pg_fenced", "PostgresBroker"),
    ("dramatiq_pg_fenced", "PostgresMessageProxy"),
    ("dramatiq_pg_fenced", "CancelOutcome"),
    ("dramatiq_pg_fenced", "StartupError"),
    ("dramatiq_pg_fenced", "PostgresResultBackend"),
    ("dramatiq_pg_fenced", "PostgresRateLimiterBackend"),
    ("dramatiq_pg_fenced.results", "PostgresBackend"),
    ("dramatiq_pg_fenced.results", "setup"),
    ("dramatiq_pg_fenced.rate_limits", "PostgresBackend"),
    ("dramatiq_pg_fenced.rate_limits", "FencedGroupCallbacks"),
    ("dramatiq_pg_fenced.routing", "RoutedBroker"),
    ("dramatiq_pg_fenced.routing", "RoutedResultBackend"),
    ("dramatiq_pg_fenced.routing", "RoutedSchedules"),
    ("dramatiq_pg_fenced.routing", "Relay"),
    ("dramatiq_pg_fenced.testing", "bind_actors"),
    ("dramatiq_pg_fenced.embedded", "start_embedded"),
    ("dramatiq_pg_fenced.middleware", "FencedDelivery"),
    ("dramatiq_pg_fenced.errors", "DeliveryLost"),
    ("dramatiq_pg_fenced.cli", "main"),
    ("dramatiq_pg_fenced.dashboard", "dashboard_app"),
    ("dramatiq_pg_fenced.integrations.django", "DjangoPostgresBroker"),
    ("dramatiq_pg_fenced.integrations.sqlalchemy", "outbox"),
]


def test_the_pages_show_imports() -> None:
    """Given the README and docs/, I expect the imports they show to be found (the check below is not empty)."""
    assert len(documented()) > 10


@pytest.mark.parametrize(("module", "name"), documented() + KEPT, ids=lambda x: str(x))
def test_a_documented_import_works(module: str, name: str | None) -> None:
    """Given an import the docs show (or a path users may have imported from), I expect it to work."""
    if module.startswith("dramatiq_pg_fenced.integrations.django"):
        pytest.importorskip("django")
    if module.startswith("dramatiq_pg_fenced.integrations.sqlalchemy"):
        pytest.importorskip("sqlalchemy")
    loaded = importlib.import_module(module)
    if name is not None and not hasattr(loaded, name):
        importlib.import_module(f"{module}.{name}")  # ``from package import module``
    if name is not None:
        assert getattr(loaded, name) is not None


def test_the_entry_points_load() -> None:
    """Given pyproject's console script and pytest plugin, I expect each to name something that imports."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [*project["scripts"].values(), *project["entry-points"]["pytest11"].values()]
    for target in targets:
        module, _, attribute = target.partition(":")
        loaded = importlib.import_module(module)
        if attribute:
            assert callable(getattr(loaded, attribute))
