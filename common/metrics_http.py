"""The Prometheus endpoint of either daemon (one HTTP server for one registry, and any pages
beside /metrics), and port files.

    port = serve_metrics("0.0.0.0:9100", registry, port_file="")
    port = serve_metrics(listen, registry, pages={"/status": lambda: ("text/html", body())})

Started only from a daemon's main(); binding port 0 picks a free port and, like the gRPC
port, can be written to a file for launchers and tests. Any path that is not a page gets the
metrics, as prometheus_client's own server does.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from common.atomic import atomic_write

# A page: () -> (content type, body); an exception answers 500 with its message.
Page = Callable[[], tuple[str, bytes]]

log = logging.getLogger(__name__)

MAX_REQUESTS = 16  # requests served at once, per server (Prometheus and a few browsers)
REQUEST_TIMEOUT_S = 10.0  # a connection silent this long is closed


def serve_metrics(
    listen: str, registry: CollectorRegistry, port_file: str = "", pages: Mapping[str, Page] = {}
) -> int:
    """Serve `registry` at http://listen/metrics and each of `pages` at its path, on daemon
    threads (one a request); returns the bound port."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        page = pages.get(environ.get("PATH_INFO", ""))
        if page is None:
            return metrics(environ, start_response)
        try:
            content_type, body = page()
            status = "200 OK"
        except Exception as err:  # noqa: BLE001 - one page's failure is that request's alone
            log.exception("page %s failed", environ.get("PATH_INFO"))
            content_type, body, status = "text/plain", f"{err}\n".encode(), "500 Server Error"
        start_response(status, [("Content-Type", content_type), ("Cache-Control", "no-store")])
        return [body]

    family = socket.getaddrinfo(host, None)[0][0]
    slots = threading.BoundedSemaphore(MAX_REQUESTS)
    server_class = type("Server", (_ThreadingServer,), {"address_family": family, "_slots": slots})
    server = make_server(host, int(port), app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    bound = server.server_port
    if port_file:
        write_port_file(port_file, bound)
    return bound


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread a request, at most MAX_REQUESTS at once: a connection beyond them is closed
    at once, so idle or slow clients cannot take the daemon's threads."""

    daemon_threads = True  # a slow scraper never keeps the daemon from exiting
    request_queue_size = 64  # connections the kernel holds until accepted (socketserver: 5)
    _slots: threading.BoundedSemaphore  # serve_metrics gives each server its own

    def handle_error(self, request, client_address) -> None:
        """A client that went silent or away: its request ends, no traceback on stderr."""
        log.debug("metrics request from %s failed", client_address, exc_info=True)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # a client that sends nothing lets its thread go

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        """Not one line per scrape on the daemon's stderr."""


def write_port_file(path: str, port: int) -> None:
    """Write a bound port for launchers and tests; atomic, so readers never see half a file."""
    atomic_write(path, f"{port}\n")


def check_listen(name: str, listen: str) -> None:
    """Raise ValueError unless `listen` is empty (off) or host:port with a valid port."""
    if not listen:
        return
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{name} must be host:port (port 0-65535) or empty, got {listen!r}")
