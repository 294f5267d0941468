"""diloco-server: the aggregator service.

    diloco-server --listen 127.0.0.1:50051 --lease-s 10 --insecure     # or --tls-cert/--tls-key

Parses flags into a ServerConfig, serves until SIGINT/SIGTERM, and always stops cleanly.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from common.config import config_parser, parse_command_line
from common.metrics_http import serve_metrics
from server.config import ServerConfig
from server.rpc.service import (
    AggregatorService,
    limit_malloc_arenas,
    single_threaded_torch,
    start_malloc_trimmer,
)


def parse_config(argv: list[str], environ: dict[str, str] | None = None) -> ServerConfig:
    """The config that `diloco-server ARGV` runs with (tests build theirs the way users do)."""
    return parse_command_line(build_parser(), ServerConfig, argv, environ or {})


def build_parser() -> argparse.ArgumentParser:
    return config_parser("diloco-server", __doc__.splitlines()[0], ServerConfig)


def main() -> None:
    parser = build_parser()
    config = parse_command_line(parser, ServerConfig)
    observability = config.observability
    logging.basicConfig(level=observability.log_level, format="%(asctime)s %(name)s %(message)s")
    limit_malloc_arenas()  # before the server's threads start allocating (server/rpc/service.py)
    single_threaded_torch()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    start_malloc_trimmer(stop)  # bounded RSS under many learners (server/rpc/service.py)
    try:
        service = AggregatorService(config)
        if observability.metrics_listen:
            port = serve_metrics(
                observability.metrics_listen,
                service.metrics.registry,
                observability.metrics_port_file,
            )
            logging.getLogger("diloco.server").info("metrics on port %d at /metrics", port)
        if service.auth is not None:  # before start(): a SIGHUP must never find the default
            signal.signal(signal.SIGHUP, lambda *_: reload_tokens(service))
        service.start()
    except (OSError, ValueError) as err:  # a port in use, an unreadable certificate or port file
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    try:
        # Wake up now and then: Python runs signal handlers in the main thread, and a signal
        # the kernel hands to another thread (gRPC's, the trimmer) does not interrupt a wait
        # without a timeout, so a SIGHUP could otherwise sit unhandled (seen in CI).
        while not stop.wait(0.2):
            pass
    finally:
        service.stop()


def reload_tokens(service: AggregatorService) -> None:
    """SIGHUP: re-read the token file, so an edited file revokes or adds learners."""
    log = logging.getLogger("diloco.server")
    try:
        log.info("auth: reloaded %d learner tokens", service.auth.reload())
    except ValueError as err:
        log.error("auth: token file not reloaded, keeping the old tokens: %s", err)


if __name__ == "__main__":
    main()
