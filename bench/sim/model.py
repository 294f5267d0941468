"""A synthetic transformer of a given size, cut into fragments by the project's own layout.

    spec = ModelSpec.of_size(params=10e9, layers=48)           # d_model solved for 10B
    plan = FragmentPlan.build(spec, fragments=16, codec="fp4_e2m1")
    plan.stage_bytes[p]     # {stage: bytes} that fragment p puts on the wire

Parameter names follow the learner's GPT (`blocks.i.attn.qkv.weight` …, `tok_emb.weight`,
`head.weight`), so `common.fragments.layout_fragments` places them exactly as the server
would place a real model's; `common.codec.encoded_sizes` gives the exact bytes each tensor
takes in each codec (fp4: 32 values share one scale byte, so 4 + 8/32 = 4.25 bits/value).

Stages are where a tensor sits in the forward pass: -1 for the embedding (used first, its
gradient is complete last), i for block i, `layers` for the final norm and the head (used
last, gradient first). The throughput model (bench/sim/throughput.py) schedules per stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.codec.tensor import codec_id, encoded_sizes
from common.fragments import block_index, layout_fragments

# (name suffix, numel as a function of d_model): a pre-norm GPT block without biases,
# 4·d² in attention (q, k, v, out) and 8·d² in an MLP of width 4·d.
_BLOCK_TENSORS = (
    ("ln1.weight", lambda d: d),
    ("attn.qkv.weight", lambda d: 3 * d * d),
    ("attn.proj.weight", lambda d: d * d),
    ("ln2.weight", lambda d: d),
    ("mlp.fc.weight", lambda d: 4 * d * d),
    ("mlp.proj.weight", lambda d: 4 * d * d),
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shape of the synthetic model; `of_size` solves d_model for a parameter count."""

    layers: int
    d_model: int
    vocab_size: int = 32_000
    """0 leaves out the embedding and head (the Streaming DiLoCo simulator's DAG has only
    transformer layers; see bench/sim/README.md)."""

    def __post_init__(self) -> None:
        if self.layers < 1 or self.d_model < 1 or self.vocab_size < 0:
            raise ValueError("layers and d_model must be >= 1 and vocab_size >= 0")

    @classmethod
    def of_size(cls, params: float, layers: int, vocab_size: int = 32_000) -> ModelSpec:
        """The d_model whose model has about `params` parameters (untied embedding and head):
        solves layers·(12·d² + 2·d) + 2·V·d + d = params for d."""
        if not params > 0 or layers < 1:
            raise ValueError(f"params must be > 0 and layers >= 1, got {params}, {layers}")
        a, b = 12 * layers, 2 * layers + 2 * vocab_size + 1
        d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
        return cls(layers=layers, d_model=max(1, round(d)), vocab_size=vocab_size)

    def parameters(self) -> tuple[list[str], list[int]]:
        """(names, numels) in the learner's naming, embedding first, head last."""
        d = self.d_model
        names: list[str] = []
        numels: list[int] = []
        if self.vocab_size:
            names.append("tok_emb.weight")
            numels.append(self.vocab_size * d)
        for i in range(self.layers):
            for suffix, numel in _BLOCK_TENSORS:
                names.append(f"blocks.{i}.{suffix}")
                numels.append(numel(d))
        names.append("ln_f.weight")
        numels.append(d)
        if self.vocab_size:
            names.append("head.weight")
            numels.append(self.vocab_size * d)
        return names, numels

    @property
    def total_params(self) -> int:
        return sum(self.parameters()[1])


def stage_of(name: str, layers: int) -> int:
    """Where a parameter is used in the forward pass: -1 embedding, i block i, `layers` head."""
    block = block_index(name)
    if block is not None:
        return block
    return -1 if "emb" in name else layers


@dataclass(frozen=True)
class FragmentPlan:
    """Per fragment, the wire bytes of each stage it holds (one codec for all tensors)."""

    stage_bytes: list[dict[int, int]]
    codec: str
    fragment_values: tuple[int, ...] = ()
    """Parameters per fragment (what the server's shard ownership balances, as fp32)."""

    @classmethod
    def build(
        cls, spec: ModelSpec, fragments: int, codec: str, layout: str = "strided"
    ) -> FragmentPlan:
        names, numels = spec.parameters()
        groups = layout_fragments(names, numels, fragments, layout)
        wire = codec_id(codec)
        stage_bytes: list[dict[int, int]] = []
        values = tuple(sum(numels[i] for i in group) for group in groups)
        for group in groups:
            per_stage: dict[int, int] = {}
            for index in group:
                stage = stage_of(names[index], spec.layers)
                payload, scales = encoded_sizes(wire, numels[index])
                per_stage[stage] = per_stage.get(stage, 0) + payload + scales
            stage_bytes.append(per_stage)
        return cls(stage_bytes, codec, values)

    @property
    def fragment_bytes(self) -> list[int]:
        return [sum(s.values()) for s in self.stage_bytes]

    @property
    def total_bytes(self) -> int:
        return sum(self.fragment_bytes)


def bits_per_value(codec: str, numel: int = 1 << 20) -> float:
    """Wire bits per parameter in `codec`, from the codec's own size rule."""
    payload, scales = encoded_sizes(codec_id(codec), numel)
    return 8 * (payload + scales) / numel


def allreduce_factor(replicas: int) -> float:
    """Bytes each replica sends (and receives) per byte of payload in a ring all-reduce:
    reduce-scatter then all-gather, each moving (K−1)/K of the payload: 2(K−1)/K."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return 2 * (replicas - 1) / replicas
