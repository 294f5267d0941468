"""diloco-export: the trained model out of a server's state dir, as safetensors or torch.

    diloco-export --state-dir state --out model.safetensors
    diloco-export --state-dir shard0 --state-dir shard1 --out model.pt

Restores each state dir as a server starting on it would (the snapshot, then the log's outer
steps), without starting a server and without writing to the dir, and writes the global
parameters under the names the learners' model gives them: a safetensors file, or torch.save
of the {name: tensor} dict, chosen by the suffix of --out or by --format. The values are the
server's own float32 ones. Several dirs (one per shard of a run) are merged by parameter
name. Reads a stopped server's dir; a running server's gives the versions logged so far.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from server.export_state import (
    FORMATS,
    ExportError,
    check_output,
    merge,
    read_state_params,
    write_params,
)

log = logging.getLogger("diloco.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diloco-export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--state-dir",
        action="append",
        required=True,
        metavar="DIR",
        help="a server's --state-dir; give it once per shard to merge them by parameter name",
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="PATH", help="file to write (replaced whole)"
    )
    parser.add_argument(
        "--format",
        choices=sorted(set(FORMATS.values())),
        help="safetensors or pt (torch.save of a state dict); default: from --out's suffix",
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        fmt = check_output(args.out, args.format)
        states = [read_state_params(state_dir) for state_dir in args.state_dir]
        params = merge(states)
        # Self-describing: which versions of the run the file holds (safetensors header).
        metadata = {
            "format": "pt",  # safetensors' own key: the tensors are torch's
            "diloco_fragment_versions": json.dumps([state.versions for state in states]),
        }
        write_params(params, args.out, fmt, metadata)
    except ExportError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    log.info(
        "exported %d parameters (%d values) at fragment versions %s to %s (%s)",
        len(params),
        sum(t.numel() for t in params.values()),
        [state.versions for state in states],
        args.out,
        fmt,
    )


if __name__ == "__main__":
    main()
