"""Every SQL statement the broker runs, bound in one place; written by concern in ``queries/``.

Statements are templates over ``{schema}``; :func:`statements` binds them to
a quoted schema identifier, each once per schema as it is first read, in a typed :class:`Statements`.
Values always travel as parameters.  Fenced statements carry
``delivery = %s AND state = 'running'``: ``delivery`` is a random token each
claim draws (migration 003), so no two deliveries ever share one, even when a
message id is inserted again or a claim is lost in a crash and its attempt
number handed out twice.  Zero rows back means the caller's delivery is stale.

A message row moves between four states (:class:`~.fencing.State`).  Every
legal transition, and the one statement that makes it:

=========  =========  ===============  ==============================================
from       to         statement        who, and the fence
=========  =========  ===============  ==============================================
(none)     queued     enqueue(_one)    a producer; ``ON CONFLICT DO NOTHING`` by id
(none)     queued     enqueue_unique   the same, with a key; nothing while the key is held
(none)     queued     schedule_tick    a scheduler; once per (schedule, tick), by the
                                       database clock (see schedules.py)
queued     running    claim            a consumer; attempt + 1, a new token, a lease; not if paused
running    (deleted)  ack              the outcome writer; fenced on the token
running    history    ack_keep         the same, and the row moves to ``history``
running    committed  fence_begin      the actor's fenced transaction, as it begins; fenced
                                       on the token; the row stays locked, and the state
                                       commits with the actor's writes or not at all
committed  (deleted)  committed_done   the outcome writer; fenced on the token; as ack
committed  history    committed_done_keep  the same, and the row moves to ``history``
committed  history    finish_committed maintenance; its lease lapsed (its process stopped
                                       extending it: died, stopped, cut off) before its
                                       writer finished it (``COMMITTED_GRACE_LEASES``
                                       leases after)
running    dead       nack             the outcome writer; fenced on the token
running    queued     retry            the outcome writer; fenced; new payload, due time
running    queued     requeue          shutdown release; fenced; attempt and place kept
running    queued     release_unseen   a consumer after a lost claim response; its rows
                                       only; lost_deliveries + 1
running    dead       release_unseen   the same, at ``max_deliveries`` lost deliveries
running    queued     rescue           maintenance; lease expired (any process);
                                       lost_deliveries + 1
running    dead       rescue           the same, at ``max_deliveries`` lost deliveries
running    running    extend           the lease keeper; fenced; lease pushed out
committed  committed  extend           the same, while its actor runs on after its block
                                       and until its outcome is written
queued     cancelled  cancel           an operator; any attempt (administrative), of the
                                       version seen if one is given (its seq)
running    cancelled  cancel           the same; fences out that attempt's outcome; the
                                       lease stays while the actor runs (see below)
cancelled  cancelled  extend_cancelled the lease keeper; fenced; while its actor runs
cancelled  cancelled  cancel_ended     the outcome writer, start gate or keeper; fenced;
                                       the cancelled delivery ended (lease cleared)
dead       queued     redrive          an operator; fenced on the row version read
                                       (:func:`version`: seq and xmin)
cancelled  queued     redrive          the same; not while its actor still runs
dead       (deleted)  purge_finished   maintenance, after ``dead_message_ttl``
cancelled  (deleted)  purge_finished   maintenance, after ``dead_message_ttl``
queued     (deleted)  purge_queue_*    an operator; never a running row
dead       (deleted)  purge_queue_*    an operator
cancelled  (deleted)  purge_queue_*    an operator
history    (deleted)  purge_history    maintenance, after ``keep_finished``
=========  =========  ===============  ==============================================

Unique keys (migration 006): a row with ``unique_key`` *holds* it while
queued, and while running if ``unique_until = 'finished'`` (the predicate of
``message_unique_idx``, :data:`_HELD`).  Every transition above keeps the
index's meaning: inserts do nothing on a held key; claim, ack, nack, cancel
and the purges only take rows out of the held set (or keep a 'finished' row
in it); the transitions *into* it from a row that did not hold its key
(``retry``, ``requeue``, ``release_unseen`` and ``rescue`` of a 'started'
row, ``redrive`` of any) take the key back only if no other row with the
key is queued or running (redrive: exists at all), else the row goes back
to the queue without its key (:func:`_retake`): the newer message keeps the
key, and both run.

``lost_deliveries`` counts the deliveries that ended without any outcome
(migration 004): only ``rescue`` and ``release_unseen`` raise it; a retry or
a release at shutdown is an outcome.

A cancelled row whose actor still runs keeps its token, its holder and a
lease in the future (``lease_expires_at``): the cancel leaves the lease,
the keeper extends it while the actor runs (``extend_cancelled``), and the
end of that delivery clears it (``cancel_ended``: its fenced-out outcome,
the start gate's refusal, or the keeper for one that never started).  A
crashed worker's lease lapses.  Operators see "cancel requested, still
running" while it is in the future (:data:`STILL_RUNNING`); a re-drive or a
purge leaves such a row alone.

``history`` is a table of its own (acked messages, state ``done`` for
readers); ``paused_queue`` and ``throughput`` (outcomes per minute) serve the
operator's console.

``attempt_log`` (migration 023) records each delivery that ends without an
ack, while history is kept (``keep_finished`` > 0): the ``_logged`` variants
of ``retry`` ('retried'), ``nack`` ('dead'), ``rescue`` ('lease lost'),
``release_unseen`` ('claim lost') and ``requeue`` ('requeued') insert it in a
CTE of the same statement, for the rows the fenced update took only;
``attempt_ended`` records the writes the fence refused ('fenced out') and the
end of a delivery whose message was cancelled while it ran ('cancelled'),
in the stale-write report.  ``purge_attempts`` deletes it with the history.
A re-drive clears the row's token: the next claim draws a new one, and a
late write of the old delivery is a stale one.

Only the enqueue waits for the WAL flush.  Unless ``durable_outcomes=True``,
``claim`` and ``extend`` run as their ``_relaxed`` variants, and the outcome
writer's and shutdown release's transactions (``ack``, ``nack``, ``retry``,
``requeue`` and what rides with them) begin with ``begin_relaxed``, and a
batch of acks alone runs as ``ack_relaxed`` (one statement, one round trip): a
crash may lose the last of them, and their messages run again (see _claim).
``rescue``, ``release_unseen``, ``cancel`` and the purges stay durable (rare,
off the hot path).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from psycopg import sql

from .queries import claim, console, enqueue, lifecycle, outcomes, processes, results
from .queries.console import FINISHED_STATES as FINISHED_STATES

# What the rest of the package (and the tests) import from here, wherever the statements' pieces live.
from .queries.pieces import (  # noqa: F401
    _BY_IDS,
    _DURABLE,
    _HELD,
    _LIVE_PROCESS,
    _LOST,
    _LOST_DEAD,
    _RELAXED,
    _STATE,
    BIGINT_MAX,
    BIGINT_MIN,
    OVERVIEW_COLUMNS,
    QUEUE_RE,
    SCHEMA_RE,
    STILL_RUNNING,
    _held,
    _retake,
    _still_running,
    check_message_id,
    check_queue,
    check_schema,
    version,
)

#: The templates of the statements a worker runs, by name, loaded with this module.
_TEMPLATES: dict[str, str] = {
    **lifecycle.TEMPLATES,
    **enqueue.TEMPLATES,
    **claim.TEMPLATES,
    **outcomes.TEMPLATES,
    **console.TEMPLATES,
    **processes.TEMPLATES,
    **results.TEMPLATES,
}
#: The modules of ``queries/`` whose statements a worker never runs (the relay's, the schedules', the
#: operators' search, charts' timings and health), or rarely (the reindex chore's): imported when one of their statements is first read.
_LATER = ("relay", "schedules", "search", "timings", "health", "reindex")


@cache
def templates() -> dict[str, str]:
    """Every statement's template by name: the worker's and those of :data:`_LATER` (imported now)."""
    found = dict(_TEMPLATES)
    for name in _LATER:
        found.update(importlib.import_module(f"{__package__}.queries.{name}").TEMPLATES)
    return found


def results_channel(schema: str) -> str:
    """The NOTIFY channel of result writes (payload: the result key)."""
    return f"{check_schema(schema)}_results"


def rate_limits_channel(schema: str) -> str:
    """The NOTIFY channel of rate-limiter events (payload: the event key)."""
    return f"{check_schema(schema)}_rate_limits"


class Statements:
    """Every statement, bound to one schema: bytes ready to execute; read-only.

    A plain class, not a frozen dataclass: generating a dataclass's methods
    for a hundred fields took a few milliseconds of every worker's start.
    Each statement is bound when first read, and kept: a worker binds the
    few dozen it runs, not all of them (binding the 190-odd took about a
    millisecond of every broker's construction), and never imports the
    templates of the statements it does not run (:data:`_LATER`).
    """

    def __init__(self, quoted_schema: str) -> None:
        self.__dict__["_schema"] = quoted_schema

    if not TYPE_CHECKING:  # for mypy, only the names declared below exist

        def __getattr__(self, name: str) -> bytes:
            """Bind statement *name* (called once per name: the bound bytes are kept in the instance)."""
            template = _TEMPLATES.get(name)
            if template is None and name in _DECLARED:
                template = templates().get(name)
            if template is None:
                raise AttributeError(f"no statement named {name!r}")
            bound = self.__dict__[name] = bind(template, self.__dict__["_schema"])
            return bound

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Statements are read-only (setting {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Statements are read-only (deleting {name!r})")

    notify: bytes
    turn_take: bytes
    turn_seats: bytes
    turn_door: bytes
    turn_door_leave: bytes
    turn_door_patience: bytes
    claim: bytes
    claim_relaxed: bytes
    claim_telling: bytes
    claim_telling_relaxed: bytes
    claim_fair: bytes
    claim_fair_relaxed: bytes
    claim_fair_telling: bytes
    claim_fair_telling_relaxed: bytes
    behind_window: bytes
    next_due: bytes
    server_clock: bytes
    release_unseen: bytes
    release_unseen_logged: bytes
    ack: bytes
    ack_keep: bytes
    ack_relaxed: bytes
    ack_keep_relaxed: bytes
    fence_lock: bytes
    fence_begin: bytes
    committed_done: bytes
    committed_done_relaxed: bytes
    committed_done_keep: bytes
    committed_done_keep_relaxed: bytes
    committed_seen: bytes
    finish_committed: bytes
    finish_committed_keep: bytes
    relay_look: bytes
    relay_take: bytes
    relay_put: bytes
    relay_mark: bytes
    relay_dead: bytes
    relay_waiting: bytes
    relay_left: bytes
    relay_purge: bytes
    nack: bytes
    nack_logged: bytes
    attempt_ended: bytes
    retry: bytes
    retry_logged: bytes
    requeue: bytes
    requeue_logged: bytes
    extend: bytes
    delivery_states: bytes
    extend_relaxed: bytes
    begin_relaxed: bytes
    current: bytes
    count_stale: bytes
    counters: bytes
    rescue: bytes
    rescue_logged: bytes
    purge_finished: bytes
    cancel: bytes
    vacuum: bytes
    message_size: bytes
    compact: bytes
    file_node: bytes
    may_vacuum: bytes
    reindex_indexes: bytes
    reindex_old_transactions: bytes
    cancel_lock_timeout: bytes
    state_of: bytes
    held_among: bytes
    still_held_many: bytes
    inspect: bytes
    flush: bytes
    pending: bytes
    dead_letters: bytes
    queue_stats: bytes
    enqueue: bytes
    enqueue_relaxed: bytes
    enqueue_one: bytes
    enqueue_one_relaxed: bytes
    enqueue_unique: bytes
    enqueue_unique_relaxed: bytes
    enqueue_fair: bytes
    enqueue_fair_relaxed: bytes
    unique_holders: bytes
    overview: bytes
    fair_keys: bytes
    fair_keys_of: bytes
    fair_keys_plan: bytes
    no_jit: bytes
    pause: bytes
    resume: bytes
    paused: bytes
    paused_among: bytes
    extend_cancelled: bytes
    cancel_ended: bytes
    still_running: bytes
    known_queues: bytes
    redrive_read: bytes
    redrive: bytes
    redrive_ids_dead: bytes
    redrive_ids_cancelled: bytes
    inspect_history: bytes
    inspect_attempts: bytes
    inspect_audit: bytes
    purge_history: bytes
    purge_attempts: bytes
    purge_throughput: bytes
    outcome_totals: bytes
    purge_queue_queued: bytes
    purge_queue_dead: bytes
    purge_queue_cancelled: bytes
    purge_queue_done: bytes
    count_queue_queued: bytes
    count_queue_dead: bytes
    count_queue_cancelled: bytes
    count_queue_done: bytes
    list_queued: bytes
    list_running: bytes
    list_dead: bytes
    list_cancelled: bytes
    list_done: bytes
    result_get: bytes
    result_drop_expired: bytes
    result_store: bytes
    result_store_fenced: bytes
    result_purge: bytes
    rate_limit_add: bytes
    rate_limit_upsert: bytes
    rate_limit_update: bytes
    rate_limit_placeholders: bytes
    rate_limit_lock: bytes
    rate_limit_set: bytes
    rate_limit_notify: bytes
    rate_limit_event: bytes
    rate_limit_purge: bytes
    schedule_versions_lock: bytes
    schedule_versions_seen: bytes
    schedule_winners: bytes
    schedule_declare: bytes
    schedule_outdated: bytes
    schedule_read: bytes
    schedule_tick: bytes
    schedule_list: bytes
    schedule_forget: bytes
    schedule_ticks: bytes
    schedule_purge_ticks: bytes
    schedule_pause: bytes
    schedule_resume: bytes
    schedule_run_request: bytes
    schedule_run_seen: bytes
    schedule_exists: bytes
    schedule_runs_pending: bytes
    schedule_run_take: bytes
    schedule_audit: bytes
    process_beat: bytes
    process_delete: bytes
    process_list: bytes
    process_purge: bytes
    process_busy: bytes
    process_started: bytes
    bulk_live: bytes
    bulk_kept: bytes
    bulk_purge_live: bytes
    bulk_purge_kept: bytes
    bulk_run_now: bytes
    audit_begin: bytes
    audit_end: bytes
    audit_page: bytes
    search_live: bytes
    search_kept: bytes
    search_id: bytes
    sample_claim: bytes
    sample_budget: bytes
    sample_budget_end: bytes
    sample_depth: bytes
    sample_outcomes: bytes
    sample_purge: bytes
    series: bytes
    timings: bytes
    sparklines: bytes
    health_activity: bytes
    health_visibility: bytes
    health_slots: bytes
    health_prepared: bytes
    health_tables: bytes
    health_history: bytes


@cache
def statements(schema: str) -> Statements:
    """The statements of *schema* (checked, quoted once), one object per schema; each statement is bound
    as it is first read (see :class:`Statements`).

    ``str.format`` puts the quoted name in, as ``psycopg.sql.SQL.format`` would (the same
    ``{{``/``}}`` escapes; a template's only field is ``{schema}``): composing each of the 140-odd
    templates with psycopg took about 5 ms of every worker's start-up, measured; this takes under 1."""
    return Statements(sql.Identifier(check_schema(schema)).as_string(None))


#: The statements' names (the annotations of :class:`Statements`).
_DECLARED = frozenset(Statements.__annotations__)


def bind(text: str, schema: str) -> bytes:
    """Put the quoted *schema* into a template; whitespace folded for the logs."""
    return " ".join(text.split()).format(schema=schema).encode()
