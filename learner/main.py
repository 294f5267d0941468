"""diloco-learner: train a model against an aggregator.

    diloco-learner --server 127.0.0.1:50051 --learner-id a --sync-every-steps 50
    torchrun --standalone --nproc-per-node 2 -m learner.main --learner-id a ...   # an island

Parses flags into a LearnerConfig, trains until done or SIGINT/SIGTERM, then leaves the run
and prints (and optionally writes) a summary. Under torchrun only rank 0 serves metrics,
writes the summary and saves the parameters: it speaks for the island (learner/island.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading

import grpc

from common.config import config_parser, parse_command_line
from common.metrics_http import serve_metrics
from learner.config import LearnerConfig
from learner.connection import unreachable
from learner.island import Island, exit_without_teardown
from learner.progress import Progress
from learner.shards import ShardMapError
from learner.trainer import Learner


def parse_config(argv: list[str], environ: dict[str, str] | None = None) -> LearnerConfig:
    """The config that `diloco-learner ARGV` runs with (tests build theirs the way users do)."""
    return parse_command_line(build_parser(), LearnerConfig, argv, environ or {})


def build_parser() -> argparse.ArgumentParser:
    return config_parser("diloco-learner", __doc__.splitlines()[0], LearnerConfig)


def main() -> None:
    parser = build_parser()
    config = parse_command_line(parser, LearnerConfig)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        learner = Learner(config, Island.from_env(os.environ))
        observability = config.observability
        if observability.metrics_listen and learner.island.is_leader:  # rank 0 of an island
            registry = learner.sync.metrics_registry()
            port = serve_metrics(
                observability.metrics_listen, registry, observability.metrics_port_file
            )
            logging.getLogger("diloco.learner").info("metrics on port %d at /metrics", port)
    except (ValueError, OSError) as err:  # e.g. a missing corpus, a metrics port in use
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    finished = False
    try:
        progress = learner.run(stop)
        finished = True
    except grpc.FutureTimeoutError:
        sys.exit(f"diloco-learner: error: {unreachable(config.connection)}")
    except grpc.RpcError as err:
        sys.exit(f"diloco-learner: error: the server answered {err.code().name}: {err.details()}")
    except ShardMapError as err:
        sys.exit(f"diloco-learner: error: {err}")
    finally:
        learner.island.close(finished)
    if learner.island.is_leader:
        _report(config, learner, progress)
    if learner.island.distributed:
        exit_without_teardown()


def _report(config: LearnerConfig, learner: Learner, progress: Progress) -> None:
    """The run's outputs: saved parameters, the summary file and the summary line."""
    if config.observability.save_params:
        learner.save_params(config.observability.save_params)
    summary = dataclasses.asdict(progress)
    if config.observability.summary_file:
        with open(config.observability.summary_file, "w") as f:
            json.dump(summary, f, indent=1)
    losses = progress.eval_losses
    print(
        f"learner={progress.learner_id} outer_steps={progress.outer_steps} "
        f"tokens={progress.tokens} eval_loss={losses[0]:.4f}->{losses[-1]:.4f} "
        f"sent_bytes={progress.bytes_sent} received_bytes={progress.bytes_received}"
        if losses
        else f"learner={progress.learner_id} stopped before the first evaluation"
    )


if __name__ == "__main__":
    main()
