"""``manage.py send N [N...] [--delay MS]``: send ``work(n)`` through the configured broker; print
each message's id and options as JSON lines."""

import json

from django.core.management.base import BaseCommand

from jobs.tasks import work


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("numbers", nargs="+", type=int)
        parser.add_argument("--delay", type=int, default=None, help="milliseconds")

    def handle(self, numbers, delay, **options):
        for n in numbers:
            message = work.send_with_options(args=(n,), delay=delay)
            self.stdout.write(json.dumps({"id": message.message_id, "options": message.options}))
