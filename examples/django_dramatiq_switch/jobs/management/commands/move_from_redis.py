"""``manage.py move_from_redis`` (new settings): move what is left on the old Redis broker, built
from the old settings, to the new broker, django_dramatiq's ``get_broker()``
(docs/migrating.md, "From django_dramatiq on Redis"). Run it once the old workers are stopped."""

import dramatiq
import old_settings as OLD
from django.core.management.base import BaseCommand
from dramatiq.brokers.redis import RedisBroker
from migrate_from_dramatiq import move  # examples/migrate_from_dramatiq.py

from jobs.tasks import work


class Command(BaseCommand):
    def handle(self, **options):
        old = RedisBroker(**OLD.DRAMATIQ_BROKER["OPTIONS"])
        try:
            moved = move(old, dramatiq.get_broker(), work.queue_name)
        finally:
            old.close()
        self.stdout.write(f"moved {moved}")
