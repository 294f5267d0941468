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
    except OSError as err:
        parser.error(str(err))
    service.start()
    try:
        stop.wait()
    finally:
        service.stop()


if __name__ == "__main__":
    main()
