"""Fair shares between keys: which fairness key and weight a send carries, and which queues are fair.

A queue is *fair* when one of its actors declares ``fairness_key`` (known as
actors are declared, in every process that declares them: senders and
workers).  Its consumers claim by weighted round robin across keys (the fair
claim, ``db/queries/claim.py``) instead of the usual order; every other
queue claims exactly as before and its sends carry no key.

- ``fairness_key``: an actor option (a ``str`` shared by all its messages, or
  a callable given the message's ``*args, **kwargs`` that returns the key, or
  ``None``), or a message option (a ``str``, or ``None``).  The message's
  option wins.  In a fair queue a message without a key gets the key ``""``:
  the keyless messages share one key's share, never more, never starved.
- ``fairness_weight``: an actor option, a positive number or a callable given
  the key that returns one (``None``: the weight table's, else 1).  Without
  it, the queue's ``fairness_weight`` table (migration 021) gives the weight
  of a key, 1 when absent.  Read at enqueue: a change applies to later sends.

The key is a column of the row (``fairness_key``), set at enqueue with its
place in the round robin (``fair_tag``, start-time fair queuing): see
docs/fairness.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dramatiq.message import Message
from dramatiq.middleware import Middleware

from ..errors import FairnessOptionError
from .unique import MAX_KEY_BYTES

#: The options this module reads.
OPTIONS = frozenset({"fairness_key", "fairness_weight"})
#: The key of a message without one in a fair queue.
NO_KEY = ""


def check_key(key: Any, where: str) -> str:
    """*key* if the database can hold it as a fairness key; else ``TypeError``/``ValueError`` saying why."""
    if not isinstance(key, str):
        raise TypeError(f"fairness_key {where} must be a str (or None), not {type(key).__name__}: {key!r}")
    if "\x00" in key:
        raise ValueError(f"fairness_key {where} contains NUL, which PostgreSQL text cannot hold: {key[:80]!r}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"fairness_key {where} is not valid Unicode (a lone surrogate?): {key[:80]!r}") from None
    if size > MAX_KEY_BYTES:
        raise ValueError(f"fairness_key {where} is {size} bytes of UTF-8, over {MAX_KEY_BYTES}: hash long keys")
    return key


def check_weight(weight: Any, where: str) -> float:
    number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not number or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"fairness_weight {where} must be a finite number > 0, not {weight!r}")
    return float(weight)


def key_of(message: Message, actor_options: dict[str, Any] | None, fair: bool) -> tuple[str | None, float | None]:
    """The fairness key and weight *message* carries: ``(None, None)`` outside a fair queue (*fair*),
    else ``(key, weight)``, the weight ``None`` when the table decides.  A send to a queue that is not
    fair costs one set lookup (the caller's) and nothing here."""
    if not fair:
        return None, None
    options = message.options
    declared = actor_options or {}
    if "fairness_key" in options:
        key = options["fairness_key"]
        where = f"of message {message.message_id}"
    else:
        key = declared.get("fairness_key")
        where = f"of actor {message.actor_name!r}"
        if callable(key):
            key = key(*message.args, **message.kwargs)
            where = f"returned by the fairness_key function of actor {message.actor_name!r}"
    key = NO_KEY if key is None else check_key(key, where)
    weight = declared.get("fairness_weight")
    if callable(weight):
        weight = weight(key)
    return key, None if weight is None else check_weight(weight, f"of key {key!r} of actor {message.actor_name!r}")


class FairShares(Middleware):
    """Declares ``fairness_key`` and ``fairness_weight`` as actor options, refuses bad ones at ``@actor``,
    and keeps :attr:`queues`, the fair queues (those with an actor that declares ``fairness_key``).

    Installed by :class:`~.broker.PostgresBroker`; it does nothing per message.
    """

    def __init__(self) -> None:
        self.queues: set[str] = set()

    @property
    def actor_options(self) -> set[str]:
        return set(OPTIONS)

    def before_declare_actor(self, broker: Any, actor: Any) -> None:
        options = actor.options
        where = f"of actor {actor.actor_name!r}"
        key: str | Callable[..., Any] | None = options.get("fairness_key")
        weight = options.get("fairness_weight")
        try:
            if key is not None and not callable(key):
                check_key(key, where)
            if weight is not None and not callable(weight):
                check_weight(weight, where)
        except (TypeError, ValueError) as e:
            raise FairnessOptionError(str(e)) from None
        if "fairness_key" in options:
            self.queues.add(actor.queue_name)
