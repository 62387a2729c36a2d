import dramatiq
from django.conf import settings
from dramatiq.common import current_millis
from dramatiq.middleware import CurrentMessage

from .models import Run


@dramatiq.actor(store_results=True)
def work(n: int) -> int:
    """The application's actor, the same before and after the switch: it records its run."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    Run.objects.create(message_id=message.message_id, side=settings.SIDE, at_ms=current_millis())
    return n * 2
