"""How long a statement waits on a blackholed connection, with the package's TCP settings and without.

A server in a network namespace of its own (``tests/cluster.py``: ``IsolatedServer``; needs root and
iproute2), reached over a veth pair whose packets are then all dropped, both ways, sockets open
(nothing answers, not even a reset).  On connections made as the package makes them
(``reconnect.PacedConnection``), once with ``reconnect.TCP_DEFAULTS`` and once with the URL setting
Linux's own (keepalives after 7200 s, 75 s apart, 9 of them; no user timeout):

- ``reply``: a statement sent before the blackhole, whose reply never comes;
- ``send``: a statement sent into the blackhole (its data never acknowledged).

Each is given ``--cap`` seconds (default 40)::

    python -m benchmarks.blackhole [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from psycopg.conninfo import make_conninfo  # noqa: E402

from dramatiq_pg_fenced.db.reconnect import PacedConnection  # noqa: E402

LINUX = {"keepalives_idle": "7200", "keepalives_interval": "75", "keepalives_count": "9", "tcp_user_timeout": "0"}


def once(server: Any, url: str, cap: float) -> dict[str, float | None]:
    """Seconds until each statement failed (``None``: still waiting after *cap*)."""
    reply_conn = PacedConnection.connect(url, autocommit=True)
    send_conn = PacedConnection.connect(url, autocommit=True)
    failed: dict[str, float | None] = {"reply": None, "send": None}

    def run(name: str, conn: Any, query: str) -> None:
        start = time.monotonic()
        try:
            conn.execute(query)
        except Exception:
            failed[name] = round(time.monotonic() - start, 1)

    threads = [threading.Thread(target=run, args=("reply", reply_conn, "SELECT pg_sleep(2)"), daemon=True)]
    threads[0].start()
    time.sleep(0.5)
    server.blackhole()
    threads.append(threading.Thread(target=run, args=("send", send_conn, "SELECT 1"), daemon=True))
    threads[1].start()
    deadline = time.monotonic() + cap
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    server.blackhole(False)
    for thread in threads:
        thread.join(30)  # the reply or an error comes once packets flow again
    for conn in (reply_conn, send_conn):
        conn.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    from cluster import IsolatedServer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cap", type=float, default=40.0)
    args = parser.parse_args(argv)
    server = IsolatedServer()
    results: dict[str, list[dict[str, float | None]]] = {"package defaults": [], "Linux defaults": []}
    try:
        for _ in range(args.runs):
            results["package defaults"].append(once(server, server.url, args.cap))
            results["Linux defaults"].append(once(server, make_conninfo(server.url, **LINUX), args.cap))
            print(time.strftime("%H:%M:%S"), {k: v[-1] for k, v in results.items()}, flush=True)
    finally:
        server.close()
    for name, runs in results.items():
        for kind in ("reply", "send"):
            values = [r[kind] for r in runs]
            shown = (
                f"median {statistics.median(v for v in values if v is not None):.1f} s"
                if all(v is not None for v in values)
                else f"still waiting after {args.cap:.0f} s in {sum(v is None for v in values)} of {len(values)}"
            )
            print(f"{name:17s} {kind:5s}: {shown} ({values})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
