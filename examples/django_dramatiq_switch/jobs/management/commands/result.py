"""``manage.py result ID [ID...]``: read ``work``'s result for each message id through the configured
results backend (django_dramatiq's ``DRAMATIQ_RESULT_BACKEND``); print them as JSON."""

import json

from django.core.management.base import BaseCommand
from dramatiq import Message
from dramatiq.results import ResultMissing

from jobs.tasks import work


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("ids", nargs="+")

    def handle(self, ids, **options):
        found = {}
        for message_id in ids:
            message = Message(queue_name=work.queue_name, actor_name=work.actor_name, args=(), kwargs={},
                              options={}, message_id=message_id)  # fmt: skip
            try:
                found[message_id] = message.get_result(block=True, timeout=10_000)
            except ResultMissing:
                found[message_id] = None
        self.stdout.write(json.dumps(found))
