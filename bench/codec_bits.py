"""Bits per parameter on the wire, per codec and direction, for the quality benchmark's model.

    python -m bench.codec_bits                       # bench/quality.py's model, k = 64 of 4096
    python -m bench.codec_bits --topk-fraction 0.01  # another kept fraction

Push: one learner's serialized pseudo-gradient of the whole model (common/codec/fragment.py's
encode_fragment; sparse codecs with their error feedback, as StreamingSync sends them).
Pull: one logged outer update of the whole model as a learner at the previous version
receives it (the FragmentUpdates chain of one version, server/state/fragment.py's log), after a
few rounds so the server's residual is warm. Both count every byte of the message: values,
indices, scales, checksums and protobuf framing, divided by the model's parameter count.
Random pseudo-gradients suffice here: the sizes depend on the shapes and k, not the values.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.simulate import Setup
from common.codec.fragment import encode_fragment, fragment_with_feedback
from common.codec.sparse import DEFAULT_TOPK_FRACTION, topk_k
from common.codec.tensor import is_sparse
from learner.model import GPT
from server.rounds.outer import NesterovOuter
from server.state.fragment import FragmentState

CODECS = ("fp32", "fp4_e2m1", "sparse_2bit")
ROUNDS = 3


def measure(topk_fraction: float = DEFAULT_TOPK_FRACTION) -> dict:
    """{codec: {"push": bits per parameter, "pull": ...}} for bench/quality.py's model."""
    torch.manual_seed(0)
    shapes = [tuple(p.shape) for p in GPT(Setup().model_config()).parameters()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    k = topk_k(topk_fraction)
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    report: dict = {"params": numel, "sparse_k": k, "chunk": 4096}
    for name in CODECS:
        if is_sparse(name):
            residuals = [torch.zeros(s) for s in shapes]
            push = fragment_with_feedback(deltas, name, k, residuals)
        else:
            push = encode_fragment(deltas, name)
        if name != "fp32":  # fp32 pulls are snapshots: 32 bits a parameter plus framing
            state = FragmentState(
                0, list(range(len(shapes))), shapes, NesterovOuter(), name, 16, pull_sparse_k=k
            )
            state.initialize([torch.zeros(s) for s in shapes])
            for _ in range(ROUNDS):
                state.apply_mean([d.clone() for d in deltas])
            pull_bytes = state.pull(ROUNDS - 1).payload_bytes
        else:
            pull_bytes = len(encode_fragment(deltas, "fp32"))
        report[name] = {"push": 8 * len(push) / numel, "pull": 8 * pull_bytes / numel}
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topk-fraction", type=float, default=DEFAULT_TOPK_FRACTION)
    args = parser.parse_args()
    report = measure(args.topk_fraction)
    print(json.dumps(report, indent=1))
    base = report["fp4_e2m1"]
    for name in CODECS:
        bits = report[name]
        ratio = (base["push"] + base["pull"]) / (bits["push"] + bits["pull"])
        print(
            f"{name:<12} push {bits['push']:.3f}  pull {bits['pull']:.3f} bits/param  "
            f"({ratio:.1f}x fewer bytes than fp4_e2m1 both ways)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
