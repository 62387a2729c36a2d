"""Integrations with web frameworks, one module each; none is imported by the package itself.

- :mod:`.django`: a broker configured from ``DATABASES`` (for ``django_dramatiq``), sends
  in Django's transaction (inside ``transaction.atomic()`` by default, :mod:`.django_atomic`;
  ``outbox()``), the dashboard in Django's URLs for staff.
- :mod:`.sqlalchemy`: sends in a ``Session``'s transaction (``outbox(session)``).
- :mod:`.opentelemetry`: the ``OpenTelemetry`` middleware, spans of sends, deliveries and fenced
  transactions (needs ``opentelemetry-api``, the ``otel`` extra).

Each imports its framework; install it yourself (or the ``frameworks`` extra).  Flask and
FastAPI need nothing of their own: see ``examples/flask_app.py`` and ``examples/fastapi_app.py``.
"""
