"""The metrics port's HTTP server: pages beside /metrics, a page's failure, and the bound on
the connections it serves at once."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from common import metrics_http
from common.metrics_http import MAX_REQUESTS, serve_metrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def failing_page() -> tuple[str, bytes]:
    raise RuntimeError("the report could not be built")


def test_pages_beside_the_metrics_and_a_failing_page_answers_500() -> None:
    registry = CollectorRegistry()
    Counter("probe_total", "A counter to find.", registry=registry).inc()
    pages = {"/hello": lambda: ("text/plain", b"hi"), "/broken": failing_page}
    port = serve_metrics("127.0.0.1:0", registry, pages=pages)
    assert get(port, "/hello") == (200, "hi")
    assert get(port, "/broken") == (500, "the report could not be built\n")
    status, body = get(port, "/metrics")
    assert status == 200 and "probe_total 1.0" in body


def test_idle_connections_cannot_take_every_thread(monkeypatch) -> None:
    monkeypatch.setattr(metrics_http._QuietHandler, "timeout", 1.0)
    port = serve_metrics("127.0.0.1:0", CollectorRegistry())
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_REQUESTS)]
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(10)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b""  # closed at once: every slot is held
        extra.close()
        for sock in idle:  # each silent client is dropped after the handler's timeout
            sock.settimeout(10)
            assert sock.recv(100) == b""
    finally:
        for sock in idle:
            sock.close()
    assert get(port, "/metrics")[0] == 200  # the slots are free again


@pytest.mark.parametrize("listen", ["[::1]:0", "127.0.0.1:0"])
def test_both_address_families_bind(listen: str) -> None:
    if listen.startswith("[") and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    port = serve_metrics(listen, CollectorRegistry())
    host = "::1" if listen.startswith("[") else "127.0.0.1"
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.0 200")
