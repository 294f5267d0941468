"""The Prometheus endpoint of either daemon (one HTTP server for one registry), and port files.

    port = serve_metrics("0.0.0.0:9100", registry, port_file="")

Started only from a daemon's main(); binding port 0 picks a free port and, like the gRPC
port, can be written to a file for launchers and tests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from common.atomic import atomic_write


def serve_metrics(listen: str, registry: CollectorRegistry, port_file: str = "") -> int:
    """Serve `registry` at http://listen/metrics on a daemon thread; returns the bound port."""
    host, _, port = listen.rpartition(":")
    server, _ = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    bound = server.server_port
    if port_file:
        write_port_file(port_file, bound)
    return bound


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
