"""The dashboard mounted under a path of another application (``SCRIPT_NAME``): its links,
forms and redirects stay under that path."""

from __future__ import annotations

import io
import re
import urllib.parse
from typing import Any

import dramatiq
import pytest

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.dashboard.render import static_name


def call(app: Any, path: str, method: str = "GET", form: dict[str, str] | None = None, script_name: str = ""):
    """One request through the WSGI app mounted at *script_name*: (status, headers, body)."""
    path, _, qs = path.partition("?")
    data = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "SCRIPT_NAME": script_name, "PATH_INFO": path, "QUERY_STRING": qs,
        "wsgi.input": io.BytesIO(data), "CONTENT_LENGTH": str(len(data)), "HTTP_HOST": "127.0.0.1:8080",
        "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "8080", "wsgi.url_scheme": "http",
    }  # fmt: skip
    seen: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body.decode()


def links(page: str) -> list[str]:
    """Every href and form action of *page*."""
    return re.findall(r'(?:href|action)="([^"]*)"', page)


@pytest.fixture
def queued(dramatiq_pg_broker: PostgresBroker) -> dramatiq.Message:
    @dramatiq.actor(broker=dramatiq_pg_broker, queue_name="emails")
    def send_email(to: str) -> None:
        pass

    return send_email.send("ann@example.com")


@pytest.mark.parametrize("script_name", ["/ops/queues", "/ops/queues/"])
def test_every_link_form_and_redirect_of_a_mounted_dashboard_stays_under_its_path(
    dramatiq_pg_broker: PostgresBroker, queued: dramatiq.Message, script_name: str
) -> None:
    # Given the dashboard mounted at /ops/queues (as Flask, Django or an ASGI mount pass it on)
    app = dashboard_app(dramatiq_pg_broker, actions=True)
    # When I open each page
    pages = [
        call(app, "/", script_name=script_name)[2],
        call(app, "/messages?queue=emails&state=queued", script_name=script_name)[2],
        call(app, f"/message/{queued.message_id}", script_name=script_name)[2],
    ]
    # I expect every link and form to point under the mount
    found = [link for page in pages for link in links(page)]
    assert f"/ops/queues/message/{queued.message_id}" in found
    assert "/ops/queues/action" in found and "/ops/queues/messages" in found and "/ops/queues/" in found
    assert all(link.startswith("/ops/queues/") for link in found), [x for x in found if not x.startswith("/ops/queues/")]
    # and an action to come back under it, while its form names the page inside the dashboard
    next_url = re.search(r'name="next" value="([^"]*)"', pages[2])
    assert next_url is not None and next_url[1] == f"/message/{queued.message_id}"
    form = {"token": app.token, "action": "cancel", "message_id": queued.message_id, "next": next_url[1]}
    status, headers, _ = call(app, "/action", "POST", form, script_name=script_name)
    assert status == "303 See Other"
    assert headers["Location"].startswith(f"/ops/queues/message/{queued.message_id}?note=")


def test_a_dashboard_not_mounted_keeps_its_links_at_the_root(
    dramatiq_pg_broker: PostgresBroker, queued: dramatiq.Message
) -> None:
    app = dashboard_app(dramatiq_pg_broker, actions=True)
    found = links(call(app, "/messages?queue=emails&state=queued")[2]) + links(call(app, "/")[2])
    assert f"/message/{queued.message_id}" in found and "/bulk" in found and "/messages" in found
    assert any(link.startswith("/confirm?") for link in found)  # the queues page's buttons ask first
    status, headers, _ = call(app, "/action", "POST", {"token": app.token, "action": "pause", "queue": "emails"})
    assert status == "303 See Other" and headers["Location"].startswith("/?note=")


@pytest.mark.parametrize("script_name", ["//evil.example", "/\\evil.example", "/ops\n/x", 'x"><script>'])
def test_a_mount_path_that_could_lead_off_the_site_is_ignored(
    dramatiq_pg_broker: PostgresBroker, queued: dramatiq.Message, script_name: str
) -> None:
    # Given a SCRIPT_NAME no mount makes (a server that took it from a header, say)
    app = dashboard_app(dramatiq_pg_broker, actions=True)
    # I expect neither a page nor a redirect to name it
    _, _, page = call(app, "/", script_name=script_name)
    assert "evil" not in page and all(link.startswith("/") for link in links(page))
    # the scripts are the package's own theme and poller, at the root
    assert re.findall(r"<script[^>]*>", page) == [
        f'<script src="/static/{static_name("theme.js")}">', f'<script src="/static/{static_name("live.js")}" defer>'
    ]
    status, headers, _ = call(
        app, "/action", "POST", {"token": app.token, "action": "pause", "queue": "emails"}, script_name=script_name
    )
    assert status == "303 See Other" and headers["Location"].startswith("/?note=")
