"""The dashboard's WSGI app: routing, the guards in order, the actions and the pages over :mod:`..admin`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import urllib.parse
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

from .. import admin, bulk
from ..config import Settings
from ..database import Database
from ..fleet import Fleet, Site
from ..sql import FINISHED_STATES, Statements, check_queue
from .bulk_pages import LABELS, audit_page, bulk_page, request_ids, selection
from .console_pages import charts_page, processes_page, search_page
from .guards import AllowedHosts, Credentials, Sessions, plain, refuse_host
from .render import (
    COUNT_CAP,
    LOCAL_TARGET,
    PAGE_SIZE,
    PURGE_COUNT_CAP,
    ROOT,
    SECURITY_HEADERS,
    Environ,
    HTTPError,
    StartResponse,
    age_text,
    away_note,
    count_text,
    esc,
    flash_note,
    href,
    html_table,
    many_text,
    mount_path,
    pretty_json,
    purge_question,
    read_form,
    static_file,
    static_name,
    utc_time,
)
from .schedule_pages import schedules_page

ACTIONS = ("cancel", "redrive", "pause", "resume", "purge", "redrive_queue", "bulk")
#: The header's links: (path, name).
PAGES = (("/", "Queues"), ("/messages", "Messages"), ("/search", "Search"), ("/charts", "Charts"), ("/processes", "Processes"),
         ("/schedules", "Schedules"), ("/audit", "Audit"), ("/metrics", "Metrics"))  # fmt: skip

logger = logging.getLogger(__package__)


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
      login: with *auth*, a browser without credentials gets a login page
        (user and password, or the token as the password) and then a signed
        session cookie (:class:`.guards.Sessions`, keyed on *secret*); scripts
        still send ``Authorization``.  Off: HTTP basic authentication's prompt.
      live: seconds between the pages' updates in place (``static/live.js``);
        0: none.
      fleet: several databases instead of *database*, *statements*, *settings*, *reader* and
        *declared* (a :class:`~..fleet.Fleet`; ``dashboard_app`` makes it from a ``RoutedBroker``):
        every page shows each database's rows, each naming its database, and every action goes to
        the message's or the queue's database.
    """

    def __init__(
        self,
        database: Database | None = None,
        statements: Statements | None = None,
        settings: Settings | None = None,
        *,
        actions: bool = False,
        ring: bool | None = None,
        secret: str | None = None,
        allowed_hosts: Iterable[str] = (),
        auth: str | None = None,
        declared: Callable[[], Iterable[str]] = tuple,
        reader: Database | None = None,
        login: bool = False,
        live: float = 5.0,
        fleet: Fleet | None = None,
    ) -> None:
        if fleet is None:
            if database is None or statements is None or settings is None:
                raise TypeError("Dashboard takes database, statements and settings, or fleet=")
            fleet = Fleet([Site("", database, reader or database, statements, settings, declared)])
        #: The databases shown (one, named "", unless made from a ``RoutedBroker`` or several URLs).
        self.fleet = fleet
        first = fleet.sites[0]
        self.database, self.reader, self.statements, self.settings = (
            first.database, first.reader, first.statements, first.settings
        )
        self.actions = actions
        self._ring = ring
        self.ring = self.ring_of(first)
        #: Forms carry it; a page of another site cannot read it.
        self.token = (
            hmac.new(secret.encode(), b"dramatiq-pg-fenced dashboard form", hashlib.sha256).hexdigest()
            if secret
            else secrets.token_urlsafe(32)
        )
        self.allowed_hosts = AllowedHosts(allowed_hosts)
        self.auth = Credentials(auth) if auth is not None else None
        self.sessions = Sessions(self.auth, secret) if self.auth is not None and login else None
        self.live = live
        #: The queues of the broker's actors (``dashboard_app``): known before their first message.
        self.declared = first.declared
        self._metrics: Any = None

    # -- WSGI --------------------------------------------------------------------
    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # Before any page, check or statement: a request for another host name (DNS
        # rebinding) or without the credentials learns nothing, the form token least of all.
        if not self.allowed_hosts.allows_request(environ):
            return refuse_host(self.allowed_hosts, environ, start_response)
        path = environ.get("PATH_INFO") or "/"
        if path.startswith("/static/"):  # the package's own style and script: no secret in them
            return static_file(path[len("/static/") :], start_response)
        root = ROOT.set(mount_path(environ))
        try:
            if self.auth is not None and not self.auth.accept(environ.get("HTTP_AUTHORIZATION") or ""):
                # Wrong credentials sent by a script (or no login page): 401, never the login page.
                if self.sessions is None or environ.get("HTTP_AUTHORIZATION"):
                    challenge = ("WWW-Authenticate", 'Basic realm="dramatiq-pg-fenced dashboard", charset="UTF-8"')
                    return plain(start_response, "401 Unauthorized", "authentication required", challenge)
                user = self.sessions.from_request(environ)
                if user is None:
                    return self.login(environ, start_response)
                environ = {**environ, "dramatiq_pg.user": user or "(token)"}
                if path == "/logout":
                    return self.logout(environ, start_response)
            return self._answer(environ, start_response)
        finally:
            ROOT.reset(root)

    # -- login (served alone, with credentials and login=True) ----------------------
    def login(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """A request without credentials: the login page, or the login itself (``POST /login``)."""
        assert self.auth is not None and self.sessions is not None
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", "")))
        wanted = query.get("next", "/")
        if path != "/login" or method not in ("GET", "HEAD", "POST"):
            if method not in ("GET", "HEAD") or environ.get("HTTP_X_DASHBOARD_LIVE"):
                return plain(start_response, "401 Unauthorized", "log in first")
            there = path + ("?" + environ["QUERY_STRING"] if environ.get("QUERY_STRING") else "")
            location = f"{ROOT.get()}/login?{urllib.parse.urlencode({'next': there})}"
            start_response("303 See Other", [("Location", location), *SECURITY_HEADERS])
            return [b""]
        failed = user = ""
        if method == "POST":
            try:
                self._same_origin(environ)  # no other site logs a browser in (to its own account, say)
            except HTTPError as e:
                return plain(start_response, e.status, e.text)
            form = read_form(environ)
            wanted = form.get("next", "/")
            if self.auth.check(form.get("user", ""), form.get("password", "")):
                logger.info("Dashboard: login of %r", form.get("user", ""))
                target = wanted if LOCAL_TARGET.fullmatch(wanted) else "/"
                cookie = self.sessions.set_cookie(self.sessions.issue(form.get("user", "")), environ, ROOT.get() or "/")
                start_response("303 See Other", [("Location", ROOT.get() + target), cookie, *SECURITY_HEADERS])
                return [b""]
            logger.warning("Dashboard: refused a login of %r", form.get("user", "")[:100])
            failed = "<p class=error id=refused>Wrong user name or password.</p>"
            user = form.get("user", "")
        body = (
            f'{failed}<form method=post action="{ROOT.get()}/login" class=login>'
            f'<input type=hidden name=next value="{esc(wanted)}">'
            f'<label>User <input name=user id=user autocomplete=username value="{esc(user)}"></label>'
            "<label>Password or token <input type=password name=password id=password "
            "autocomplete=current-password required></label><button id=login>Log in</button></form>"
        )
        data = self.layout("Log in", body, nav=False).encode()
        status = "401 Unauthorized" if failed else "200 OK"
        start_response(status, [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(data))),
                                *SECURITY_HEADERS])  # fmt: skip
        return [data]

    def logout(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """``POST /logout`` with the form token: the browser's session cookie cleared."""
        assert self.sessions is not None
        if environ.get("REQUEST_METHOD") != "POST":
            return plain(start_response, "405 Method Not Allowed", "log out with the page's button")
        try:
            self._same_origin(environ)
        except HTTPError as e:
            return plain(start_response, e.status, e.text)
        if not hmac.compare_digest(read_form(environ).get("token", ""), self.token):
            return plain(start_response, "403 Forbidden", "the form's token is missing or stale: reload the page")
        cookie = self.sessions.clear_cookie(environ, ROOT.get() or "/")
        start_response("303 See Other", [("Location", f"{ROOT.get()}/login"), cookie, *SECURITY_HEADERS])
        return [b""]

    def _answer(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        try:
            if method == "POST" and path == "/action":
                location = self.act(environ)
                start_response("303 See Other", [("Location", location), *SECURITY_HEADERS])
                return [b""]
            if method not in ("GET", "HEAD"):
                raise HTTPError("405 Method Not Allowed", "method not allowed")
            query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", "")))
            if path == "/metrics":
                return self.metrics(start_response)
            if path == "/login" and self.sessions is not None:  # logged in already: where it was going
                target = query.get("next", "/")
                target = target if LOCAL_TARGET.fullmatch(target) else "/"
                start_response("303 See Other", [("Location", ROOT.get() + target), *SECURITY_HEADERS])
                return [b""]
            if path == "/":
                body = self.queues_page(query)
            elif path == "/purge":
                body = self.purge_page(query)
            elif path == "/messages":
                body = self.messages_page(query)
            elif path == "/search":
                found = search_page(self.fleet, self.queue_names(), query, actions=self.actions)
                body = self.layout("Search", found)
            elif path == "/bulk":
                if not self.actions:
                    raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
                ids = request_ids(environ.get("QUERY_STRING", ""))
                body = self.layout("Bulk action", bulk_page(self._bulk_targets, query, ids, self._form))
            elif path == "/audit":
                body = self.layout("Audit log", flash_note(query) + audit_page(self.fleet, query))
            elif path == "/charts":
                body = self.layout("Charts", charts_page(self.fleet, self.queue_names(), query))
            elif path == "/processes":
                body = self.layout("Processes", processes_page(self.fleet))
            elif path == "/schedules":
                title, content = schedules_page(self.fleet, query)
                body = self.layout(title, content)
            elif path.startswith("/message/"):
                body = self.message_page(path[len("/message/") :], query)
            else:
                raise HTTPError("404 Not Found", "no such page")
        except HTTPError as e:
            body, status = self.layout(e.status, f"<p class=error>{esc(e.text)}</p>"), e.status
        except ValueError as e:
            body, status = self.layout("Bad request", f"<p class=error>{esc(str(e))}</p>"), "400 Bad Request"
        except Exception:  # the log has it; the page names no server or URL
            logger.exception("Dashboard: %s %s failed", method, path)
            text = "The database could not answer (see the server's log)."
            body, status = self.layout("Unavailable", f"<p class=error>{text}</p>"), "503 Service Unavailable"
        else:
            status = "200 OK"
        data = body.encode()
        start_response(status, [("Content-Type", "text/html; charset=utf-8"), ("Content-Length", str(len(data))),
                                *SECURITY_HEADERS])  # fmt: skip
        return [data]

    def metrics(self, start_response: StartResponse) -> Iterable[bytes]:
        try:
            from .. import metrics
        except ImportError as e:
            raise HTTPError("501 Not Implemented", str(e)) from None
        if self._metrics is None:  # of several databases: each sample labelled with its database
            self._metrics = self.fleet.metrics_registry()
        data = metrics.exposition(self._metrics)
        start_response("200 OK", [("Content-Type", metrics.CONTENT_TYPE), ("Content-Length", str(len(data)))])
        return [data]

    # -- actions -----------------------------------------------------------------
    def act(self, environ: Environ) -> str:
        """Check and perform one action; returns where to go next."""
        if not self.actions:
            raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
        self._same_origin(environ)
        form = read_form(environ)
        if not hmac.compare_digest(form.get("token", ""), self.token):
            raise HTTPError("403 Forbidden", "the form's token is missing or stale: reload the page")
        action = form.get("action", "")
        # A message's buttons carry the version its page showed: they act on that row only.
        message_id, seen = form.get("message_id", ""), form.get("seen") or None
        named = form.get("database") or None
        site = self.fleet.sites[0]
        if action in ("pause", "resume", "purge", "redrive_queue"):
            # Never a phantom queue (400, naming the known ones); the queue's database (its route, or where known).
            site = self.fleet.queue_site(form.get("queue", ""), database=named)
        elif action in ("cancel", "redrive"):
            site = self._message_site(admin.check_message_id(message_id), named)
        ring, db, st = self.ring_of(site), site.database, site.statements
        if action == "cancel":
            outcome = admin.cancel(db, st, message_id, channel=site.settings.channel, seen=seen)
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
        elif action == "bulk":
            if form.get("confirm") != "yes":
                raise HTTPError(
                    "400 Bad Request", "a bulk action is confirmed on its page, which says how many it touches"
                )
            what = form.get("bulk_action", "")
            if what not in bulk.ACTIONS:
                raise ValueError(f"unknown bulk action {what!r}: one of {', '.join(bulk.ACTIONS)}")
            chosen = selection(form, [i for i in form.get("ids", "").split(",") if i])
            notes = []
            for where, label, mine in self._bulk_targets(chosen, acting=what):
                # Each database's audit row is written in that database, by the action that touched it.
                result = bulk.bulk(where.database, where.statements, what, who=self.who(environ),
                                   channel=where.settings.channel, listen=self.ring_of(where) is not None,
                                   **mine)  # fmt: skip
                notes.append(
                    f"{result.touched} touched of {result.previewed} counted, {len(result.skipped)} skipped "
                    f"(audit #{result.audit_id}{' in ' + label if label else ''})"
                )
            note = f"{LABELS[what]}: " + ("; ".join(notes) or "nothing to act on in any database")
            if self.fleet.several and "ids" in chosen:  # ids no database holds (unknown, or finished)
                _, missing = self.fleet.holders(chosen["ids"])
                note += f"; {len(missing)} in no database" if missing else ""
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
        if self.fleet.several and action != "bulk":
            note += f" ({site.label})"
        logger.info("Dashboard action %s: %s", action, note)
        target = form.get("next", "/")
        if not LOCAL_TARGET.fullmatch(target):
            target = "/"  # never a redirect elsewhere
        joiner = "&" if "?" in target else "?"
        return f"{ROOT.get()}{target}{joiner}{urllib.parse.urlencode({'note': note})}"

    def ring_of(self, site: Site) -> str | None:
        """The NOTIFY channel a re-drive or resume in *site* rings (``None``: no ring)."""
        listen = site.settings.listen if self._ring is None else self._ring
        return site.settings.channel if listen else None

    def _reading_site(self, queue: str, named: str | None) -> Site:
        """Whose messages of *queue* a page lists: the database named, else the queue's (its route), else
        the first that knows it (a queue of no route, or known in several, is still shown)."""
        try:
            return self.fleet.queue_site(queue, database=named, create=True)
        except ValueError:
            if named is not None:
                raise
            return next((s for s in self.fleet if queue in s.known_queues()), self.fleet.sites[0])

    def _message_site(self, message_id: str, named: str | None) -> Site:
        """Where an action on a message goes: the database its form names, else the one holding it."""
        if named is not None or not self.fleet.several:
            return self.fleet.site(named or "")
        held, _ = self.fleet.holders([message_id])
        return self.fleet.site(next(iter(held))) if held else self.fleet.sites[0]

    def _bulk_targets(
        self, chosen: dict[str, Any], acting: str | None = None
    ) -> list[tuple[Site, str, dict[str, Any]]]:
        """A bulk selection per database, as (site, its label, its selection): ids go to the database
        holding each, a filter to every database.  *acting* (the action about to run): only the databases
        where it touches something, so that an audit row is written where the action touched."""
        if not self.fleet.several:
            return [(self.fleet.sites[0], "", chosen)]
        if "ids" in chosen:
            held, _ = self.fleet.holders(chosen["ids"])
            return [(self.fleet.site(name), self.fleet.site(name).label, {"ids": ids}) for name, ids in held.items()]
        targets = [(site, site.label, chosen) for site in self.fleet]
        if acting is not None:
            targets = [t for t in targets if bulk.bulk_preview(t[0].database, t[0].statements, acting, **chosen).count]
        return targets

    def who(self, environ: Environ) -> str:
        """Who acts, for the audit log: the login's user, the web server's ``REMOTE_USER`` (an application's
        login, mounted), the user of basic authentication, else where the request came from."""
        user = environ.get("dramatiq_pg.user") or environ.get("REMOTE_USER")
        if user:
            return str(user)[:200]
        scheme, _, value = (environ.get("HTTP_AUTHORIZATION") or "").partition(" ")
        if self.auth is not None and scheme.lower() == "basic":
            try:
                name = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
            except ValueError:
                name = ""
            return (name or "(basic)")[:200]
        if self.auth is not None:
            return "(token)"
        return f"(no login) {environ.get('REMOTE_ADDR') or 'unknown'}"

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
            f'<input type=hidden name="{esc(k)}" value="{esc(v)}">'
            for k, v in {"token": self.token, "action": action, "next": next_url, **fields}.items()
        )
        return f'<form method=post action="{ROOT.get()}/action" class=inline>{hidden}{extra}<button name=do value="{esc(action)}">{esc(label)}</button></form>'

    # -- pages -------------------------------------------------------------------
    def queues_page(self, query: dict[str, str]) -> str:
        several = self.fleet.several
        read, away = self.fleet.each(lambda site: admin.overview(site.reader, site.statements, cap=COUNT_CAP + 1))
        queues = [(site, q) for site, found in read for q in found]
        heads = ["queue", "queued", "delayed", "running", "prefetched", "expired leases", "dead", "cancelled", "done 1 min",
                 "done 1 h", "dead 1 h", "stale writes", "oldest due", ""]  # fmt: skip
        if several:
            heads.insert(0, "database")
        rows = []
        for site, q in queues:
            name, db = q["queue"], site.name
            where = {"database": db} if db else {}
            link = href("/messages", queue=name, state="queued", database=db)
            paused = " <span class=badge>paused</span>" if q["paused_since"] else ""
            actions = ""
            if self.actions:
                toggle = ("resume", "Resume") if q["paused_since"] else ("pause", "Pause")
                actions = (
                    self._form(toggle[0], toggle[1], {"queue": name, **where}, "/")
                    + self._form("redrive_queue", "Re-drive dead", {"queue": name, "state": "dead", **where}, "/")
                    + purge_question(name, db)
                )
            cells = [
                f'<a href="{link}">{esc(name)}</a>{paused}',
                count_text(q["queued"]),
                count_text(q["delayed"]),
                count_text(q["running"]),
                f'<a href="{ROOT.get()}/processes">{count_text(q["prefetched"])}</a>' if q["prefetched"] else "0",
                count_text(q["expired_leases"]),
                f'<a href="{href("/messages", queue=name, state="dead", database=db)}">{count_text(q["dead"])}</a>',
                f'<a href="{href("/messages", queue=name, state="cancelled", database=db)}">{count_text(q["cancelled"])}</a>',
                count_text(q["done_last_minute"]),
                f'<a href="{href("/messages", queue=name, state="done", database=db)}">{count_text(q["done_last_hour"])}</a>',
                count_text(q["dead_last_hour"]),
                count_text(q["stale_writes"]),
                age_text(q["oldest_due_seconds"]),
                actions,
            ]
            rows.append([f"<span class=database>{esc(db)}</span>", *cells] if several else cells)
        table = html_table(heads, rows, cls="queues") if rows else "<p>No messages in any queue.</p>"
        table = away_note(away) + table
        note = f"<p class=note>Counts above {COUNT_CAP:,} show as {COUNT_CAP:,}+. Queued includes delayed messages (due later). Running: claimed and its actor started; prefetched: claimed, waiting in a worker's prefetch (as of the workers' last heartbeats, see Processes).</p>"
        return self.layout("Queues", flash_note(query) + table + note)

    def purge_page(self, query: dict[str, str]) -> str:
        """The question before a purge: how many rows of which states it deletes (counted now)."""
        if not self.actions:
            raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
        queue, state = query.get("queue", ""), query.get("state") or "dead"
        actor = query.get("actor", "").strip()
        site = self.fleet.queue_site(queue, database=query.get("database") or None)
        if state != "all" and state not in admin.PURGEABLE:
            raise ValueError(f"cannot purge state {state!r}: one of all, {', '.join(admin.PURGEABLE)}")
        states = admin.PURGEABLE if state == "all" else (state,)
        counts = admin.purge_counts(
            site.database, site.statements, queue, states, actor=actor or None, cap=PURGE_COUNT_CAP + 1
        )
        total = sum(counts.values())
        what = f"{many_text(total)} {'' if state == 'all' else state + ' '}message{'' if total == 1 else 's'}"
        what += f" of queue {queue}" + (f" of actor {actor}" if actor else "") + (f" in {site.label}" if site.name else "")
        if state == "all":
            what += " (" + ", ".join(f"{s} {many_text(n)}" for s, n in counts.items()) + ")"
        if not total:
            return self.layout(
                "Purge", f'<p id=nothing>Nothing to purge: {esc(what)}.</p><p><a href="{ROOT.get()}/">Back</a></p>'
            )
        fields = {"queue": queue, "state": state, "actor": actor, "confirm": "yes", **({"database": site.name} if site.name else {})}
        body = (
            f"<p id=question>Delete {esc(what)}?</p>"
            "<p class=note>Counted just now; running messages are never deleted, and any that arrive meanwhile in "
            "these states are deleted too. This cannot be undone.</p>"
            f'<p class=actions>{self._form("purge", f"Delete {many_text(total)}", fields, "/")} <a href="{ROOT.get()}/">Cancel</a></p>'
        )
        return self.layout("Purge", body)

    def queue_names(self) -> list[str]:
        """The queues known (a message, a pause) or declared (the broker's actors), sorted; of every database."""
        return self.fleet.queue_names()

    def messages_page(self, query: dict[str, str]) -> str:
        queue = query.get("queue", "")
        state = query.get("state", "queued")
        actor = query.get("actor", "").strip()
        names = self.queue_names()
        if not queue and names:
            queue = names[0]
        if queue and queue not in names:
            raise HTTPError("404 Not Found", str(admin.unknown_queue(check_queue(queue), names)))
        named = query.get("database") or None
        site = self._reading_site(queue, named) if queue else self.fleet.sites[0]
        options = "".join(f"<option{' selected' if n == queue else ''}>{esc(n)}</option>" for n in names)
        states = "".join(f"<option{' selected' if s == state else ''}>{s}</option>" for s in admin.LISTABLE)
        databases = ""
        if self.fleet.several:
            choices = "<option value=''>the queue's</option>" + "".join(
                f"<option{' selected' if s.name == named else ''}>{esc(s.name)}</option>" for s in self.fleet
            )
            databases = f"<label>database <select name=database id=database>{choices}</select></label> "
        form = (
            f'<form method=get action="{ROOT.get()}/messages" class=filters>'
            f"<label>queue <select name=queue id=queue>{options}</select></label> {databases}"
            f"<label>state <select name=state id=state>{states}</select></label> "
            f'<label>actor <input name=actor id=actor value="{esc(actor)}" placeholder="any"></label> '
            "<button id=filter>Filter</button></form>"
        )
        if not queue:
            return self.layout("Messages", form + "<p>No queues yet.</p>")
        check_queue(queue)
        page = admin.list_messages(
            site.reader, site.statements, queue, state, actor=actor or None, after=query.get("after"), limit=PAGE_SIZE
        )
        db = site.name
        where = {"database": db} if db else {}
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
                f'<a href="{ROOT.get()}/message/{esc(r["message_id"])}" class=mid>{esc(r["message_id"])}</a>',
                esc(r["actor_name"]),
                esc(r["state"])
                + (
                    f"<br><small class=note>{esc(admin.still_running_note(r['lease_holder'], r['running_since']))}</small>"
                    if r["still_running"]
                    else ""
                ),
                str(r["attempt"]),
                str(r["priority"]),
                utc_time(r["enqueued_at"], short=True),
                utc_time(r["at"], short=True),
                "" if r["still_running"] else utc_time(r["finished_at"], short=True),
                esc(r["lease_holder"] or ""),
                f"<span class=err>{esc(admin.error_summary(r['last_error'], limit=160))}</span>",
            ]
            for r in page.rows
        ]
        order = {
            "queued": "next to run first",
            "running": "newest first; claimed, whether its actor started or it waits in a worker's prefetch "
            "(the Processes page tells them apart per process)",
        }.get(state, "most recently finished first")
        body = form + f"<p class=note>{esc(queue)}{esc(' in ' + site.label) if db else ''}, {esc(state)}: {order}; times in UTC.</p>"
        body += html_table(heads, rows, cls="messages") if rows else "<p id=empty>No messages.</p>"
        if page.searched:
            body += (
                f"<p class=note id=searched>Searched {page.searched:,} messages for this actor; more may follow.</p>"
            )
        if page.next:
            body += f'<p><a id=next href="{href("/messages", queue=queue, state=state, actor=actor, after=page.next, database=db)}">Next page</a></p>'
        if self.actions and rows:  # the bulk actions, on every message of this list (not only this page)
            these = f"{state} messages of {queue}" + (f" of actor {actor}" if actor else "")
            bulk = ""
            if state in FINISHED_STATES:
                fields = {"queue": queue, "state": state, "actor": actor, **where}
                back = "/messages?" + urllib.parse.urlencode({"queue": queue, **where})
                bulk += self._form("redrive_queue", f"Re-drive every {these}", fields, back)
            if state in admin.PURGEABLE:
                link = href("/purge", queue=queue, state=state, actor=actor, database=db)
                bulk += f'<a id=purge-these href="{link}">Purge every {esc(these)}…</a>'
            body += f"<p class=actions>{bulk}</p>" if bulk else ""
        return self.layout("Messages", flash_note(query) + body)

    def message_page(self, message_id: str, query: dict[str, str]) -> str:
        message_id = admin.check_message_id(urllib.parse.unquote(message_id))
        found = self.fleet.message_site(message_id)
        if found is None:
            anywhere = " in any database" if self.fleet.several else ""
            raise HTTPError("404 Not Found", f"no message {message_id}{anywhere} (unknown, or finished longer ago than kept)")
        site, info = found
        db = site.name
        here = f"/message/{message_id}"
        fields = [
            (
                "state",
                f"<span id=state>{esc(info['state'])}</span>"
                + (f" <span class=badge id=still-running>{esc(info['note'])}</span>" if info["still_running"] else ""),
            ),
            (
                "queue",
                f'<a href="{href("/messages", queue=info["queue_name"], state=info["state"], database=db)}">{esc(info["queue_name"])}</a>',
            ),
            ("actor", esc(info["actor_name"])),
            ("attempt", f"{info['attempt']} (deliveries so far)"),
            ("retries", esc(str(info.get("retries")))),
            ("priority", str(info["priority"])),
            ("enqueued", utc_time(info["enqueued_at"])),
            ("due", utc_time(info["available_at"])),
            ("claimed", utc_time(info["claimed_at"])),
            ("lease until", utc_time(info["lease_expires_at"])),
            ("lease holder", esc(info["lease_holder"] or "")),
            ("cancel requested" if info["still_running"] else "finished", utc_time(info["finished_at"])),
            ("ran", age_text(info["ran_seconds"])),
        ]
        if db:
            fields.insert(0, ("database", f"<span id=database>{esc(db)}</span>"))
        if info.get("unique_key") is not None:
            fields.append(("unique key", f"{esc(info['unique_key'])} (unique_until={esc(info['unique_until'])})"))
        body = (
            flash_note(query)
            + "<div class=scroll><table class=fields>"
            + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in fields)
        )
        body += "</table></div>"
        if "decode_error" in info:
            body += f"<p class=error>Payload not decodable here: {esc(info['decode_error'])}</p>"
        else:
            body += "<h2>Arguments</h2><pre id=args>" + esc(
                pretty_json({"args": info["args"], "kwargs": info["kwargs"]})
            )
            body += "</pre><h2>Options</h2><pre>" + esc(pretty_json(info["options"])) + "</pre>"
        if info["last_error"]:
            body += f"<h2>Last error</h2><p class=err id=error>{esc(info['error'])}</p>"
            body += f"<pre class=err>{esc(info['last_error'])}</pre>"
        if info["history"]:
            heads = ["finished", "attempt", "holder", "ran"]
            rows = [[utc_time(h["finished_at"]), str(h["attempt"]), esc(h["lease_holder"] or ""), age_text(h["ran_seconds"])]
                    for h in info["history"]]  # fmt: skip
            body += "<h2>History</h2>" + html_table(heads, rows)
        if self.actions:
            buttons = ""
            shown = {"message_id": message_id, "seen": info["version"], **({"database": db} if db else {})}
            if info["state"] in ("queued", "running"):
                buttons += self._form("cancel", "Cancel", shown, here)
            if info["state"] in FINISHED_STATES and not info["still_running"]:  # not while its actor runs
                buttons += self._form("redrive", "Re-drive", shown, here)
            if info["state"] == "queued" and info["available_at"] > datetime.now(timezone.utc):  # delayed: asks first
                link = href("/bulk", action="run_now", scope="selected", ids=message_id)
                buttons += f'<a id=run-now href="{link}">Run now…</a>'

            body += f"<p class=actions>{buttons}</p>" if buttons else ""
        return self.layout(f"Message {message_id}", body)

    def _where(self) -> str:
        """The header's words for what is shown: the schema, or each database's name and schema."""
        if not self.fleet.several:
            return f"schema {self.settings.schema}"
        return "databases " + ", ".join(f"{s.name} ({s.settings.schema})" for s in self.fleet)

    def layout(self, title: str, body: str, *, nav: bool = True) -> str:
        """A whole page: *body* goes in ``<div id=content>``, the part ``live.js`` replaces.  Without *nav*
        (the login page) it names nothing of this server."""
        root = ROOT.get()
        head = (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)} · dramatiq-pg-fenced</title>"
            f'<link rel=stylesheet href="{root}/static/{static_name("style.css")}">'
        )
        if not nav:
            return f"{head}</head><body><header><b>dramatiq-pg-fenced</b></header><main><h1>{esc(title)}</h1>{body}</main></body></html>"
        mode = "actions on" if self.actions else "read-only"
        links = " ".join(f'<a href="{root}{path}">{name}</a>' for path, name in PAGES)
        logout = ""
        if self.sessions is not None:
            logout = (
                f'<form method=post action="{root}/logout"><input type=hidden name=token value="{esc(self.token)}">'
                "<button id=logout>Log out</button></form>"
            )
        live = ""
        if self.live:
            live = "<button type=button id=live-toggle hidden>Pause live</button> <span id=live-status></span>"
        return f"""{head}<script src="{root}/static/{static_name("live.js")}" defer></script></head>
<body data-live="{self.live:g}"><header><b>dramatiq-pg-fenced</b> <span class=schema>{esc(self._where())}</span>
<nav>{links}</nav>{live}<span class=mode>{mode}</span>{logout}</header>
<main><h1>{esc(title)}</h1><div id=content>{body}</div></main></body></html>"""


def dashboard_app(
    broker: Any,
    *,
    actions: bool = False,
    ring: bool | None = None,
    secret: str | None = None,
    allowed_hosts: Iterable[str] = (),
    auth: str | None = None,
    login: bool = False,
    live: float = 5.0,
) -> Dashboard:
    """The dashboard over *broker*'s database and schema (a ``PostgresBroker``), or over every database
    of a ``RoutedBroker`` (or a :class:`~..fleet.Fleet`): a WSGI app to mount (options as :class:`Dashboard`)."""
    if not isinstance(broker, Fleet) and not hasattr(broker, "shards"):
        return Dashboard(
            broker.database, broker.statements, broker.settings, actions=actions, ring=ring, secret=secret,
            allowed_hosts=allowed_hosts, auth=auth, declared=broker.get_declared_queues,
            reader=getattr(broker, "reader", None), login=login, live=live,
        )  # fmt: skip
    return Dashboard(
        fleet=Fleet.of(broker),
        actions=actions,
        ring=ring,
        secret=secret,
        allowed_hosts=allowed_hosts,
        auth=auth,
        login=login,
        live=live,
    )
