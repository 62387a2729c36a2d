"""Moving a django_dramatiq project from Redis to PostgreSQL, while messages keep coming
(docs/migrating.md, "From django_dramatiq on Redis"), with the project in
``examples/django_dramatiq_switch`` (``old_settings``: Redis, ``new_settings``: PostgreSQL; only
``DRAMATIQ_BROKER`` and ``DRAMATIQ_RESULT_BACKEND`` differ).

    pip install -e '.[embedded,migrate]' django django_dramatiq   # from a checkout
    python examples/migrate_from_django_dramatiq.py       # REDIS_URL, else redis://127.0.0.1:6379/0

PostgreSQL: a database of its own on ``DATABASE_URL``'s server (else an embedded one), dropped at the
end, with ``DJANGO_DATABASE`` its name if given. Django's settings are per process: every step with
either configuration is a ``manage.py`` process of its own. The steps, as the guide gives them:

1. The old project (``old_settings``) sends on Redis: five ready messages.
2. Switch: ``manage.py migrate`` with the new settings creates the broker's tables; the new
   ``rundramatiq`` runs on PostgreSQL, the old one (old settings) drains Redis, and the new
   settings send five more.
3. Once Redis's queue has no ready message (``LLEN`` 0), an old sender still running (a web process
   not yet deployed, say) sends one more, delayed; stop the old ``rundramatiq`` (SIGTERM to its main
   process): it puts the delayed message back if it had taken it (in the delay queue, or in the
   queue if it fell due meanwhile), and holds nothing (its ``__acks__`` sets are empty).
4. ``manage.py move_from_redis`` (new settings): ``move()`` from ``RedisBroker(**OLD
   DRAMATIQ_BROKER["OPTIONS"])`` to ``get_broker()``, ids and due times kept.
5. Check: every message ran exactly once, the delayed one on PostgreSQL and not before it was due;
   its result (and a new message's) read back through the new results backend, an old message's
   through the old one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

EXAMPLES = Path(__file__).resolve().parent
PROJECT = EXAMPLES / "django_dramatiq_switch"
# Past the old worker's stop (sent just before it): a load that slows every process start cannot
# make it fall due on Redis, as a delay counted from step 1 did (the drain took longer than it).
DELAY_MS = 15_000


def manage(env: dict[str, str], settings: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "django", *args, f"--settings={settings}"], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=120, **kwargs)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} ({settings}) failed:\n{done.stdout}{done.stderr}")
    return done


def rundramatiq(env: dict[str, str], settings: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "django", "rundramatiq", "--processes", "1", "--threads", "2",
                                 f"--settings={settings}"], cwd=PROJECT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def stop(worker: subprocess.Popen) -> int:
    """SIGTERM to the main ``dramatiq`` process (``rundramatiq`` execs it), which passes it on to its
    worker processes: they finish what they run and put back what they hold. Not to the whole process
    group: a worker process that gets a second SIGTERM is killed, and what it held stays in Redis's
    ``__acks__`` set of that worker, where ``move()`` does not see it."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    return worker.returncode


def sent(done: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def wait_for(what: str, done: Any, logs: list[Path], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}\n" + "\n".join(p.read_text()[-3000:] for p in logs))
        time.sleep(0.1)


def switch(url: str, redis_url: str, workdir: Path) -> None:
    import redis

    namespace = f"migrate_dj_{uuid.uuid4().hex[:8]}"
    path = [str(PROJECT), str(EXAMPLES), str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, DATABASE_URL=url, REDIS_URL=redis_url, REDIS_NAMESPACE=namespace,
               PYTHONPATH=os.pathsep.join(p for p in path if p), PYTHONUNBUFFERED="1")  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    old_log, new_log = workdir / "old-rundramatiq.log", workdir / "new-rundramatiq.log"
    workers: list[subprocess.Popen] = []

    def runs() -> dict[str, list[tuple[str, int]]]:
        found: dict[str, list[tuple[str, int]]] = {}
        with psycopg.connect(url) as conn:
            for message_id, side, at_ms in conn.execute("SELECT message_id, side, at_ms FROM jobs_run ORDER BY id"):
                found.setdefault(message_id, []).append((side, at_ms))
        return found

    try:
        # 1. The old project: its tables (django_dramatiq's, the app's), then sends on Redis.
        manage(env, "old_settings", "migrate", "--noinput")
        before = sent(manage(env, "old_settings", "send", "0", "1", "2", "3", "4"))
        print(f"1. sent on Redis (old settings): {len(before)} ready")

        # 2. Switch: the new settings migrate (the broker's tables), the new worker starts, the old
        #    one keeps draining Redis, and new sends go to PostgreSQL.
        manage(env, "new_settings", "migrate", "--noinput")
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT to_regclass('dramatiq.message')").fetchone()[0] is not None
        workers.append(old := rundramatiq(env, "old_settings", old_log))
        workers.append(new := rundramatiq(env, "new_settings", new_log))
        after = sent(manage(env, "new_settings", "send", "5", "6", "7", "8", "9"))
        print(f"2. switched: migrate made the broker's tables; {len(after)} sent on PostgreSQL; both workers run")

        # 3. No ready message left on Redis: stop the old worker.
        queue = f"{namespace}:default"
        wait_for("the old ready messages", lambda: all(m["id"] in runs() for m in before) and client.llen(queue) == 0,
                 [old_log, new_log])  # fmt: skip
        (delayed,) = sent(manage(env, "old_settings", "send", "99", "--delay", str(DELAY_MS)))
        code = stop(old)
        assert delayed["id"] not in runs(), "the delayed message ran on Redis: make DELAY_MS longer"
        if code != 0:
            print(f"the old worker exited {code}:\n{old_log.read_text()[-4000:]}")
        left = client.llen(f"{queue}.DQ"), client.llen(queue)
        held = [key.decode() for key in client.scan_iter(f"{namespace}:__acks__.*") if client.scard(key)]
        assert code == 0 and not held, f"the old worker exited {code}, leaving {held} held"
        print(f"3. Redis drained of ready messages; 1 sent delayed by {DELAY_MS // 1000} s by an old sender; "
              f"the old worker stopped (exit {code}); "
              f"left on Redis: {left[0]} delayed, {left[1]} ready")  # fmt: skip

        # 4. Move what is left, from the old settings' broker to the new one.
        moved = manage(env, "new_settings", "move_from_redis").stdout.strip()
        print(f"4. {moved} message(s) to PostgreSQL, ids and due times kept")
        assert moved == "moved 1", moved

        # 5. Everything ran once; the delayed one on PostgreSQL, when it was due; results read back.
        everyone = [m["id"] for m in [*before, *after, delayed]]
        wait_for("every message to run", lambda: all(m in runs() for m in everyone), [old_log, new_log])
        stop(new)
        ran = runs()
        sides = {m: [side for side, _ in ran.get(m, [])] for m in everyone}
        assert set(ran) == set(everyone), ran
        assert all(sides[m["id"]] == ["redis"] for m in before), sides
        assert all(sides[m["id"]] == ["postgres"] for m in [*after, delayed]), sides
        eta, ran_at = delayed["options"]["eta"], ran[delayed["id"]][0][1]
        assert ran_at >= eta - 50, (ran_at, eta)  # this machine's clock and the database's, a few ms apart
        print(f"5. every message ran once: {len(before)} on Redis, {len(after) + 1} on PostgreSQL "
              f"(the delayed one {ran_at - eta} ms after it was due)")  # fmt: skip
        new_results = json.loads(manage(env, "new_settings", "result", after[0]["id"], delayed["id"]).stdout)
        old_results = json.loads(manage(env, "old_settings", "result", before[0]["id"]).stdout)
        assert new_results == {after[0]["id"]: 10, delayed["id"]: 198}, new_results
        assert old_results == {before[0]["id"]: 0}, old_results
        print(f"   results through the new backend: {sorted(new_results.values())}; "
              f"an old message's through the old one: {list(old_results.values())}")  # fmt: skip
    finally:
        for worker in workers:
            stop(worker)
        keys = list(client.scan_iter(f"{namespace}*"))
        if keys:
            client.delete(*keys)
        client.close()


def main() -> int:
    server, stop_server = os.environ.get("DATABASE_URL"), None
    if not server:
        from dramatiq_pg_fenced.embedded import start_embedded

        server, stop_server = start_embedded()
    name = os.environ.get("DJANGO_DATABASE") or f"migrate_dj_{uuid.uuid4().hex[:8]}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            import tempfile

            with tempfile.TemporaryDirectory() as workdir:
                switch(make_conninfo(server, dbname=name), redis_url, Path(workdir))
        finally:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name])
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
    finally:
        if stop_server is not None:
            stop_server()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
