"""Django: the broker from ``DATABASES``, sends in Django's transaction, the dashboard in Django's URLs.

Set up with ``django_dramatiq`` (it builds the broker from ``DRAMATIQ_BROKER``)::

    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq_pg_fenced.integrations.django.DjangoPostgresBroker",
        "OPTIONS": {"database": "default"},          # and any PostgresBroker option
        "MIDDLEWARE": ["dramatiq.middleware.Retries", ...],
    }

- :class:`DjangoPostgresBroker` connects where ``DATABASES[database]`` says, read when
  the process first connects (so the test runner's test database is the one it uses),
  and creates or upgrades its tables when ``manage.py migrate`` (or the test runner)
  migrates that database.
- Sends inside ``transaction.atomic()`` on the broker's database (``ATOMIC_REQUESTS``, a
  ``TestCase``'s test included) are rows of that transaction, rolled back with it (to its
  savepoint); ``join_atomic=False`` turns it off; :func:`at_once` writes a block's sends at
  once; see :mod:`.django_atomic`.
- :func:`outbox`: ``with outbox(): ...`` is ``transaction.atomic()`` whose sends are
  written on Django's own connection, in its transaction: they exist if and only if it
  commits (with any broker, ``join_atomic`` or not).
- :func:`fenced_atomic`: inside an actor, ``transaction.atomic()`` whose writes (the ORM's
  included) commit together with the delivery's ack, under its fence, or not at all (the
  fenced transaction of :mod:`dramatiq_pg_fenced.exactly_once` on Django's connection).
- :func:`dashboard_urls`: the dashboard under a path of your URLs, for staff only
  (Django's authentication), answering the host names of ``ALLOWED_HOSTS``.
- :class:`TestRunner`: Django's runner, closing the broker's connections before the
  test database is dropped.

Django 4.2+ on psycopg 3 (``django.db.connection.connection`` is a ``psycopg.Connection``).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, Error, connections, transaction
from django.db.models.signals import post_migrate
from django.http import HttpRequest, HttpResponse
from django.http.request import split_domain_port, validate_host
from django.test.runner import DiscoverRunner
from django.urls import re_path
from django.views.decorators.csrf import csrf_exempt
from psycopg import pq
from psycopg.conninfo import make_conninfo

from ..broker import PostgresBroker
from ..core.interrupt import shielded
from ..dashboard import AllowedHosts, Dashboard, dashboard_app
from ..db.database import Database
from ..errors import FencedTransactionError
from ..routing.router import RoutedBroker
from .django_atomic import AtomicSends, at_once

__all__ = ["DjangoAllowedHosts", "DjangoPostgresBroker", "TestRunner", "at_once", "dashboard_urls",
           "dashboard_view", "fenced_atomic", "outbox"]  # fmt: skip

#: Keys of ``DATABASES[...]["OPTIONS"]`` that are Django's, not libpq's: never passed on.
_DJANGO_OPTIONS = {"assume_role", "isolation_level", "pool", "server_side_binding", "prepare_threshold", "context",
                   "cursor_factory"}  # fmt: skip


def database_conninfo(alias: str = DEFAULT_DB_ALIAS) -> str:
    """The libpq connection string of ``DATABASES[alias]`` as Django connects to it now (the test
    database while tests run): ``NAME``, ``USER``, ``PASSWORD``, ``HOST``, ``PORT`` and the libpq
    parameters of ``OPTIONS`` (``sslmode``, ``service``...)."""
    params = connections[alias].settings_dict
    libpq = {d.keyword.decode() for d in pq.Conninfo.get_defaults()}
    kwargs: dict[str, Any] = {k: v for k, v in (params.get("OPTIONS") or {}).items() if k in libpq}
    kwargs["dbname"] = params.get("NAME") or ("postgres" if params.get("NAME") is None else None)
    for key, name in (("user", "USER"), ("password", "PASSWORD"), ("host", "HOST"), ("port", "PORT")):
        if params.get(name):
            kwargs[key] = params[name]
    return make_conninfo("", **{k: v for k, v in kwargs.items() if v not in (None, "")})


class DjangoPostgresBroker(PostgresBroker):
    """A :class:`~dramatiq_pg_fenced.PostgresBroker` in the database of ``DATABASES[database]``.

    For ``django_dramatiq``: ``"BROKER": "dramatiq_pg_fenced.integrations.django.DjangoPostgresBroker"``,
    ``"OPTIONS": {"database": "default", ...}`` (any other option of ``PostgresBroker``; ``url=``
    or ``pool=`` instead connect there, and Django's settings are then not read).

    The connection string is read when a process first connects, not when the broker is built
    (settings time): Django's test runner has renamed the database to its test database by then,
    so the tests' broker, worker and ``outbox()`` all use the test database.

    Parameters:
      database: the alias in ``DATABASES``.
      migrate: create or upgrade the broker's tables when Django migrates that database
        (``manage.py migrate``, the test runner's creation of the test database).  ``False``:
        run ``dramatiq-pg-fenced migrate`` (or ``broker.migrate()``) yourself, e.g. as a
        role with more rights.
      join_atomic: a send made while a ``transaction.atomic()`` block is open on that database
        (and no block of the broker decides) is a row of Django's transaction: it commits with
        the block, and a rollback (to its savepoint) takes it away.  ``False``: written at once,
        as by any other broker (then use :func:`outbox`).  A send inside an atomic block on
        another database is written at once, and logged once per database
        (:mod:`.django_atomic`).  With ``url=``/``pool=`` no database of Django's is the broker's.
    """

    def __init__(self, url: str | None = None, *, database: str = DEFAULT_DB_ALIAS, migrate: bool = True,
                 join_atomic: bool = True, **options: Any) -> None:  # fmt: skip
        super().__init__(url, **options)
        self.django_database = database
        self.join_atomic = join_atomic
        self.atomic_sends = AtomicSends(database if url is None and options.get("pool") is None else None, self.logger)
        if url is None and options.get("pool") is None:
            given = self.database
            self.database = _DjangoDatabase(
                database,
                schema=given.schema,
                connect_timeout=given.connect_timeout,
                pool_max_size=given.pool_max_size,
                prepare=given.prepare,
            )
            if self.reader is given:  # no read_url: operators' reads go where the writes go
                self.reader = self.database
        if migrate:
            post_migrate.connect(self._migrate_with_django, weak=False, dispatch_uid=f"dramatiq_pg_fenced-{id(self)}")
        self._migrated: str | None = None

    def joined_transaction(self, *, quiet: bool = False) -> psycopg.Connection | None:
        """Django's connection while ``transaction.atomic()`` is open on the broker's database (see
        ``join_atomic``); ``None`` otherwise (and with ``join_atomic=False``)."""
        if not self.join_atomic:
            return None
        return self.atomic_sends.connection(quiet=quiet)

    def _migrate_with_django(self, sender: Any, using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
        """``post_migrate`` (sent once per app): migrate our tables once per database Django migrates."""
        if using != self.django_database:
            return
        where = database_conninfo(using)
        if self._migrated == where:
            return
        if self.database.started:
            self.close()  # maybe connected before the test runner renamed the database: connect anew
        self.migrate()
        self._migrated = where


class _DjangoDatabase(Database):
    """The broker's :class:`~dramatiq_pg_fenced.database.Database`, its ``url`` read from Django's settings."""

    def __init__(self, alias: str, **options: Any) -> None:
        self.alias = alias
        super().__init__(None, **options)

    @property  # type: ignore[override]
    def url(self) -> str:
        return database_conninfo(self.alias)

    @url.setter
    def url(self, value: str) -> None:
        pass  # Database.__init__ sets it; Django's settings decide


def _broker(broker: PostgresBroker | None) -> PostgresBroker:
    found = broker if broker is not None else dramatiq.get_broker()
    if not isinstance(found, PostgresBroker):
        raise TypeError(f"the broker is a {type(found).__name__}, not a PostgresBroker: set DRAMATIQ_BROKER")
    return found


def _sender(broker: PostgresBroker | RoutedBroker | None) -> Any:
    """*broker*, or Dramatiq's global one, for the blocks that send: a PostgresBroker or a RoutedBroker
    (whose sends in the block are rows of it whatever their queue's database: outbox rows, relayed
    after the commit)."""
    found = broker if broker is not None else dramatiq.get_broker()
    if not isinstance(found, (PostgresBroker, RoutedBroker)):
        raise TypeError(f"the broker is a {type(found).__name__}, not a PostgresBroker or a RoutedBroker: "
                        "set DRAMATIQ_BROKER")  # fmt: skip
    return found


@contextmanager
def outbox(broker: PostgresBroker | RoutedBroker | None = None, *,
           using: str | None = None) -> Iterator[psycopg.Connection]:  # fmt: skip
    """``transaction.atomic(using)`` whose sends are written on Django's connection, in its transaction.

    ``with outbox(): order.save(); confirm.send(order.pk)``: the message exists if and only if
    Django's transaction commits (it is a row of that transaction), and is then claimed, fenced and
    counted like any other.  Inside an ``atomic()`` block it joins it, without a savepoint
    (``savepoint=False``): an exception out of it rolls the enclosing transaction back, as Django
    does; wrap it in ``atomic()`` to roll back only to there.

    The broker's tables must be in that database (:class:`DjangoPostgresBroker` puts them there).
    *broker*: Dramatiq's global broker by default (``django_dramatiq`` sets it).  Yields the
    ``psycopg.Connection``.
    """
    broker = _sender(broker)
    with transaction.atomic(using=using, savepoint=False):
        conn = transaction.get_connection(using).connection
        if not isinstance(conn, psycopg.Connection):
            raise TypeError(f"Django's connection is a {type(conn).__module__}.{type(conn).__name__}: "
                            "outbox() needs Django on psycopg 3 (pip install 'psycopg[binary]')")  # fmt: skip
        with broker.transaction(conn):
            yield conn


@contextmanager
def fenced_atomic(broker: PostgresBroker | RoutedBroker | None = None, *,
                  using: str | None = None) -> Iterator[psycopg.Connection]:  # fmt: skip
    """Inside an actor: ``transaction.atomic(using)`` whose writes commit together with this delivery's
    ack, under its fence, or not at all (``broker.fenced_transaction()`` on Django's connection)::

        @dramatiq.actor
        def pay(order_id):
            with fenced_atomic():
                Order.objects.filter(pk=order_id).update(paid=True)
                receipt.send(order_id)  # a row of the same transaction

    As the block begins, the delivery's row is taken, locked, in Django's transaction, as its ack
    (the row moves to ``committed`` there); if the delivery no longer holds its message (its lease
    lapsed and it was redelivered, or it was cancelled),
    :class:`~dramatiq_pg_fenced.errors.DeliveryLost` is raised before the body runs.  Just before
    Django commits, the sends made earlier in ``with_ack()`` are written in the transaction; the
    message is done once Django has committed (``transaction.on_commit``).  An exception out of the body rolls it all back and takes the
    delivery's normal path (retry, dead letter).  Sends inside are rows of the transaction.

    The block must own the commit: inside another ``atomic()`` (or a ``TestCase``'s) it is refused
    (:class:`~dramatiq_pg_fenced.errors.FencedTransactionError`), as on a database that is not
    PostgreSQL through psycopg 3, outside an actor, or a second time in one delivery.  The
    broker's tables must be in that database.  Yields the ``psycopg.Connection``.
    """
    broker = _sender(broker)
    fence = broker.fence()
    wrapper = transaction.get_connection(using)
    if wrapper.in_atomic_block:
        raise FencedTransactionError(
            "fenced_atomic() inside an atomic block: the fenced transaction must begin and commit Django's "
            "transaction itself (its commit is the ack); open it outside transaction.atomic()"
        )
    if wrapper.vendor != "postgresql":
        raise FencedTransactionError(f"fenced_atomic(using={using!r}): the database is {wrapper.vendor}, not the "
                                     "PostgreSQL of the broker's tables")  # fmt: skip
    ended = False
    try:
        with shielded(), transaction.atomic(using=using):
            conn = wrapper.connection
            if not isinstance(conn, psycopg.Connection):
                raise FencedTransactionError(f"Django's connection is a {type(conn).__module__}.{type(conn).__name__}: "
                                             "fenced_atomic() needs Django on psycopg 3 (pip install 'psycopg[binary]')")  # fmt: skip
            fence.begin(conn, explicit=False)  # Django's atomic() turned autocommit off: this begins it
            with broker.transaction(conn, block="fenced_atomic()"):
                yield conn
            fence.end(conn, commit=False)
            ended = True
            transaction.on_commit(fence.committed, using=using)
    except Error:  # Django's, its InterfaceError included
        # The connection broke as Django committed: did the commit happen?
        if ended and not fence.message.committed and fence.committed_after_all():
            broker.logger.info("The connection broke as message %s's fenced_atomic() committed; it did commit.",
                               fence.message.message_id)  # fmt: skip
            fence.committed()
            return
        raise


class DjangoAllowedHosts(AllowedHosts):
    """The dashboard's ``Host`` and ``Origin`` checks by ``ALLOWED_HOSTS``, read on each request with
    Django's rules (``"*"``, ``.example.com``, ports ignored; the loopback names under ``DEBUG``
    with none listed; ``testserver`` under the test runner)."""

    def __init__(self) -> None:
        super().__init__(())

    def __repr__(self) -> str:
        return f"ALLOWED_HOSTS {settings.ALLOWED_HOSTS!r}"

    def allows(self, value: str, default_port: int) -> bool:
        allowed = settings.ALLOWED_HOSTS
        if settings.DEBUG and not allowed:
            allowed = [".localhost", "127.0.0.1", "[::1]"]
        domain, _ = split_domain_port(value)
        return bool(domain) and validate_host(domain, allowed)


def dashboard_view(
    broker: PostgresBroker | None = None,
    *,
    actions: bool = False,
    secret: str | None = None,
    require: Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]] | None = None,
) -> Callable[..., HttpResponse]:
    """The dashboard as a Django view taking the rest of the path as ``rest`` (see :func:`dashboard_urls`).

    *require*: who may see it, a view decorator; ``staff_member_required`` by default (staff
    only, others sent to the admin's login).  *secret*: the forms' token, the same in every
    server process; ``SECRET_KEY`` by default.  *broker*: Dramatiq's global broker by default,
    read on the first request.  The dashboard's own checks run too: ``Host`` and ``Origin`` by
    ``ALLOWED_HOSTS`` (:class:`DjangoAllowedHosts`), its form token, no framing; Django's CSRF
    check is left to them (its forms carry their own token).
    """
    if require is None:
        from django.contrib.admin.views.decorators import staff_member_required

        require = staff_member_required
    made: list[Dashboard] = []
    lock = threading.Lock()

    def app() -> Dashboard:
        with lock:
            if not made:
                dashboard = dashboard_app(_broker(broker), actions=actions, secret=secret or settings.SECRET_KEY)
                dashboard.allowed_hosts = DjangoAllowedHosts()
                made.append(dashboard)
            return made[0]

    def view(request: HttpRequest, rest: str = "") -> HttpResponse:
        request.get_host()  # Django's own check first: DisallowedHost is a 400
        mount = request.path[: len(request.path) - len(rest)] if rest else request.path
        body = request.body  # read once by Django; the dashboard reads its form from it
        environ = {
            **request.environ,
            "SCRIPT_NAME": _wsgi_str(mount.rstrip("/")),
            "PATH_INFO": _wsgi_str("/" + rest),
            "wsgi.input": io.BytesIO(body),
            "CONTENT_LENGTH": str(len(body)),
            # who acts, for the audit log of bulk actions: the Django user *require* let in
            "REMOTE_USER": _wsgi_str(request.user.get_username()) if getattr(request, "user", None) else "",
        }
        status, headers, content = _call(app(), environ)
        response = HttpResponse(content, status=int(status[:3]), reason=status[4:] or None)
        for name, value in headers:
            response[name] = value
        return response

    return csrf_exempt(require(view))


def dashboard_urls(
    broker: PostgresBroker | None = None,
    *,
    actions: bool = False,
    secret: str | None = None,
    require: Callable[[Callable[..., HttpResponse]], Callable[..., HttpResponse]] | None = None,
) -> list[Any]:
    """URL patterns of the dashboard, to include under a path of yours::

        path("ops/queues/", include(dashboard_urls(actions=True))),

    Options as :func:`dashboard_view`.
    """
    view = dashboard_view(broker, actions=actions, secret=secret, require=require)
    return [re_path(r"^(?P<rest>.*)\Z", view, name="dramatiq_pg_fenced_dashboard")]


def _wsgi_str(text: str) -> str:
    """A path as WSGI carries it: its UTF-8 bytes as latin-1."""
    return text.encode().decode("latin-1")


def _call(app: Dashboard, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    """Run a WSGI app on *environ*: (status, headers, body)."""
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen["status"], seen["headers"] = status, headers

    result: Iterable[bytes] = app(environ, start_response)
    try:
        content = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return seen["status"], seen["headers"], content


class TestRunner(DiscoverRunner):
    """Django's test runner, closing the global broker's connections before the test databases are
    dropped (``DROP DATABASE`` fails while it holds some).  ``TEST_RUNNER`` names it, or a runner of
    yours does the same."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        broker = dramatiq.get_broker()
        if isinstance(broker, PostgresBroker):
            broker.close()
        super().teardown_databases(old_config, **kwargs)
