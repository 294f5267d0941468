"""diloco-server: the aggregator service.

    diloco-server --listen 127.0.0.1:50051 --lease-s 10

Parses flags into a ServerConfig, serves until SIGINT/SIGTERM, and always stops cleanly.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from common.config import add_config_flags, config_from_args
from common.metrics_http import serve_metrics
from server.app import AggregatorService, ServerConfig


def main() -> None:
    parser = argparse.ArgumentParser(prog="diloco-server", description=__doc__.splitlines()[0])
    add_config_flags(parser, ServerConfig)
    config = config_from_args(parser, ServerConfig, parser.parse_args())
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        service = AggregatorService(config)
        if config.metrics_listen:
            port = serve_metrics(
                config.metrics_listen, service.metrics.registry, config.metrics_port_file
            )
            logging.getLogger("diloco.server").info("metrics on port %d at /metrics", port)
    except OSError as err:  # e.g. a port already in use
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    service.start()
    try:
        stop.wait()
    finally:
        service.stop()


if __name__ == "__main__":
    main()
