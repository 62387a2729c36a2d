"""Django's Tasks framework's tasks (``@task``), run by a ``dramatiq`` worker as messages of the broker
(``dramatiq_pg_fenced.integrations.django_tasks``; ``shop.task_scenarios`` tests them)."""

from __future__ import annotations

import dramatiq_pg_fenced

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

from django.db import connection

from dramatiq_pg_fenced.core import delivery

from .models import Order


class PaymentDeclined(Exception):
    """What charge() raises for a negative total."""


@task(queue_name="shop-tasks")
def add(a: int, b: int) -> dict[str, object]:
    """Returns the sum, and where this worker imported the package from."""
    return {"sum": a + b, "package": dramatiq_pg_fenced.__file__}


@task(queue_name="shop-tasks")
def confirm(order_id: int) -> str:
    """Confirms an order: runs only for orders whose transaction committed, and finds their row."""
    if not Order.objects.filter(pk=order_id).update(status="confirmed"):
        raise LookupError(f"order {order_id} is not there")
    return "confirmed"


@task(queue_name="shop-tasks")
def charge(total: int) -> int:
    if total < 0:
        raise PaymentDeclined(f"total {total} is negative")
    return total


def _at_once(func):  # type: ignore[no-untyped-def]
    """``@task(enqueue_on_commit=False)`` where ``@task`` passes its keywords on (the backport, Django
    6.1+); on Django 6.0, whose ``@task`` takes none but its own, ``.using(enqueue_on_commit=False)``."""
    try:
        return task(queue_name="shop-tasks", enqueue_on_commit=False)(func)
    except TypeError:
        return task(queue_name="shop-tasks")(func).using(enqueue_on_commit=False)


@_at_once
def count_at_once(order_id: int) -> int:
    """Enqueued at once, whatever the transaction it is enqueued in does."""
    return order_id


@task(queue_name="shop-tasks")
async def add_in_a_coroutine(a: int, b: int) -> int:
    """An ``async def`` task: the worker runs it to completion in its thread."""
    return a + b


@task(queue_name="shop-tasks", takes_context=True)
def hold_the_first_attempt(context, key: int) -> str:
    """The first attempt waits for the advisory lock *key* (the test holds it), then returns "late";
    the next attempt returns "current" at once."""
    attempt = delivery.running().attempt  # type: ignore[union-attr]
    assert context.attempt == attempt, (context.attempt, attempt)
    if attempt == 1:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [key])
            cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
        return "late"
    return "current"
