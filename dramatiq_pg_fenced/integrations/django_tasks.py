"""Django's Tasks framework on this broker: ``@task`` functions become messages, run by ``dramatiq`` workers.

Settings (beside ``DRAMATIQ_BROKER``, whose broker is a :class:`~.django.DjangoPostgresBroker`)::

    TASKS = {
        "default": {
            "BACKEND": "dramatiq_pg_fenced.integrations.django_tasks.PostgresBackend",
            "QUEUES": ["default", "emails"],        # each a Dramatiq queue the workers consume
            "OPTIONS": {"result_ttl": 7 * 24 * 3600 * 1000},   # optional, see PostgresBackend
        }
    }

- Every task is a message of one generic actor (:data:`ACTOR_NAME`) in the task's queue; the worker
  imports the task by its module path and calls it.  Stock workers run it
  (``manage.py rundramatiq``, or ``dramatiq django_dramatiq.setup dramatiq_pg_fenced.integrations.django_tasks
  yourapp.tasks``): the backend declares the actor and the queues when it is first built (the
  import of a module with a ``@task``, or of this module under configured settings).
- ``priority`` is the row's claim order (higher first), ``run_after`` a delay by the sender's
  clock, ``queue_name`` the message's queue; they are validated as ``BaseTaskBackend`` does.
- Enqueued inside ``transaction.atomic()`` the task is a row of that transaction (``outbox()``'s
  mechanism: ``broker.transaction(conn)`` on Django's connection): it exists if and only if the
  transaction commits, which is what ``enqueue_on_commit`` asks for, without its gap (a crash
  between the commit and the send).  ``enqueue_on_commit=False`` (``OPTIONS``, or the task's:
  ``task.using(enqueue_on_commit=False)``, or ``@task(enqueue_on_commit=False)`` where ``@task`` passes
  it on) writes it at once on the broker's own connection instead.
- ``async def`` tasks run on the worker's thread (``Task.call``); ``aenqueue``/``aget_result`` are
  Django's (the sync methods in a thread).
- :meth:`PostgresBackend.get_result` reads the message's row (or its history) for the status and
  the errors, and the results backend for the return value: its writes are fenced on the
  attempt, so a delivery that lost its lease never replaces the current attempt's result.

Supported: Django 6.0 and 6.1's ``django.tasks`` (Python 3.12+), else the ``django-tasks`` backport 0.12
on Django 4.2 to 5.2 (``django_tasks``, the API of Django 6.0's), imported when ``django.tasks`` is not
there.  Tested (``.ci/run``): the backport 0.12.0 on Django 5.2 (Python 3.11), and Django 6.1 and 6.0's
own on Python 3.12.  What differs between them and is handled here: Django 6.0's ``@task`` passes no
keyword of a backend's on (hence ``PostgresTask.using(enqueue_on_commit=...)``), its ``Task`` fields
have no defaults (tasks are made with ``dataclasses.replace``, never built field by field), and
Django 6 registers its system checks itself (the backport needs ``django_tasks`` in ``INSTALLED_APPS``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import datetime
from typing import Any

import dramatiq
import psycopg
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils import timezone
from django.utils.module_loading import import_string
from dramatiq.results import ResultBackend, ResultFailure, ResultMissing, Results
from psycopg import sql

from ..broker import PostgresBroker
from ..core import delivery
from ..features.results import PostgresBackend as PostgresResultBackend

try:  # Django 6.0+
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # the backport (pip install django-tasks)
    from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends  # type: ignore[no-redef]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef]
    from django_tasks.base import Task, TaskError  # type: ignore[no-redef]
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist  # type: ignore[no-redef]
    from django_tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[no-redef]

__all__ = ["ACTOR_NAME", "PostgresBackend", "PostgresTask", "run_task"]

#: The name of the one actor every task's message is for.
ACTOR_NAME = "django_task"
#: What this process is called in a task's ``worker_ids``.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
#: The actor's options by default (those the broker's middleware knows): Django's tasks are not retried.
DEFAULT_ACTOR_OPTIONS = {"max_retries": 0}
#: How long a result is kept (ms) when this backend adds the Results middleware itself: 7 days.
DEFAULT_RESULT_TTL = 7 * 24 * 3600 * 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class PostgresTask(Task):  # type: ignore[misc]
    """Django's ``Task``, which also takes ``enqueue_on_commit``: ``task.using(enqueue_on_commit=False)``
    on every version, and ``@task(enqueue_on_commit=False)`` where ``@task`` passes its other keyword
    arguments on (the backport, Django 6.1+; Django 6.0's raises ``TypeError``).  ``None``: the
    backend's ``OPTIONS["enqueue_on_commit"]``."""

    enqueue_on_commit: bool | None = None

    def using(
        self,
        *,
        priority: int | None = None,
        queue_name: str | None = None,
        run_after: datetime | None = None,
        backend: str | None = None,
        enqueue_on_commit: bool | None = None,
    ) -> Any:
        """Django's ``using()``, and ``enqueue_on_commit`` (``None``: as it was)."""
        task = super().using(priority=priority, queue_name=queue_name, run_after=run_after, backend=backend)
        if enqueue_on_commit is not None:
            task = dataclasses.replace(task, enqueue_on_commit=enqueue_on_commit)
        return task


class PostgresBackend(BaseTaskBackend):
    """A task backend whose tasks are messages of this broker (Dramatiq's global broker, which
    ``django_dramatiq`` builds from ``DRAMATIQ_BROKER``; a :class:`~.broker.PostgresBroker`).

    ``OPTIONS``:
      enqueue_on_commit: ``True`` (default): inside ``atomic()``, a task is a row of the transaction;
        ``False``: written at once on the broker's own connection.
      actor_options: the generic actor's Dramatiq options (``max_retries``, ``time_limit``...);
        ``{"max_retries": 0}`` by default (a failed task is FAILED at once).
      result_ttl: ms a result is kept, when the broker has no ``Results`` middleware and this backend
        adds one (on a fenced :class:`~.features.results.PostgresBackend`); 7 days by default.
      database: the alias of Django's connection for the transactions (the broker's, else ``default``).
    """

    task_class = PostgresTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.enqueue_on_commit = bool(self.options.get("enqueue_on_commit", True))
        self.broker = _broker()
        self.using = self.options.get("database") or getattr(self.broker, "django_database", DEFAULT_DB_ALIAS)
        self.results = _results(self.broker, int(self.options.get("result_ttl", DEFAULT_RESULT_TTL)))
        self.actor = _declare(self.broker, self.options.get("actor_options"))
        for queue in sorted(self.queues):
            self.broker.declare_queue(queue)

    # -- enqueue --------------------------------------------------------------------
    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        result = TaskResult(
            task=task, id="", status=TaskResultStatus.READY, enqueued_at=None, started_at=None, finished_at=None,
            last_attempted_at=None, args=list(args), kwargs=dict(kwargs), backend=self.alias, errors=[],
            worker_ids=[],
        )  # fmt: skip
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name=task.queue_name,
            actor_name=ACTOR_NAME,
            args=(task.module_path, result.args, result.kwargs),
            kwargs={},
            options={"django_task": _options_of(task, self.alias)},
        )
        delay = None
        if task.run_after is not None:
            delay = max(0, int((task.run_after - timezone.now()).total_seconds() * 1000))
        on_commit = getattr(task, "enqueue_on_commit", None)
        on_commit = self.enqueue_on_commit if on_commit is None else on_commit
        django_conn = transaction.get_connection(self.using)
        if on_commit and django_conn.in_atomic_block:
            with transaction.atomic(using=self.using, savepoint=False):  # outbox()'s mechanism
                conn = django_conn.connection
                if not isinstance(conn, psycopg.Connection):
                    raise ImproperlyConfigured(
                        "the tasks backend needs Django on psycopg 3 (pip install 'psycopg[binary]')"
                    )
                self._write(conn, message, delay, task.priority)
        else:
            with self.broker.database.connection() as conn, conn.transaction():
                self._write(conn, message, delay, task.priority)
        object.__setattr__(result, "id", message.message_id)
        object.__setattr__(result, "enqueued_at", timezone.now())
        task_enqueued.send(type(self), task_result=result)
        return result

    def _write(
        self, conn: psycopg.Connection, message: dramatiq.Message[Any], delay: int | None, priority: int
    ) -> None:
        """The task's row on *conn*, in its transaction; its claim order from the task's priority
        (Django's higher first is the broker's lower first), set in the same transaction."""
        with self.broker.transaction(conn):
            self.broker.enqueue(message, delay=delay)
        if priority:
            conn.execute(
                sql.SQL("UPDATE {}.message SET priority = %s WHERE message_id = %s AND state = 'queued'").format(
                    sql.Identifier(self.broker.schema)
                ),
                [-priority, message.message_id],
            )

    # -- results --------------------------------------------------------------------
    def get_result(self, result_id: str) -> TaskResult:
        """The task's result as the database has it now (committed rows only)."""
        try:
            info = self.broker.inspect(result_id)
        except ValueError:
            info = None
        if info is None or info.get("actor_name") != ACTOR_NAME or "args" not in info:
            raise TaskResultDoesNotExist(result_id)
        path, args, kwargs = info["args"]
        task = _task_at(path)
        options = (info.get("options") or {}).get("django_task") or {}
        run_after = options.get("run_after")
        task = dataclasses.replace(
            task,
            queue_name=info["queue_name"],
            priority=options.get("priority", task.priority),
            run_after=datetime.fromisoformat(run_after) if run_after else None,
        )
        status, errors, value = self._outcome(info, task)
        holder = info.get("lease_holder") or WORKER_ID
        result = TaskResult(
            task=task, id=info["message_id"], status=status, enqueued_at=info.get("enqueued_at"),
            started_at=info.get("claimed_at"), finished_at=info.get("finished_at"),
            last_attempted_at=info.get("claimed_at"), args=args, kwargs=kwargs, backend=self.alias, errors=errors,
            worker_ids=[holder] * int(info.get("attempt") or 0),
        )  # fmt: skip
        object.__setattr__(result, "_return_value", value)
        return result

    def _outcome(self, info: dict[str, Any], task: Task) -> tuple[Any, list[Any], Any]:
        """(status, errors, return value) of the message described by *info* (``inspect``)."""
        state = info["state"]
        errors = [_error(info["last_error"])] if info.get("last_error") else []
        if state == "done":
            return TaskResultStatus.SUCCESSFUL, errors, self._value(info)
        if state == "dead":
            return TaskResultStatus.FAILED, errors, None
        if state == "cancelled":  # no status of Django's says cancelled: a failure, said so
            cancelled = getattr(TaskResultStatus, "CANCELLED", TaskResultStatus.FAILED)
            note = TaskError(exception_class_path="dramatiq_pg_fenced.core.interrupt.MessageCancelled",
                             traceback=f"message {info['message_id']} was cancelled")  # fmt: skip
            return cancelled, [*errors, note], None
        if state in ("running", "committed"):  # (committed: its outcome is not written yet)
            return TaskResultStatus.RUNNING, errors, None
        return TaskResultStatus.READY, errors, None

    def _value(self, info: dict[str, Any]) -> Any:
        """The stored return value (``None`` when none is: expired, or no results backend)."""
        if self.results is None:
            return None
        message: dramatiq.Message[Any] = dramatiq.Message(queue_name=info["queue_name"], actor_name=ACTOR_NAME, args=(), kwargs={},
                                   options={}, message_id=info["message_id"])  # fmt: skip
        try:
            return self.results.get_result(message)
        except (ResultMissing, ResultFailure):
            return None

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        found: list[checks.CheckMessage] = list(super().check(**kwargs))
        if not self.queues:
            found.append(checks.Error(
                f"TASKS[{self.alias!r}]['QUEUES'] is empty: name every queue, so that workers consume them",
                id="dramatiq_pg_fenced.E001",
            ))  # fmt: skip
        return found


def run_task(task_path: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The generic actor: import the task at *task_path* and call it; its return value is the result."""
    task = _task_at(task_path)
    running = delivery.running()
    attempt = running.attempt if running is not None else 1
    now = timezone.now()
    result = TaskResult(
        task=task, id=running.message_id if running is not None else "", status=TaskResultStatus.RUNNING,
        enqueued_at=None, started_at=now, finished_at=None, last_attempted_at=now, args=args, kwargs=kwargs,
        backend=task.backend, errors=[], worker_ids=[WORKER_ID] * attempt,
    )  # fmt: skip
    task_started.send(PostgresBackend, task_result=result)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except BaseException:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        object.__setattr__(result, "finished_at", timezone.now())
        task_finished.send(PostgresBackend, task_result=result)
        raise
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(PostgresBackend, task_result=result)
    return value


def _broker() -> PostgresBroker:
    broker = dramatiq.get_broker()
    if not isinstance(broker, PostgresBroker):
        raise ImproperlyConfigured(f"the tasks backend needs a PostgresBroker (DRAMATIQ_BROKER), not a "
                                   f"{type(broker).__name__}")  # fmt: skip
    return broker


def _results(broker: PostgresBroker, ttl: int) -> ResultBackend | None:
    """The broker's results backend; a fenced one of ours on the broker, added with ``Results``, if it has none."""
    for middleware in broker.middleware:
        if isinstance(middleware, Results):
            return middleware.backend  # type: ignore[no-any-return]
    if ACTOR_NAME in broker.actors:
        return None  # declared before (another backend): its actor stores no result we could add now
    backend = PostgresResultBackend(broker=broker)
    broker.add_middleware(Results(backend=backend, result_ttl=ttl))
    return backend


def _declare(broker: PostgresBroker, options: dict[str, Any] | None) -> dramatiq.Actor:
    """The generic actor on *broker*, declared once per broker."""
    if ACTOR_NAME in broker.actors:
        return broker.get_actor(ACTOR_NAME)  # type: ignore[no-any-return]
    known = broker.actor_options
    given = {k: v for k, v in DEFAULT_ACTOR_OPTIONS.items() if k in known}
    given.update(options or {})
    if "store_results" in known:
        given.setdefault("store_results", True)
    return dramatiq.Actor(run_task, actor_name=ACTOR_NAME, queue_name="default", priority=0, broker=broker,
                          options=given)  # fmt: skip


def _options_of(task: Task, alias: str) -> dict[str, Any]:
    run_after = task.run_after.isoformat() if task.run_after is not None else None
    return {"backend": alias, "priority": task.priority, "run_after": run_after}


def _task_at(path: str) -> Task:
    """The ``Task`` a module path names (``@task`` binds the function's name to it)."""
    try:
        found = import_string(path)
    except ImportError as e:
        raise InvalidTaskError(f"no task at {path!r}: {e}") from e
    if not isinstance(found, Task):
        raise InvalidTaskError(f"{path!r} is a {type(found).__name__}, not a Task")
    return found


def _error(text: str) -> Any:
    """A ``TaskError`` from Dramatiq's traceback text: the exception's class path is the first word of
    the last traceback's exception line (``builtins.`` for a bare name, as Python leaves it)."""
    lines = text.rstrip("\n").splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
               default=-1)  # fmt: skip
    name = ""
    for line in lines[last + 1 :]:
        if line and not line[:1].isspace():
            name = line.split(":", 1)[0].strip()
            break
    if not name or " " in name:
        name = "Exception"
    if "." not in name:
        name = f"builtins.{name}"
    return TaskError(exception_class_path=name, traceback=text)


def _declare_configured() -> None:
    """Once Django is set up and the broker set (a worker importing this module after
    ``django_dramatiq.setup``), build this module's backends: the actor and queues are declared."""
    from django.apps import apps
    from django.conf import settings
    from dramatiq import broker as dramatiq_broker

    if not apps.ready or not isinstance(dramatiq_broker.global_broker, PostgresBroker):
        return
    for alias, params in (getattr(settings, "TASKS", None) or {}).items():
        if params.get("BACKEND") == f"{__name__}.PostgresBackend":
            task_backends[alias]


_declare_configured()
