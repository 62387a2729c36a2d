"""A primary and its streaming standby of a test's (or a benchmark's) own, the faults done to them, and
the failover run that measures what survives (imported as ``cluster``; ``benchmarks/failover.py`` uses
it too).

- :class:`ReadOnlyServer`: an :class:`~test_faults.OwnedServer` that can stop taking writes with its
  sockets open (``ALTER SYSTEM SET default_transaction_read_only``), as Aurora and some proxies demote.
- :class:`Standby`: a hot standby made with ``pg_basebackup -R``; :meth:`Standby.cut` stops its WAL
  receiver (``primary_conninfo = ''``), so the primary goes on alone: a network partition between them.
- :func:`make_pair`: a primary with no standby, an asynchronous or a synchronous one
  (``synchronous_standby_names``), on one multi-host URL with ``target_session_attrs=read-write``.
- :class:`IsolatedServer`: a server in a network namespace of its own whose link can be blackholed.
- :class:`Producer`: sends every 10 ms; a send that raises is sent again with the same id.
- :func:`failover_run`: worker processes and the producer on a pair, a fault, then a promotion (or,
  for a crash, a restart); what the ledger and the new primary say.
"""

from __future__ import annotations

import datetime as dt
import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from helpers import wait_for
from psycopg import sql
from test_faults import Env, OwnedServer

from dramatiq_pg_fenced import PostgresBroker

#: What :func:`failover_run` does to the primary, then what brings a server that takes writes back:
#: ``kill`` (``pg_ctl stop -m immediate``, then promote), ``read-only`` (read-only with every socket
#: open, then promote), ``isolated`` (the standby's WAL receiver stopped 5 s before the kill, then
#: promote), ``crash`` (every server process SIGKILLed, then the same server started again).
FAULTS = ("kill", "read-only", "isolated", "crash")
#: How long the primary goes on alone before ``isolated``'s kill.
ISOLATED_FOR = 5.0


class ReadOnlyServer(OwnedServer):
    """An :class:`OwnedServer` that can stop and resume taking writes without closing a socket."""

    def read_only(self, on: bool) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            if on:
                conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            else:
                conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.1)  # the backends take the reload at their next statement; give the signal time

    def synchronous(self, on: bool) -> None:
        """Make its commits wait for a standby's flush (``synchronous_standby_names = '*'``), or not."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'*' if on else ''}'")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.1)

    def replicas(self) -> int:
        """How many standbys stream from it now (``pg_stat_replication``)."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'").fetchone()
        return int(row[0]) if row else 0


class Standby(OwnedServer):
    """A hot standby of *primary*, made with ``pg_basebackup -R`` (streaming from it), on a port of its own."""

    def __init__(self, primary: OwnedServer) -> None:  # not OwnedServer's: no initdb
        self.bin, self.user = primary.bin, primary.user
        if not os.path.exists(os.path.join(self.bin, "pg_basebackup")):
            pytest.skip(f"no pg_basebackup in {self.bin} for a standby of the test's own")
        # Not the primary's synchronous_standby_names: once promoted, it would wait for a standby forever.
        self.settings = {k: v for k, v in primary.settings.items() if k != "synchronous_standby_names"}
        self.datadir = tempfile.mkdtemp(prefix="dramatiq-pg-standby-")
        if self.user is not None:
            os.chown(self.datadir, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._pg(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", self.datadir, "-R", "-X", "stream", "--no-sync", "-c", "fast",
        )  # fmt: skip
        self.start()

    def promote(self) -> float:
        """``pg_ctl promote -w``; returns (``time.time()``) when the promotion is complete."""
        self._pg("pg_ctl", "promote", "-w", "-D", self.datadir)
        return time.time()

    def cut(self) -> float:
        """Stop streaming from the primary, as a network partition between the two would: its WAL
        receiver is stopped (``primary_conninfo = ''`` and a reload) and not started again; the
        primary goes on alone.  Returns (``time.time()``) when no WAL receiver runs any more."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
            conn.execute("SELECT pg_reload_conf()")
            wait_for(
                lambda: not conn.execute("SELECT 1 FROM pg_stat_wal_receiver").fetchall(),
                30,
                "the WAL receiver to stop",
            )
        return time.time()


class Pair(NamedTuple):
    primary: ReadOnlyServer
    standby: Standby | None  #: None: the primary alone
    url: str  #: every server, in one libpq URL, with target_session_attrs=read-write


def make_pair(standby: str | None, **settings: str) -> Pair:
    """A primary (*settings* are its server settings) and, unless *standby* is ``None``, its streaming
    standby: ``"sync"`` (the primary's commits wait for the standby's flush) or ``"async"``.  The
    caller closes both (the standby first)."""
    if standby == "sync":
        settings = {"synchronous_standby_names": "*", **settings}
    primary = ReadOnlyServer(**settings)
    if standby is None:
        return Pair(primary, None, f"{primary.url}?connect_timeout=2")
    try:
        replica = Standby(primary)
    except BaseException:
        primary.close()
        raise
    url = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{replica.port}/postgres"
        "?target_session_attrs=read-write&connect_timeout=2"
    )
    return Pair(primary, replica, url)


class Producer:
    """A thread that sends ``work`` messages on *url*, one every 10 ms; a send that raises is sent again
    with the same message id until it returns (what the README asks of a caller mid-failover)."""

    def __init__(self, url: str, schema: str, job_seconds: float = 0.01) -> None:
        self.broker = PostgresBroker(url, schema=schema, connect_timeout=2)
        self.job_seconds = job_seconds
        self.returned: list[tuple[str, float]] = []  # (message id, time.time() when its send returned)
        self.raised = 0
        self.longest = 0.0  # seconds, from the first try of a send to its return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = Message(queue_name="work", actor_name="work", args=(self.job_seconds,), kwargs={}, options={})
            began = time.time()
            while not self._stop.is_set():
                try:
                    self.broker.enqueue(message)
                    now = time.time()
                    self.returned.append((message.message_id, now))
                    self.longest = max(self.longest, now - began)
                    break
                except ConnectionClosed:
                    self.raised += 1
                    time.sleep(0.05)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.broker.close()


def failover_run(servers: Pair, env: Env, *, fault: str, workers: int = 2, job_seconds: float = 0.01) -> dict[str, Any]:
    """*workers* worker processes (their broker on ``servers.url``: start them with ``FAULT_BROKER_URL``
    set to it) and a :class:`Producer` on *servers* (each job takes *job_seconds*: with 2 workers of 4
    threads, 0.01 leaves them idle most of the time, 0.1 lets a backlog grow); *fault* (see :data:`FAULTS`) the primary, then
    promote the standby a second later (``crash``: start the primary again); returns what the ledger
    and the server that takes writes after say, once every message is settled.

    The figures: ``recovery (s)``, from the promotion (or restart) to the first job that starts after
    it; ``lost``, sends that returned and never ran; ``ran twice``, messages that started more than
    once; ``dead``, messages dead-lettered; ``workers restarted``; ``longest send (s)``, the longest a
    send took to return, tries included; ``gone``, sends that returned and that the server that takes
    writes after does not have (neither queued nor in its history: they ran before the fault, or are
    lost); and, for ``isolated``, ``returned while isolated``.
    """
    assert fault in FAULTS, fault
    assert (servers.standby is None) == (fault == "crash"), "a crash restarts the primary; the others promote"
    schema = env.broker.schema
    setup = PostgresBroker(servers.primary.url, schema=schema)
    setup.migrate()
    setup.close()
    procs = [env.workers.start() for _ in range(workers)]
    producer = Producer(servers.url, schema, job_seconds)
    cut = killed = 0.0
    try:
        wait_for(lambda: env.ledger.count("finish") >= 20, 60, "work before the fault")
        if fault == "crash":
            servers.primary.crash()
            time.sleep(1.0)
            servers.primary.start()
            back = time.time()
        else:
            assert servers.standby is not None
            if fault == "isolated":
                cut = servers.standby.cut()
                time.sleep(ISOLATED_FOR)
            if fault == "read-only":  # with every socket open, as Aurora and some proxies demote a primary
                servers.primary.read_only(True)
            else:
                servers.primary.stop("immediate")
            killed = time.time()
            time.sleep(1.0)  # nothing accepts writes meanwhile
            back = servers.standby.promote()
        time.sleep(4.0)
    finally:
        producer.stop()
    sent = dict(producer.returned)
    writable = servers.primary if servers.standby is None else servers.standby
    with psycopg.connect(writable.url, autocommit=True) as conn:
        pending = sql.SQL("SELECT count(*) FROM {}.message WHERE state IN ('queued', 'running')").format(
            sql.Identifier(schema)
        )

        def settled() -> bool:
            done = {e.message_id for e in env.ledger.entries() if e.event == "finish"}
            row = conn.execute(pending).fetchone()
            return all(mid in done for mid, at in producer.returned if at > back) and row is not None and row[0] == 0

        wait_for(settled, 60, "every message to be settled")
        time.sleep(1.0)  # lets the outcomes of the last ones be written
        in_db = sql.SQL("SELECT state, count(*) FROM {}.message GROUP BY state").format(sql.Identifier(schema))
        states = dict(conn.execute(in_db).fetchall())
        kept = sql.SQL("SELECT message_id::text FROM {s}.message UNION SELECT message_id::text FROM {s}.history")
        have = {row[0] for row in conn.execute(kept.format(s=sql.Identifier(schema)))}
    entries = env.ledger.entries()
    starts = Counter(e.message_id for e in entries if e.event == "start")
    after = [e.at.timestamp() for e in entries if e.event == "start" and e.at is not None and e.at.timestamp() > back]
    figures: dict[str, Any] = {
        "recovery (s)": round(min(after) - back, 2) if after else None,
        "sends returned": len(sent),
        "sends raised (sent again)": producer.raised,
        "longest send (s)": round(producer.longest, 2),
        "lost": sum(1 for mid in sent if mid not in starts),
        "gone": sum(1 for mid in sent if mid not in have),
        "ran twice": sum(1 for n in starts.values() if n > 1),
        "dead": states.get("dead", 0),
        "workers restarted": sum(1 for w in procs if w.poll() is not None),
    }
    if fault == "isolated":
        figures["returned while isolated"] = sum(1 for at in sent.values() if cut < at < killed)
    logs = "\n".join(Path(w.log_path).read_text() for w in procs)  # type: ignore[attr-defined]
    return {**figures, "logs": logs}


class IsolatedServer(OwnedServer):
    """An :class:`OwnedServer` in a network namespace of its own, reached over a veth pair
    (``10.231.N.2``), whose link the test can blackhole: :meth:`blackhole` points each side's
    neighbour entry at a MAC address nobody has, so every packet either way is dropped while both
    sockets stay open, as when a server's host dies, a firewall or NAT forgets the connection or a
    failover moves an address; nothing answers, not even with a reset.  Needs root and ``ip``
    (iproute2); skips otherwise."""

    NOBODY = "02:00:00:00:00:01"

    def __init__(self, **settings: str) -> None:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("setpriv"):
            pytest.skip("a network namespace needs root, ip (iproute2) and setpriv")
        tag = f"{os.getpid() % 10000}{random.randrange(100, 1000)}"
        self.ns, self.host_if, self.ns_if = f"dpg{tag}", f"dpgh{tag}", f"dpgn{tag}"
        taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        subnet = random.choice([n for n in range(1, 255) if f"10.231.{n}." not in taken])
        self.host_ip, self.server_ip = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
        try:
            self._ip("netns", "add", self.ns)
        except subprocess.CalledProcessError:
            pytest.skip("cannot make a network namespace here")
        try:
            self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._ip("link", "set", self.ns_if, "netns", self.ns)
            self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            self._ip("link", "set", self.host_if, "up")
            self._ip("addr", "add", f"{self.server_ip}/30", "dev", self.ns_if, ns=True)
            self._ip("link", "set", self.ns_if, "up", ns=True)
            self._ip("link", "set", "lo", "up", ns=True)
            super().__init__(**settings)
        except BaseException:
            self._remove_namespace()
            raise

    def _ip(self, *args: str, ns: bool = False) -> None:
        where = ["ip", "netns", "exec", self.ns] if ns else []
        subprocess.run([*where, "ip", *args], check=True, capture_output=True, timeout=30)

    def start(self) -> dt.datetime:
        """Start the server in the namespace, listening on its address there; returns when it first
        accepted a connection from here."""
        self.url = f"postgresql://postgres@{self.server_ip}:{self.port}/postgres"
        hba = os.path.join(self.datadir, "pg_hba.conf")
        with open(hba) as f:
            lines = f.read()
        if self.host_ip not in lines:
            with open(hba, "a") as f:
                f.write(f"host all all {self.host_ip}/32 trust\n")
        options = f"-h {self.server_ip} -p {self.port} -k {self.datadir} " + " ".join(
            f"-c {name}={value}" for name, value in self.settings.items()
        )
        as_user = ["setpriv", f"--reuid={self.user}", f"--regid={self.user}", "--init-groups"] if self.user else []
        subprocess.run(
            ["ip", "netns", "exec", self.ns, *as_user, os.path.join(self.bin, "pg_ctl"), "-D", self.datadir,
             "-l", os.path.join(self.datadir, "log"), "-o", options, "-W", "start"],
            check=True, cwd=self.datadir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, timeout=120,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return dt.datetime.now(dt.timezone.utc)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def blackhole(self, on: bool = True) -> None:
        """Drop every packet between here and the server (``on``), or let them through again."""
        if on:
            self._ip("neigh", "replace", self.server_ip, "lladdr", self.NOBODY, "dev", self.host_if, "nud", "permanent")
            self._ip(
                "neigh", "replace", self.host_ip, "lladdr", self.NOBODY, "dev", self.ns_if, "nud", "permanent", ns=True
            )
        else:
            self._ip("neigh", "del", self.server_ip, "dev", self.host_if)
            self._ip("neigh", "del", self.host_ip, "dev", self.ns_if, ns=True)

    def _remove_namespace(self) -> None:
        with suppress(subprocess.SubprocessError):
            self._ip("link", "del", self.host_if)
        with suppress(subprocess.SubprocessError):
            self._ip("netns", "del", self.ns)

    def close(self) -> None:
        with suppress(subprocess.SubprocessError):
            self.blackhole(False)
        super().close()
        self._remove_namespace()
