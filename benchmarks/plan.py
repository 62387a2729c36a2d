"""The benchmark's plan (full or quick), its log, and the worker processes it starts (``python -m benchmarks.run``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
KINDS = ("postgres", "redis", "redis-aof", "rabbitmq", "rabbitmq-confirms")
PROCESSES, THREADS = 2, 8


@dataclass
class Plan:
    name: str
    repeats: int
    backlog: int  # N for the side-by-side drain
    single_max: int  # sends per single-send measurement (also bounded by single_seconds)
    single_seconds: float
    latency_count: int
    latency_rate: float  # messages per second
    small: int  # ours: drain with a small backlog ...
    big: int  # ... against a big one
    pg_chunk: int  # enqueue_many chunk size
    backlog_repeats: int


FULL = Plan("full", 5, 20_000, 5_000, 5.0, 300, 20.0, 10_000, 200_000, 5_000, 2)
QUICK = Plan("quick", 1, 2_000, 500, 1.0, 40, 20.0, 2_000, 20_000, 5_000, 1)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


# -- worker processes ----------------------------------------------------------
class Workers:
    """``dramatiq benchmarks.apps -p 2 -t 8`` in a session of its own."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "benchmarks.apps", "-p", str(PROCESSES), "-t", str(THREADS)]
            + ["--path", str(REPO)],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def children(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[1]) == self.proc.pid:
                        pids.append(int(entry))
        return pids

    def rss(self) -> dict[int, int]:
        """Resident memory of each worker process, bytes."""
        out = {}
        for pid in self.children():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) * 1024
        return out

    def cpu(self) -> dict[int, float]:
        return cpu_seconds(self.children())

    def ready(self) -> int:
        return self.log_path.read_text(errors="replace").count("ready for action")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log("workers did not stop in time; killing their process group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log_file.close()


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU time of each process so far, seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def pids_named(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/comm") as f:
                if f.read().strip() == name:
                    pids.append(int(entry))
    return pids
