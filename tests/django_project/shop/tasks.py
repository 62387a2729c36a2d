import dramatiq

from .models import Order


@dramatiq.actor(queue_name="shop", max_retries=0)
def confirm_order(order_id: int) -> None:
    """Runs only for orders whose transaction committed, and always finds their row."""
    updated = Order.objects.filter(pk=order_id).update(status="confirmed")
    if not updated:
        raise LookupError(f"order {order_id} is not there")
