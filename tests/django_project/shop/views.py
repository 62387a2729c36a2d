from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from dramatiq_pg_fenced.integrations.django import outbox

from .models import Order
from .tasks import confirm_order


@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    """The order and its confirmation commit together, or neither does."""
    total = int(request.POST["total"])
    with outbox():
        order = Order.objects.create(total=total)
        message = confirm_order.send(order.pk)
        if total < 0:
            raise ValueError("a negative total is refused")  # rolls back the order and its message
    return JsonResponse({"order": order.pk, "message_id": message.message_id})


#: The ids of the messages place_order_plainly sent, in order (the tests look them up).
SENT: list[str] = []


@require_POST
def place_order_plainly(request: HttpRequest) -> JsonResponse:
    """Written the django_dramatiq way, under ATOMIC_REQUESTS: the view is the transaction, the send a row of it."""
    total = int(request.POST["total"])
    order = Order.objects.create(total=total)
    SENT.append(confirm_order.send(order.pk).message_id)
    if total < 0:
        raise ValueError("a negative total is refused")  # the request's transaction rolls back: order and message
    return JsonResponse({"order": order.pk})
