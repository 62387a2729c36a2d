"""A minimal Django project on the real PostgreSQL: ``DATABASE_URL`` names the database,
``DJANGO_TEST_DATABASE`` the test runner's (made and dropped by it)."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DATABASE_URL"])

SECRET_KEY = "only-for-these-tests"
DEBUG = False
ALLOWED_HOSTS = ["shop.example.com"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "urls"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        "TEST": {"NAME": os.environ.get("DJANGO_TEST_DATABASE")},
        # Each request in a transaction: a view's sends are rows of it (shop.views.place_order_plainly).
        "ATOMIC_REQUESTS": True,
    },
    # Another PostgreSQL database: a send in its atomic blocks is not one of the broker's transaction.
    "other": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "postgres"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
        "TEST": {"NAME": os.environ.get("DJANGO_TEST_DATABASE") and os.environ["DJANGO_TEST_DATABASE"] + "_other"},
    },
    # Not PostgreSQL: fenced_atomic(using="sqlite") is refused (no test queries it).
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_dramatiq",
    "shop",
]
try:  # Django 6+: django.tasks; older: the backport's app (its checks and log signals)
    import django.tasks  # noqa: F401
except ImportError:
    INSTALLED_APPS.append("django_tasks")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# django_dramatiq builds the broker: DjangoPostgresBroker(middleware=[...], **OPTIONS).
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq_pg_fenced.integrations.django.DjangoPostgresBroker",
    "OPTIONS": {"database": "default", "schema": "shop_queue", "poll_interval": 0.2},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Retries",
        "django_dramatiq.middleware.AdminMiddleware",
        "django_dramatiq.middleware.DbConnectionsMiddleware",
    ],
}

# Django's Tasks framework on the broker (dramatiq_pg_fenced.integrations.django_tasks; shop/jobs.py).
TASKS = {
    "default": {
        "BACKEND": "dramatiq_pg_fenced.integrations.django_tasks.PostgresBackend",
        "QUEUES": ["default", "shop-tasks"],
    }
}

# Closes the broker's connections before the test database is dropped.
TEST_RUNNER = "dramatiq_pg_fenced.integrations.django.TestRunner"
