"""The dashboard's WSGI app: routing, the guards in order, the actions and the pages over :mod:`..admin`."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from dramatiq.errors import ConnectionClosed

from ..config import Settings
from ..db.database import Database
from ..db.statements import FINISHED_STATES, Statements
from ..ops import admin, bulk
from ..ops.fleet import Fleet, Site
from .bulk_pages import LABELS, audit_page, bulk_page, request_ids, selection
from .console_pages import charts_page, processes_page, search_page
from .guards import AllowedHosts, Sessions, plain, refuse_host
from .health_pages import database_page
from .pages import QueuePages
from .render import (
    LOCAL_TARGET,
    ROOT,
    SECURITY_HEADERS,
    Environ,
    HTTPError,
    StartResponse,
    esc,
    flash_note,
    mount_path,
    read_form,
    static_file,
)
from .roles import READ_ONLY, ROLE, RoleCredentials, from_session, session_name
from .row_actions import queue_question
from .schedule_actions import SCHEDULE_ACTIONS, act_on_schedule, buttons
from .schedule_pages import schedules_page

ACTIONS = ("cancel", "redrive", "pause", "resume", "purge", "redrive_queue", "bulk", *SCHEDULE_ACTIONS)

logger = logging.getLogger(__package__)


class Dashboard(QueuePages):
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
        :class:`Credentials`), or several, one a line, each after an optional role
        word (``operator``, ``read-only``: sees every page, acts on nothing; see
        :mod:`.roles`); read it from a file or the environment, never
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
        self._actions_on = actions
        self._ring = ring
        self.ring = self.ring_of(first)
        #: Forms carry it; a page of another site cannot read it.
        self.token = (
            hmac.new(secret.encode(), b"dramatiq-pg-fenced dashboard form", hashlib.sha256).hexdigest()
            if secret
            else secrets.token_urlsafe(32)
        )
        self.allowed_hosts = AllowedHosts(allowed_hosts)
        self.auth = RoleCredentials(auth) if auth is not None else None
        sessions = Sessions(self.auth, secret) if self.auth is not None and login else None  # type: ignore[arg-type]
        self.sessions = sessions
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
        role = ROLE.set(None)
        try:
            sent = self.auth.accept(environ.get("HTTP_AUTHORIZATION") or "") if self.auth is not None else None
            ROLE.set(sent)
            if self.auth is not None and sent is None:
                # Wrong credentials sent by a script (or no login page): 401, never the login page.
                if self.sessions is None or environ.get("HTTP_AUTHORIZATION"):
                    challenge = ("WWW-Authenticate", 'Basic realm="dramatiq-pg-fenced dashboard", charset="UTF-8"')
                    return plain(start_response, "401 Unauthorized", "authentication required", challenge)
                named = self.sessions.from_request(environ)
                if named is None:
                    return self.login(environ, start_response)
                user, given = from_session(named)
                ROLE.set(given)
                environ = {**environ, "dramatiq_pg.user": user or "(token)"}
                if path == "/logout":
                    return self.logout(environ, start_response)
            return self._answer(environ, start_response)
        finally:
            ROLE.reset(role)
            ROOT.reset(root)

    @property
    def actions(self) -> bool:  # type: ignore[override]
        """Whether this request may act: the dashboard's actions are on and its credentials are not read-only's."""
        return self._actions_on and ROLE.get() != READ_ONLY

    @actions.setter
    def actions(self, value: bool) -> None:
        self._actions_on = value

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
            given = self.auth.check(form.get("user", ""), form.get("password", ""))
            if given is not None:
                logger.info("Dashboard: login of %r (%s)", form.get("user", ""), given)
                target = wanted if LOCAL_TARGET.fullmatch(wanted) else "/"
                issued = self.sessions.issue(session_name(form.get("user", ""), given))
                cookie = self.sessions.set_cookie(issued, environ, ROOT.get() or "/")
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
            elif path == "/confirm":  # the queues page's pause and resume ask first, with the count
                if not self.actions:
                    raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
                site = self.fleet.queue_site(query.get("queue", ""), database=query.get("database") or None)
                title = f"{query.get('action', '').capitalize()} queue"
                body = self.layout(title, queue_question(site, query.get("action", ""), query.get("queue", ""), self._form))
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
            elif path == "/database":
                body = self.layout("Database", database_page(self.fleet))
            elif path == "/processes":
                body = self.layout("Processes", processes_page(self.fleet))
            elif path == "/schedules":
                title, content = schedules_page(self.fleet, query, buttons(self._form) if self.actions else None)
                body = self.layout(title, flash_note(query) + content)
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
            from ..ops import metrics
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
            if self._actions_on:  # on, but not for these credentials
                raise HTTPError("403 Forbidden", "your credentials are read-only: they may not act")
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
        elif action == "redrive":
            site = self._message_site(admin.check_message_id(message_id), named)
        ring, db, st = self.ring_of(site), site.database, site.statements
        if action in SCHEDULE_ACTIONS:
            note = act_on_schedule(self.fleet, action, form, self.who(environ))
        elif action == "cancel":
            # As RoutedBroker.cancel: wherever it is now (a relay may have moved it since the page
            # showed it), the version shown applying in the database it was shown in.
            cancelled = self.fleet.cancel(message_id, seen=seen, database=named)
            site = self.fleet.site(cancelled.database or named or site.name)
            note = f"cancel: {cancelled.outcome.value}"
            if cancelled.unreachable and cancelled.database is None:
                note += f"; database {', '.join(cancelled.unreachable)} did not answer"
            if cancelled.outcome is not admin.CancelOutcome.NOT_FOUND:  # (in the database that holds it)
                did = cancelled.outcome in (admin.CancelOutcome.QUEUED, admin.CancelOutcome.RUNNING)
                note += self._audited(site, environ, "cancel", message_id, did)
        elif action == "redrive":
            done = admin.redrive(db, st, [message_id], ring, seen=None if seen is None else {message_id: seen})
            note = "re-driven" if done.redriven else f"not re-driven: {'; '.join(done.skipped.values())}"
            note += self._audited(site, environ, "redrive", message_id, bool(done.redriven))
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
        if self.fleet.several and action not in ("bulk", *SCHEDULE_ACTIONS):
            note += f" ({site.label})"
        logger.info("Dashboard action %s: %s", action, note)
        target = form.get("next", "/")
        if not LOCAL_TARGET.fullmatch(target):
            target = "/"  # never a redirect elsewhere
        joiner = "&" if "?" in target else "?"
        return f"{ROOT.get()}{target}{joiner}{urllib.parse.urlencode({'note': note})}"

    def _audited(self, site: Site, environ: dict[str, Any], action: str, message_id: str, touched: bool) -> str:
        """Record a message page's action in the audit log of the database that holds the message (its
        story shows it); a record that fails after the action was done is said in the note, not a 500."""
        try:
            bulk.record(site.database, site.statements, who=self.who(environ), action=action, message_id=message_id,
                        touched=touched)  # fmt: skip
        except (psycopg.Error, ConnectionClosed) as e:
            logger.warning("Dashboard: %s of %s done, not recorded in the audit log: %s", action, message_id, e)
            return f"; not recorded in the audit log ({type(e).__name__})"
        return ""

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
