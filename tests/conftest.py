"""Shared test helpers.  The broker and worker fixtures come from the package's
own pytest plugin (``dramatiq_pg_fenced.testing``), as they would for users."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import dramatiq
import dramatiq.broker
import pytest

from dramatiq_pg_fenced import PostgresBroker

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_dramatiq_globals() -> Iterator[None]:
    """Tests set the global broker and encoder; put them back afterwards."""
    broker, encoder = dramatiq.broker.global_broker, dramatiq.get_encoder()
    yield
    dramatiq.broker.global_broker = broker
    dramatiq.set_encoder(encoder)


@pytest.fixture
def dramatiq_cli(dramatiq_pg_url: str, tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """``start(broker, module, *args)``: the real ``dramatiq`` CLI on *broker*'s schema.

    The app module reads ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``.  Output
    goes to ``proc.log_path`` (a file, so a chatty worker never blocks on a
    pipe).  The CLI runs in its own process group, killed at teardown if the
    test left it running.
    """
    started: list[subprocess.Popen] = []

    def start(broker: PostgresBroker, module: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, DRAMATIQ_PG_URL=dramatiq_pg_url, DRAMATIQ_PG_SCHEMA=broker.schema, PYTHONUNBUFFERED="1")
        log_path = tmp_path / f"dramatiq-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", module, *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log_path  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
