"""The web dashboard: a WSGI app over the operator's functions in :mod:`.admin`.

Pages: ``/`` (queues), ``/messages`` (a queue's messages by state, filtered by
actor, keyset pages), ``/message/<id>`` (one message), ``/metrics``
(Prometheus, when ``prometheus_client`` is installed).  Actions (cancel,
re-drive, pause, resume, purge) are ``POST /action`` forms, refused unless the
app was built with ``actions=True``.

Who may ask, checked before anything else runs: a request whose ``Host`` is not
one of the allowed host names gets 400 (a DNS-rebinding page names its own host,
and would otherwise read every page, arguments and form token included), then,
when the app has credentials (``auth``), one without them gets 401.  Cross-site
requests cannot act: every form carries a token made for this process (compared
in constant time), a form whose ``Origin`` is not an allowed host or whose
``Sec-Fetch-Site`` names another site is refused, and pages may not be framed.
Nothing of the connection string is ever rendered: the pages name the schema only.

Budget: every page runs a fixed number of indexed statements that stop early
(counts capped at :data:`COUNT_CAP` per priority, pages of :data:`PAGE_SIZE`
rows by keyset, an actor filter reads at most :data:`.admin.FILTER_WINDOW`
rows per page); none scans the message table.  Mount it in any WSGI server
(``gunicorn 'myapp:dashboard'``), or serve it with ``dramatiq-pg-fenced dashboard``.
Mounted under a path of another application, it reads that path from ``SCRIPT_NAME``
(as WSGI dispatchers and ASGI adapters set it) and keeps its links, forms and
redirects under it.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import html
import ipaddress
import json
import logging
import re
import secrets
import socket
import socketserver
import urllib.parse
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from . import admin
from .conditions import Condition
from .config import Settings
from .database import Database
from .sql import FINISHED_STATES, Statements, check_queue

#: Counts on the queues page stop here (shown as "10,000+").
COUNT_CAP = 10_000
PAGE_SIZE = 50
#: A purge's question counts the rows it deletes up to here (shown as "100,000+").
PURGE_COUNT_CAP = 100_000
ACTIONS = ("cancel", "redrive", "pause", "resume", "purge", "redrive_queue")
#: Always answered: no page of another site can be served from these names.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: Where the ``dashboard`` command reads its credentials unless given ``--auth-file``.
AUTH_ENV = "DRAMATIQ_PG_DASHBOARD_AUTH"

logger = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
Environ = dict[str, Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    # Not no-referrer: under it a browser sends "Origin: null" with our own forms, which a sandboxed
    # frame of any site sends too; same-origin keeps the origin for us and sends nothing elsewhere.
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]


class HTTPError(Exception):
    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class AllowedHosts:
    """The host names a request may be addressed to (its ``Host``) and a form may come from (its ``Origin``).

    A DNS-rebinding page is served from its own name, which then resolves to this
    host: the browser sends that name in ``Host`` and ``Origin`` and lets the page
    read the answers.  So both must name a host the operator listed, never merely
    each other.  Always allowed: :data:`LOOPBACK_HOSTS`.  Names compare without case
    and without a trailing dot; IPv6 addresses in brackets, in any spelling.  A name
    without a port matches any port (an SSH tunnel or a proxy may put the dashboard
    on another one); ``name:port`` only that port (a request without one means its
    scheme's default); ``.example.com`` matches example.com and its subdomains.
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._names = [_allowed_name(n) for n in (*LOOPBACK_HOSTS, *names)]

    def __repr__(self) -> str:
        return ", ".join(f"{h}:{p}" if p is not None else h for h, p in self._names)

    def allows(self, value: str, default_port: int) -> bool:
        """Whether *value* (``host[:port]``, as in ``Host``) is allowed; a malformed one never is."""
        parsed = _host_and_port(value)
        if parsed is None:
            return False
        host, port = parsed
        port = default_port if port is None else port
        return any(
            (host == name or (name.startswith(".") and (host == name[1:] or host.endswith(name))))
            and wanted in (None, port)
            for name, wanted in self._names
        )

    def allows_request(self, environ: Environ) -> bool:
        """Whether the request's ``Host`` is allowed (a request without one is not)."""
        default = 443 if environ.get("wsgi.url_scheme") == "https" else 80
        return self.allows(environ.get("HTTP_HOST") or "", default)

    def allows_origin(self, origin: str) -> bool:
        """Whether ``Origin`` (``scheme://host[:port]``) is an allowed host over HTTP(S); ``null`` is not."""
        match = re.fullmatch(r"(https?)://(.+)", origin)
        if match is None:
            return False
        return self.allows(match[2], 443 if match[1] == "https" else 80)


# host[:port]: a name of ASCII letters, digits, "-", "_" and dots, or an IPv6 address in brackets.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?")


def _host_and_port(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` as (canonical host, port or ``None``); ``None`` when it is no such thing."""
    match = _HOST.fullmatch(value)
    if match is None:
        return None
    port = int(match["port"]) if match["port"] else None
    if port is not None and port > 65535:
        return None
    if match["ipv6"]:
        try:
            return f"[{ipaddress.IPv6Address(match['ipv6']).compressed}]", port
        except ValueError:
            return None
    host = match["name"].lower()
    host = host[:-1] if host.endswith(".") else host
    if len(host) > 253 or "" in host.split("."):
        return None
    return host, port


def _allowed_name(name: str) -> tuple[str, int | None]:
    """An allowed host as given (``name``, ``name:port``, ``.domain``, an IPv6 address with or without brackets)."""
    name = name.strip()
    try:
        return f"[{ipaddress.IPv6Address(name).compressed}]", None
    except ValueError:
        pass
    domain = name.startswith(".")
    parsed = _host_and_port(name[1:] if domain else name)
    if parsed is None:
        raise ValueError(f"not a host name, host:port or .domain: {name!r}")
    host, port = parsed
    return ("." + host if domain else host), port


class Credentials:
    """The HTTP authentication a dashboard asks for: ``user:password`` (basic authentication), or a
    token (a colon-free secret: the password of basic authentication under any user name, or
    ``Authorization: Bearer TOKEN`` for scripts and Prometheus).  Compared in constant time.

    Basic authentication because a browser asks for it by itself and sends it on every request
    to the same origin (never to a rebinding page's: it is another origin).
    """

    def __init__(self, secret: str) -> None:
        secret = secret.strip()
        if not secret:
            raise ValueError("the dashboard's credentials are empty")
        self._token = ":" not in secret
        self._secret = secret.encode()

    def __repr__(self) -> str:
        return "Credentials(token)" if self._token else "Credentials(user:password)"

    def accept(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header carries these credentials."""
        scheme, _, value = authorization.strip().partition(" ")
        scheme, value = scheme.lower(), value.strip()
        if scheme == "bearer" and self._token:
            given = value.encode()
        elif scheme == "basic":
            try:
                decoded = base64.b64decode(value, validate=True).decode()
            except ValueError:  # not base64, or not UTF-8
                return False
            user, colon, password = decoded.partition(":")
            if not colon:
                return False
            given = password.encode() if self._token else decoded.encode()
        else:
            return False
        return hmac.compare_digest(given, self._secret)


class Dashboard:
    """The WSGI app.  Build it with :func:`dashboard_app` (from a broker) or from the parts.

    Parameters:
      database, statements, settings: the broker's (``broker.database``, ...).
      actions: allow cancel, re-drive, pause/resume and purge (off: read-only).
      ring: NOTIFY workers when a re-drive or resume makes messages due
        (default: as the broker's ``listen``).
      secret: derive the forms' token from it, so every process of a
        multi-process server (gunicorn workers, replicas) accepts the others'
        forms; ``None``: a random token made when the app is built (one process,
        or an app built before the server forks).
      allowed_hosts: the host names requests may be addressed to besides
        :data:`LOOPBACK_HOSTS` (see :class:`AllowedHosts`): the names people
        reach it by, or the ``Host`` your proxy passes on.  Others get 400.
      auth: require HTTP authentication: ``"user:password"`` or a token (see
        :class:`Credentials`); read it from a file or the environment, never
        from code or a command line.  ``None``: none (put the app behind yours).
      declared: the queues of the broker's actors, known before their first
        message (``dashboard_app`` passes the broker's).
      reader: where the pages and ``/metrics`` read (the broker's ``reader``: a
        replica's, with ``read_url``); actions always go to *database*.
    """

    def __init__(
        self,
        database: Database,
        statements: Statements,
        settings: Settings,
        *,
        actions: bool = False,
        ring: bool | None = None,
        secret: str | None = None,
        allowed_hosts: Iterable[str] = (),
        auth: str | None = None,
        declared: Callable[[], Iterable[str]] = tuple,
        reader: Database | None = None,
    ) -> None:
        self.database = database
        self.reader = reader or database
        self.statements = statements
        self.settings = settings
        self.actions = actions
        self.ring = settings.channel if (settings.listen if ring is None else ring) else None
        #: Forms carry it; a page of another site cannot read it.
        self.token = (
            hmac.new(secret.encode(), b"dramatiq-pg-fenced dashboard form", hashlib.sha256).hexdigest()
            if secret
            else secrets.token_urlsafe(32)
        )
        self.allowed_hosts = AllowedHosts(allowed_hosts)
        self.auth = Credentials(auth) if auth is not None else None
        #: The queues of the broker's actors (``dashboard_app``): known before their first message.
        self.declared = declared
        self._metrics: Any = None

    # -- WSGI --------------------------------------------------------------------
    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # Before any page, check or statement: a request for another host name (DNS
        # rebinding) or without the credentials learns nothing, the form token least of all.
        if not self.allowed_hosts.allows_request(environ):
            return _refuse_host(self.allowed_hosts, environ, start_response)
        if self.auth is not None and not self.auth.accept(environ.get("HTTP_AUTHORIZATION") or ""):
            challenge = ("WWW-Authenticate", 'Basic realm="dramatiq-pg-fenced dashboard", charset="UTF-8"')
            return _plain(start_response, "401 Unauthorized", "authentication required", challenge)
        root = _ROOT.set(_mount_path(environ))
        try:
            return self._answer(environ, start_response)
        finally:
            _ROOT.reset(root)

    def _answer(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        try:
            if method == "POST" and path == "/action":
                location = self.act(environ)
                start_response("303 See Other", [("Location", location), *_HEADERS])
                return [b""]
            if method not in ("GET", "HEAD"):
                raise HTTPError("405 Method Not Allowed", "method not allowed")
            query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", "")))
            if path == "/metrics":
                return self.metrics(start_response)
            if path == "/":
                body = self.queues_page(query)
            elif path == "/purge":
                body = self.purge_page(query)
            elif path == "/messages":
                body = self.messages_page(query)
            elif path.startswith("/message/"):
                body = self.message_page(path[len("/message/") :], query)
            else:
                raise HTTPError("404 Not Found", "no such page")
        except HTTPError as e:
            body, status = self.layout(e.status, f"<p class=error>{_e(e.text)}</p>"), e.status
        except ValueError as e:
            body, status = self.layout("Bad request", f"<p class=error>{_e(str(e))}</p>"), "400 Bad Request"
        except Exception:  # the log has it; the page names no server or URL
            logger.exception("Dashboard: %s %s failed", method, path)
            text = "The database could not answer (see the server's log)."
            body, status = self.layout("Unavailable", f"<p class=error>{text}</p>"), "503 Service Unavailable"
        else:
            status = "200 OK"
        data = body.encode()
        start_response(status, [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(data))),
                                *_HEADERS])  # fmt: skip
        return [data]

    def metrics(self, start_response: StartResponse) -> Iterable[bytes]:
        try:
            from . import metrics
        except ImportError as e:
            raise HTTPError("501 Not Implemented", str(e)) from None
        if self._metrics is None:
            self._metrics = metrics.registry(self.reader, self.statements)
        data = metrics.exposition(self._metrics)
        start_response("200 OK", [("Content-Type", metrics.CONTENT_TYPE), ("Content-Length", str(len(data)))])
        return [data]

    # -- actions -----------------------------------------------------------------
    def act(self, environ: Environ) -> str:
        """Check and perform one action; returns where to go next."""
        if not self.actions:
            raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
        self._same_origin(environ)
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        form = dict(urllib.parse.parse_qsl(environ["wsgi.input"].read(min(length, 10_000)).decode()))
        if not hmac.compare_digest(form.get("token", ""), self.token):
            raise HTTPError("403 Forbidden", "the form's token is missing or stale: reload the page")
        action = form.get("action", "")
        ring, db, st = self.ring, self.database, self.statements
        # A message's buttons carry the version its page showed: they act on that row only.
        message_id, seen = form.get("message_id", ""), form.get("seen") or None
        if action in ("pause", "resume", "purge", "redrive_queue"):
            admin.check_known(db, st, form.get("queue", ""), declared=self.declared())  # never a phantom queue (400, naming the known ones)
        if action == "cancel":
            outcome = admin.cancel(db, st, message_id, channel=self.settings.channel, seen=seen)
            note = f"cancel: {outcome.value}"
        elif action == "redrive":
            done = admin.redrive(db, st, [message_id], ring, seen=None if seen is None else {message_id: seen})
            note = "re-driven" if done.redriven else f"not re-driven: {'; '.join(done.skipped.values())}"
        elif action == "redrive_queue":
            again = FINISHED_STATES if form.get("state") == "all" else (form.get("state") or "dead",)
            done = admin.redrive_queue(db, st, form.get("queue", ""), again, ring, actor=form.get("actor") or None)
            note = f"re-driven: {len(done.redriven)}, skipped: {len(done.skipped)}"
        elif action == "pause":
            note = "paused" if admin.pause(db, st, form.get("queue", "")) else "was paused already"
        elif action == "resume":
            note = "resumed" if admin.resume(db, st, form.get("queue", ""), ring) else "was not paused"
        elif action == "purge":
            if form.get("confirm") != "yes":
                raise HTTPError(
                    "400 Bad Request", "a purge is confirmed on its page, which says how many rows it deletes"
                )
            state = form.get("state") or "dead"
            states = admin.PURGEABLE if state == "all" else (state,)
            deleted = admin.purge_queue(db, st, form.get("queue", ""), states, actor=form.get("actor") or None)
            note = "purged: " + ", ".join(f"{k} {v}" for k, v in deleted.items())
        else:
            raise HTTPError("400 Bad Request", f"unknown action {action!r}")
        logger.info("Dashboard action %s: %s", action, note)
        target = form.get("next", "/")
        if not _LOCAL_TARGET.fullmatch(target):
            target = "/"  # never a redirect elsewhere
        joiner = "&" if "?" in target else "?"
        return f"{_ROOT.get()}{target}{joiner}{urllib.parse.urlencode({'note': note})}"

    def _same_origin(self, environ: Environ) -> None:
        """Refuse a form another page posted (the token is the main guard; this is the second).

        ``Origin`` must be an allowed host, never compared with ``Host``: a rebinding
        page sets both to its own name.  ``null`` (a sandboxed frame, a file) is
        refused; so is ``Sec-Fetch-Site: same-site`` (a page of a sibling host, or of
        another port of this one).  A request without ``Origin`` (not a browser's, or a
        very old one) has only the token to pass.
        """
        if environ.get("HTTP_SEC_FETCH_SITE") in ("cross-site", "same-site"):
            raise HTTPError("403 Forbidden", "cross-site request refused")
        origin = environ.get("HTTP_ORIGIN")
        if origin is not None and not self.allowed_hosts.allows_origin(origin):
            raise HTTPError("403 Forbidden", "cross-origin request refused")

    def _form(self, action: str, label: str, fields: dict[str, str], next_url: str, extra: str = "") -> str:
        if not self.actions:
            return ""
        hidden = "".join(
            f'<input type=hidden name="{_e(k)}" value="{_e(v)}">'
            for k, v in {"token": self.token, "action": action, "next": next_url, **fields}.items()
        )
        return f'<form method=post action="{_ROOT.get()}/action" class=inline>{hidden}{extra}<button name=do value="{_e(action)}">{_e(label)}</button></form>'

    # -- pages -------------------------------------------------------------------
    def queues_page(self, query: dict[str, str]) -> str:
        queues = admin.overview(self.reader, self.statements, cap=COUNT_CAP + 1)
        heads = ["queue", "queued", "delayed", "running", "expired leases", "dead", "cancelled", "done 1 min",
                 "done 1 h", "dead 1 h", "stale writes", "oldest due", ""]  # fmt: skip
        rows = []
        for q in queues:
            name = q["queue"]
            link = _link("/messages", queue=name, state="queued")
            paused = " <span class=badge>paused</span>" if q["paused_since"] else ""
            actions = ""
            if self.actions:
                toggle = ("resume", "Resume") if q["paused_since"] else ("pause", "Pause")
                actions = (
                    self._form(toggle[0], toggle[1], {"queue": name}, "/")
                    + self._form("redrive_queue", "Re-drive dead", {"queue": name, "state": "dead"}, "/")
                    + _purge_question(name)
                )
            cells = [
                f'<a href="{link}">{_e(name)}</a>{paused}',
                _count(q["queued"]),
                _count(q["delayed"]),
                _count(q["running"]),
                _count(q["expired_leases"]),
                f'<a href="{_link("/messages", queue=name, state="dead")}">{_count(q["dead"])}</a>',
                f'<a href="{_link("/messages", queue=name, state="cancelled")}">{_count(q["cancelled"])}</a>',
                _count(q["done_last_minute"]),
                f'<a href="{_link("/messages", queue=name, state="done")}">{_count(q["done_last_hour"])}</a>',
                _count(q["dead_last_hour"]),
                _count(q["stale_writes"]),
                _age(q["oldest_due_seconds"]),
                actions,
            ]
            rows.append(cells)
        table = _table(heads, rows, cls="queues") if rows else "<p>No messages in any queue.</p>"
        note = f"<p class=note>Counts above {COUNT_CAP:,} show as {COUNT_CAP:,}+. Queued includes delayed messages (due later); running includes prefetched ones.</p>"
        return self.layout("Queues", _note(query) + table + note)

    def purge_page(self, query: dict[str, str]) -> str:
        """The question before a purge: how many rows of which states it deletes (counted now)."""
        if not self.actions:
            raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
        queue, state = query.get("queue", ""), query.get("state") or "dead"
        actor = query.get("actor", "").strip()
        admin.check_known(self.database, self.statements, queue, declared=self.declared())
        if state != "all" and state not in admin.PURGEABLE:
            raise ValueError(f"cannot purge state {state!r}: one of all, {', '.join(admin.PURGEABLE)}")
        states = admin.PURGEABLE if state == "all" else (state,)
        counts = admin.purge_counts(
            self.database, self.statements, queue, states, actor=actor or None, cap=PURGE_COUNT_CAP + 1
        )
        total = sum(counts.values())
        what = f"{_many(total)} {'' if state == 'all' else state + ' '}message{'' if total == 1 else 's'}"
        what += f" of queue {queue}" + (f" of actor {actor}" if actor else "")
        if state == "all":
            what += " (" + ", ".join(f"{s} {_many(n)}" for s, n in counts.items()) + ")"
        if not total:
            return self.layout("Purge", f'<p id=nothing>Nothing to purge: {_e(what)}.</p><p><a href="{_ROOT.get()}/">Back</a></p>')
        fields = {"queue": queue, "state": state, "actor": actor, "confirm": "yes"}
        body = (
            f"<p id=question>Delete {_e(what)}?</p>"
            "<p class=note>Counted just now; running messages are never deleted, and any that arrive meanwhile in "
            "these states are deleted too. This cannot be undone.</p>"
            f'<p class=actions>{self._form("purge", f"Delete {_many(total)}", fields, "/")} <a href="{_ROOT.get()}/">Cancel</a></p>'
        )
        return self.layout("Purge", body)

    def messages_page(self, query: dict[str, str]) -> str:
        queue = query.get("queue", "")
        state = query.get("state", "queued")
        actor = query.get("actor", "").strip()
        names = sorted(set(admin.known_queues(self.reader, self.statements)).union(self.declared()))
        if not queue and names:
            queue = names[0]
        if queue and queue not in names:
            raise HTTPError("404 Not Found", str(admin.unknown_queue(check_queue(queue), names)))
        options = "".join(f"<option{' selected' if n == queue else ''}>{_e(n)}</option>" for n in names)
        states = "".join(f"<option{' selected' if s == state else ''}>{s}</option>" for s in admin.LISTABLE)
        form = (
            f'<form method=get action="{_ROOT.get()}/messages" class=filters>'
            f"<label>queue <select name=queue id=queue>{options}</select></label> "
            f"<label>state <select name=state id=state>{states}</select></label> "
            f'<label>actor <input name=actor id=actor value="{_e(actor)}" placeholder="any"></label> '
            "<button id=filter>Filter</button></form>"
        )
        if not queue:
            return self.layout("Messages", form + "<p>No queues yet.</p>")
        check_queue(queue)
        page = admin.list_messages(
            self.reader, self.statements, queue, state, actor=actor or None, after=query.get("after"), limit=PAGE_SIZE
        )
        when = {"queued": "due", "running": "lease until", "done": "claimed"}.get(state, "due")
        heads = [
            "message",
            "actor",
            "state",
            "attempt",
            "priority",
            "enqueued",
            when,
            "finished",
            "holder",
            "last error",
        ]
        rows = [
            [
                f'<a href="{_ROOT.get()}/message/{_e(r["message_id"])}" class=mid>{_e(r["message_id"])}</a>',
                _e(r["actor_name"]),
                _e(r["state"])
                + (
                    f"<br><small class=note>{_e(admin.still_running_note(r['lease_holder'], r['running_since']))}</small>"
                    if r["still_running"]
                    else ""
                ),
                str(r["attempt"]),
                str(r["priority"]),
                _time(r["enqueued_at"], short=True),
                _time(r["at"], short=True),
                "" if r["still_running"] else _time(r["finished_at"], short=True),
                _e(r["lease_holder"] or ""),
                f"<span class=err>{_e(admin.error_summary(r['last_error'], limit=160))}</span>",
            ]
            for r in page.rows
        ]
        order = {
            "queued": "next to run first",
            "running": "newest first",
        }.get(state, "most recently finished first")
        body = form + f"<p class=note>{_e(queue)}, {_e(state)}: {order}; times in UTC.</p>"
        body += _table(heads, rows, cls="messages") if rows else "<p id=empty>No messages.</p>"
        if page.searched:
            body += (
                f"<p class=note id=searched>Searched {page.searched:,} messages for this actor; more may follow.</p>"
            )
        if page.next:
            body += f'<p><a id=next href="{_link("/messages", queue=queue, state=state, actor=actor, after=page.next)}">Next page</a></p>'
        if self.actions and rows:  # the bulk actions, on every message of this list (not only this page)
            these = f"{state} messages of {queue}" + (f" of actor {actor}" if actor else "")
            bulk = ""
            if state in FINISHED_STATES:
                fields = {"queue": queue, "state": state, "actor": actor}
                bulk += self._form("redrive_queue", f"Re-drive every {these}", fields, f"/messages?queue={queue}")
            if state in admin.PURGEABLE:
                link = _link("/purge", queue=queue, state=state, actor=actor)
                bulk += f'<a id=purge-these href="{link}">Purge every {_e(these)}…</a>'
            body += f"<p class=actions>{bulk}</p>" if bulk else ""
        return self.layout("Messages", _note(query) + body)

    def message_page(self, message_id: str, query: dict[str, str]) -> str:
        message_id = admin.check_message_id(urllib.parse.unquote(message_id))
        info = admin.inspect(self.reader, self.statements, message_id)
        if info is None:
            raise HTTPError("404 Not Found", f"no message {message_id} (unknown, or finished longer ago than kept)")
        here = f"/message/{message_id}"
        fields = [
            (
                "state",
                f"<span id=state>{_e(info['state'])}</span>"
                + (f" <span class=badge id=still-running>{_e(info['note'])}</span>" if info["still_running"] else ""),
            ),
            (
                "queue",
                f'<a href="{_link("/messages", queue=info["queue_name"], state=info["state"])}">{_e(info["queue_name"])}</a>',
            ),
            ("actor", _e(info["actor_name"])),
            ("attempt", f"{info['attempt']} (deliveries so far)"),
            ("retries", _e(str(info.get("retries")))),
            ("priority", str(info["priority"])),
            ("enqueued", _time(info["enqueued_at"])),
            ("due", _time(info["available_at"])),
            ("claimed", _time(info["claimed_at"])),
            ("lease until", _time(info["lease_expires_at"])),
            ("lease holder", _e(info["lease_holder"] or "")),
            ("cancel requested" if info["still_running"] else "finished", _time(info["finished_at"])),
            ("ran", _age(info["ran_seconds"])),
        ]
        if info.get("unique_key") is not None:
            fields.append(("unique key", f"{_e(info['unique_key'])} (unique_until={_e(info['unique_until'])})"))
        body = _note(query) + "<table class=fields>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in fields)
        body += "</table>"
        if "decode_error" in info:
            body += f"<p class=error>Payload not decodable here: {_e(info['decode_error'])}</p>"
        else:
            body += "<h2>Arguments</h2><pre id=args>" + _e(_json({"args": info["args"], "kwargs": info["kwargs"]}))
            body += "</pre><h2>Options</h2><pre>" + _e(_json(info["options"])) + "</pre>"
        if info["last_error"]:
            body += f"<h2>Last error</h2><p class=err id=error>{_e(info['error'])}</p>"
            body += f"<pre class=err>{_e(info['last_error'])}</pre>"
        if info["history"]:
            heads = ["finished", "attempt", "holder", "ran"]
            rows = [[_time(h["finished_at"]), str(h["attempt"]), _e(h["lease_holder"] or ""), _age(h["ran_seconds"])]
                    for h in info["history"]]  # fmt: skip
            body += "<h2>History</h2>" + _table(heads, rows)
        if self.actions:
            buttons = ""
            shown = {"message_id": message_id, "seen": info["version"]}
            if info["state"] in ("queued", "running"):
                buttons += self._form("cancel", "Cancel", shown, here)
            if info["state"] in FINISHED_STATES and not info["still_running"]:  # not while its actor runs
                buttons += self._form("redrive", "Re-drive", shown, here)
            body += f"<p class=actions>{buttons}</p>" if buttons else ""
        return self.layout(f"Message {message_id}", body)

    def layout(self, title: str, body: str) -> str:
        mode = "actions on" if self.actions else "read-only"
        root = _ROOT.get()
        return f"""<!doctype html><html lang=en><head><meta charset=utf-8>
<meta name=viewport content="width=device-width, initial-scale=1"><title>{_e(title)} · dramatiq-pg-fenced</title>
<style>{_CSS}</style></head><body>
<header><b>dramatiq-pg-fenced</b> <span class=schema>schema {_e(self.settings.schema)}</span>
<nav><a href="{root}/">Queues</a> <a href="{root}/messages">Messages</a> <a href="{root}/metrics">Metrics</a></nav>
<span class=mode>{mode}</span></header>
<main><h1>{_e(title)}</h1>{body}</main></body></html>"""


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{display:flex;gap:1.5em;align-items:center;padding:.6em 1.2em;background:#1d2330;color:#fff}
header a{color:#cfe0ff;margin-right:1em;text-decoration:none}header .mode{margin-left:auto;opacity:.8}
.schema{opacity:.7}main{padding:1em 1.2em}h1{font-size:1.3em;margin:.2em 0 .8em}h2{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse;background:#fff;box-shadow:0 1px 2px #0002}
th,td{padding:.35em .7em;border-bottom:1px solid #e4e7ec;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}td{font-variant-numeric:tabular-nums}
table.fields th{width:9em}.badge{background:#f0b429;color:#000;border-radius:3px;padding:0 .4em;font-size:.85em}
.err{color:#b42318}pre{background:#fff;padding:.7em;overflow:auto;max-width:100%;box-shadow:0 1px 2px #0002}
pre.err{white-space:pre-wrap}.note{color:#5b6476}.error{color:#b42318;font-weight:600}
.flash{background:#e7f5ec;border-left:4px solid #2f9e5b;padding:.4em .8em}
form.inline{display:inline-block;margin:0 .3em .2em 0}.filters{margin-bottom:1em}
button{cursor:pointer}a.mid{font-family:ui-monospace,monospace;font-size:.92em}
a.mid,time{white-space:nowrap}table.messages{font-size:13px}table.messages td,table.messages th{padding:.35em .5em}
.err{overflow-wrap:anywhere}
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _link(path: str, **params: str) -> str:
    return _e(f"{_ROOT.get()}{path}?{urllib.parse.urlencode({k: v for k, v in params.items() if v})}")


def _note(query: dict[str, str]) -> str:
    note = query.get("note")
    return f"<p class=flash id=flash>{_e(note)}</p>" if note else ""


def _purge_question(queue: str) -> str:
    """The queues page's purge control: it asks first (:meth:`Dashboard.purge_page`); dead letters by default."""
    options = "".join(f"<option{' selected' if s == 'dead' else ''}>{s}</option>" for s in (*_PURGE_ORDER, "all"))
    return (
        f'<form method=get action="{_ROOT.get()}/purge" class=inline><input type=hidden name=queue value="{_e(queue)}">'
        f'<select name=state aria-label="state to purge">{options}</select><button>Purge…</button></form>'
    )


#: The purge control's states, the least harmful first.
_PURGE_ORDER = ("dead", "cancelled", "done", "queued")


def _many(n: int) -> str:
    return f"{PURGE_COUNT_CAP:,}+" if n > PURGE_COUNT_CAP else f"{n:,}"


def _count(n: int | None) -> str:
    if n is None:
        return ""
    return f"{COUNT_CAP:,}+" if n > COUNT_CAP else f"{n:,}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _time(value: datetime | None, short: bool = False) -> str:
    """A time in UTC; *short* (in lists) without the year, the full time as its tooltip."""
    if value is None:
        return ""
    utc = value.astimezone(timezone.utc)
    full = utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    if not short:
        return _e(full)
    return f'<time title="{_e(full)}">{_e(utc.strftime("%m-%d %H:%M:%S"))}</time>'


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, default=repr, ensure_ascii=False)


def _table(heads: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table class={cls or 'plain'}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


#: Where an action may send the browser next: a path here.  Printable ASCII only (browsers drop tabs
#: and newlines), no backslash (browsers read it as a slash), and no second slash first ("//host").
_LOCAL_TARGET = re.compile(r"/(?![/\\])[!-\[\]-~]*")

#: Where this request's dashboard is mounted (``SCRIPT_NAME`` without its last slash): every link,
#: form and redirect starts with it.  Per request: one app may be reached under several mounts.
_ROOT: contextvars.ContextVar[str] = contextvars.ContextVar("dashboard_root", default="")


def _mount_path(environ: Environ) -> str:
    """``SCRIPT_NAME`` as a prefix for our paths; ``""`` when absent or not a plain local path
    (quotes, ``<``, ``>``, ``&`` or a leading ``//`` could lead a link or a redirect elsewhere)."""
    mount = (environ.get("SCRIPT_NAME") or "").rstrip("/")
    if not mount or not _LOCAL_TARGET.fullmatch(mount) or any(c in mount for c in "\"'<>&"):
        return ""
    return mount


_refused_hosts = Condition(logger, "Dashboard: refusing requests for host names not allowed", interval=600.0)


def _plain(start_response: StartResponse, status: str, text: str, *headers: tuple[str, str]) -> list[bytes]:
    data = f"{status}: {text}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                            *headers, *_HEADERS])  # fmt: skip
    return [data]


def _refuse_host(allowed: AllowedHosts, environ: Environ, start_response: StartResponse) -> list[bytes]:
    """400, naming nothing of this server; the log says which name was refused, now and then."""
    host = environ.get("HTTP_HOST")
    _refused_hosts.hit(f"{(host or '')[:100]!r} (allowed: {allowed!r}; add it with allowed_hosts= or --allow-host)")
    return _plain(start_response, "400 Bad Request", "this host name is not one this server answers to")


def host_checked(app: WSGIApp, allowed_hosts: AllowedHosts) -> WSGIApp:
    """*app*, answering 400 to a request whose ``Host`` is not allowed (the metrics server is so wrapped)."""

    def checked(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if not allowed_hosts.allows_request(environ):
            return _refuse_host(allowed_hosts, environ, start_response)
        return app(environ, start_response)

    return checked


def dashboard_app(
    broker: Any,
    *,
    actions: bool = False,
    ring: bool | None = None,
    secret: str | None = None,
    allowed_hosts: Iterable[str] = (),
    auth: str | None = None,
) -> Dashboard:
    """The dashboard over *broker*'s database and schema (a ``PostgresBroker``): a WSGI app to mount."""
    return Dashboard(
        broker.database,
        broker.statements,
        broker.settings,
        actions=actions,
        ring=ring,
        secret=secret,
        allowed_hosts=allowed_hosts,
        auth=auth,
        declared=broker.get_declared_queues,
        reader=getattr(broker, "reader", None),
    )


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)


def make_dashboard_server(app: WSGIApp, host: str = "127.0.0.1", port: int = 8080) -> WSGIServer:
    """A threaded WSGI server for *app*, the dashboard or another (``serve_forever()`` it; ``port=0``
    picks a free one; an IPv6 *host* binds IPv6).

    A dashboard with actions and no credentials bound beyond loopback is one any host that
    reaches it can purge: that is said once, at WARNING, when the server is made.
    """
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = _Server6 if family == socket.AF_INET6 else _Server
    server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    address = str(server.server_address[0])
    if isinstance(app, Dashboard) and app.actions and app.auth is None and not _loopback(address):
        logger.warning(
            "Dashboard on %s with actions on and no authentication: anyone who can reach this address can cancel, "
            "re-drive and purge messages (give it credentials: --auth-file, $%s or auth=; or bind 127.0.0.1)",
            netloc(address, server.server_port),
            AUTH_ENV,
        )
    return server


def netloc(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
