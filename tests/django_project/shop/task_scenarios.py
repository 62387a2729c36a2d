"""Django's Tasks framework on the broker (``dramatiq_pg_fenced.integrations.django_tasks``), run by
Django's test runner (``tests/test_django_tasks.py`` starts it): ``TestCase`` ones first (each test in
a transaction rolled back at its end), then a real ``dramatiq`` worker process runs the tasks."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import dramatiq
import psycopg
from asgiref.sync import async_to_sync
from django.db import connection, transaction
from django.test import TestCase, TransactionTestCase
from django.utils import timezone
from psycopg import sql

import dramatiq_pg_fenced
from dramatiq_pg_fenced.integrations.django import database_conninfo
from dramatiq_pg_fenced.integrations.django_tasks import ACTOR_NAME, PostgresBackend

try:
    from django.tasks import TaskResultStatus, default_task_backend
    from django.tasks.exceptions import InvalidTask as InvalidTaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    from django_tasks import TaskResultStatus, default_task_backend
    from django_tasks.exceptions import InvalidTaskError, TaskResultDoesNotExist

from . import jobs
from .models import Order


def row_on_djangos_connection(message_id: str) -> tuple[Any, ...] | None:
    """(queue, actor, priority, due in the future?) of the message's row as Django's connection sees it."""
    with connection.cursor() as cursor:
        cursor.execute(
            sql.SQL("SELECT queue_name, actor_name, priority, available_at > now() FROM {}.message "
                    "WHERE message_id = %s").format(sql.Identifier(dramatiq.get_broker().schema))
            .as_string(connection.connection),
            [message_id],
        )  # fmt: skip
        return cursor.fetchone()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class TheBackendInATestCase(TestCase):
    def test_the_backend_is_ours_and_the_package_is_the_one_under_test(self) -> None:
        self.assertIsInstance(jobs.add.get_backend(), PostgresBackend)
        expected = os.environ.get("EXPECT_PACKAGE_UNDER")
        if expected:
            self.assertTrue(dramatiq_pg_fenced.__file__.startswith(expected), dramatiq_pg_fenced.__file__)
        # the broker has the generic actor, the backend's queues, and results to read from
        broker = dramatiq.get_broker()
        self.assertIn(ACTOR_NAME, broker.actors)
        self.assertLessEqual({"default", "shop-tasks"}, broker.get_declared_queues())

    def test_a_task_enqueued_in_atomic_is_a_row_of_the_transaction_only(self) -> None:
        # Given the test's transaction (TestCase), when a task is enqueued in it
        result = jobs.add.enqueue(1, 2)
        # I expect a row Django's connection sees, for the generic actor in the task's queue
        self.assertEqual(row_on_djangos_connection(result.id), ("shop-tasks", ACTOR_NAME, 0, False))
        self.assertEqual(result.status, TaskResultStatus.READY)
        # and that the broker's connections (so any worker, and get_result) do not see
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result(result.id)

    def test_priority_and_run_after_are_the_rows_claim_order_and_due_time(self) -> None:
        later = timezone.now() + datetime.timedelta(hours=1)
        result = jobs.add.using(priority=10, run_after=later).enqueue(1, 2)
        # Django's higher first is the broker's lower first; run_after is the row's due time
        self.assertEqual(row_on_djangos_connection(result.id), ("shop-tasks", ACTOR_NAME, -10, True))

    def test_the_options_are_validated_as_djangos_backends_do(self) -> None:
        with self.assertRaises(InvalidTaskError):
            jobs.add.using(priority=101)
        with self.assertRaises(InvalidTaskError):
            jobs.add.using(queue_name="not-a-declared-queue")
        with self.settings(USE_TZ=True), self.assertRaises(InvalidTaskError):
            jobs.add.using(run_after=datetime.datetime(2030, 1, 1))  # naive
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result("not-an-id")
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result("0f0f0f0f-0000-4000-8000-000000000000")


class TasksWithAWorkerProcess(TransactionTestCase):
    """A stock ``dramatiq`` worker process (``django_dramatiq.setup``, then this module's backend and
    the tasks' module) on the test database."""

    worker: subprocess.Popen[bytes]
    log: Any

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        env = dict(os.environ, DATABASE_URL=database_conninfo("default"), DJANGO_SETTINGS_MODULE="settings",
                   PYTHONUNBUFFERED="1")  # fmt: skip
        cls.log = tempfile.NamedTemporaryFile(prefix="dramatiq-worker-", suffix=".log", delete=False)
        cls.worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "--processes", "1", "--threads", "2", "django_dramatiq.setup",
             "dramatiq_pg_fenced.integrations.django_tasks", "shop.jobs"],
            env=env, stdout=cls.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    @classmethod
    def tearDownClass(cls) -> None:
        os.killpg(cls.worker.pid, signal.SIGTERM)
        try:
            cls.worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(cls.worker.pid, signal.SIGKILL)
            cls.worker.wait()
        cls.log.close()
        os.unlink(cls.log.name)
        super().tearDownClass()

    def finished(self, result: Any, timeout: float = 60.0) -> Any:
        def done() -> bool:
            if self.worker.poll() is not None:
                raise AssertionError("the worker exited:\n" + open(self.log.name).read()[-4000:])
            result.refresh()
            return result.is_finished

        try:
            wait_for(done, f"task {result.id} to finish", timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{open(self.log.name).read()[-4000:]}") from None
        return result

    def test_a_committed_task_runs_and_its_return_value_is_read_back(self) -> None:
        with transaction.atomic():
            result = jobs.add.enqueue(2, 3)
        self.assertIn(result.status, (TaskResultStatus.READY, TaskResultStatus.RUNNING))
        self.finished(result)
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value["sum"], 5)
        self.assertEqual(result.errors, [])
        self.assertEqual(result.attempts, 1)
        self.assertIsNotNone(result.finished_at)
        # the worker imported the package under test too
        expected = os.environ.get("EXPECT_PACKAGE_UNDER")
        if expected:
            self.assertTrue(result.return_value["package"].startswith(expected), result.return_value["package"])
        # get_result gives the same, through the task too
        self.assertEqual(jobs.add.get_result(result.id).return_value["sum"], 5)

    def test_a_task_finds_the_row_its_transaction_committed_and_a_rolled_back_one_leaves_nothing(self) -> None:
        with transaction.atomic():
            order = Order.objects.create(total=3)
            kept = jobs.confirm.enqueue(order.pk)
        try:
            with transaction.atomic():
                gone = Order.objects.create(total=4)
                dropped = jobs.confirm.enqueue(gone.pk)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        self.assertEqual(self.finished(kept).return_value, "confirmed")
        self.assertEqual(Order.objects.get(pk=order.pk).status, "confirmed")
        with self.assertRaises(TaskResultDoesNotExist):
            default_task_backend.get_result(dropped.id)
        self.assertIsNone(dramatiq.get_broker().inspect(dropped.id))

    def test_a_task_enqueue_on_commit_false_is_written_whatever_the_transaction_does(self) -> None:
        try:
            with transaction.atomic():
                result = jobs.count_at_once.enqueue(7)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        self.assertEqual(self.finished(result).return_value, 7)

    def test_using_enqueue_on_commit_false_writes_a_task_at_once_whatever_the_transaction_does(self) -> None:
        # Given a task enqueued on commit by default, when .using(enqueue_on_commit=False) enqueues it in a
        # transaction that rolls back, I expect it written and run all the same (any Django's @task)
        at_once = jobs.charge.using(enqueue_on_commit=False)
        self.assertIs(jobs.charge.enqueue_on_commit, None)
        try:
            with transaction.atomic():
                result = at_once.enqueue(8)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        self.assertEqual(self.finished(result).return_value, 8)

    def test_an_async_task_runs_and_is_enqueued_and_read_back_with_aenqueue_and_aget_result(self) -> None:
        result = async_to_sync(jobs.add_in_a_coroutine.aenqueue)(4, 5)
        self.finished(result)
        self.assertEqual((result.status, result.return_value), (TaskResultStatus.SUCCESSFUL, 9))
        again = async_to_sync(jobs.add_in_a_coroutine.aget_result)(result.id)
        self.assertEqual((again.status, again.return_value), (TaskResultStatus.SUCCESSFUL, 9))

    def test_a_failing_task_is_failed_with_its_exceptions_class_path_and_traceback(self) -> None:
        result = jobs.charge.enqueue(-5)
        self.finished(result)
        self.assertEqual(result.status, TaskResultStatus.FAILED)
        self.assertEqual(len(result.errors), 1)
        error = result.errors[0]
        self.assertEqual(error.exception_class_path, "shop.jobs.PaymentDeclined")
        self.assertIs(error.exception_class, jobs.PaymentDeclined)
        self.assertIn("total -5 is negative", error.traceback)
        self.assertIn("Traceback (most recent call last)", error.traceback)
        with self.assertRaises(ValueError):
            result.return_value  # noqa: B018

    def test_a_task_that_outlives_its_lease_never_replaces_the_current_result(self) -> None:
        broker = dramatiq.get_broker()
        key = 4343
        stale_before = broker.stats()["totals"].get("stale_writes", 0)
        with psycopg.connect(database_conninfo("default"), autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", [key])
            # Given a task whose first attempt waits for the lock the test holds
            result = jobs.hold_the_first_attempt.enqueue(key)
            wait_for(lambda: holder.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted", [key]
            ).fetchone(), "the first attempt to wait for the lock")  # fmt: skip
            # When its lease lapses and the message is taken back, the next attempt runs and succeeds
            same = sql.SQL("{}.message").format(sql.Identifier(broker.schema))

            def taken_back() -> bool:
                broker.database.run(lambda c: c.execute(
                    sql.SQL("UPDATE {} SET lease_expires_at = now() - interval '1 second' "
                            "WHERE message_id = %s AND state = 'running' AND attempt = 1").format(same),
                    [result.id]))  # fmt: skip
                broker.parts.maintenance.rescue()
                return not broker.database.run(lambda c: c.execute(
                    sql.SQL("SELECT 1 FROM {} WHERE message_id = %s AND state = 'running' AND attempt = 1")
                    .format(same), [result.id]).fetchone())  # fmt: skip

            wait_for(taken_back, "the first attempt's lease to be taken back")
            self.finished(result)
            self.assertEqual((result.status, result.return_value, result.attempts),
                             (TaskResultStatus.SUCCESSFUL, "current", 2))  # fmt: skip
            # and when the first attempt finishes late, its result and ack are fenced out
            holder.execute("SELECT pg_advisory_unlock(%s)", [key])
        wait_for(lambda: broker.stats()["totals"].get("stale_writes", 0) > stale_before,
                 "the late attempt's writes to be refused")  # fmt: skip
        # the worker logged its late result as refused, and the current one stands
        refused = f"Stale result of message {result.id} by attempt 1 ignored"
        wait_for(lambda: refused in open(self.log.name).read(), "the worker to log the late result as refused")
        result.refresh()
        self.assertEqual((result.status, result.return_value), (TaskResultStatus.SUCCESSFUL, "current"))
