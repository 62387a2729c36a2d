"""The project before the switch: django_dramatiq on Redis, results in Redis.

``DATABASE_URL`` names the project's database, ``REDIS_URL`` the Redis server and
``REDIS_NAMESPACE`` the keys this run uses (``examples/migrate_from_django_dramatiq.py`` sets them).
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DATABASE_URL"])

SECRET_KEY = "only-for-this-example"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}
INSTALLED_APPS = ["django.contrib.contenttypes", "django_dramatiq", "jobs"]

#: Which configuration ran an actor (jobs.tasks records it).
SIDE = "redis"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
MIDDLEWARE_LIST = [
    "dramatiq.middleware.AgeLimit",
    "dramatiq.middleware.TimeLimit",
    "dramatiq.middleware.Callbacks",
    "dramatiq.middleware.Retries",
    "dramatiq.middleware.CurrentMessage",
    "django_dramatiq.middleware.AdminMiddleware",
    "django_dramatiq.middleware.DbConnectionsMiddleware",
]

# before (docs/migrating.md, "From django_dramatiq on Redis")
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.redis.RedisBroker",
    "OPTIONS": {"url": REDIS_URL, "namespace": os.environ.get("REDIS_NAMESPACE", "dramatiq")},
    "MIDDLEWARE": MIDDLEWARE_LIST,
}
DRAMATIQ_RESULT_BACKEND = {
    "BACKEND": "dramatiq.results.backends.redis.RedisBackend",
    "BACKEND_OPTIONS": {"url": REDIS_URL, "namespace": os.environ.get("REDIS_NAMESPACE", "dramatiq") + "-results"},
    "MIDDLEWARE_OPTIONS": {"result_ttl": 600_000},
}
