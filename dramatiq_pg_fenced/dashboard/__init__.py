"""The web dashboard: a WSGI app over the operator's functions in :mod:`..admin`.

Pages: ``/`` (queues), ``/messages`` (a queue's messages by state, filtered by
actor, keyset pages), ``/message/<id>`` (one message), ``/schedules`` (every
schedule, its ticks and their messages), ``/metrics`` (Prometheus, when
``prometheus_client`` is installed).  Actions (cancel, re-drive, pause, resume,
purge) are ``POST /action`` forms, refused unless the app was built with
``actions=True``.  Pages update in place while open (``static/live.js``, a
poller shipped in the package; pausable), follow the system's dark mode and
fit a phone's width (``static/style.css``).

Who may ask, checked before anything else runs: a request whose ``Host`` is not
one of the allowed host names gets 400 (a DNS-rebinding page names its own host,
and would otherwise read every page, arguments and form token included), then,
when the app has credentials (``auth``), one without them gets 401 (or, with
``login=True``, the login page; a signed session cookie then stands for them).
Cross-site requests cannot act: every form carries a token made for this
process (compared in constant time), a form whose ``Origin`` is not an allowed
host or whose ``Sec-Fetch-Site`` names another site is refused, and pages may
not be framed.  Nothing of the connection string is ever rendered: the pages
name the schema only.

Budget: every page runs a fixed number of indexed statements that stop early
(counts capped at :data:`COUNT_CAP` per priority, pages of :data:`PAGE_SIZE`
rows by keyset, an actor filter reads at most :data:`..admin.FILTER_WINDOW`
rows per page); none scans the message table.  Mount it in any WSGI server
(``gunicorn 'myapp:dashboard'``), or serve it with ``dramatiq-pg-fenced dashboard``.
Mounted under a path of another application, it reads that path from ``SCRIPT_NAME``
(as WSGI dispatchers and ASGI adapters set it) and keeps its links, forms and
redirects under it.

Over several databases (a ``RoutedBroker``, or a :class:`..fleet.Fleet`), every page shows every
database's rows, each naming its database, and every action goes to the database of its message
or queue (see "Operating several databases" in ``docs/routing.md``).

Modules, one concern each: :mod:`.guards` (hosts, credentials, sessions),
:mod:`.render` (escaping, links, tables, times), :mod:`.app` (routing, actions,
the pages), :mod:`.server` (the CLI's server), ``static/`` (style and script).
"""

from .app import ACTIONS, Dashboard, dashboard_app
from .guards import AUTH_ENV, LOOPBACK_HOSTS, AllowedHosts, Credentials, host_checked
from .render import COUNT_CAP, PAGE_SIZE, PURGE_COUNT_CAP, HTTPError
from .server import make_dashboard_server, netloc

__all__ = [
    "ACTIONS", "AUTH_ENV", "COUNT_CAP", "LOOPBACK_HOSTS", "PAGE_SIZE", "PURGE_COUNT_CAP", "AllowedHosts",
    "Credentials", "Dashboard", "HTTPError", "dashboard_app", "host_checked", "make_dashboard_server", "netloc",
]  # fmt: skip
