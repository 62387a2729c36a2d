"""What every page is made of: escaping, links under the mount path, tables, times, the headers."""

from __future__ import annotations

import contextvars
import hashlib
import html
import importlib.resources
import json
import re
import urllib.parse
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

#: Counts on the queues page stop here (shown as "10,000+").
COUNT_CAP = 10_000
PAGE_SIZE = 50
#: A purge's question counts the rows it deletes up to here (shown as "100,000+").
PURGE_COUNT_CAP = 100_000

StartResponse = Callable[..., Any]
Environ = dict[str, Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

SECURITY_HEADERS = [
    (
        "Content-Security-Policy",
        # Our own style and script only (served from the package, /static/), fetched by our own poller.
        "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
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


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def href(path: str, **params: str) -> str:
    return esc(f"{ROOT.get()}{path}?{urllib.parse.urlencode({k: v for k, v in params.items() if v})}")


def flash_note(query: dict[str, str]) -> str:
    note = query.get("note")
    return f"<p class=flash id=flash>{esc(note)}</p>" if note else ""


def purge_question(queue: str, database: str = "") -> str:
    """The queues page's purge control: it asks first (:meth:`Dashboard.purge_page`); dead letters by default.
    *database*: the queue's, of several (carried to the question, then to the purge)."""
    options = "".join(f"<option{' selected' if s == 'dead' else ''}>{s}</option>" for s in (*PURGE_ORDER, "all"))
    where = f'<input type=hidden name=database value="{esc(database)}">' if database else ""
    return (
        f'<form method=get action="{ROOT.get()}/purge" class=inline><input type=hidden name=queue value="{esc(queue)}">'
        f'{where}<select name=state aria-label="state to purge">{options}</select><button>Purge…</button></form>'
    )


def away_note(names: list[str]) -> str:
    """What a page of several databases says of those that did not answer (their rows are missing)."""
    if not names:
        return ""
    return (
        f"<p class=error id=away>Database{'s' if len(names) > 1 else ''} {esc(', '.join(names))} did not answer "
        "(see the server's log): what it holds is missing below.</p>"
    )


def none_answered(away: list[str]) -> HTTPError:
    """What a page of several databases answers when not one of them did."""
    return HTTPError("503 Service Unavailable", f"no database answered ({', '.join(away)}): see the server's log")


#: The purge control's states, the least harmful first.
PURGE_ORDER = ("dead", "cancelled", "done", "queued")


def many_text(n: int) -> str:
    return f"{PURGE_COUNT_CAP:,}+" if n > PURGE_COUNT_CAP else f"{n:,}"


def count_text(n: int | None) -> str:
    if n is None:
        return ""
    return f"{COUNT_CAP:,}+" if n > COUNT_CAP else f"{n:,}"


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def utc_time(value: datetime | None, short: bool = False) -> str:
    """A time in UTC; *short* (in lists) without the year, the full time as its tooltip."""
    if value is None:
        return ""
    utc = value.astimezone(timezone.utc)
    full = utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    if not short:
        return esc(full)
    return f'<time title="{esc(full)}">{esc(utc.strftime("%m-%d %H:%M:%S"))}</time>'


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, default=repr, ensure_ascii=False)


def html_table(heads: list[str], rows: list[list[str]], cls: str = "", *, cards: bool = False) -> str:
    """A table in a box that scrolls sideways when the table is wider than the page.  *cards*: on a phone
    (style.css) each row is a card, each value after its column's name (its cell's ``data-label``), so
    that a list of many columns is read down the screen rather than scrolled across it."""
    head = "".join(f"<th>{esc(h)}</th>" for h in heads)
    labels = [f' data-label="{esc(h)}"' if cards and h else "" for h in heads]
    body = "".join(
        "<tr>" + "".join(f"<td{labels[i] if i < len(labels) else ''}>{c}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    classes = f'"{cls or "plain"} cards"' if cards else (cls or "plain")
    return f"<div class=scroll><table class={classes}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


#: Where an action may send the browser next: a path here.  Printable ASCII only (browsers drop tabs
#: and newlines), no backslash (browsers read it as a slash), and no second slash first ("//host").
LOCAL_TARGET = re.compile(r"/(?![/\\])[!-\[\]-~]*")

#: Where this request's dashboard is mounted (``SCRIPT_NAME`` without its last slash): every link,
#: form and redirect starts with it.  Per request: one app may be reached under several mounts.
ROOT: contextvars.ContextVar[str] = contextvars.ContextVar("dashboard_root", default="")


def mount_path(environ: Environ) -> str:
    """``SCRIPT_NAME`` as a prefix for our paths; ``""`` when absent or not a plain local path
    (quotes, ``<``, ``>``, ``&`` or a leading ``//`` could lead a link or a redirect elsewhere)."""
    mount = (environ.get("SCRIPT_NAME") or "").rstrip("/")
    if not mount or not LOCAL_TARGET.fullmatch(mount) or any(c in mount for c in "\"'<>&"):
        return ""
    return mount


def read_form(environ: Environ, limit: int = 10_000) -> dict[str, str]:
    """A POSTed form (``application/x-www-form-urlencoded``), read up to *limit* bytes."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    return dict(urllib.parse.parse_qsl(environ["wsgi.input"].read(min(max(length, 0), limit)).decode(errors="replace")))


#: The files under ``/static/``, shipped in the package (the wheel includes them): name -> content type.
STATIC = {"style.css": "text/css; charset=utf-8", "live.js": "text/javascript; charset=utf-8",
          "theme.js": "text/javascript; charset=utf-8"}
_static: dict[str, bytes] = {}


def _static_bytes(name: str) -> bytes:
    if name not in _static:
        _static[name] = importlib.resources.files(__package__).joinpath("static").joinpath(name).read_bytes()
    return _static[name]


def static_name(name: str) -> str:
    """*name* with its content's digest as a query: a browser's cached copy is never an older one."""
    return f"{name}?v={hashlib.sha256(_static_bytes(name)).hexdigest()[:12]}"


def static_file(name: str, start_response: StartResponse) -> list[bytes]:
    """One of :data:`STATIC`, cacheable for a day (its links carry its digest); 404 for any other name."""
    if name not in STATIC:
        data = b"404 Not Found: no such file\n"
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(data))), *SECURITY_HEADERS])  # fmt: skip
        return [data]
    data = _static_bytes(name)
    headers = [(k, v) for k, v in SECURITY_HEADERS if k != "Cache-Control"]
    start_response("200 OK", [("Content-Type", STATIC[name]), ("Content-Length", str(len(data))),
                              ("Cache-Control", "private, max-age=86400"), *headers])  # fmt: skip
    return [data]
