"""Sends in ``transaction.atomic()`` without ``outbox()``, written the django_dramatiq way: a row of the
transaction open on the broker's database, rolled back with it (run by Django's runner with
``shop.scenarios``; ``TestCase`` classes first, then the ``TransactionTestCase`` ones, with a worker)."""

from __future__ import annotations

import dramatiq
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.test import TestCase, TransactionTestCase
from django_dramatiq.test import DramatiqTestCase

from dramatiq_pg_fenced.integrations.django import DjangoPostgresBroker, at_once
from dramatiq_pg_fenced.routing import RoutedBroker

from . import views
from .models import Order
from .scenarios import rows_on_djangos_connection
from .tasks import confirm_order

#: The id of the message a TestCase sends plainly in its transaction; no later test may find it.
JOINED_IN_A_TESTCASE = "0f0f0f0f-0000-4000-8000-00000000a70c"

LOGGER = "dramatiq_pg_fenced"


def a_message(queue_name: str = "shop", message_id: str | None = None) -> dramatiq.Message:
    extra = {} if message_id is None else {"message_id": message_id}
    return dramatiq.Message(queue_name=queue_name, actor_name="confirm_order", args=(0,), kwargs={}, options={},
                            **extra)  # fmt: skip


class SendsInATestCase(TestCase):
    """Each test runs in an atomic block rolled back at its end: a plain send is a row of it."""

    def test_a_plain_send_is_a_row_of_the_tests_transaction_seen_only_on_its_connection(self) -> None:
        # Given a send with no outbox(), as django_dramatiq users write it
        dramatiq.get_broker().enqueue(a_message(message_id=JOINED_IN_A_TESTCASE))
        # I expect Django's connection to see it, and the broker's connections (any worker) not to
        self.assertEqual(rows_on_djangos_connection(JOINED_IN_A_TESTCASE), 1)
        self.assertIsNone(dramatiq.get_broker().inspect(JOINED_IN_A_TESTCASE))

    def test_a_send_in_a_nested_block_rolled_back_to_its_savepoint_vanishes_with_it(self) -> None:
        kept = confirm_order.send(Order.objects.create(total=1).pk)
        try:
            with transaction.atomic():  # a savepoint
                dropped = confirm_order.send(Order.objects.create(total=-1).pk)
                raise ValueError
        except ValueError:
            pass
        self.assertEqual(rows_on_djangos_connection(kept.message_id), 1)
        self.assertEqual(rows_on_djangos_connection(dropped.message_id), 0)
        self.assertEqual(Order.objects.count(), 1)

    def test_an_on_commit_send_captured_by_the_test_is_a_row_of_its_transaction(self) -> None:
        sent: list[dramatiq.Message] = []
        with self.captureOnCommitCallbacks(execute=True) as callbacks, transaction.atomic():
            order = Order.objects.create(total=2)
            transaction.on_commit(lambda: sent.append(confirm_order.send(order.pk)))
            self.assertEqual(sent, [])  # not before the (captured) commit
        self.assertEqual(len(callbacks), 1)
        self.assertEqual(rows_on_djangos_connection(sent[0].message_id), 1)

    def test_enqueue_many_and_a_batch_in_the_block_are_rows_of_it_too(self) -> None:
        broker = dramatiq.get_broker()
        many = broker.enqueue_many([a_message(), a_message()])
        with broker.batch():
            batched = confirm_order.send(0)
            self.assertEqual(rows_on_djangos_connection(batched.message_id), 0)  # at the batch's end
        for message in [*many, batched]:
            self.assertEqual(rows_on_djangos_connection(message.message_id), 1)
            self.assertIsNone(broker.inspect(message.message_id))

    def test_a_send_in_a_block_marked_for_rollback_raises_djangos_error_as_a_query_would(self) -> None:
        with transaction.atomic():
            transaction.set_rollback(True)
            with self.assertRaises(TransactionManagementError):
                confirm_order.send(0)

    def test_at_once_writes_a_send_on_the_brokers_connection_even_here(self) -> None:
        broker = dramatiq.get_broker()
        with at_once():
            message = broker.enqueue(a_message("shop-at-once"))
        self.addCleanup(broker.flush, "shop-at-once")
        self.assertEqual(broker.inspect(message.message_id)["state"], "queued")


class AfterTheAtomicTestCases(TransactionTestCase):
    """Runs after every TestCase (Django orders them so)."""

    def test_the_message_a_testcase_sent_plainly_in_its_transaction_is_gone(self) -> None:
        self.assertIsNone(dramatiq.get_broker().inspect(JOINED_IN_A_TESTCASE))
        self.assertEqual(rows_on_djangos_connection(JOINED_IN_A_TESTCASE), 0)


class SendsInAtomicWithAWorker(DramatiqTestCase):
    """Real commits (django_dramatiq's test case, a worker on the broker)."""

    databases = {"default", "other"}

    def join(self) -> None:
        self.broker.join(confirm_order.queue_name, timeout=30_000)

    def test_a_send_in_a_committed_atomic_block_runs_and_finds_its_row(self) -> None:
        with transaction.atomic():
            order = Order.objects.create(total=100)
            message = confirm_order.send(order.pk)
            self.assertIsNone(self.broker.inspect(message.message_id))  # not before the commit
        self.join()
        order.refresh_from_db()
        self.assertEqual(order.status, "confirmed")
        self.assertEqual(self.broker.inspect(message.message_id)["state"], "done")

    def test_a_send_in_a_rolled_back_atomic_block_leaves_neither_row_nor_message(self) -> None:
        with self.assertRaises(ValueError), transaction.atomic():
            message = confirm_order.send(Order.objects.create(total=-5).pk)
            raise ValueError("refused")
        self.join()
        self.assertIsNone(self.broker.inspect(message.message_id))
        self.assertFalse(Order.objects.exists())

    def test_a_nested_block_rolled_back_to_its_savepoint_takes_its_send_and_the_outer_commits(self) -> None:
        with transaction.atomic():
            kept = confirm_order.send(Order.objects.create(total=1).pk)
            with self.assertRaises(ValueError), transaction.atomic():
                dropped = confirm_order.send(Order.objects.create(total=-1).pk)
                raise ValueError
        self.join()
        self.assertEqual(self.broker.inspect(kept.message_id)["state"], "done")
        self.assertIsNone(self.broker.inspect(dropped.message_id))
        self.assertEqual([o.status for o in Order.objects.all()], ["confirmed"])

    def test_an_on_commit_send_is_written_after_the_commit_and_never_for_a_rollback(self) -> None:
        sent: list[dramatiq.Message] = []
        with transaction.atomic():
            order = Order.objects.create(total=4)
            transaction.on_commit(lambda: sent.append(confirm_order.send(order.pk)))
        self.assertEqual(len(sent), 1)  # run after the commit, outside any block: written at once
        self.join()
        order.refresh_from_db()
        self.assertEqual(order.status, "confirmed")
        with self.assertRaises(ValueError), transaction.atomic():
            transaction.on_commit(lambda: sent.append(confirm_order.send(0)))
            raise ValueError
        self.assertEqual(len(sent), 1)

    def test_a_view_under_ATOMIC_REQUESTS_sends_in_the_requests_transaction(self) -> None:
        response = self.client.post("/orders/plainly/", {"total": "7"}, HTTP_HOST="shop.example.com")
        self.assertEqual(response.status_code, 200)
        self.join()
        self.assertEqual(Order.objects.get(pk=response.json()["order"]).status, "confirmed")
        # a view that raises: the request's transaction rolls back, its message with it
        with self.assertRaises(ValueError):
            self.client.post("/orders/plainly/", {"total": "-1"}, HTTP_HOST="shop.example.com")
        self.join()
        self.assertIsNone(self.broker.inspect(views.SENT[-1]))
        self.assertEqual(Order.objects.count(), 1)

    def test_a_send_outside_any_atomic_block_is_written_at_once(self) -> None:
        self.worker.pause()
        self.addCleanup(self.worker.resume)
        message = confirm_order.send(0)
        self.addCleanup(self.broker.cancel, message.message_id)
        self.assertEqual(self.broker.inspect(message.message_id)["state"], "queued")

    def test_with_join_atomic_off_a_send_in_atomic_is_written_at_once(self) -> None:
        # Given the setting off: "OPTIONS": {"join_atomic": False, ...}
        broker = DjangoPostgresBroker(database="default", schema="shop_queue", join_atomic=False, migrate=False,
                                      middleware=[])  # fmt: skip
        self.addCleanup(broker.close)
        with self.assertRaises(ValueError), transaction.atomic():
            message = broker.enqueue(a_message("shop-unjoined"))
            raise ValueError
        self.addCleanup(broker.flush, "shop-unjoined")
        # I expect it written at once, whatever the block did
        self.assertEqual(broker.inspect(message.message_id)["state"], "queued")

    def test_a_send_in_an_atomic_block_on_another_database_is_written_at_once_and_logged_once(self) -> None:
        broker = DjangoPostgresBroker(database="default", schema="shop_queue", migrate=False, middleware=[])
        self.addCleanup(broker.close)
        self.addCleanup(broker.flush, "shop-elsewhere")
        with self.assertLogs(LOGGER, "WARNING") as logs:
            for _ in range(2):
                with self.assertRaises(ValueError), transaction.atomic(using="other"):
                    message = broker.enqueue(a_message("shop-elsewhere"))
                    raise ValueError
                self.assertEqual(broker.inspect(message.message_id)["state"], "queued")
        said = [r.getMessage() for r in logs.records]
        self.assertEqual(len(said), 1, said)
        self.assertIn("'other'", said[0])
        self.assertIn("at once", said[0])


class SendsOfARoutedBrokerInAtomic(TransactionTestCase):
    """A Django project whose broker is a RoutedBroker over two of its databases."""

    databases = {"default", "other", "sqlite"}

    def setUp(self) -> None:
        self.router = RoutedBroker(
            brokers={"main": DjangoPostgresBroker(database="default", schema="shop_routed", migrate=False),
                     "far": DjangoPostgresBroker(database="other", schema="shop_routed", migrate=False)},
            routes={"shop-far": "far"}, default="main", middleware=[],
        )  # fmt: skip
        for shard in self.router.shards.values():
            shard.migrate()
        self.addCleanup(self.router.close)
        for queue in ("shop-near", "shop-far"):
            self.router.declare_queue(queue)
            self.addCleanup(self.router.flush, queue)

    def test_a_send_in_an_atomic_block_on_one_of_its_databases_joins_it_whatever_its_queue(self) -> None:
        main = self.router.shards["main"]
        with self.assertRaises(ValueError), transaction.atomic():
            near = self.router.enqueue(a_message("shop-near"))
            far = self.router.enqueue(a_message("shop-far"))
            raise ValueError
        # rolled back: neither
        self.assertIsNone(self.router.inspect(near.message_id))
        self.assertIsNone(self.router.inspect(far.message_id))
        self.assertIsNone(main.inspect(far.message_id))
        with transaction.atomic():
            near = self.router.enqueue(a_message("shop-near"))
            far = self.router.enqueue(a_message("shop-far"))
        # committed: both rows of the block's database, the far one an outbox row there, for the relay
        self.assertEqual(main.inspect(near.message_id)["state"], "queued")
        self.assertEqual(main.inspect(far.message_id)["queue_name"], "shop-far")
        self.assertIsNone(self.router.shards["far"].inspect(far.message_id))
        main.flush("shop-far")

    def test_a_send_in_an_atomic_block_on_a_database_not_its_own_is_written_at_once_and_logged_once(self) -> None:
        with self.assertLogs(LOGGER, "WARNING") as logs:
            for _ in range(2):
                with self.assertRaises(ValueError), transaction.atomic(using="sqlite"):
                    message = self.router.enqueue(a_message("shop-near"))
                    raise ValueError
                self.assertEqual(self.router.inspect(message.message_id)["state"], "queued")
        said = [r.getMessage() for r in logs.records]
        self.assertEqual(len(said), 1, said)
        self.assertIn("'sqlite'", said[0])
