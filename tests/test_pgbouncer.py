"""Behind a real PgBouncer in transaction pooling, and as a least-privilege role (issue 14).

PgBouncer (the system package) runs in front of the test database with
``pool_mode = transaction`` (fixture ``pgbouncer``, see ``pgbouncer.py``): every
statement outside a transaction may land on another server connection, and
nothing resets a server connection between clients.  So no statement may
depend on session state (prepared statements, ``SET``, LISTEN, session
advisory locks), and none may be left behind: after each test every server
connection PgBouncer holds is inspected.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.errors import BrokerError
from dramatiq.message import Message
from helpers import wait_for
from pgbouncer import TRACKED_PARAMETERS, PgBouncer
from psycopg import sql

from dramatiq_pg_fenced import PayloadTooLarge, PostgresBroker
from dramatiq_pg_fenced.features import rate_limits, results
from dramatiq_pg_fenced.sending.enqueue import CHUNK

APP = "tests.apps.pgbouncer_app"


# -- what a server connection carries ---------------------------------------------------
SESSION_STATE = """
    SELECT pg_backend_pid(),
           (SELECT count(*) FROM pg_prepared_statements),
           current_setting('lock_timeout'),
           (SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM pg_settings WHERE source = 'session'),
           (SELECT count(*) FROM pg_listening_channels()),
           (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())
"""


def server_sessions(bouncer: PgBouncer, user: str) -> dict[int, dict[str, Any]]:
    """The session state of every server connection PgBouncer holds for *user*.

    Each server connection is reached by a client that keeps a transaction
    open on it (so the next client gets another one) until all were seen.
    """
    pids = bouncer.server_pids(user)
    seen: dict[int, dict[str, Any]] = {}
    clients: list[psycopg.Connection] = []
    try:
        for _ in range(bouncer.pool_size):
            if pids <= set(seen):
                break
            conn = psycopg.connect(bouncer.url(user), prepare_threshold=None)  # not autocommit: pinned until rollback
            clients.append(conn)
            pid, prepared, lock_timeout, settings, listening, advisory = conn.execute(SESSION_STATE).fetchone()  # type: ignore[misc]
            seen[pid] = {
                "prepared_statements": prepared,
                "lock_timeout": lock_timeout,
                "session_settings": sorted(s for s in settings if s.lower() not in TRACKED_PARAMETERS),
                "listening": listening,
                "advisory_locks": advisory,
            }
    finally:
        for conn in clients:
            conn.rollback()
            conn.close()
    assert pids <= set(seen), f"could not reach every server connection: {pids - set(seen)} unseen"
    return seen


CLEAN = {"prepared_statements": 0, "lock_timeout": "0", "session_settings": [], "listening": 0, "advisory_locks": 0}


def assert_clean(bouncer: PgBouncer, user: str) -> int:
    sessions = server_sessions(bouncer, user)
    dirty = {pid: state for pid, state in sessions.items() if state != CLEAN}
    assert not dirty, f"session state left on PgBouncer's server connections: {dirty}"
    return len(sessions)


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture
def schema(dramatiq_pg_url: str) -> Iterator[str]:
    """A fresh schema name, dropped after the test."""
    name = f"pgb_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(thing)``: close it after the test."""
    things: list[Any] = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        thing.close()


def migrate_direct(url: str, schema: str) -> None:
    broker = PostgresBroker(url, schema=schema)
    try:
        broker.migrate()
    finally:
        broker.close()


def message(actor: str = "plain", queue: str = "default", *args: Any) -> Message:
    return Message(queue_name=queue, actor_name=actor, args=args, kwargs={}, options={})


# -- the set-up of docs/pgbouncer.md through PgBouncer ------------------------------------
def test_sends_claims_and_acks_through_pgbouncer(pgbouncer, dramatiq_pg_url, schema, closing):
    """Hundreds of statements per connection (psycopg would prepare after five) in several threads."""
    migrate_direct(dramatiq_pg_url, schema)
    broker = closing(PostgresBroker(pgbouncer.url(), schema=schema, listen=False, poll_interval=0.05))
    broker.declare_queue("default")
    errors: list[BaseException] = []

    def send(n: int) -> None:
        try:
            for i in range(n):
                broker.enqueue(message("plain", "default", i))
                broker.stats()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=send, args=(40,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert broker.stats()["queues"] == {"default": {"queued": 160}}

    done: list[int] = []
    dramatiq.actor(done.append, broker=broker, actor_name="plain", max_retries=0)
    with_worker(broker, lambda: len(done) >= 160)
    broker.join("default", timeout=10_000)
    assert sorted(done) == sorted(list(range(40)) * 4)
    assert assert_clean(pgbouncer, pgbouncer.admin_user) >= 1


def with_worker(broker: PostgresBroker, until: Callable[[], bool], timeout: float = 30) -> None:
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=4)
    worker.start()
    try:
        wait_for(until, timeout=timeout, what="the worker")
    finally:
        worker.stop()


def test_bulk_enqueue_in_pipelined_chunks_through_pgbouncer(pgbouncer, dramatiq_pg_url, schema, closing):
    """More than ``enqueue.CHUNK`` messages go in pipeline mode, in one transaction: PgBouncer keeps it on one
    server connection, and a failed one leaves nothing behind."""
    migrate_direct(dramatiq_pg_url, schema)
    broker = closing(PostgresBroker(pgbouncer.url(), schema=schema, listen=False, max_payload_bytes=2000))
    broker.declare_queue("default")
    for _ in range(3):
        broker.enqueue_many([message("plain", "default", i) for i in range(CHUNK * 2 + 7)])
    bad = [message("plain", "default", i) for i in range(CHUNK * 2 + 7)]
    bad[-1] = message("plain", "default", "y" * 5000)
    with pytest.raises(PayloadTooLarge):
        broker.enqueue_many(bad)
    assert broker.stats()["queues"] == {"default": {"queued": 3 * (CHUNK * 2 + 7)}}
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        [(writers,)] = conn.execute(
            sql.SQL("SELECT count(DISTINCT xmin::text) FROM {}.message").format(sql.Identifier(schema))
        )
    assert writers == 3  # one transaction per call
    assert assert_clean(pgbouncer, pgbouncer.admin_user) >= 1


def test_results_and_rate_limit_backends_with_pools_of_their_own(pgbouncer, dramatiq_pg_url, schema, closing):
    """``results.PostgresBackend(url)`` and ``rate_limits.PostgresBackend(url)`` make their own pools: same rule."""
    migrate_direct(dramatiq_pg_url, schema)
    url = pgbouncer.url()
    backend = closing(results.PostgresBackend(url, schema=schema, listen=False))
    limits = closing(rate_limits.PostgresBackend(url, schema=schema, listen=False))
    errors: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            for i in range(30):
                m = message("plain", "default", k, i)
                backend.store_result(m, [k, i], 60_000)
                assert backend.get_result(m) == [k, i]
                assert limits.incr(f"k{k}", 1, 10**6, 60_000)
                limits.add(f"once{k}-{i}", 1, 60_000)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert assert_clean(pgbouncer, pgbouncer.admin_user) >= 1


def test_compact_through_pgbouncer_leaves_no_setting_behind(pgbouncer, dramatiq_pg_url, schema, closing):
    """Other clients keep PgBouncer's server connections busy while ``compact()`` runs: nothing of it may stay."""
    migrate_direct(dramatiq_pg_url, schema)
    broker = closing(PostgresBroker(pgbouncer.url(), schema=schema, listen=False))
    others = closing(PostgresBroker(pgbouncer.url(), schema=schema, listen=False, pool_max_size=4))
    broker.declare_queue("default")
    broker.enqueue_many([message() for _ in range(500)])
    broker.flush("default")
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            while not stop.is_set():
                others.stats()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=busy) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            sizes = broker.compact()
            assert sizes["bytes_after"] <= sizes["bytes_before"]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert assert_clean(pgbouncer, pgbouncer.admin_user) >= 2


# -- least privilege -----------------------------------------------------------------------
def cli(url: str, schema: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "--schema", schema, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 3, (result.stdout, result.stderr)  # 3: the database refused (docs/operating.md, exit codes)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_migrate_as_the_schema_owner_without_create_on_the_database(least_privilege, pgbouncer):
    lp = least_privilege
    owner_url = pgbouncer.url(lp.owner)
    first = cli(owner_url, lp.schema, "migrate")
    assert first.returncode == 0, first.stderr
    assert "1, 2" in first.stdout
    again = cli(owner_url, lp.schema, "migrate")
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout
    # The owner may not create a schema in this database: a one-line error naming the privilege.
    assert_one_line_error(cli(owner_url, lp.schema + "_new", "migrate"), "CREATE", "permission denied")
    # The application role owns nothing: without its grants it cannot even read the schema, and says so in one line.
    assert_one_line_error(cli(pgbouncer.url(lp.app), lp.schema, "migrate"), "permission denied")
    # With them, a migrate that has nothing to do changes nothing, so it needs nothing more
    # (an application may call broker.migrate() at start-up).
    lp.grant()
    as_app = cli(pgbouncer.url(lp.app), lp.schema, "migrate")
    assert as_app.returncode == 0, as_app.stderr
    assert "nothing to do" in as_app.stdout


def test_compact_as_a_non_owner_is_an_error_naming_the_privilege(least_privilege, pgbouncer, closing):
    lp = least_privilege
    assert cli(pgbouncer.url(lp.owner), lp.schema, "migrate").returncode == 0
    lp.grant()
    broker = closing(PostgresBroker(pgbouncer.url(lp.app), schema=lp.schema, listen=False))
    with pytest.raises(BrokerError, match="owner") as raised:
        broker.compact()
    assert "MAINTAIN" in str(raised.value)
    assert_one_line_error(cli(pgbouncer.url(lp.app), lp.schema, "compact"), "owner", "MAINTAIN")
    done = cli(pgbouncer.url(lp.owner), lp.schema, "compact")
    assert done.returncode == 0, done.stderr
    assert assert_clean(pgbouncer, lp.owner) >= 1


# -- timeliness without LISTEN ---------------------------------------------------------------
def test_delays_without_listen_start_on_time(dramatiq_pg_broker_factory):
    """An idle worker without LISTEN learns of a delayed message at its next poll and starts it when due.

    The bound: a message starts by ``max(due, enqueued + poll_interval)`` (plus a claim).
    """
    broker = dramatiq_pg_broker_factory(listen=False, poll_interval=0.5)
    started: dict[int, float] = {}

    @dramatiq.actor(broker=broker, max_retries=0)
    def late(n: int) -> None:
        started[n] = time.time()

    delays = {0: 0.6, 1: 0.75, 2: 0.9, 3: 0.2}
    with_worker_running(broker)
    try:
        time.sleep(0.7)  # the consumer has claimed nothing and knows of no delayed row
        sent: dict[int, float] = {}
        for n, delay in delays.items():
            sent[n] = time.time()
            late.send_with_options(args=(n,), delay=int(delay * 1000))
        wait_for(lambda: len(started) == len(delays), timeout=10, what="the delayed messages")
    finally:
        stop_worker(broker)
    lateness = {n: started[n] - sent[n] - delays[n] for n in delays}
    assert all(v > -0.02 for v in lateness.values()), lateness  # never early
    # Due after the next poll: on time (polling alone, every 0.5 s, makes one of these three at
    # least 0.3 s late, whatever the phase).  Due before it (n=3): by the next poll.
    assert max(lateness[n] for n in (0, 1, 2)) < 0.25, lateness
    assert started[3] - sent[3] < 0.5 + 0.25, lateness


def test_blocking_result_read_without_listen_is_prompt(dramatiq_pg_broker_factory, dramatiq_pg_url, closing):
    """``get_result(block=True)`` without LISTEN re-reads soon at first (10 ms, doubling to ``poll_interval``).

    No timing assert (a loaded machine took 0.35 s once): the poll interval is a minute and the read's
    timeout 10 s, so a read that waited a poll interval before its second look times out."""
    broker = dramatiq_pg_broker_factory()
    backend = closing(results.PostgresBackend(dramatiq_pg_url, schema=broker.schema, listen=False, poll_interval=60.0))
    for _ in range(3):
        m = message()
        timer = threading.Timer(0.05, lambda m=m: backend.store_result(m, 42, 60_000))
        timer.start()
        assert backend.get_result(m, block=True, timeout=10_000) == 42  # ready after 50 ms
        timer.join()


_workers: dict[int, dramatiq.Worker] = {}


def with_worker_running(broker: PostgresBroker) -> None:
    # The dramatiq CLI's worker_timeout: consumers come back every second, not every 50 ms.
    worker = _workers[id(broker)] = dramatiq.Worker(broker, worker_timeout=1000, worker_threads=2)
    worker.start()


def stop_worker(broker: PostgresBroker) -> None:
    _workers.pop(id(broker)).stop()


# -- the workload: real worker processes through PgBouncer ----------------------------------
class Workload:
    """What the test sent, and what each message must cause: executions per message id."""

    def __init__(self) -> None:
        self.expected: dict[str, tuple[str, int]] = {}  # message id -> (kind, executions)
        self.results: list[tuple[Any, Any]] = []  # (message / pipeline / group, expected result)
        self.delays: dict[str, float] = {}

    def expect(self, m: Message, kind: str, executions: int = 1) -> Message:
        self.expected[m.message_id] = (kind, executions)
        return m


def send_workload(broker: PostgresBroker, actors: dict[str, Any], scale: int = 1) -> Workload:
    """About 270 messages: sends, a batch, retries, delays, results, pipelines, a group, a mutex."""
    w = Workload()
    plain, later, flaky, add = actors["plain"], actors["later"], actors["flaky"], actors["add"]
    for i in range(150 * scale):
        w.expect(plain.send(i), "plain")
    with broker.batch():
        for i in range(20):
            w.expect(plain.send(1000 + i), "plain")
    for i in range(20):
        w.expect(flaky.send(i), "flaky", 3)  # fails twice, then succeeds
    for i in range(20):
        delay = 200 + 50 * i
        m = later.send_with_options(args=(i, time.time() + delay / 1000), delay=delay)
        w.expect(m, "later")
    for i in range(20):
        w.results.append((w.expect(add.send(i, i), "add"), 2 * i))
    for i in range(5):
        pipe = dramatiq.pipeline([add.message(i, 1), add.message(2), add.message(3)], broker=broker)
        for m in pipe.messages:
            w.expect(m, "add")
        w.results.append((pipe.run(), i + 6))
    members = [add.message(i, 100) for i in range(10)]
    done = actors["group_done"].message("g")
    for m in [*members, done]:
        w.expect(m, "add" if m is not done else "group_done")
    g = dramatiq.group(members, broker=broker)
    g.add_completion_callback(done)
    w.results.append((g.run(), [i + 100 for i in range(10)]))
    for i in range(15):
        w.expect(actors["exclusive"].send(i), "exclusive")
    return w


def result_of(thing: Any, backend: results.PostgresBackend) -> Any:
    if isinstance(thing, dramatiq.group):
        return list(thing.get_results(block=True, timeout=30_000))
    if isinstance(thing, dramatiq.pipeline):
        return thing.get_result(block=True, timeout=30_000)
    return backend.get_result(thing, block=True, timeout=30_000)


def run_workload(
    *,
    broker_url: str,
    schema: str,
    ledger_url: str,
    dramatiq_cli: Callable[..., subprocess.Popen],
    monkeypatch: pytest.MonkeyPatch,
    closing: Callable[[Any], Any],
) -> dict[str, Any]:
    """Two ``dramatiq`` worker processes and this process's sends, all through *broker_url* (PgBouncer)."""
    from apps.pgbouncer_app import LEDGER_TABLE, build

    ledger = closing(psycopg.connect(ledger_url, autocommit=True))
    ident = sql.Identifier(schema)
    ledger.execute(sql.SQL(LEDGER_TABLE).format(ident))
    monkeypatch.setenv("PGB_BROKER_URL", broker_url)
    broker, backend, actors = build(broker_url, schema, ledger_url)
    closing(broker)
    procs = [
        dramatiq_cli(broker, APP, "--processes", "1", "--threads", "4", "--worker-shutdown-timeout", "5000")
        for _ in range(2)
    ]
    wait_for(
        lambda: all("ready for action" in p.log_path.read_text() for p in procs), timeout=30, what="the workers"
    )  # so the delays' lateness is the broker's, not the workers' start-up
    began = time.monotonic()
    w = send_workload(broker, actors)
    for thing, expected in w.results:
        assert result_of(thing, backend) == expected

    def executions() -> Counter:
        return Counter(
            dict(
                ledger.execute(
                    sql.SQL("SELECT message_id, count(*) FROM {}.ledger GROUP BY 1").format(ident)
                ).fetchall()
            )
        )

    def mutex_entries() -> int:
        row = ledger.execute(sql.SQL("SELECT count(*) FROM {}.ledger WHERE kind = 'enter'").format(ident)).fetchone()
        return row[0] if row else 0

    total = sum(n * (2 if kind == "exclusive" else 1) for kind, n in w.expected.values())
    wait_for(lambda: sum(executions().values()) >= total, timeout=90, what="every execution")
    elapsed = time.monotonic() - began
    broker.join("default", timeout=30_000)
    time.sleep(1.5)  # a poll interval and more: an extra execution would show now
    for proc in procs:
        proc.send_signal(15)
    for proc in procs:
        assert proc.wait(timeout=30) == 0, proc.log_path.read_text()[-3000:]

    # 0 lost, 0 extra: each message ran exactly as often as it should (the mutex: entered once, left once).
    counted = executions()
    wrong = {
        mid: (kind, counted.get(mid, 0), n * (2 if kind == "exclusive" else 1))
        for mid, (kind, n) in w.expected.items()
        if counted.get(mid, 0) != n * (2 if kind == "exclusive" else 1)
    }
    assert not wrong, f"messages run the wrong number of times (kind, ran, expected): {wrong}"
    unknown = set(counted) - set(w.expected)
    assert not unknown, f"executions of messages nobody sent: {unknown}"
    rows = ledger.execute(
        sql.SQL("SELECT message_id, kind, arg, attempt, retries FROM {}.ledger ORDER BY at").format(ident)
    ).fetchall()
    by_message: defaultdict[str, list[int]] = defaultdict(list)
    for mid, kind, _, attempt, _ in rows:
        if kind != "exit":
            by_message[mid].append(attempt)
    assert all(
        attempts == list(range(1, len(attempts) + 1))
        for mid, attempts in by_message.items()
        if w.expected[mid][0] != "exclusive"
    ), "a redelivery happened (attempts skipped or repeated)"

    # The mutex held: enter and exit alternate.
    order = [kind for _, kind, _, _, _ in rows if kind in ("enter", "exit")]
    assert order == ["enter", "exit"] * (len(order) // 2), "two holders of the mutex at once"
    assert mutex_entries() == 15

    # Delays: never early.
    lateness = [float(arg.split(":")[1]) for _, kind, arg, _, _ in rows if kind == "later"]
    assert min(lateness) > -0.05, lateness

    # Nothing left behind in the broker's table, nothing failed, nothing went stale.
    stats = broker.stats()
    assert stats["queues"] == {}, stats
    assert int(stats["totals"].get("stale_writes", 0)) == 0, stats
    logs = "\n".join(p.log_path.read_text() for p in procs)
    for bad in ("prepared statement", "cannot reach PostgreSQL", "could not write", "Lease of message"):
        assert bad not in logs, f"{bad!r} in the worker logs:\n{logs[-3000:]}"
    return {"messages": len(w.expected), "executions": sum(counted.values()), "seconds": round(elapsed, 2)}


@pytest.mark.slow
def test_workload_through_pgbouncer(pgbouncer, dramatiq_pg_url, dramatiq_cli, monkeypatch, closing, schema):
    """The set-up of docs/pgbouncer.md, ``url=<PgBouncer>, listen=False``: 0 lost, 0 extra, clean server connections."""
    migrate_direct(dramatiq_pg_url, schema)
    figures = run_workload(
        broker_url=pgbouncer.url(), schema=schema, ledger_url=dramatiq_pg_url,
        dramatiq_cli=dramatiq_cli, monkeypatch=monkeypatch, closing=closing,
    )  # fmt: skip
    broker = closing(PostgresBroker(pgbouncer.url(), schema=schema, listen=False))
    broker.compact()  # through PgBouncer too
    servers = assert_clean(pgbouncer, pgbouncer.admin_user)
    print(f"\nworkload through PgBouncer: {figures}, {servers} server connections checked")


# ~10-20 s: CLI worker processes through PgBouncer as the application role, with their start and stop.
@pytest.mark.slow
def test_workload_as_a_least_privilege_role(
    least_privilege, pgbouncer, dramatiq_pg_url, dramatiq_cli, monkeypatch, closing
):
    """The same workload as docs/permissions.md's application role, migrated by its owner role."""
    lp = least_privilege
    lp.grant()  # before migrate: the default privileges cover the tables migrate creates
    migrated = cli(pgbouncer.url(lp.owner), lp.schema, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    app_url = pgbouncer.url(lp.app)
    figures = run_workload(
        broker_url=app_url, schema=lp.schema, ledger_url=dramatiq_pg_url,
        dramatiq_cli=dramatiq_cli, monkeypatch=monkeypatch, closing=closing,
    )  # fmt: skip
    # The operator commands, as the application role.
    assert cli(app_url, lp.schema, "stats").returncode == 0
    parked = closing(PostgresBroker(app_url, schema=lp.schema, listen=False))
    m = parked.enqueue(message("plain", "parked"))
    inspected = cli(app_url, lp.schema, "inspect", m.message_id)
    assert inspected.returncode == 0 and '"queued"' in inspected.stdout, inspected
    cancelled = cli(app_url, lp.schema, "cancel", m.message_id)
    assert cancelled.returncode == 0 and "cancelled_queued" in cancelled.stdout, cancelled
    assert_one_line_error(cli(app_url, lp.schema, "compact"), "owner")
    assert cli(pgbouncer.url(lp.owner), lp.schema, "compact").returncode == 0
    servers = assert_clean(pgbouncer, lp.app) + assert_clean(pgbouncer, lp.owner)
    print(f"\nworkload as {lp.app}: {figures}, {servers} server connections checked")


def test_operator_commands_need_what_the_readme_says(least_privilege, pgbouncer, closing):
    """The table of docs/permissions.md: stats and inspect read; cancel also updates ``message``; compact needs the owner."""
    lp = least_privilege
    owner_url, ops_url = pgbouncer.url(lp.owner), pgbouncer.url(lp.app)
    assert cli(owner_url, lp.schema, "migrate").returncode == 0
    owner = closing(PostgresBroker(owner_url, schema=lp.schema, listen=False))
    m = owner.enqueue(message("plain", "parked"))

    def grant(text: str) -> None:
        with psycopg.connect(owner_url, autocommit=True, prepare_threshold=None) as conn:
            conn.execute(sql.SQL(text).format(s=sql.Identifier(lp.schema), r=sql.Identifier(lp.app)))

    grant("GRANT USAGE ON SCHEMA {s} TO {r}")
    grant(
        "GRANT SELECT ON {s}.message, {s}.counter, {s}.schema_version, {s}.paused_queue, {s}.throughput,"
        " {s}.history, {s}.attempt_log, {s}.audit, {s}.fairness_weight, {s}.schedule, {s}.schedule_run,"
        " {s}.process, {s}.outcome_total TO {r}"
    )
    stats = cli(ops_url, lp.schema, "stats", "--json")
    assert stats.returncode == 0 and '"parked"' in stats.stdout, stats
    inspected = cli(ops_url, lp.schema, "inspect", m.message_id)
    assert inspected.returncode == 0 and '"queued"' in inspected.stdout, inspected
    assert_one_line_error(cli(ops_url, lp.schema, "cancel", m.message_id), "permission denied")
    grant("GRANT UPDATE ON {s}.message TO {r}")
    cancelled = cli(ops_url, lp.schema, "cancel", m.message_id)
    assert cancelled.returncode == 0 and "cancelled_queued" in cancelled.stdout, cancelled
    assert_one_line_error(cli(ops_url, lp.schema, "compact"), "owner", "MAINTAIN")
