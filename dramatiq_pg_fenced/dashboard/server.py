"""A threaded WSGI server for the dashboard (or the metrics app), as the CLI serves them."""

from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .app import Dashboard
from .guards import AUTH_ENV
from .render import WSGIApp

logger = logging.getLogger(__package__)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)


def make_dashboard_server(app: WSGIApp, host: str = "127.0.0.1", port: int = 8080) -> WSGIServer:
    """A threaded WSGI server for *app*, the dashboard or another (``serve_forever()`` it; ``port=0``
    picks a free one; an IPv6 *host* binds IPv6).

    A dashboard with actions and no credentials bound beyond loopback is one any host that
    reaches it can purge: that is said once, at WARNING, when the server is made.
    """
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = _Server6 if family == socket.AF_INET6 else _Server
    server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    address = str(server.server_address[0])
    if isinstance(app, Dashboard) and app.actions and app.auth is None and not _loopback(address):
        logger.warning(
            "Dashboard on %s with actions on and no authentication: anyone who can reach this address can cancel, "
            "re-drive and purge messages (give it credentials: --auth-file, $%s or auth=; or bind 127.0.0.1)",
            netloc(address, server.server_port),
            AUTH_ENV,
        )
    return server


def netloc(host: str, port: int) -> str:
    """``host:port`` as a URL writes it (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
