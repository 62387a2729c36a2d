"""Who may talk to the dashboard: the host names it answers (DNS rebinding), the origins it
takes forms from, its optional authentication, and the warning when it is exposed without one.

A DNS-rebinding page is served from ``evil.example``, then has that name resolve to
127.0.0.1: the browser sends the dashboard ``Host: evil.example`` and ``Origin:
http://evil.example``, and lets the page read the answers as its own.  So the ``Host`` must
be one the operator named, and a form's ``Origin`` must be one of those too, never merely
equal to the ``Host``.
"""

from __future__ import annotations

import base64
import http.client
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dramatiq
import pytest

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.config import Settings
from dramatiq_pg_fenced.dashboard import Dashboard, dashboard_app, make_dashboard_server

ARGUMENT = "arg-4f1c-private"  # what a message's arguments hold: nothing of it may leak


def call(
    app: Any,
    path: str = "/",
    method: str = "GET",
    form: dict[str, str] | None = None,
    host: str | None = "127.0.0.1:8080",
    scheme: str = "http",
    **headers: str,
) -> tuple[str, dict[str, str], str]:
    """One request through the WSGI app, with the ``Host`` (``None``: no ``Host`` at all) and
    other headers given; returns (status, headers, body)."""
    path, _, qs = path.partition("?")
    data = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": qs, "wsgi.input": io.BytesIO(data),
        "CONTENT_LENGTH": str(len(data)), "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8080",
        "wsgi.url_scheme": scheme,
    }  # fmt: skip
    if host is not None:
        environ["HTTP_HOST"] = host
    environ.update({f"HTTP_{k.upper()}": v for k, v in headers.items()})
    seen: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body.decode()


class NoDatabase:
    """Stands for the database and the statements: a request that reaches either fails (503)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the request reached the database ({name})")


def offline(**options: Any) -> Dashboard:
    """A dashboard without a database: only the checks that run before any page can answer."""
    return Dashboard(NoDatabase(), NoDatabase(), Settings(schema="ops_schema"), **options)  # type: ignore[arg-type]


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def queued_message(broker: PostgresBroker) -> dramatiq.Message:
    broker.declare_queue("emails")
    message = dramatiq.Message(queue_name="emails", actor_name="send", args=(ARGUMENT,), kwargs={}, options={})
    broker.enqueue(message)
    return message


def state(broker: PostgresBroker, message: dramatiq.Message) -> str | None:
    info = broker.inspect(message.message_id)
    return None if info is None else info["state"]


# -- Host -------------------------------------------------------------------------------------------
def test_a_dns_rebinding_page_gets_400_and_no_page_no_token_no_action(dramatiq_pg_broker: PostgresBroker) -> None:
    # Given a dashboard with actions, and a queued message whose arguments are private
    broker = dramatiq_pg_broker
    m = queued_message(broker)
    app = dashboard_app(broker, actions=True)
    pages = ["/", "/messages?queue=emails&state=queued", f"/message/{m.message_id}", "/metrics", "/nowhere"]
    # When a page of evil.example, now resolving to this host, reads every page
    for host in ("evil.example", "evil.example:8080", "EVIL.example:8080"):
        for path in pages:
            status, _, body = call(app, path, host=host)
            # I expect 400, and nothing of the queues, the message or the form token
            assert status == "400 Bad Request", (host, path, status)
            assert app.token not in body and ARGUMENT not in body and "emails" not in body, (host, path)
            assert broker.schema not in body
    # When it posts a form with the token it would have read, from its own origin
    form = {"token": app.token, "action": "cancel", "message_id": m.message_id, "next": "/"}
    status, _, _ = call(app, "/action", "POST", form, host="evil.example:8080", origin="http://evil.example:8080")
    # I expect 400, and the message untouched
    assert status == "400 Bad Request"
    assert state(broker, m) == "queued"


def test_the_host_check_runs_before_anything_else() -> None:
    # Given a dashboard that fails any request reaching its database
    app = offline(actions=True)
    # When a request names another host: on every page, and for an action
    for path, method in (("/", "GET"), ("/metrics", "GET"), ("/action", "POST"), ("/", "DELETE")):
        status, headers, body = call(app, path, method, host="evil.example")
        # I expect 400 before any page, check or database call, and a page that says no more than that
        assert status == "400 Bad Request", (path, method, status)
        assert headers["Content-Type"].startswith("text/plain") and "ops_schema" not in body
    assert call(app, "/nowhere", host="127.0.0.1:8080")[0] == "404 Not Found"  # an allowed host goes on


@pytest.mark.parametrize(
    "host",
    [
        "localhost", "LOCALHOST", "localhost:8080", "localhost:9999", "localhost.", "LocalHost.:8080",
        "127.0.0.1", "127.0.0.1:8080", "[::1]", "[::1]:8080", "[0:0:0:0:0:0:0:1]:8080",
        "dash.example.com", "Dash.Example.COM:443", "app.internal.example", "internal.example:1",
        "proxy.example:8443", "[2001:db8::7]:80", "10.0.0.5",
    ],
)  # fmt: skip
def test_allowed_host_names_compare_without_case_and_with_any_port(host: str) -> None:
    app = offline(
        allowed_hosts=["dash.example.com", ".internal.example", "proxy.example:8443", "2001:db8::7", "10.0.0.5"]
    )
    assert call(app, "/nowhere", host=host)[0] == "404 Not Found", host


@pytest.mark.parametrize(
    "host",
    [
        None, "", " ", ":8080", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example",
        "evillocalhost", "dash.example.com.evil.example", "notinternal.example", "proxy.example",
        "proxy.example:8080", "::1", "[::1", "[::1]x", "[::2]", "[fe80::1%25eth0]", "[::1]:", "localhost:",
        "localhost:abc", "localhost:99999", "localhost:8080:1", "localhost:+80", "localhost:-1",
        "localhost,evil.example", "evil.example,localhost", "localhost evil.example", "localhost\t",
        "localhost\x00", "localhost\r\nX-Evil: 1", "lócalhost", "localhost\xff", "user@localhost",
        "localhost/", "localhost#", "localhost..", ".localhost", "*", "127.0.0.1:8080@evil.example",
        "localhost" + "a" * 300,
    ],
)  # fmt: skip
def test_other_missing_or_malformed_hosts_get_400(host: str | None) -> None:
    app = offline(allowed_hosts=["dash.example.com", ".internal.example", "proxy.example:8443"])
    status, _, body = call(app, "/nowhere", host=host)
    assert status == "400 Bad Request", (host, status)
    assert "\r" not in body and "\x00" not in body and "evil" not in body  # the refusal never echoes the header


def test_a_port_named_with_an_allowed_host_is_the_only_port_for_it() -> None:
    app = offline(allowed_hosts=["secure.example:443"])
    assert call(app, "/nowhere", host="secure.example", scheme="https")[0] == "404 Not Found"  # 443 implied
    assert call(app, "/nowhere", host="secure.example", scheme="http")[0] == "400 Bad Request"  # 80 implied
    assert call(app, "/nowhere", host="secure.example:8443", scheme="https")[0] == "400 Bad Request"


@pytest.mark.parametrize("name", ["", "http://dash.example", "dash example", "dash.example:http", "[::1", "*", "a/b"])
def test_a_malformed_allowed_host_is_refused_when_the_app_is_built(name: str) -> None:
    with pytest.raises(ValueError):
        offline(allowed_hosts=[name])


# -- Origin and Sec-Fetch-Site -------------------------------------------------------------------------
def test_a_form_from_another_origin_is_refused_even_with_the_token(dramatiq_pg_broker: PostgresBroker) -> None:
    # Given a dashboard with actions, reached as 127.0.0.1:8080, and a queued message
    broker = dramatiq_pg_broker
    m = queued_message(broker)
    app = dashboard_app(broker, actions=True, allowed_hosts=["dash.example.com"])
    form = {"token": app.token, "action": "cancel", "message_id": m.message_id, "next": "/"}
    # When forms with the right token come from origins that are not the dashboard's
    for origin in ("http://evil.example", "http://evil.example:8080", "null", "file://", "http://127.0.0.1.evil.example",
                   "http://localhost@evil.example", "javascript:1", "http://", "garbage"):  # fmt: skip
        # I expect each refused, and the message untouched
        assert call(app, "/action", "POST", form, origin=origin)[0] == "403 Forbidden", origin
    for site in ("cross-site", "same-site"):  # another site's page, or a sibling of this one
        assert call(app, "/action", "POST", form, sec_fetch_site=site)[0] == "403 Forbidden", site
    assert state(broker, m) == "queued"
    # When the origin is one of the allowed hosts (not necessarily the one in Host)
    status, _, _ = call(app, "/action", "POST", form, origin="http://localhost:8080", sec_fetch_site="same-origin")
    # I expect the action done
    assert status == "303 See Other"
    assert state(broker, m) == "cancelled"
    again = {**form, "action": "pause", "queue": "emails"}
    assert (
        call(app, "/action", "POST", again, host="dash.example.com", origin="https://dash.example.com")[0]
        == "303 See Other"
    )


def test_a_redirect_after_an_action_never_leaves_the_dashboard(dramatiq_pg_broker: PostgresBroker) -> None:
    app = dashboard_app(dramatiq_pg_broker, actions=True)
    dramatiq_pg_broker.pause("emails", create=True)  # a queue the actions below may name
    # Browsers read a backslash as a slash and drop tabs and newlines: each of these is "//evil.example"
    for target in ("//evil.example/", "/\\evil.example", "\\\\evil.example", "/\t/evil.example", "/\n/evil.example",
                   "/\r\nSet-Cookie: x=1", "https://evil.example", " //evil.example"):  # fmt: skip
        form = {"token": app.token, "action": "pause", "queue": "emails", "next": target}
        status, headers, _ = call(app, "/action", "POST", form)
        location = headers["Location"]
        assert status == "303 See Other" and location.startswith("/?note="), (target, location)
    form = {"token": app.token, "action": "resume", "queue": "emails", "next": "/messages?queue=emails"}
    assert call(app, "/action", "POST", form)[1]["Location"].startswith("/messages?queue=emails&note=")


# -- authentication --------------------------------------------------------------------------------------
def test_with_a_password_every_request_needs_it() -> None:
    # Given a dashboard with basic authentication as ops / pa:ss
    app = offline(actions=True, auth="ops:pa:ss")
    # When requests come without it, with a wrong one, or malformed
    for authorization in (None, basic("ops", "wrong"), basic("root", "pa:ss"), basic("ops", "pa:s"), "Basic !!!",
                          "Bearer pa:ss", "Basic " + base64.b64encode(b"ops:pa:ss\xff").decode(), "ops:pa:ss"):  # fmt: skip
        headers = {} if authorization is None else {"authorization": authorization}
        for path, method in (("/", "GET"), ("/metrics", "GET"), ("/action", "POST")):
            status, hdrs, body = call(app, path, method, **headers)
            # I expect 401, a challenge, and nothing else
            assert status == "401 Unauthorized", (authorization, path, status)
            assert hdrs["WWW-Authenticate"].startswith("Basic realm=") and app.token not in body
    # When the right one comes, I expect the request to go on
    assert call(app, "/nowhere", authorization=basic("ops", "pa:ss"))[0] == "404 Not Found"
    # The host is checked first: a rebinding page with the credentials still gets 400
    assert call(app, "/", host="evil.example", authorization=basic("ops", "pa:ss"))[0] == "400 Bad Request"


def test_with_a_token_any_user_name_or_a_bearer_header_carries_it() -> None:
    app = offline(auth="tok-9d2e")
    assert call(app, "/nowhere", authorization=basic("anyone", "tok-9d2e"))[0] == "404 Not Found"
    assert call(app, "/nowhere", authorization="Bearer tok-9d2e")[0] == "404 Not Found"
    assert call(app, "/nowhere", authorization="bearer tok-9d2e")[0] == "404 Not Found"
    for wrong in ("Bearer tok-9d2", "Bearer tok-9d2ee", basic("tok-9d2e", ""), "Bearer", ""):
        assert call(app, "/nowhere", authorization=wrong)[0] == "401 Unauthorized", wrong
    with pytest.raises(ValueError):
        offline(auth=" ")  # an empty secret is a mistake, not "no authentication"


def test_the_secret_is_never_rendered_or_logged(dramatiq_pg_broker: PostgresBroker, caplog: Any) -> None:
    broker = dramatiq_pg_broker
    queued_message(broker)
    app = dashboard_app(broker, actions=True, auth="ops:hunter2-secret")
    caplog.set_level(logging.DEBUG)
    for path in ("/", "/messages?queue=emails", "/metrics"):
        status, _, body = call(app, path, authorization=basic("ops", "hunter2-secret"))
        assert status == "200 OK" and "hunter2" not in body
    call(app, "/", authorization=basic("ops", "hunter2-secreT"))
    call(app, "/", host="evil.example", authorization=basic("ops", "hunter2-secret"))
    assert "hunter2" not in caplog.text and "hunter2" not in repr(app.__dict__)


# -- a real server ---------------------------------------------------------------------------------------
@contextmanager
def serving(app: Any, host: str = "127.0.0.1") -> Iterator[int]:
    server = make_dashboard_server(app, host, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def raw(port: int, request: bytes, address: str = "127.0.0.1") -> bytes:
    """Send *request* as these exact bytes; the whole answer."""
    with socket.create_connection((address, port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_real_server_answers_only_the_names_it_was_given(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    m = queued_message(broker)
    app = dashboard_app(broker, actions=True)
    with serving(app) as port:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.putrequest("GET", f"/message/{m.message_id}", skip_host=True)
            conn.putheader("Host", host)
            conn.endheaders()
            answer = conn.getresponse()
            assert answer.status == 200 and ARGUMENT in answer.read().decode(), host
        for request in (
            f"GET /message/{m.message_id} HTTP/1.1\r\nHost: evil.example:{port}\r\nConnection: close\r\n\r\n",
            f"GET /message/{m.message_id} HTTP/1.0\r\n\r\n",  # no Host at all
            "GET / HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
        ):
            answer = raw(port, request.encode())
            assert answer.startswith(b"HTTP/1.0 400 ") and ARGUMENT.encode() not in answer, answer[:200]
            assert app.token.encode() not in answer
        answer = raw(port, b"GET / HTTP/1.1\r\nHost: local\xffhost\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]


def test_a_server_bound_to_ipv6_loopback_answers_its_bracketed_name(dramatiq_pg_broker: PostgresBroker) -> None:
    app = dashboard_app(dramatiq_pg_broker)
    with serving(app, "::1") as port:
        assert raw(
            port, f"GET / HTTP/1.1\r\nHost: [::1]:{port}\r\nConnection: close\r\n\r\n".encode(), "::1"
        ).startswith(b"HTTP/1.0 200 ")
        assert raw(port, b"GET / HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n", "::1").startswith(
            b"HTTP/1.0 400 "
        )


def test_binding_beyond_loopback_with_actions_and_no_authentication_warns(
    dramatiq_pg_broker: PostgresBroker, caplog: Any
) -> None:
    broker = dramatiq_pg_broker
    caplog.set_level(logging.WARNING, logger="dramatiq_pg_fenced.dashboard")
    quiet = [
        (dashboard_app(broker, actions=True), "127.0.0.1"),
        (dashboard_app(broker, actions=False), "0.0.0.0"),
        (dashboard_app(broker, actions=True, auth="tok"), "0.0.0.0"),
    ]
    for app, address in quiet:
        make_dashboard_server(app, address, 0).server_close()
    assert not caplog.records
    make_dashboard_server(dashboard_app(broker, actions=True), "0.0.0.0", 0).server_close()
    (record,) = caplog.records
    assert record.levelno >= logging.WARNING and "\n" not in record.getMessage()
    assert "no authentication" in record.getMessage() and "0.0.0.0" in record.getMessage()


# -- the commands ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(port: int, host: str, authorization: str | None = None, path: str = "/") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", path, skip_host=True)
    conn.putheader("Host", host)
    if authorization:
        conn.putheader("Authorization", authorization)
    conn.endheaders()
    answer = conn.getresponse()
    answer.read()
    return answer.status


@contextmanager
def command(url: str, schema: str, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, list[str]]]:
    """Run ``dramatiq-pg-fenced ARGS`` until it says where it listens: (port, stderr lines so far)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "--schema", schema, *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        while " on http://" not in (lines[-1] if lines else ""):
            line = proc.stderr.readline()
            assert line, f"the command ended: {lines}"
            lines.append(line)
        port = int(lines[-1].rsplit(":", 1)[1].split("/")[0])
        yield port, lines
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_the_dashboard_command_takes_its_secret_from_a_file_or_the_environment(
    dramatiq_pg_url: str, dramatiq_pg_broker: PostgresBroker, tmp_path: Path
) -> None:
    schema = dramatiq_pg_broker.schema
    secret = tmp_path / "dashboard-auth"
    secret.write_text("ops:file-secret-51\n")
    ok, wrong = basic("ops", "file-secret-51"), basic("ops", "file-secret-5")
    with command(dramatiq_pg_url, schema, "dashboard", "--port", "0", "--auth-file", str(secret),
                 "--allow-host", "dash.example") as (port, lines):  # fmt: skip
        # a browser without credentials is sent to the login page; a wrong header gets 401
        assert status_of(port, f"127.0.0.1:{port}") == 303
        assert status_of(port, f"127.0.0.1:{port}", path="/login") == 200
        assert status_of(port, f"127.0.0.1:{port}", wrong) == 401
        assert status_of(port, f"127.0.0.1:{port}", ok) == 200
        assert status_of(port, "dash.example", ok) == 200
        assert status_of(port, "evil.example", ok) == 400
        assert "file-secret" not in "".join(lines)
    env = {"DRAMATIQ_PG_DASHBOARD_AUTH": "env-token-77"}
    with command(dramatiq_pg_url, schema, "dashboard", "--port", "0", env=env) as (port, lines):
        assert status_of(port, f"localhost:{port}") == 303
        assert status_of(port, f"localhost:{port}", "Bearer env-token-7") == 401
        assert status_of(port, f"localhost:{port}", "Bearer env-token-77") == 200
        assert "env-token" not in "".join(lines)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    # an empty file, a missing one, and a secret given as an argument (read as a file name, never echoed)
    for bad in (["--auth-file", str(empty)], ["--auth-file", str(tmp_path / "missing")], ["--auth", "cli-secret-3"]):
        done = subprocess.run(
            [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", dramatiq_pg_url, "--schema", schema,
             "dashboard", "--port", "0", *bad],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and "cli-secret" not in done.stderr, (bad, done.stderr)


def test_the_dashboard_command_warns_when_it_exposes_actions_without_authentication(
    dramatiq_pg_url: str, dramatiq_pg_broker: PostgresBroker
) -> None:
    schema = dramatiq_pg_broker.schema
    exposed = ("dashboard", "--host", "0.0.0.0", "--port", "0", "--actions")
    with command(dramatiq_pg_url, schema, *exposed) as (port, lines):
        warning = [line for line in lines if "no authentication" in line]
        assert len(warning) == 1 and "0.0.0.0" in warning[0], lines
        assert status_of(port, f"127.0.0.1:{port}") == 200
        assert status_of(port, f"evil.example:{port}") == 400
    with command(dramatiq_pg_url, schema, "dashboard", "--port", "0", "--actions") as (port, lines):
        assert not any("no authentication" in line for line in lines), lines


def test_the_metrics_server_answers_only_allowed_host_names(
    dramatiq_pg_url: str, dramatiq_pg_broker: PostgresBroker
) -> None:
    pytest.importorskip("prometheus_client")
    schema = dramatiq_pg_broker.schema
    port = free_port()
    with command(dramatiq_pg_url, schema, "metrics", "--port", str(port), "--allow-host", "metrics.example"):
        assert status_of(port, f"127.0.0.1:{port}", path="/metrics") == 200
        assert status_of(port, "metrics.example:9191", path="/metrics") == 200
        assert status_of(port, f"evil.example:{port}", path="/metrics") == 400
