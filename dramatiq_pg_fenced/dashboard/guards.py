"""Who may ask: the allowed host names (``Host`` and ``Origin``) and the credentials of a dashboard served alone."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Iterable

from ..conditions import Condition
from .render import SECURITY_HEADERS, Environ, StartResponse, WSGIApp

#: Always answered: no page of another site can be served from these names.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: Where the ``dashboard`` command reads its credentials unless given ``--auth-file``.
AUTH_ENV = "DRAMATIQ_PG_DASHBOARD_AUTH"

logger = logging.getLogger(__package__)


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
        self._names = [allowed_name(n) for n in (*LOOPBACK_HOSTS, *names)]

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


def allowed_name(name: str) -> tuple[str, int | None]:
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

    def check(self, user: str, password: str) -> bool:
        """Whether a login form's user and password are these credentials (a token: the password, any user)."""
        given = password if self._token else f"{user}:{password}"
        return hmac.compare_digest(given.encode(), self._secret)

    def fingerprint(self) -> bytes:
        """A digest of the secret: sessions signed under one set of credentials end when they change."""
        return hashlib.sha256(b"dramatiq-pg-fenced dashboard credentials\0" + self._secret).digest()


#: The session cookie of a dashboard served alone with a login page (:class:`Sessions`).
SESSION_COOKIE = "dramatiq_pg_session"
#: How long a login lasts.
SESSION_SECONDS = 12 * 3600


class Sessions:
    """Signed session cookies: what a login page gives a browser in place of its credentials.

    A cookie is ``expires.nonce.signature``: HMAC-SHA256 over the first two under a key
    derived from the app's *secret* (every process given the same secret accepts the
    others' sessions; none given: one random key per process, so a restart logs everyone
    out) and the credentials' fingerprint (a changed password ends every session).
    Nothing is stored on the server: logout clears the browser's cookie, and a copied
    cookie works until it expires.  Sent ``HttpOnly`` (no script reads it),
    ``SameSite=Strict`` (no other site's page or link carries it) and ``Secure`` over HTTPS.
    """

    def __init__(self, credentials: Credentials, secret: str | None = None, seconds: int = SESSION_SECONDS) -> None:
        base = secret.encode() if secret else secrets.token_bytes(32)
        self._key = hmac.new(base, b"dramatiq-pg-fenced dashboard session\0" + credentials.fingerprint(),
                             hashlib.sha256).digest()  # fmt: skip
        self.seconds = seconds

    def _sign(self, value: str) -> str:
        return hmac.new(self._key, value.encode(), hashlib.sha256).hexdigest()

    def issue(self, user: str = "", now: float | None = None) -> str:
        """A new session's cookie value, for *user* (the name given at the login; the audit log says it)."""
        name = base64.urlsafe_b64encode(user.encode()).decode().rstrip("=")
        value = f"{int((time.time() if now is None else now) + self.seconds)}.{secrets.token_urlsafe(16)}.{name}"
        return f"{value}.{self._sign(value)}"

    def user(self, value: str, now: float | None = None) -> str | None:
        """The user of *value* if it is a cookie this app signed and that has not expired, else ``None``."""
        signed, dot, signature = value.rpartition(".")
        expires, _, rest = signed.partition(".")
        nonce, _, name = rest.partition(".")
        if not (dot and expires.isdigit() and nonce) or len(value) > 4096:
            return None
        if not hmac.compare_digest(signature.encode(), self._sign(signed).encode()):
            return None
        if int(expires) <= (time.time() if now is None else now):
            return None
        try:
            return base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
        except ValueError:
            return None

    def valid(self, value: str, now: float | None = None) -> bool:
        """Whether *value* is a cookie this app signed and that has not expired."""
        return self.user(value, now) is not None

    def from_request(self, environ: Environ) -> str | None:
        """The user of the request's valid session cookie, if it has one."""
        for value in request_cookies(environ, SESSION_COOKIE):
            user = self.user(value)
            if user is not None:
                return user
        return None

    def set_cookie(self, value: str, environ: Environ, path: str) -> tuple[str, str]:
        return _cookie(f"{value}; Max-Age={self.seconds}", environ, path)

    def clear_cookie(self, environ: Environ, path: str) -> tuple[str, str]:
        return _cookie("; Max-Age=0", environ, path)


def _cookie(value: str, environ: Environ, path: str) -> tuple[str, str]:
    secure = "; Secure" if environ.get("wsgi.url_scheme") == "https" else ""
    return "Set-Cookie", f"{SESSION_COOKIE}={value}; Path={path or '/'}; HttpOnly; SameSite=Strict{secure}"


def request_cookies(environ: Environ, name: str) -> list[str]:
    """The values of cookie *name* in the request (a browser may send several of one name)."""
    found = []
    for part in (environ.get("HTTP_COOKIE") or "").split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            found.append(value.strip().strip('"'))
    return found


_refused_hosts = Condition(logger, "Dashboard: refusing requests for host names not allowed", interval=600.0)


def plain(start_response: StartResponse, status: str, text: str, *headers: tuple[str, str]) -> list[bytes]:
    data = f"{status}: {text}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data))),
                            *headers, *SECURITY_HEADERS])  # fmt: skip
    return [data]


def refuse_host(allowed: AllowedHosts, environ: Environ, start_response: StartResponse) -> list[bytes]:
    """400, naming nothing of this server; the log says which name was refused, now and then."""
    host = environ.get("HTTP_HOST")
    _refused_hosts.hit(f"{(host or '')[:100]!r} (allowed: {allowed!r}; add it with allowed_hosts= or --allow-host)")
    return plain(start_response, "400 Bad Request", "this host name is not one this server answers to")


def host_checked(app: WSGIApp, allowed_hosts: AllowedHosts) -> WSGIApp:
    """*app*, answering 400 to a request whose ``Host`` is not allowed (the metrics server is so wrapped)."""

    def checked(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if not allowed_hosts.allows_request(environ):
            return refuse_host(allowed_hosts, environ, start_response)
        return app(environ, start_response)

    return checked
