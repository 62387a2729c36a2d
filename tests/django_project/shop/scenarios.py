"""The Django integration, run by Django's own test runner (``tests/test_django.py`` starts it).

Test classes run in Django's order: ``TestCase`` ones first (each test in a transaction rolled
back at its end), then ``TransactionTestCase`` ones (real commits; a worker runs the actors).
"""

from __future__ import annotations

import re
import urllib.parse

import dramatiq
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase
from django_dramatiq.test import DramatiqTestCase
from dramatiq.middleware import Retries
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from dramatiq_pg_fenced.errors import FencedTransactionError
from dramatiq_pg_fenced.integrations.django import DjangoPostgresBroker, at_once, fenced_atomic, outbox
from dramatiq_pg_fenced.middleware import FencedDelivery

from . import tasks
from .models import Order
from .tasks import confirm_order, count_in_a_fenced_atomic, misuse_fenced_atomic

#: The id of the message a TestCase sends in its transaction; no later test may find it.
IN_A_TESTCASE = "0f0f0f0f-0000-4000-8000-00000000c0de"


def rows_on_djangos_connection(message_id: str) -> int:
    """How many rows of the broker's message table Django's connection sees for *message_id*."""
    with connection.cursor() as cursor:
        cursor.execute(
            sql.SQL("SELECT count(*) FROM {}.message WHERE message_id = %s")
            .format(sql.Identifier(dramatiq.get_broker().schema))
            .as_string(connection.connection),
            [message_id],
        )
        return cursor.fetchone()[0]


class DjangoDramatiqBuildsTheBroker(TestCase):
    def test_the_broker_is_built_from_DRAMATIQ_BROKER_in_the_test_database(self) -> None:
        broker = dramatiq.get_broker()
        # I expect our broker, with the options and middleware of the setting, FencedDelivery last
        self.assertIsInstance(broker, DjangoPostgresBroker)
        self.assertEqual(broker.schema, "shop_queue")
        self.assertEqual(broker.poll_interval, 0.2)
        self.assertTrue(any(isinstance(m, Retries) for m in broker.middleware))
        self.assertIsInstance(broker.middleware[-1], FencedDelivery)
        # connected to the test runner's database, where migrate created its tables
        self.assertEqual(conninfo_to_dict(broker.url)["dbname"], connection.settings_dict["NAME"])
        self.assertTrue(connection.settings_dict["NAME"].startswith("test_"))
        self.assertEqual(broker.database.run(lambda c: c.execute("SELECT current_database()").fetchone()[0]),
                         connection.settings_dict["NAME"])  # fmt: skip


class OutboxInATestCase(TestCase):
    """Each test runs in a transaction that is rolled back: an outbox send is a row of it."""

    def test_a_send_is_a_row_of_the_tests_transaction_seen_only_on_its_connection(self) -> None:
        with outbox():
            order = Order.objects.create(total=10)
            message = dramatiq.Message(queue_name="shop", actor_name="confirm_order", args=(order.pk,), kwargs={},
                                       options={}, message_id=IN_A_TESTCASE)  # fmt: skip
            dramatiq.get_broker().enqueue(message)
        # Django's connection sees it; the broker's connections (and so any worker) do not
        self.assertEqual(rows_on_djangos_connection(IN_A_TESTCASE), 1)
        self.assertIsNone(dramatiq.get_broker().inspect(IN_A_TESTCASE))

    def test_an_outbox_rolled_back_to_a_savepoint_takes_its_messages_with_it(self) -> None:
        with outbox():
            kept = confirm_order.send(Order.objects.create(total=1).pk)
            try:
                with transaction.atomic():  # a savepoint
                    with outbox():  # joins it
                        dropped = confirm_order.send(Order.objects.create(total=-1).pk)
                        raise ValueError
            except ValueError:
                pass
        self.assertEqual(rows_on_djangos_connection(kept.message_id), 1)
        self.assertEqual(rows_on_djangos_connection(dropped.message_id), 0)
        self.assertEqual(Order.objects.count(), 1)


class DashboardForStaff(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.staff = User.objects.create_user("ops", password="x", is_staff=True)
        cls.customer = User.objects.create_user("customer", password="x")

    def get(self, path: str, **extra: str):
        return self.client.get(path, HTTP_HOST="shop.example.com", **extra)

    def post(self, path: str, form: dict[str, str], **extra: str):
        """A form as a browser posts the dashboard's (urlencoded)."""
        return self.client.post(path, urllib.parse.urlencode(form), "application/x-www-form-urlencoded",
                                HTTP_HOST="shop.example.com", **extra)  # fmt: skip

    def test_staff_get_the_dashboard_under_its_path(self) -> None:
        self.client.force_login(self.staff)
        response = self.get("/ops/queues/")
        self.assertEqual(response.status_code, 200)
        page = response.content.decode()
        self.assertIn("dramatiq-pg-fenced", page)
        links = re.findall(r'(?:href|action)="([^"]*)"', page)
        self.assertIn("/ops/queues/messages", links)
        self.assertTrue(all(link.startswith("/ops/queues/") for link in links), links)
        self.assertEqual(response["X-Frame-Options"], "DENY")
        self.assertEqual(self.get("/ops/queues/messages?queue=shop").status_code, 200)

    def test_anonymous_visitors_and_customers_are_sent_to_the_login(self) -> None:
        response = self.get("/ops/queues/")
        self.assertEqual(response.status_code, 302)
        self.assertTrue(response["Location"].startswith("/admin/login/?next=/ops/queues/"))
        self.client.force_login(self.customer)
        self.assertEqual(self.get("/ops/queues/messages").status_code, 302)
        self.assertEqual(self.post("/ops/queues/action", {"action": "pause", "queue": "shop"}).status_code, 302)

    def test_a_host_name_not_in_ALLOWED_HOSTS_gets_400(self) -> None:
        self.client.force_login(self.staff)
        self.assertEqual(self.client.get("/ops/queues/", HTTP_HOST="evil.example").status_code, 400)

    def test_staff_act_with_the_dashboards_form_and_come_back_under_its_path(self) -> None:
        broker = dramatiq.get_broker()
        # a queue on the queues page (committed by the broker's own connection, outside the test's transaction)
        with at_once():
            broker.enqueue(dramatiq.Message(queue_name="shop-dashboard", actor_name="confirm_order", args=(0,),
                                            kwargs={}, options={}))  # fmt: skip
        self.addCleanup(broker.flush, "shop-dashboard")
        self.client.force_login(self.staff)
        page = self.get("/ops/queues/").content.decode()
        self.assertIn("/ops/queues/confirm?action=pause&amp;queue=shop-dashboard", page)  # actions on: they ask first
        question = self.get("/ops/queues/confirm?action=pause&queue=shop-dashboard").content.decode()
        token = re.search(r'name="token" value="([^"]*)"', question)
        self.assertIsNotNone(token)  # the question's form acts
        form = {"token": token[1], "action": "resume", "queue": "shop-dashboard", "next": "/"}
        # Django's CSRF check is the dashboard's own: its token, and the Origin by ALLOWED_HOSTS
        response = self.post("/ops/queues/action", form, HTTP_ORIGIN="https://shop.example.com")
        self.assertEqual(response.status_code, 303, re.findall(r"class=error>[^<]*", response.content.decode()))
        self.assertTrue(response["Location"].startswith("/ops/queues/?note="), response["Location"])
        response = self.post("/ops/queues/action", form, HTTP_ORIGIN="https://evil.example")
        self.assertEqual(response.status_code, 403)
        self.assertEqual(self.post("/ops/queues/action", {**form, "token": "guess"}).status_code, 403)

    def test_the_audit_log_names_the_django_user_who_acted(self) -> None:
        broker = dramatiq.get_broker()
        message = dramatiq.Message(queue_name="shop-audit", actor_name="confirm_order", args=(0,), kwargs={},
                                   options={})  # fmt: skip
        with at_once():  # the dashboard must see it: not a row of the test's transaction
            broker.enqueue(message)
        self.addCleanup(broker.flush, "shop-audit")
        self.client.force_login(self.staff)
        page = self.get(f"/ops/queues/bulk?action=cancel&scope=selected&ids={message.message_id}").content.decode()
        self.assertIn("Cancel 1 message", page)
        form = dict(re.findall(r'<input type=hidden name="([^"]+)" value="([^"]*)">', page.split("<form")[-1]))
        response = self.post("/ops/queues/action", form, HTTP_ORIGIN="https://shop.example.com")
        self.assertEqual(response.status_code, 303, re.findall(r"class=error>[^<]*", response.content.decode()))
        self.assertRegex(self.get("/ops/queues/audit").content.decode(), r"<td[^>]*>ops</td>")  # (a cell, its label or not)


class AfterTheTestCases(TransactionTestCase):
    """Runs after every TestCase (Django orders them so), before any worker test flushes the queues."""

    def test_the_message_a_testcase_sent_in_its_transaction_is_gone(self) -> None:
        self.assertIsNone(dramatiq.get_broker().inspect(IN_A_TESTCASE))
        self.assertEqual(rows_on_djangos_connection(IN_A_TESTCASE), 0)


class OutboxWithAWorker(DramatiqTestCase):
    """django_dramatiq's test case: real commits, and a worker on the broker."""

    def join(self) -> None:
        self.broker.join(confirm_order.queue_name, timeout=30_000)

    def test_a_message_sent_in_a_committed_transaction_runs_and_finds_its_row(self) -> None:
        with outbox():
            order = Order.objects.create(total=100)
            message = confirm_order.send(order.pk)
        self.join()
        order.refresh_from_db()
        self.assertEqual(order.status, "confirmed")
        info = self.broker.inspect(message.message_id)
        self.assertEqual((info["state"], info["attempt"]), ("done", 1))

    def test_a_rolled_back_transaction_leaves_neither_row_nor_message(self) -> None:
        with self.assertRaises(ValueError), outbox():
            order = Order.objects.create(total=-5)
            message = confirm_order.send(order.pk)
            raise ValueError("refused")
        self.join()
        self.assertIsNone(self.broker.inspect(message.message_id))
        self.assertFalse(Order.objects.exists())

    def test_a_view_enqueues_in_its_transaction(self) -> None:
        response = self.client.post("/orders/", {"total": "7"}, HTTP_HOST="shop.example.com")
        self.assertEqual(response.status_code, 200)
        self.join()
        self.assertEqual(Order.objects.get(pk=response.json()["order"]).status, "confirmed")
        with self.assertRaises(ValueError):
            self.client.post("/orders/", {"total": "-1"}, HTTP_HOST="shop.example.com")
        self.assertEqual(Order.objects.count(), 1)

    def test_an_outbox_send_under_an_id_already_queued_is_reported_and_counted(self) -> None:
        message = confirm_order.message(0)
        counted = self.broker.stats()["process"]["duplicate_sends"]
        self.worker.pause()
        with outbox():
            self.broker.enqueue(message)
        with outbox():
            self.broker.enqueue(message)
        self.assertEqual(self.broker.stats()["process"]["duplicate_sends"], counted + 1)
        self.broker.cancel(message.message_id)
        self.worker.resume()

    def test_a_send_in_at_once_is_not_tied_to_the_transaction(self) -> None:
        # The contrast: inside atomic() but at_once(), a send is written at once, on the broker's own
        # connection (it is then there even if the transaction rolls back; the actor may not find its row).
        self.worker.pause()
        with self.assertRaises(ValueError), transaction.atomic(), at_once():
            message = confirm_order.send(Order.objects.create(total=3).pk)
            raise ValueError
        self.assertEqual(self.broker.inspect(message.message_id)["state"], "queued")
        self.broker.cancel(message.message_id)
        self.worker.resume()


class FencedAtomicWithAWorker(DramatiqTestCase):
    """fenced_atomic(): an actor's ORM writes commit with its delivery's ack, or not at all."""

    def join(self) -> None:
        self.broker.join("shop-fenced", timeout=30_000)
        self.assertTrue(self.broker.flush_outcomes(10))

    def total(self, order: Order) -> int:
        order.refresh_from_db()
        return order.total

    def test_the_orm_write_commits_with_the_ack_and_not_before(self) -> None:
        # Given an actor held inside its block after its ORM write
        order = Order.objects.create(total=0)
        tasks.INSIDE.clear()
        tasks.HOLD.clear()
        message = count_in_a_fenced_atomic.send(order.pk, "hold")
        self.assertTrue(tasks.INSIDE.wait(30))
        # I expect neither the write nor the ack visible while it is open
        self.assertEqual(self.total(order), 0)
        self.assertEqual(self.broker.inspect(message.message_id)["state"], "running")
        # and when it ends, both: the total at 1, the message done at its first attempt
        tasks.HOLD.set()
        self.join()
        self.assertEqual(self.total(order), 1)
        info = self.broker.inspect(message.message_id)
        self.assertEqual((info["state"], info["attempt"]), ("done", 1))
        self.assertEqual(tasks.SEEN[order.pk], [("body", 1), ("after", "done")])

    def test_a_delivery_that_lost_its_message_writes_nothing_and_raises_DeliveryLost(self) -> None:
        # Given a first attempt whose lease lapses and whose message is rescued before its block begins
        order = Order.objects.create(total=0)
        message = count_in_a_fenced_atomic.send(order.pk, "lose_first")
        self.join()
        # I expect DeliveryLost before its body, and only the redelivery's write: the total at 1
        seen = tasks.SEEN[order.pk]
        self.assertEqual(sorted(seen, key=str), sorted([("rescued", 1), ("lost", 1), ("body", 2)], key=str))
        self.assertEqual(self.total(order), 1)
        info = self.broker.inspect(message.message_id)
        self.assertEqual((info["state"], info["attempt"]), ("done", 2))

    def test_an_exception_in_the_body_rolls_back_and_the_retry_writes(self) -> None:
        order = Order.objects.create(total=0)
        message = count_in_a_fenced_atomic.send(order.pk, "fail_first")
        self.join()
        self.assertEqual(tasks.SEEN[order.pk], [("body", 1), ("body", 2)])
        self.assertEqual(self.total(order), 1)  # the first attempt's write rolled back
        info = self.broker.inspect(message.message_id)
        self.assertEqual((info["state"], info["attempt"]), ("done", 2))

    def test_a_commit_whose_connection_broke_after_it_applied_counts_as_committed(self) -> None:
        # Given a block whose COMMIT applies but whose connection breaks before the reply
        order = Order.objects.create(total=0)
        stale = self.broker.stats()["process"]["stale_writes"]
        message = count_in_a_fenced_atomic.send(order.pk, "broken_commit")
        self.join()
        # I expect the block to find it committed: the actor goes on, nothing retried, no stale write
        self.assertEqual(tasks.SEEN[order.pk], [("body", 1), ("after", 1)])
        self.assertEqual(self.total(order), 1)
        info = self.broker.inspect(message.message_id)
        self.assertEqual((info["state"], info["attempt"]), ("done", 1))
        self.assertEqual(self.broker.stats()["process"]["stale_writes"], stale)

    def test_it_is_refused_inside_atomic_on_another_database_and_outside_an_actor(self) -> None:
        with self.assertRaisesRegex(FencedTransactionError, "outside an actor"), fenced_atomic():
            pass
        order = Order.objects.create(total=0)
        message = misuse_fenced_atomic.send(order.pk)
        self.join()
        seen = tasks.SEEN[order.pk]
        self.assertEqual([kind for kind, _ in seen], ["refused", "refused", "nested"], seen)
        self.assertIn("inside an atomic block", seen[0][1])
        self.assertIn("sqlite", seen[1][1])
        self.assertIn("with_ack() inside fenced_atomic()", seen[2][1])
        self.assertEqual(self.total(order), 0)
        self.assertEqual(self.broker.inspect(message.message_id)["state"], "done")
