"""Roles: several credentials side by side, each an operator's (may act) or read-only (sees every page,
acts on nothing: the buttons are not drawn and ``POST /action`` answers 403).

The auth file (``--auth-file``, ``$DRAMATIQ_PG_DASHBOARD_AUTH``, ``auth=``) holds one credential a line,
as before (``user:password``, or a token), optionally after a role word and a space::

    # who may do what (blank lines and lines starting with # are skipped)
    operator alice:correct-horse
    read-only bob:battery-staple
    read-only 6f1c...e2          (a token: a script's, Prometheus')
    carol:staple-horse            (no role word: an operator, as a one-line file always was)

A file of one line without a role word is read as it always was.  Credentials compare in
constant time (:class:`.guards.Credentials`, one per line); the first that matches decides the role.
"""

from __future__ import annotations

import contextvars
import hashlib

from .guards import Credentials

OPERATOR = "operator"
READ_ONLY = "read-only"
ROLES = (OPERATOR, READ_ONLY)

#: The role of the request being answered (``None``: no credentials asked, the dashboard's own setting rules).
ROLE: contextvars.ContextVar[str | None] = contextvars.ContextVar("dramatiq_pg_dashboard_role", default=None)


def parse_line(line: str) -> tuple[str, str]:
    """(role, secret) of one line of the auth file."""
    word, space, rest = line.strip().partition(" ")
    if space and word in ROLES and rest.strip():
        return word, rest.strip()
    return OPERATOR, line.strip()


class RoleCredentials:
    """Every credential of the auth file with its role; the interface of :class:`.guards.Credentials`
    (``accept``, ``check``, ``fingerprint``), each answering the role (``None``: none matched)."""

    def __init__(self, text: str) -> None:
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if not lines:
            raise ValueError("the dashboard's credentials are empty")
        self.entries = [(role, Credentials(secret)) for role, secret in map(parse_line, lines)]

    def __repr__(self) -> str:
        return "RoleCredentials(" + ", ".join(f"{role} {c!r}" for role, c in self.entries) + ")"

    def accept(self, authorization: str) -> str | None:
        """The role of an ``Authorization`` header's credentials (``None``: no match)."""
        found = [role for role, c in self.entries if c.accept(authorization)]  # each compared: no early exit
        return found[0] if found else None

    def check(self, user: str, password: str) -> str | None:
        """The role of a login form's user and password (``None``: no match)."""
        found = [role for role, c in self.entries if c.check(user, password)]
        return found[0] if found else None

    def fingerprint(self) -> bytes:
        """A digest of every secret and role: a change to the file ends the sessions signed before it."""
        digest = hashlib.sha256()
        for role, c in self.entries:
            digest.update(role.encode() + b"\0" + c.fingerprint())
        return digest.digest()


def session_name(user: str, role: str) -> str:
    """What a session cookie carries for a login: the user and the role it was given."""
    return f"{role}\0{user}"


def from_session(name: str) -> tuple[str, str]:
    """(user, role) of a session cookie's name (one issued before roles existed: an operator's)."""
    role, zero, user = name.partition("\0")
    return (user, role) if zero and role in ROLES else (name, OPERATOR)
