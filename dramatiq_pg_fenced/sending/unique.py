"""Unique messages: which key a send carries, and the middleware that declares the options.

A key is per actor.  While a message of the actor holds it, another send with
the same key is not inserted and its sender gets the holder's id back (see
:meth:`.broker.PostgresBroker.enqueue`).  The database enforces it (the
partial unique index of migration 006), so it holds across processes and
hosts; this module only decides which key a send carries and refuses keys
the database could not hold.

- ``unique_key``: a message option (a ``str``; ``None`` sends without a key,
  even when the actor has one), or an actor option (a ``str`` shared by all
  its messages, or a callable given the message's ``*args, **kwargs`` that
  returns the key, or ``None`` for no key).
- ``unique_until``: ``"started"`` (the default: held while the message is
  queued, a retry waiting for its backoff included; free once a worker starts
  it) or ``"finished"`` (held while queued or running).  Either way the key
  frees when the message is acked, dead-lettered or cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dramatiq.message import Message
from dramatiq.middleware import Middleware

from ..errors import UniqueOptionError

#: The options this module reads, as actor options and as message options.
OPTIONS = frozenset({"unique_key", "unique_until"})
#: When a key frees, besides ack, dead letter and cancel.
UNTIL = ("started", "finished")
#: Longest key, in bytes of UTF-8 (a btree entry holds at most ~2.7 kB, the actor name included).
MAX_KEY_BYTES = 1000


def check_key(key: Any, where: str) -> str:
    """*key* if the database can hold it as a key; else a ``TypeError`` or ``ValueError`` saying why."""
    if not isinstance(key, str):
        raise TypeError(f"unique_key {where} must be a str (or None for no key), not {type(key).__name__}: {key!r}")
    if not key:
        raise ValueError(f"unique_key {where} is empty: use None for no key")
    if "\x00" in key:
        raise ValueError(f"unique_key {where} contains NUL, which PostgreSQL text cannot hold: {key[:80]!r}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"unique_key {where} is not valid Unicode (a lone surrogate?): {key[:80]!r}") from None
    if size > MAX_KEY_BYTES:
        raise ValueError(
            f"unique_key {where} is {size} bytes of UTF-8, over {MAX_KEY_BYTES}: hash long keys "
            f"(e.g. hashlib.sha256(key.encode()).hexdigest())"
        )
    return key


def check_until(until: Any, where: str) -> str:
    if until not in UNTIL:
        raise ValueError(f"unique_until {where} must be 'started' or 'finished', not {until!r}")
    return str(until)


def key_of(message: Message, actor_options: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """The key *message* carries and when it frees: ``(key, until)``, or ``(None, None)``.

    The message's options win over the actor's.  A send without either
    costs two dictionary lookups.
    """
    options = message.options
    if "unique_key" in options:
        key = options["unique_key"]
        where = f"of message {message.message_id}"
    elif actor_options and actor_options.get("unique_key") is not None:
        key = actor_options["unique_key"]
        where = f"of actor {message.actor_name!r}"
        if callable(key):
            key = key(*message.args, **message.kwargs)
            where = f"returned by the unique_key function of actor {message.actor_name!r}"
    else:
        return None, None
    if key is None:
        return None, None
    check_key(key, where)
    if "unique_until" in options:
        until = check_until(options["unique_until"], f"of message {message.message_id}")
    else:
        until = check_until((actor_options or {}).get("unique_until", "started"), f"of actor {message.actor_name!r}")
    return key, until


class UniqueMessages(Middleware):
    """Declares ``unique_key`` and ``unique_until`` as actor options; refuses bad ones when an actor is declared.

    Installed by :class:`~.broker.PostgresBroker`; it does nothing per message
    (the broker reads the options as it builds the row).
    """

    @property
    def actor_options(self) -> set[str]:
        return set(OPTIONS)

    def before_declare_actor(self, broker: Any, actor: Any) -> None:
        options = actor.options
        where = f"of actor {actor.actor_name!r}"
        key: str | Callable[..., Any] | None = options.get("unique_key")
        try:
            if key is not None and not callable(key):
                check_key(key, where)
            if "unique_until" in options:
                check_until(options["unique_until"], where)
        except (TypeError, ValueError) as e:
            raise UniqueOptionError(str(e)) from None
