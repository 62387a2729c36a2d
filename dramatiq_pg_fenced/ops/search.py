"""The console's search: messages by id, queue, actor, state and argument value, in the message table and
the history, paged by key.

Pages run in key order ``(message_id, table, seq)``: the message table's
primary key and history's ``message_id`` index, so searching adds no index
(and no cost) to the hot table; the order is stable but not by time.  Each
page reads at most :data:`SEARCH_WINDOW` rows of each table after the cursor
and keeps those that match (``Page.searched`` says how many were read when
the page did not fill: more may match further on, from ``Page.next``).
Argument values are matched by JSON containment (``@>``) on the message's
``{"args": [...], "kwargs": {...}}`` (``message_arguments``, migration 014):
``args=[42]`` finds messages one of whose positional arguments is 42,
``kwargs={"user": 7}`` those called with ``user=7``.  A plain *value* (what
people type: ``alice``, ``42``, an id) finds the messages one of whose
arguments, positional or keyword (its value, not its name), holds it at any
depth (a list's item, a dict's value): as a string equal to the text, or, when
the text reads as a JSON number, ``true``, ``false`` or ``null``, equal to that
too (``42`` matches ``42``, ``42.0`` and ``"42"``; ``"42"`` quoted only the
string).  A payload that is not JSON (a pickling encoder) never matches an
argument filter.
"""

from __future__ import annotations

import decimal
import functools
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

import psycopg
from dramatiq.errors import BrokerError
from dramatiq.message import Message

from ..db.database import Database
from ..db.statements import Statements, check_queue
from ..errors import describe_failure
from . import admin
from .admin import LISTABLE, Page, check_message_id

logger = logging.getLogger(__name__)

#: Rows of each table a page reads at most.
SEARCH_WINDOW = 5000
#: ... when it looks for a plain value: a page answers for 100,000 rows of each table in about half a
#: second (``benchmarks/search.py``), so that a value is found, or said absent, in one page.
VALUE_WINDOW = 100_000
#: The parameters of :func:`filters` that select rows.
FILTERS = ("queue", "actor", "state", "arguments", "value")
#: Where the first page starts: before every key.
_START = ("00000000-0000-0000-0000-000000000000", -1, -1)
_COLUMNS = (
    "message_id", "src", "seq", "queue_name", "actor_name", "state", "attempt", "enqueued_at", "available_at",
    "finished_at", "last_error",
)  # fmt: skip


def filters(
    *,
    queue: str | None = None,
    actor: str | None = None,
    state: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    value: str | None = None,
) -> dict[str, Any]:
    """The statements' filter parameters, checked (``ValueError`` for a bad queue name or state)."""
    if queue is not None:
        check_queue(queue)
    if state is not None and state not in LISTABLE:
        raise ValueError(f"cannot search state {state!r}: one of {', '.join(LISTABLE)}")
    if args is not None and not isinstance(args, list):
        raise ValueError("args must be a list (the positional arguments to contain)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("kwargs must be a dict (the keyword arguments to contain)")
    if actor is not None and "\x00" in actor:
        raise ValueError("actor: a NUL character is in no actor's name")
    contained: dict[str, Any] = {}
    if args is not None:
        contained["args"] = args
    if kwargs is not None:
        contained["kwargs"] = kwargs
    if _has_nul(contained):  # PostgreSQL's jsonb holds no NUL character: the server would refuse the search
        raise ValueError("arguments: a NUL character (\\u0000) cannot be searched for")
    arguments = json.dumps(contained) if contained else None
    return {"queue": queue or None, "actor": actor or None, "state": state or None, "arguments": arguments,
            "value": value_vars(value), "needles": value_needles(value)}  # fmt: skip


_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def value_needles(value: str | None) -> list[bytes] | None:
    """Byte strings one of which a JSON payload holds when one of its arguments equals *value*
    (:func:`value_vars`), as Python's ``json`` writes it (Dramatiq's JSON encoder: ASCII only, or
    UTF-8): a string as its quoted literal, a number, ``true``, ``false`` or ``null`` also bare after
    ``[``, ``,`` or ``:`` (a space between or not): a cheap first test that spares most rows the parse.
    ``None`` (no first test, every row parsed) for a number Python may write otherwise (see
    :func:`_python_form`)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    bare: list[str] = []
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            text = json.loads(text)
        except ValueError:
            pass
    elif _JSON_NUMBER.fullmatch(text):
        form = _python_form(text)
        if form is None:
            return None
        bare = [form]
    elif text in ("true", "false", "null"):
        bare = [text]
    quoted = [json.dumps(text), json.dumps(text, ensure_ascii=False)]
    around = [f"{before}{space}{b}" for b in bare for before in "[,:" for space in ("", " ")]
    return [n.encode() for n in dict.fromkeys(quoted + around)]


def _python_form(number: str) -> str | None:
    """How ``json.dumps`` begins to write an int or float equal to *number* (``42`` for 42 and 42.0,
    ``1.5`` for 1.50); ``None`` when it may be written otherwise (zero, which may be ``-0.0``; 16
    digits or more, which a float writes with an exponent)."""
    exact = decimal.Decimal(number)
    if not exact.is_finite() or exact == 0:
        return None
    if exact == exact.to_integral_value():
        return str(int(exact)) if abs(exact) < 10**15 else None
    written = repr(float(number))
    return written if "e" not in written and decimal.Decimal(written) == exact else None


def value_vars(value: str | None) -> str | None:
    """A plain value's jsonpath variables (``{"s": the text, "v": the text as a JSON scalar}``), ``None`` for
    none.  Quoted (``"42"``): that string only.  A JSON number is kept as typed (PostgreSQL's numeric compares
    it, whatever its size)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("value must be a text (what an argument equals)")
    if not value.strip():
        return None
    text = value.strip()
    if "\x00" in text:
        raise ValueError("value: a NUL character (\\u0000) cannot be searched for")
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            text = json.loads(text)
        except ValueError:
            pass
        else:
            return json.dumps({"s": text, "v": text})
    if _JSON_NUMBER.fullmatch(text):
        return f'{{"s": {json.dumps(text)}, "v": {text}}}'
    scalar = {"true": True, "false": False, "null": None}.get(text, text)
    return json.dumps({"s": text, "v": scalar})


def _has_nul(value: Any) -> bool:
    """Does a string in *value* (a JSON value: keys included) hold a NUL character?"""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def search(
    database: Database,
    statements: Statements,
    *,
    message_id: str | None = None,
    queue: str | None = None,
    actor: str | None = None,
    state: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    value: str | None = None,
    after: str | None = None,
    limit: int = 50,
) -> Page:
    """A page of the messages that match every filter given (see the module's docstring).

    *state*: queued, running, dead, cancelled (the message table) or done (the
    history); ``None``: all.  *message_id*: that id only (every row of it).
    *value*: a plain value one of its arguments holds (see the module's docstring).
    *after*: the previous page's ``next``.  Rows: ``message_id``,
    ``queue_name``, ``actor_name``, ``state``, ``attempt``, ``enqueued_at``,
    ``available_at``, ``finished_at``, ``error`` (one line), ``last_error``,
    and, decoded, ``args``, ``kwargs`` (``decode_error`` if the payload
    cannot be decoded here).
    """
    return _search([(None, database, statements)], message_id=message_id, queue=queue, actor=actor, state=state,
                   args=args, kwargs=kwargs, value=value, after=after, limit=limit)  # fmt: skip


def search_many(
    sources: Iterable[tuple[str, Database, Statements]], *, away: list[str] | None = None, **wanted: Any
) -> Page:
    """:func:`search` over several databases at once, *sources* being (name, database, statements): one
    page in key order across all of them, every row with its ``database``.  A page stops where the first
    database stopped reading (its window), so that no database's rows are skipped by the next page.

    With *away* (a list), a database that does not answer is left out, logged and named there: the page
    holds the others' rows (the console says what is missing); without it, its error is raised."""
    return _search(list(sources), away=away, **wanted)


def _search(
    sources: list[tuple[str | None, Database, Statements]],
    *,
    message_id: str | None = None,
    after: str | None = None,
    limit: int = 50,
    away: list[str] | None = None,
    **wanted: Any,
) -> Page:
    """:func:`search` over *sources*; *wanted*: the filters of :func:`filters` (queue, actor, state, args, kwargs,
    value)."""
    if not 1 <= limit <= 1000:
        raise ValueError("limit must be between 1 and 1000")
    params = filters(**wanted)
    state = wanted.get("state")
    if message_id is not None:
        params["message_id"] = check_message_id(message_id)
        tagged: list[tuple[str | None, Any]] = []
        for name, database, statements in sources:
            read_id = functools.partial(_fetch, statement=statements.search_id, params=params)
            tagged += [(name, r) for r in _run(name, database, read_id, away, transaction=False)]
        return Page([_row(r, name) for name, r in tagged[:limit]], None)
    cursor = _cursor(after)
    filtered = any(params[k] is not None for k in FILTERS)
    window = VALUE_WINDOW if params["value"] is not None else SEARCH_WINDOW
    scan = max(window, limit + 1) if filtered else limit + 1  # unfiltered: the page is the window
    params.update(id=cursor[0], src=cursor[1], seq=cursor[2], scan=scan, limit=limit + 1)

    def read(conn: Any, statements: Statements) -> list[list[Any]]:
        tables = []
        if state != "done":
            tables.append(statements.search_live)
        if state is None or state == "done":
            tables.append(statements.search_kept)
        return [conn.execute(t, params).fetchall() for t in tables]

    found: list[tuple[str | None, Any]] = []
    edge: tuple | None = None  # the smallest key up to which every table was read (None: all of them)
    scanned = 0
    for name, database, statements in sources:
        for rows in _run(name, database, functools.partial(read, statements=statements), away, transaction=True):
            last = rows.pop() if rows and rows[-1][-2] else None
            found += [(name, r) for r in rows]
            if last is not None:
                scanned += int(last[-1])
                if int(last[-1]) >= params["scan"]:  # the window was full: this table goes on
                    key = _key(last)
                    edge = key if edge is None or key < edge else edge
    found.sort(key=lambda t: (_key(t[1]), t[0] or ""))
    if edge is not None:
        found = [t for t in found if _key(t[1]) <= edge]
    following = None
    searched = None
    if len(found) > limit:
        found = found[:limit]
        following = _key(found[-1][1])
    elif edge is not None:
        following, searched = edge, scanned
    rows = [_row(r, name) for name, r in found]
    return Page(rows, None if following is None else _cursor_text(following), searched)


def _run(name: str | None, database: Database, read: Any, away: list[str] | None, *, transaction: bool) -> list[Any]:
    """*read* on *database*; with *away*, a database that does not answer reads as empty and is named there."""
    try:
        return list(database.run(read, transaction=transaction))
    except (psycopg.Error, BrokerError) as e:
        if away is None:
            raise
        logger.warning("Database %r could not be searched: %s", name, describe_failure(e))
        away.append(str(name))
        return []


def _fetch(conn: Any, *, statement: Any, params: dict[str, Any]) -> list[Any]:
    return list(conn.execute(statement, params).fetchall())


def _key(row: Any) -> tuple[str, int, int]:
    return (str(row[0]), int(row[1]), int(row[2]))


def _cursor(after: str | None) -> tuple[str, int, int]:
    if not after:
        return _START
    try:
        message_id, src, seq = after.split("|")
        return (check_message_id(message_id), int(src), int(seq))
    except ValueError:
        raise ValueError(f"bad cursor {after!r}") from None


def _cursor_text(key: tuple[str, int, int]) -> str:
    return f"{key[0]}|{key[1]}|{key[2]}"


def _row(row: Any, database: str | None = None) -> dict[str, Any]:
    item = admin.with_error(dict(zip(_COLUMNS, row[: len(_COLUMNS)], strict=True)))
    if database is not None:
        item["database"] = database
    item["message_id"] = str(item["message_id"])
    del item["src"], item["seq"]
    try:
        decoded = Message.decode(bytes(row[len(_COLUMNS)]))
        item["args"], item["kwargs"] = list(decoded.args), decoded.kwargs
    except Exception as e:  # another encoder's payload: shown without its arguments
        item["args"] = item["kwargs"] = None
        item["decode_error"] = str(e)
    return item
