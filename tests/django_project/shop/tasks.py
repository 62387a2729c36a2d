import threading

import dramatiq
import psycopg
from django.db import transaction
from django.db.models import F
from psycopg import sql

from dramatiq_pg_fenced.core import delivery
from dramatiq_pg_fenced.errors import DeliveryLost, FencedTransactionError, NestedSendError
from dramatiq_pg_fenced.integrations.django import fenced_atomic

from .models import Order


@dramatiq.actor(queue_name="shop", max_retries=0)
def confirm_order(order_id: int) -> None:
    """Runs only for orders whose transaction committed, and always finds their row."""
    updated = Order.objects.filter(pk=order_id).update(status="confirmed")
    if not updated:
        raise LookupError(f"order {order_id} is not there")


#: What the fenced actors saw, per order: ("body", attempt), ("lost", attempt), ("refused", text)...
SEEN: dict[int, list[tuple[str, object]]] = {}
#: Set by a test to hold an actor inside its block until it is set again (see count_in_a_fenced_atomic).
HOLD = threading.Event()
INSIDE = threading.Event()


@dramatiq.actor(queue_name="shop-fenced", max_retries=3, min_backoff=10, max_backoff=10)
def count_in_a_fenced_atomic(order_id: int, how: str = "") -> None:
    """Adds 1 to the order's total inside fenced_atomic(): the ORM's write commits with the ack.

    *how*: ``hold`` waits inside the block (after the write) for HOLD; ``fail_first`` raises inside
    the block on the first attempt; ``lose_first`` lets the first attempt's lease lapse and its
    message be rescued (back to the queue) before the block begins; ``broken_commit``: Django's
    commit applies, then its connection breaks before the reply.
    """
    attempt = delivery.running().attempt  # type: ignore[union-attr]
    seen = SEEN.setdefault(order_id, [])
    if how == "lose_first" and attempt == 1:
        broker = dramatiq.get_broker()
        broker.database.run(lambda c: c.execute(
            sql.SQL("UPDATE {}.message SET lease_expires_at = now() - interval '1 second' WHERE state = 'running'")
            .format(sql.Identifier(broker.schema))))  # fmt: skip
        seen.append(("rescued", broker.parts.maintenance.rescue()))
    try:
        with fenced_atomic() as conn:
            seen.append(("body", attempt))
            Order.objects.filter(pk=order_id).update(total=F("total") + 1)
            if how == "broken_commit":  # Django's COMMIT applies, then its connection breaks
                real = conn.commit

                def broken() -> None:
                    conn.commit = real  # once
                    real()
                    raise psycopg.OperationalError("server closed the connection unexpectedly")

                conn.commit = broken
            if how == "hold":
                INSIDE.set()
                HOLD.wait(30)
            if how == "fail_first" and attempt == 1:
                raise RuntimeError("fails inside the block")
    except DeliveryLost:
        seen.append(("lost", attempt))
        raise
    except Exception as e:
        if how == "broken_commit":  # not expected: what it was shows in the scenario's assertion
            seen.append(("raised", f"{type(e).__module__}.{type(e).__name__}: {e}"))
        raise
    if how == "broken_commit":
        seen.append(("after", attempt))
    if how == "hold":  # the block's commit was the ack: the message is done before the actor returns
        info = dramatiq.get_broker().inspect(delivery.running().message_id)  # type: ignore[union-attr]
        seen.append(("after", info and info["state"]))


@dramatiq.actor(queue_name="shop-fenced", max_retries=0)
def misuse_fenced_atomic(order_id: int) -> None:
    """fenced_atomic() where it cannot keep its promise: each refusal is recorded, nothing written."""
    seen = SEEN.setdefault(order_id, [])
    for where in ("atomic", "sqlite"):
        try:
            if where == "atomic":
                with transaction.atomic(), fenced_atomic():
                    Order.objects.filter(pk=order_id).update(total=F("total") + 1)
            else:
                with fenced_atomic(using="sqlite"):
                    pass
        except FencedTransactionError as e:
            seen.append(("refused", str(e)))
    try:
        with fenced_atomic(), dramatiq.get_broker().with_ack():
            pass
    except NestedSendError as e:
        seen.append(("nested", str(e)))
