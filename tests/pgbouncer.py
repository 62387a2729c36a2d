"""A real PgBouncer (the system package) in front of the test PostgreSQL, for the tests.

``PgBouncer.start(upstream_url)`` writes a config and an auth file in a
temporary folder, starts ``pgbouncer`` in ``pool_mode = transaction`` on a
free port as a non-root user, and waits until it answers.  ``url(user)`` is a
URL through it; ``server_pids()`` asks its admin console which server
connections it holds; ``stop()`` ends it.  Used by the fixtures in
``conftest.py``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: Parameters PgBouncer itself SETs on a server connection to match a client
#: (1.18 tracks these); everything else set in a session is a leak.
TRACKED_PARAMETERS = {"client_encoding", "datestyle", "timezone", "standard_conforming_strings", "application_name"}


def binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as(upstream_host: str) -> pwd.struct_passwd | None:
    """The system user PgBouncer runs as (it refuses root): ``None`` when we are not root.

    An upstream reached by a Unix socket in a private folder (the embedded
    server's) is only reachable by the folder's owner: run as that one.
    """
    if os.geteuid() != 0:
        return None
    if upstream_host.startswith("/"):
        owner = os.stat(upstream_host).st_uid
        if owner != 0:
            return pwd.getpwuid(owner)
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("no non-root user to run pgbouncer as")


def _quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


class PgBouncer:
    def __init__(self, upstream_url: str, *, pool_size: int = 6) -> None:
        info = conninfo_to_dict(upstream_url)
        self.upstream = info
        self.host = str(info.get("host") or "127.0.0.1")
        self.upstream_port = str(info.get("port") or 5432)
        self.dbname = str(info.get("dbname") or info.get("user") or "postgres")
        self.admin_user = str(info.get("user") or "postgres")
        self.pool_size = pool_size
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.users: dict[str, str] = {self.admin_user: str(info.get("password") or "")}
        self.user = _run_as(self.host)

    # -- files --------------------------------------------------------------------
    def _write_auth(self) -> None:
        path = self.dir / "users.txt"
        path.write_text("".join(f"{_quote(u)} {_quote(p)}\n" for u, p in self.users.items()))
        self._chown(path)

    def _chown(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def _write_config(self) -> None:
        upstream = f"host={self.host} port={self.upstream_port}"
        config = f"""\
[databases]
* = {upstream}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir / "users.txt"}
admin_users = {self.admin_user}
pool_mode = transaction
default_pool_size = {self.pool_size}
max_client_conn = 400
server_reset_query =
server_check_delay = 0
ignore_startup_parameters = extra_float_digits
logfile = {self.dir / "pgbouncer.log"}
"""
        path = self.dir / "pgbouncer.ini"
        path.write_text(config)
        self._chown(path)

    # -- life cycle -----------------------------------------------------------------
    def start(self) -> PgBouncer:
        exe = binary()
        if exe is None:
            raise FileNotFoundError("pgbouncer")
        self._chown(self.dir)
        self._write_auth()
        for _ in range(5):  # a port picked free may be taken before pgbouncer binds it
            self.port = _free_port()
            self._write_config()
            kwargs: dict = {}
            if self.user is not None:
                kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
            log = open(self.dir / "stdout.log", "ab")  # closed below, once the process has it
            self.proc = subprocess.Popen(
                [exe, str(self.dir / "pgbouncer.ini")],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **kwargs,
            )
            log.close()
            if self._wait_ready():
                return self
            self.stop(remove=False)
        raise RuntimeError(f"pgbouncer did not start; its log:\n{self.log()}")

    def _wait_ready(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with self.admin() as conn:
                    conn.execute("SHOW VERSION")
                return True
            except psycopg.OperationalError:
                time.sleep(0.05)
        return False

    def stop(self, *, remove: bool = True) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # immediate shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        parts = []
        for name in ("pgbouncer.log", "stdout.log"):
            path = self.dir / name
            if path.exists():
                parts.append(path.read_text(errors="replace")[-4000:])
        return "\n".join(parts)

    # -- use --------------------------------------------------------------------------
    def url(self, user: str | None = None, dbname: str | None = None) -> str:
        """A URL through PgBouncer (no password: it trusts its clients, and logs in upstream with the auth file's)."""
        return make_conninfo(
            "", host="127.0.0.1", port=self.port, user=user or self.admin_user, dbname=dbname or self.dbname
        )

    def add_user(self, user: str, password: str = "") -> None:
        """Let *user* through (and log in upstream with *password*); reloads PgBouncer."""
        self.users[user] = password
        self._write_auth()
        with self.admin() as conn:
            conn.execute("RELOAD")

    def admin(self) -> psycopg.Connection:
        """A connection to PgBouncer's admin console (simple query protocol only)."""
        return psycopg.connect(
            self.url(dbname="pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor, connect_timeout=2
        )

    def show(self, what: str) -> list[dict]:
        with self.admin() as conn:
            cur = conn.execute(f"SHOW {what}")
            names = [c.name for c in cur.description or []]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def server_pids(self, user: str | None = None) -> set[int]:
        """The backend pids of PgBouncer's server connections (of *user*, else all but the admin's)."""
        return {
            int(row["remote_pid"])
            for row in self.show("SERVERS")
            if (row["user"] == user if user else True) and row["database"] != "pgbouncer"
        }

    def close_idle_servers(self) -> None:
        """Make PgBouncer drop its server connections (RECONNECT), e.g. before dropping a role."""
        with self.admin() as conn:
            conn.execute("RECONNECT")
