"""The Prometheus endpoint of either daemon: one HTTP server for one registry.

    port = serve_metrics("0.0.0.0:9100", registry, port_file="")

Started only from a daemon's main(); binding port 0 picks a free port and, like the gRPC
port, can be written to a file for launchers and tests.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(listen: str, registry: CollectorRegistry, port_file: str = "") -> int:
    """Serve `registry` at http://listen/metrics on a daemon thread; returns the bound port."""
    host, _, port = listen.rpartition(":")
    server, _ = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=registry)
    bound = server.server_port
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{bound}\n")
        os.replace(tmp, port_file)  # atomic: readers never see a partial file
    return bound


def check_listen(name: str, listen: str) -> None:
    """Raise ValueError unless `listen` is empty (off) or host:port with a valid port."""
    if not listen:
        return
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{name} must be host:port (port 0-65535) or empty, got {listen!r}")
