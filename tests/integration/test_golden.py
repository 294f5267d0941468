"""Golden runs: what every machine must reproduce, checked without pinning a machine's bits.

- Streaming DiLoCo (2 fragments, fp4 both ways, overlap, merge): a real server (in process,
  loopback port 0) and two of the daemon's learners (in threads), configs built from
  command-line flags as users build them. Every learner's replicas end bit-identical to the
  server's parameters, and both learners' models equal them.
- Plain DiLoCo (1 fragment, fp32 both ways, no overlap, merge α = 0): the same, and the
  server's parameters equal an independent plain-torch DiLoCo (tests/support/reference.py)
  within float tolerance; a reference with another outer lr does not.
- Quorum: the aggregator on a fake clock, three learners with token weighting, a grace window
  that closes a round without the straggler, stale contributions, partial rounds, fp4 pulls.
  Its inputs make every operation exact or a single correctly rounded one (integer-valued
  inputs times powers of two, weights and staleness discounts powers of two, outer lr and
  momentum powers of two), so any IEEE-754 machine computes the same bits: its CRCs are
  pinned. They change only with a deliberate change of behaviour (and the commit says why).

Trained models are not pinned: torch's CPU kernels (matmul, AdamW) round differently on
different instruction sets, so a model's bits belong to its machine.
"""

from __future__ import annotations

import threading

import torch

from common.codec.fragment import apply_updates, decode_fragment, params_crc32
from common.generated.diloco.v1 import aggregator_pb2 as pb
from learner.main import parse_config as learner_config
from learner.model import GPT
from learner.progress import Progress
from learner.trainer import Learner
from server.aggregator import Aggregator
from server.main import AggregatorService
from server.main import parse_config as server_config
from server.state.params import ParamSpec
from tests.support.fakes import FakeClock
from tests.support.reference import reference_diloco

OUTER_STEPS = 4
H = 4
LEARNERS = ("golden-a", "golden-b")
MODEL_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]
RUN_FLAGS = ["--batch-size", "4", "--seed", "7", "--corpus-max-bytes", "200000"]
RUN_FLAGS += ["--eval-batches", "1", "--torch-threads", "1", "--device", "cpu"]
RUN_FLAGS += ["--status-every-s", "0", "--checkpoint-every-s", "0", "--insecure"]
RUN_FLAGS += ["--sync-every-steps", str(H), "--max-outer-steps", str(OUTER_STEPS)]

STREAMING = (
    ["--fragments", "2", "--pull-codec", "fp4_e2m1", "--outer-momentum-warmup-rounds", "0"],
    ["--overlap-steps", "1", "--merge-alpha", "0.5", "--push-codec", "fp4_e2m1"],
)
PLAIN = (
    ["--fragments", "1", "--pull-codec", "fp32", "--outer-momentum-warmup-rounds", "0"]
    + ["--outer-state-dtype", "float32"],
    ["--overlap-steps", "0", "--merge-alpha", "0", "--push-codec", "fp32"],
)

# fmt: off
QUORUM_SERVER_CRCS = {0: 2606222324, 1: 2489813865}
QUORUM_VERSIONS = {0: 8, 1: 8}
# fmt: on


def train(server_flags: list[str], learner_flags: list[str]):
    """Two learners against a fresh server; returns (server, their progress, a config)."""
    flags = ["--listen", "127.0.0.1:0", "--insecure", "--lease-s", "30", "--min-contributors"]
    service = AggregatorService(server_config([*flags, "2", *server_flags]))
    service.start()
    try:
        configs = [
            learner_config(
                ["--server", f"127.0.0.1:{service.port}", "--learner-id", name]
                + MODEL_FLAGS
                + RUN_FLAGS
                + learner_flags
            )
            for name in LEARNERS
        ]
        # Built one after the other: each seeds torch's global generator for its model.
        learners = [Learner(config) for config in configs]
        results: dict[str, Progress] = {}
        threads = [
            threading.Thread(
                target=lambda lr=lr: results.__setitem__(
                    lr.config.connection.learner_id, lr.run(threading.Event())
                )
            )
            for lr in learners
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 2, "a learner did not finish (its error is printed above)"
    finally:
        service.stop(grace_s=0)
    return service.aggregator, results, configs[0]


def check_replicas(agg: Aggregator, results: dict[str, Progress]) -> list[torch.Tensor]:
    """Every learner's replicas and model equal the server's parameters, bit for bit;
    returns the server's parameters in the model's order."""
    layout = agg.layout()
    assert [version for _, _, version in layout] == [OUTER_STEPS] * len(layout)
    by_index = {}
    for fid, indices, _ in layout:
        by_index.update(zip(indices, agg.params(fid), strict=True))
    server = [by_index[i] for i in range(len(by_index))]
    fragment_crcs = [params_crc32(agg.params(fid)) for fid, _, _ in layout]
    for progress in results.values():
        assert progress.versions == [OUTER_STEPS] * len(layout)
        assert progress.params_crc32 == fragment_crcs  # each replica, in fragment order
        assert progress.rank_params_crc32 == [params_crc32(server)]  # the model after drain
    return server


def test_streaming_learners_end_bit_identical_to_the_server() -> None:
    agg, results, _ = train(*STREAMING)
    check_replicas(agg, results)


def test_plain_diloco_equals_an_independent_reference() -> None:
    agg, results, config = train(*PLAIN)
    server = check_replicas(agg, results)
    reference = reference_diloco(config, LEARNERS, OUTER_STEPS)
    torch.manual_seed(7)
    initial = [p.detach() for p in GPT(config.model).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(reference, initial, strict=True))
    for got, want in zip(server, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The comparison can tell: another outer lr moves the parameters well past the tolerance.
    other = reference_diloco(config, LEARNERS, OUTER_STEPS, outer_lr=0.35)
    assert any(
        not torch.allclose(got, want, rtol=1e-3, atol=1e-4)
        for got, want in zip(server, other, strict=True)
    )


QUORUM_SPECS = [
    ParamSpec("h.0.w", (16, 9), "float32"),
    ParamSpec("h.0.b", (7,), "float32"),
    ParamSpec("h.1.w", (33, 5), "float32"),
    ParamSpec("h.1.b", (5,), "float32"),
]


def _values(shapes, seed: int, exponent: int) -> list[torch.Tensor]:
    """Integers in [-64, 64] times 2^exponent: exact in float32, the same on every machine."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-64, 65, s, generator=g).float() * 2.0**exponent for s in shapes]


def test_quorum_run_reproduces_its_parameters_bit_for_bit() -> None:
    clock = FakeClock()
    config = server_config(
        ["--insecure", "--mode", "quorum", "--fragments", "2", "--min-contributors", "2"]
        + ["--grace-min-s", "1", "--grace-max-s", "4", "--grace-steps", "5"]
        # Staleness 0 or 1: discounts 1 and 1/2. Tokens powers of two: weights too.
        + ["--max-staleness", "1", "--weighting", "tokens", "--pull-codec", "fp4_e2m1"]
        + ["--update-log-versions", "32", "--outer-momentum-warmup-rounds", "0"]
        + ["--outer-lr", "0.5", "--outer-momentum", "0.5"]
    )
    agg = Aggregator(config, clock=clock)
    names = ["qa", "qb", "qc"]
    sessions = {n: agg.join(n, QUORUM_SPECS).session_id for n in names}
    layout = agg.layout()
    shapes = {fid: [QUORUM_SPECS[i].shape for i in idx] for fid, idx, _ in layout}
    for fid, fshapes in shapes.items():
        agg.initialize(sessions["qa"], fid, _values(fshapes, 100 + fid, -4))
    # replica[learner][fragment] = (version, tensors), kept by pulling as a learner does.
    replicas = {n: {fid: (-1, []) for fid in shapes} for n in names}

    def pull(name: str, fid: int) -> None:
        version, tensors = replicas[name][fid]
        result = agg.pull(sessions[name], fid, version)
        payload = result.payload
        if result.kind == pb.PULL_KIND_SNAPSHOT:
            tensors, version = decode_fragment(payload, shapes[fid]), result.version
        elif result.kind == pb.PULL_KIND_UPDATES:
            version = apply_updates(tensors, payload, version)
        assert params_crc32(tensors) == result.params_crc32
        replicas[name][fid] = (version, tensors)

    for name in names:
        agg.heartbeat(sessions[name], step=1, tokens=0, step_time_s=0.1 * (1 + names.index(name)))
    refused = 0
    for rnd in range(8):
        clock.now += 0.5
        for fid, fshapes in shapes.items():
            for i, name in enumerate(names):
                if name == "qc" and rnd % 3 != 2:  # qc pushes one round in three
                    continue
                base = replicas[name][fid][0] if rnd else 0
                delta = _values(fshapes, 1000 * rnd + 10 * i + fid, -10 + i)
                try:
                    agg.push(
                        sessions[name], fid, max(base, 0), delta, tokens=512 << i, inner_steps=8
                    )
                except Exception as err:  # noqa: BLE001 - a refused push is part of the run
                    print(f"round {rnd} {name} fragment {fid}: {type(err).__name__}")
                    refused += 1
            clock.now += 2.0  # past the grace window of the two quick learners
            agg.tick()
        for name in names:
            if name != "qc" or rnd % 3 == 2:
                for fid in shapes:
                    pull(name, fid)
    crcs = {fid: params_crc32(agg.params(fid)) for fid in shapes}
    versions = {fid: agg.version(fid) for fid in shapes}
    for name in names:
        for fid in shapes:
            pull(name, fid)
            assert params_crc32(replicas[name][fid][1]) == crcs[fid]
    print("quorum golden:", crcs, versions, "refused:", refused)
    assert refused > 0  # the straggler's stale pushes: the run covers the refusal
    assert versions == QUORUM_VERSIONS
    assert crcs == QUORUM_SERVER_CRCS
