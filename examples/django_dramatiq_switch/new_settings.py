"""The project after the switch: the same project, the broker and its results in PostgreSQL
(docs/migrating.md, "From django_dramatiq on Redis": only these two settings change)."""

from __future__ import annotations

import os

from old_settings import *  # noqa: F403
from old_settings import MIDDLEWARE_LIST

SIDE = "postgres"

# after
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq_pg_fenced.integrations.django.DjangoPostgresBroker",
    "OPTIONS": {"database": "default", "poll_interval": 0.2},
    "MIDDLEWARE": MIDDLEWARE_LIST,  # the same list
}
DRAMATIQ_RESULT_BACKEND = {
    "BACKEND": "dramatiq_pg_fenced.PostgresResultBackend",
    "BACKEND_OPTIONS": {"url": os.environ["DATABASE_URL"]},  # the broker's database
    "MIDDLEWARE_OPTIONS": {"result_ttl": 600_000},
}
