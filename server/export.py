"""diloco-export: the trained model out of a server's state dir, as safetensors or torch.

    diloco-export --state-dir state --out model.safetensors
    diloco-export --state-dir shard0 --state-dir shard1 --out model.pt

Restores each state dir as a server starting on it would (the snapshot, then the log's outer
steps), without starting a server and without writing to the dir, and writes the global
parameters under the names the learners' model gives them: a safetensors file, or torch.save
of the {name: tensor} dict, chosen by the suffix of --out or by --format. The values are the
server's own float32 ones. Several dirs (one per shard of a run) are merged by parameter
name. Reads a stopped server's dir; a running server's gives the versions logged so far.

A state dir is restored exactly as a server starting on it would restore it: the snapshot,
then the log's outer steps replayed through an Aggregator, read through server/state/store.py
without writing to the dir. The replay needs the settings of the server that wrote the dir:
its fragments, layout, mode and pull codec (the dir's identity) and its outer optimizer's,
which the snapshot records (server/rounds/outer.py). Several dirs must hold the same model
(fingerprint), and each parameter must come from exactly one of them. Every error a user can
cause is an ExportError with one sentence that names the dir or file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from common.atomic import atomic_path
from common.errors import DilocoError
from server.aggregator import Aggregator
from server.config import AggregatorConfig, aggregator_config
from server.rounds.outer import snapshot_settings
from server.state.formats import Restored
from server.state.params import ParamSpec
from server.state.store import read_state_dir

log = logging.getLogger("diloco.export")

FORMATS = {".safetensors": "safetensors", ".pt": "pt", ".pth": "pt"}

# What an unreadable or inconsistent state dir raises: the snapshot's SnapshotError (a
# ValueError), persistence's for a broken log, the Aggregator's for a layout that does not fit.
_READ_ERRORS = (OSError, KeyError, RuntimeError, ValueError, DilocoError)


class ExportError(ValueError):
    """A state dir or output the export cannot use; the message names it."""


@dataclass(frozen=True)
class StateParams:
    """One state dir's global parameters."""

    state_dir: str
    fingerprint: list[ParamSpec]
    params: dict[str, torch.Tensor]  # by name; a fragment without parameters yet is left out
    versions: list[int]  # each fragment's version (-1: no parameters yet)


def read_state_params(state_dir: str) -> StateParams:
    """The global parameters `state_dir` holds, restored as a server starting on it would."""
    path = Path(state_dir)
    if not path.is_dir():
        raise ExportError(f"state dir {state_dir} does not exist or is not a directory")
    if not any(path.iterdir()):
        raise ExportError(f"state dir {state_dir} is empty: no server has written to it")
    try:
        restored = read_state_dir(path)
        if restored is None:
            raise ExportError(f"state dir {state_dir} holds no snapshot: no state to export")
        aggregator = Aggregator(replay_config(restored))
        aggregator.resume(restored)
    except _READ_ERRORS as err:
        if isinstance(err, ExportError):
            raise
        raise ExportError(f"cannot read state dir {state_dir}: {err}") from err
    names = [spec.name for spec in restored.fingerprint]
    params: dict[str, torch.Tensor] = {}
    layout = aggregator.layout()
    for fid, indices, version in layout:
        if version >= 0:  # -1: no learner has handed this fragment's values over yet
            params.update(zip((names[i] for i in indices), aggregator.params(fid), strict=True))
    if not params:
        raise ExportError(
            f"state dir {state_dir} has no parameters yet: no learner has handed them over"
        )
    ordered = {name: params[name] for name in names if name in params}
    return StateParams(state_dir, restored.fingerprint, ordered, [v for _, _, v in layout])


def replay_config(restored: Restored) -> AggregatorConfig:
    """The Aggregator settings that replay `restored` as its server would: the dir's identity
    (state_identity's keys are setting names) and the outer optimizer's recorded settings."""
    outer = snapshot_settings(restored.fragments[0]["outer"]) if restored.fragments else {}
    return aggregator_config(**restored.identity, **outer)


def merge(states: Sequence[StateParams]) -> dict[str, torch.Tensor]:
    """Every parameter of the model by name, in fingerprint order, from the dirs that hold
    it; raises ExportError for dirs of different models, a parameter in two dirs or in none."""
    first = states[0]
    owner: dict[str, str] = {}
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        if state.fingerprint != first.fingerprint:
            raise ExportError(
                f"state dir {state.state_dir} holds another model than state dir "
                f"{first.state_dir}: {_difference(first.fingerprint, state.fingerprint)}"
            )
        for name, tensor in state.params.items():
            if name in owner:
                raise ExportError(
                    f"parameter {name} is in both state dir {owner[name]} and {state.state_dir}"
                )
            owner[name], merged[name] = state.state_dir, tensor
    missing = [spec.name for spec in first.fingerprint if spec.name not in merged]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        dirs = ", ".join(state.state_dir for state in states)
        raise ExportError(
            f"parameter {missing[0]}{more} has no values in state dir {dirs}: "
            f"its fragment has no parameters yet"
        )
    return {spec.name: merged[spec.name] for spec in first.fingerprint}


def check_output(out: Path, chosen: str | None) -> str:
    """The file format to write (`chosen`, else the one `out`'s suffix names), once `out`
    looks writable: checked before the state dirs are read, which may take a while."""
    if out.is_dir():
        raise ExportError(f"cannot write {out}: it is a directory")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: {out.parent} is not a writable directory")
    if chosen:
        return chosen
    if out.suffix in FORMATS:
        return FORMATS[out.suffix]
    raise ExportError(
        f"cannot tell the format of {out} from its name: end it in "
        f"{' or '.join(FORMATS)}, or pass --format"
    )


def write_params(
    params: dict[str, torch.Tensor], out: Path, fmt: str, metadata: dict[str, str]
) -> None:
    """Write `params` to `out`, replaced atomically: a safetensors file (with `metadata` in
    its header), or torch.save of the name -> tensor dict ("pt")."""
    try:
        with atomic_path(out) as tmp:
            if fmt == "safetensors":
                safetensors.torch.save_file(params, str(tmp), metadata=metadata)
            else:
                torch.save(params, tmp)
    except (OSError, safetensors.SafetensorError) as err:
        raise ExportError(f"cannot write {out}: {getattr(err, 'strerror', None) or err}") from err


def _difference(expected: list[ParamSpec], got: list[ParamSpec]) -> str:
    if len(expected) != len(got):
        return f"{len(got)} parameters, not {len(expected)}"
    pairs = enumerate(zip(expected, got, strict=True))
    i, want, have = next((i, w, h) for i, (w, h) in pairs if w != h)
    return (
        f"its parameter {i} is {have.name} {list(have.shape)} {have.dtype}, "
        f"not {want.name} {list(want.shape)} {want.dtype}"
    )


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
