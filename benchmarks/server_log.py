"""A database's transactions counted from the server's log: each one by what it ran, the server's own apart.

``pg_stat_database`` counts every transaction that ends in a database (``xact_commit +
xact_rollback``): the ones our statements make, and ones no statement shows:

- **catch-ups**: an idle backend that fell behind the shared invalidation queue (which DDL
  anywhere on the server fills, another database's included: ``CREATE``, ``DROP``, ``ALTER``,
  ``VACUUM`` of a catalog) is signalled, and reads the queue in a transaction of its own
  (``ProcessCatchupEvent``; after a long lock wait, ``cache state reset``).  A test suite
  making schemas beside a benchmark makes many;
- **a Parse alone**: psycopg prepares a statement (its sixth run on a connection) with a
  Parse and a Sync of their own, a transaction ``log_statement`` does not show.

With ``log_min_messages = debug5`` the server logs the start and the end of every transaction
(``StartTransaction`` and ``CommitTransaction``, xact.c's ``ShowTransactionState``) with the
backend's pid, and ``log_statement = 'all'`` logs what each ran (``statement:``, or
``execute <name>:`` for the extended protocol); an ``ERROR`` ends a transaction as rolled back
(it is counted in ``xact_rollback``).  :func:`count` reads those lines; the log's
``log_line_prefix`` must begin with ``%m [%p]`` (Debian's and initdb's default do).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable

#: The stamp (``%m``, to the millisecond, its zone after it), the pid (``[%p]``), anything the prefix
#: adds (``%q%u@%d``), the level, the message.
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \S+ \[(\d+)\] (?:.*? )?([A-Z]+\d?):  (.*)$")

CATCH_UP = "catch-up (the server's, after DDL anywhere on it)"
PREPARE = "prepare (a Parse alone)"

#: What a transaction that ran statements was for, by the first pattern its statements match (the
#: broker's idle statements; ``other`` for anything else).
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("claim (idle poll)", r"SET state = 'running', attempt = m\.attempt \+ 1"),
        ("next due read (after a short claim)", r"min\(available_at\) - clock_timestamp"),
        ("rescue", r"WITH expired AS"),
        ("heartbeat", r"INSERT INTO \S+\.process "),
        ("seats read (LISTEN connection's check)", r"SELECT l\.classid"),
        ("door wait (10 s in the lock queue)", r"pg_advisory_lock\("),
        ("seat or door taken or left", r"pg_try_advisory_lock|pg_advisory_unlock|UNLISTEN|LISTEN"),
        ("charts' sample", r"queue_minute"),
        ("purge", r"DELETE FROM|WITH finished AS \( DELETE"),
        ("connection check (empty statement)", r"^statement:\s*$"),
    )
)


def kind_of(statements: list[str], before: str) -> str:
    """What a transaction was for: its *statements* (as logged), else the debug line *before* it."""
    if not statements:
        if "sinval" in before or "Catchup" in before or "cache state reset" in before:
            return CATCH_UP
        return PREPARE if before.startswith("parse ") else f"no statement (after: {before[:60]})"
    text = " | ".join(statements)
    return next((kind for kind, pattern in KINDS if pattern.search(text)), "other")


def count(lines: Iterable[str], pids: Collection[int], start: str, end: str) -> Counter[str]:
    """The transactions of the backends *pids* that ended from *start* to *end* (stamps as the log's,
    ``YYYY-MM-DD HH:MM:SS.mmm`` in its zone), by kind (:func:`kind_of`; `` (rolled back)`` added to
    the ones an ``ERROR`` ended).  Lines before *start* are read for the transactions under way then."""
    wanted = {str(pid) for pid in pids}
    statements: dict[str, list[str]] = {}  # pid -> what its open transaction ran
    before: dict[str, str] = {}  # pid -> its last debug line outside a transaction
    found: Counter[str] = Counter()
    for line in lines:
        match = LINE.match(line.rstrip("\n"))
        if match is None:
            continue
        stamp, pid, level, message = match.groups()
        if pid not in wanted or stamp > end:
            continue
        if message.startswith("StartTransaction("):
            statements[pid] = []
        elif message.startswith(("statement:", "execute ")) and level == "LOG":
            statements.setdefault(pid, []).append(message)
        elif message.startswith("CommitTransaction(") or (level == "ERROR" and pid in statements):
            ran = statements.pop(pid, [])
            if stamp >= start:
                found[kind_of(ran, before.get(pid, "")) + (" (rolled back)" if level == "ERROR" else "")] += 1
        elif (
            level == "DEBUG" and pid not in statements and not message.startswith(("bind ", "shmem_exit", "proc_exit"))
        ):
            before[pid] = message
    return found
