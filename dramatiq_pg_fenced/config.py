"""Defaults, defined once (docs/configuration.md lists them), and
the settings the broker hands to its parts."""

from __future__ import annotations

from typing import NamedTuple

#: This package's version (the wheel's metadata is built from it: pyproject's ``[tool.hatch.version]``).
__version__ = "0.1.0"

DEFAULT_SCHEMA = "dramatiq"
DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_RESCUE_INTERVAL = 1.0
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
DEFAULT_DEAD_MESSAGE_TTL = 7 * 86400
#: Seconds acked messages stay in the history table (0: none kept).  One hour
#: answers "what happened to message X" through an incident and is bounded on
#: disk; docs/operating.md ("What history costs") gives the measured cost per message.
DEFAULT_KEEP_FINISHED = 3600
DEFAULT_POOL_MAX_SIZE = 8
DEFAULT_CONNECT_TIMEOUT = 5
#: Deliveries of one message that may end without an outcome (the worker
#: crashed or lost its lease) before it is dead-lettered instead of re-queued.
DEFAULT_MAX_DELIVERIES = 10
#: The longest error text stored with a message (``last_error``), in bytes of
#: UTF-8.  Dramatiq's traceback option (30 frames) is a few KiB, so a real
#: traceback is never cut; an exception whose text runs to megabytes would
#: otherwise be written into the hot message table with every retry and shown
#: by every ``inspect``.  Longer texts keep their head and their tail (where
#: a Python traceback names the exception).
MAX_ERROR_BYTES = 64 * 1024
#: The results and rate-limit backends: their own pools are smaller.
DEFAULT_BACKEND_POOL_MAX_SIZE = 4
#: Seconds between purges of expired results and rate-limit keys, per process.
DEFAULT_PURGE_INTERVAL = 60.0
#: Do claims, acks, nacks, retries, lease extensions and shutdown releases wait
#: for the WAL flush?  Not by default: one lost in a database crash makes its
#: message run again (at-least-once allows it); only the enqueue must be
#: durable, and it always is (unless ``synchronous_commit=False``).
DEFAULT_DURABLE_OUTCOMES = False
#: Does cancelling a running message interrupt its actor (``MessageCancelled``
#: raised in its thread)?  Not by default: an actor opts in with
#: ``@dramatiq.actor(interrupt_on_cancel=True)``, or every actor with the broker's option.
DEFAULT_INTERRUPT_ON_CANCEL = False


class Settings(NamedTuple):
    """What the consumer, lease keeper, outcome writer and maintenance loop
    need to know of the broker's configuration (never the broker itself).

    Read-only.  A named tuple, not a frozen dataclass: making a frozen dataclass's
    methods took about a millisecond of every process's ``import dramatiq_pg_fenced``.
    """

    schema: str = DEFAULT_SCHEMA
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    poll_interval: float = DEFAULT_POLL_INTERVAL
    rescue_interval: float = DEFAULT_RESCUE_INTERVAL
    listen: bool = True
    dead_message_ttl: int = DEFAULT_DEAD_MESSAGE_TTL
    #: Deliveries without an outcome before a message is dead-lettered; ``None``: no limit.
    max_deliveries: int | None = DEFAULT_MAX_DELIVERIES
    keep_finished: int = DEFAULT_KEEP_FINISHED
    #: ``False``: claims, outcomes, extensions and releases commit without waiting for the WAL flush.
    durable_outcomes: bool = DEFAULT_DURABLE_OUTCOMES
    #: Actors without their own ``interrupt_on_cancel`` option: are they interrupted by a cancel?
    interrupt_on_cancel: bool = DEFAULT_INTERRUPT_ON_CANCEL

    @property
    def channel(self) -> str:
        """The NOTIFY channel that rings when a queue has due messages."""
        return f"{self.schema}_wake"
