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
