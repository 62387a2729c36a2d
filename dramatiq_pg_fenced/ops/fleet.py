"""The databases an operator sees at once: :class:`Fleet`, for the CLI and the dashboard.

A :class:`~.routing.RoutedBroker` spreads queues over several databases; its operators should not
have to run one command (or open one dashboard) per database.  A fleet is the named databases
(each a :class:`Site`: its connections, statements and settings) and where a queue or a message
lives among them, so that a read shows every database (each row names its database) and an
action goes to one:

- a **queue**'s database is its route when the fleet knows the routes (made from a
  ``RoutedBroker``); else the one database that knows the queue (a message, a pause, a schedule,
  a declared actor).  A queue of no route, or one no database knows, is a ``ValueError`` naming
  the databases and their queues; a queue found in two databases without routes is one too (name
  the database): an action never lands in a database by guess;
- a **message**'s database is the one that holds its id (ids are UUIDs, made once, so at most one
  holds it, but for a relay's move in flight, or a row copied by hand): :meth:`Fleet.locate` and
  :meth:`Fleet.cancel` (:mod:`.finding`) find it during a move too, and name a database that does
  not answer instead of failing on it.

One database is a fleet of one named ``""``: the CLI and the dashboard then show no database
column, exactly as before routing existed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from dramatiq.errors import BrokerError

from ..db.statements import check_queue
from ..errors import describe_failure
from . import admin, finding
from .finding import Cancelled, Located
from .site import Site as Site

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Fleet:
    """Named databases, in order, and where a queue or message lives among them (see the module).

    Parameters:
      sites: the databases, each a :class:`Site` with a name of its own.
      route: queue name -> database name (a ``RoutedBroker``'s ``database_of``: raises ``RouteError``,
        a ``ValueError``, for a queue of no route); ``None``: a queue lives where it is known.
      router: the ``RoutedBroker`` the fleet was made of (``move_queue``), if any.
    """

    def __init__(self, sites: Sequence[Site], *, route: Callable[[str], str] | None = None, router: Any = None) -> None:
        if not sites:
            raise ValueError("a fleet needs at least one database")
        names = [s.name for s in sites]
        if len(set(names)) != len(names):
            raise ValueError(f"database names must differ: {names}")
        self.sites = list(sites)
        self.route = route
        self.router = router

    @classmethod
    def of(cls, broker: Any) -> Fleet:
        """The fleet of a ``PostgresBroker`` (one database, named ``""``), a ``RoutedBroker`` (its shards
        and routes) or a fleet (itself)."""
        if isinstance(broker, Fleet):
            return broker
        shards = getattr(broker, "shards", None)
        if isinstance(shards, Mapping):
            return cls([Site.of(n, s) for n, s in shards.items()], route=broker.database_of, router=broker)
        return cls([Site.of("", broker)])

    @classmethod
    def of_brokers(cls, brokers: Mapping[str, Any]) -> Fleet:
        """Named ``PostgresBroker``\\ s without routes (the CLI's ``--url NAME=URL``, repeated)."""
        return cls([Site.of(n, b) for n, b in brokers.items()])

    @property
    def several(self) -> bool:
        """Whether pages and tables name the database of each row (any fleet of named databases)."""
        return len(self.sites) > 1 or bool(self.sites[0].name)

    @property
    def shards(self) -> dict[str, Site]:
        """Name -> site (what :class:`~.metrics.DatabasesCollector` reads: ``reader`` and ``statements``)."""
        return {s.name: s for s in self.sites}

    def metrics_registry(self) -> Any:
        """A Prometheus registry with every database's queue figures, each sample labelled with its
        ``database`` (as :meth:`~.routing.RoutedBroker.metrics_registry`); a fleet of one: unlabelled,
        as :func:`.metrics.registry`."""
        from . import metrics

        if not self.several:
            return metrics.registry(self.sites[0].reader, self.sites[0].statements)
        return metrics.databases_registry(self)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.sites)

    def each(
        self, read: Callable[[Site], T], sites: Sequence[Site] | None = None
    ) -> tuple[list[tuple[Site, T]], list[str]]:
        """*read* of every database (of *sites*, if given), and the names of those that failed: one database
        away leaves the others' figures on the page (the failure is logged).  A fleet of one raises, as
        before it was a fleet."""
        done: list[tuple[Site, T]] = []
        away: list[str] = []
        for s in self.sites if sites is None else sites:
            try:
                done.append((s, read(s)))
            except Exception as e:
                if not self.several:
                    raise
                if isinstance(e, (psycopg.Error, BrokerError)):  # said in a line, as the CLI says it
                    logger.warning("Database %r could not be read: %s", s.name, describe_failure(e))
                else:
                    logger.exception("Database %r could not be read", s.name)
                away.append(s.name)
        return done, away

    def site(self, name: str) -> Site:
        """The database named *name* (``ValueError`` naming the others)."""
        for s in self.sites:
            if s.name == name:
                return s
        raise ValueError(f"no database {name!r}: one of {', '.join(s.name for s in self.sites)}")

    def queue_site(self, queue_name: str, *, database: str | None = None, create: bool = False) -> Site:
        """The database an action on *queue_name* goes to: *database* if named (the queue must be known
        there unless *create*), else its route, else the one database that knows it."""
        check_queue(queue_name)
        if database is not None:
            chosen = self.site(database)
            if not create:
                self._check_known(chosen, queue_name)
            return chosen
        if len(self.sites) == 1 and self.route is None:
            chosen = self.sites[0]
            if not create:
                self._check_known(chosen, queue_name)
            return chosen
        if self.route is not None:
            chosen = self.site(self.route(queue_name))  # RouteError (a ValueError) for a queue of no route
            if not create and not self._known_anywhere(queue_name):
                raise self._unknown(queue_name)
            return chosen
        holders = [s for s in self.sites if queue_name in s.known_queues()]
        if len(holders) == 1:
            return holders[0]
        if not holders:
            raise self._unknown(
                queue_name, hint="name its database (--database NAME) to act on it anyway" if create else ""
            )
        names = ", ".join(s.name for s in holders)
        raise ValueError(f"queue {queue_name!r} is known in databases {names}: name one (--database NAME)")

    def message_site(self, message_id: str) -> tuple[Site, dict[str, Any]] | None:
        """The database holding *message_id* and the message as it has it (:func:`.admin.inspect`), or
        ``None`` when none does; a database that does not answer is skipped, and
        :class:`~.finding.Unreachable` names it when none of the others has the message."""
        found = finding.locate(self.sites, message_id).checked(message_id)
        return None if found.site is None or found.info is None else (found.site, found.info)

    def locate(self, message_id: str) -> Located:
        """:func:`.finding.locate` over these databases (a relay's move and a database away included)."""
        return finding.locate(self.sites, message_id)

    def cancel(self, message_id: str, *, seen: str | None = None, database: str | None = None) -> Cancelled:
        """:func:`.finding.cancel` over these databases: wherever the message is, in flight between two
        included; the databases that did not answer are named in its answer."""
        return finding.cancel(self.sites, message_id, seen=seen, database=database)

    def holders(self, message_ids: Iterable[str]) -> tuple[dict[str, list[str]], list[str]]:
        """Database name -> the ids of *message_ids* whose row it holds (in their order), and the ids none
        holds (unknown, or finished and kept in the history only).  One indexed statement per database."""
        left = list(dict.fromkeys(message_ids))
        found: dict[str, list[str]] = {}
        for s in self.sites:
            if not left:
                break
            here = {
                str(r[0]) for r in s.database.run(functools.partial(_held, statement=s.statements.held_among, ids=left))
            }
            if here:
                found[s.name] = [m for m in left if m in here]
                left = [m for m in left if m not in here]
        return found, left

    def queue_names(self) -> list[str]:
        """Every queue known or declared in any database, sorted (of a database that does not answer,
        the queues declared on its broker: a page of the others still offers them)."""
        read, away = self.each(lambda s: s.known_queues())
        return sorted(set().union(*(known for _, known in read), *(self.site(name).declared() for name in away)))

    def _known_anywhere(self, queue_name: str) -> bool:
        """Known or declared in any database (a routed queue whose rows are still in its old database, say)."""
        return any(queue_name in s.known_queues() for s in self.sites)

    def _check_known(self, site: Site, queue_name: str) -> None:
        admin.check_known(site.database, site.statements, queue_name, declared=site.declared())

    def _unknown(self, queue_name: str, hint: str = "") -> admin.UnknownQueue:
        """The error for a queue no database knows, naming each database's queues."""
        known = [f"{q} ({s.name})" for s in self.sites for q in sorted(s.known_queues())]
        return admin.unknown_queue(queue_name, known, hint)


def _held(conn: Any, *, statement: bytes, ids: list[str]) -> list[Any]:
    return list(conn.execute(statement, [ids]).fetchall())


__all__ = ["Fleet", "Site"]
