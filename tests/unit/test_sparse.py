"""The top-k sparse codecs (common/codec/sparse.py): what they keep, their
size, error feedback on both sides, chunked encoding, and the refusal of hostile payloads."""

import math

import pytest
import torch

from common.codec import native
from common.codec.fragment import (
    UpdateEncoder,
    apply_updates,
    decode_fragment,
    fragment_with_feedback,
    params_crc32,
)
from common.codec.framing import tensor_message
from common.codec.sparse import SPARSE_CHUNK, encode_sparse, kept_total, sparse_sizes, topk_k
from common.codec.tensor import CODECS, check_tensor, decode, encode, is_sparse
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.config import StreamingConfig
from server.rounds.ingest import CHUNK_VALUES
from server.rounds.outer import NesterovOuter
from server.state.fragment import FragmentState
from server.state.params import state_identity

SPARSE = [pb.CODEC_SPARSE_2BIT]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("numel", [1, 100, SPARSE_CHUNK, 3 * SPARSE_CHUNK + 5])
def test_keeps_the_top_k_of_each_chunk_with_their_signs(codec: int, numel: int) -> None:
    x, k = randn(numel), 64
    y = decode(encode(x, codec, sparse_k=k)).reshape(-1)
    for start in range(0, numel, SPARSE_CHUNK):
        chunk, got = x[start : start + SPARSE_CHUNK], y[start : start + SPARSE_CHUNK]
        kept = math.ceil(k * chunk.numel() / SPARSE_CHUNK)
        expected = set(chunk.abs().topk(kept).indices.tolist())
        assert set(got.nonzero().reshape(-1).tolist()) <= expected
        assert torch.equal(torch.sign(got[list(expected)]), torch.sign(chunk[list(expected)]))
        # Each kept value within its quantizer's error of the original.
        err = (got[list(expected)] - chunk[list(expected)]).abs().max()
        assert err <= 0.5 * chunk.abs().max()


@pytest.mark.parametrize(("codec", "bits"), [(pb.CODEC_SPARSE_2BIT, 0.227)])
def test_bits_per_parameter_with_indices_and_scales(codec: int, bits: float) -> None:
    numel = 256 * SPARSE_CHUNK
    msg = encode(randn(numel), codec, sparse_k=64)
    on_wire = len(msg.SerializeToString()) * 8 / numel
    assert on_wire == pytest.approx(bits, abs=0.001)
    payload, scales = sparse_sizes(codec, numel, 64)
    assert (len(msg.payload), len(msg.scales)) == (payload, scales)


def test_topk_fraction_maps_to_a_count_per_chunk() -> None:
    assert topk_k(1 / 64) == 64 and topk_k(1.0) == SPARSE_CHUNK and topk_k(1e-9) == 1
    with pytest.raises(ValueError, match="topk fraction"):
        topk_k(0.0)
    assert kept_total(SPARSE_CHUNK + 100, 64) == 64 + 2  # a short chunk keeps its share


@pytest.mark.parametrize("codec", SPARSE)
def test_a_chunk_range_encodes_to_that_range_of_the_whole(codec: int) -> None:
    x = randn(2 * CHUNK_VALUES + 3 * SPARSE_CHUNK + 7, seed=3)
    whole = encode_sparse(x, codec, 41)
    encoder = UpdateEncoder(codec, [tuple(x.shape)], 41)
    dense = [encoder.add(0, s, x[s : s + CHUNK_VALUES]) for s in range(0, x.numel(), CHUNK_VALUES)]
    (msg,) = pb.EncodedFragment.FromString(encoder.serialized()).tensors
    assert msg.payload == whole.payload().numpy().tobytes()
    assert msg.scales == whole.scales.numpy().tobytes()
    assert torch.equal(torch.cat(dense), whole.dense(x.numel()))


@pytest.mark.parametrize("codec", SPARSE)
def test_learner_error_feedback_sends_what_was_left_out(codec: int) -> None:
    """Σ decoded messages + residual == Σ pseudo-gradients: nothing is lost, only delayed."""
    shapes = [(70, 90), (33,)]
    residuals = [torch.zeros(s) for s in shapes]
    sent = [torch.zeros(s) for s in shapes]
    total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for step in range(20):
        deltas = [randn(*s, seed=10 * step + i) for i, s in enumerate(shapes)]
        data = fragment_with_feedback(deltas, codec, 64, residuals)
        for acc, s, got, d in zip(sent, total, decode_fragment(data, shapes), deltas, strict=True):
            acc.add_(got)
            s.add_(d.double())
    for acc, s, r in zip(sent, total, residuals, strict=True):
        torch.testing.assert_close((acc + r).double(), s, atol=1e-4, rtol=0)
    assert all(bool(r.abs().sum() > 0) for r in residuals)


@pytest.mark.parametrize("codec", SPARSE)
def test_a_decayed_residual_sends_the_decayed_sum(codec: int) -> None:
    """With decay β the message is S(Δ + β·e) and the new residual what that leaves out."""
    shape = (SPARSE_CHUNK,)
    delta, residual = randn(*shape, seed=1), randn(*shape, seed=2)
    summed = delta + 0.5 * residual
    undecayed = fragment_with_feedback([summed], codec, 64, [torch.zeros(shape)])
    data = fragment_with_feedback([delta], codec, 64, [residual], decay=0.5)
    assert data == undecayed
    sent = decode_fragment(data, [shape])[0]
    assert torch.equal(residual, summed - sent)
    assert bool(residual.abs().sum() > 0)


@pytest.mark.parametrize("codec", ["sparse_2bit"])
def test_server_error_feedback_served_plus_residual_is_the_exact_trajectory(codec: str) -> None:
    """The served parameters (what learners rebuild) plus the server's residual equal the
    parameters of fp32 pulls, and a learner adding the updates is bit-identical."""
    shapes = [(CHUNK_VALUES + 9000,), (20, 30)]
    states = {}
    for name in ("fp32", codec):
        state = FragmentState(0, [0, 1], shapes, NesterovOuter(), name, update_log_versions=50)
        state.initialize([randn(*s, seed=i) for i, s in enumerate(shapes)])
        states[name] = state
    replica = [p.clone() for p in states[codec].params]
    for rnd in range(6):
        mean = [randn(*s, seed=100 + 10 * rnd + i) * 0.01 for i, s in enumerate(shapes)]
        for state in states.values():
            state.apply_mean([m.clone() for m in mean])
    sparse = states[codec]
    result = sparse.pull(0)
    assert result.kind == pb.PULL_KIND_UPDATES
    assert apply_updates(replica, result.payload, 0) == 6
    assert params_crc32(replica) == result.params_crc32 == params_crc32(sparse.params)
    residual = sparse.state_dict()["residual"]
    for exact, served, e in zip(states["fp32"].params, sparse.params, residual, strict=True):
        torch.testing.assert_close(served + e, exact, atol=1e-5, rtol=0)
    numel = sum(math.prod(s) for s in shapes)
    assert result.payload_bytes * 8 / (6 * numel) < 0.3  # bits per value per update


def test_state_dir_identity_binds_the_sparse_fraction_only() -> None:
    dense = state_identity(StreamingConfig(pull_codec="fp4_e2m1"), "sync")
    assert "pull_topk_fraction" not in dense  # state dirs of dense codecs read as before
    sparse = state_identity(
        StreamingConfig(pull_codec="sparse_2bit", pull_topk_fraction=0.01), "sync"
    )
    assert sparse["pull_topk_fraction"] == 0.01


def forged(codec: int, numel: int, k: int, payload: bytes, scales: bytes) -> pb.EncodedTensor:
    return tensor_message(codec, (numel,), payload, scales, k)


def valid_parts(codec: int, numel: int = 100, k: int = 64) -> tuple[bytes, bytes]:
    msg = encode(randn(numel), codec, sparse_k=k)
    return msg.payload, msg.scales


@pytest.mark.parametrize("codec", SPARSE)
def test_hostile_payloads_are_refused_before_anything_is_decoded(codec: int) -> None:
    payload, scales = valid_parts(codec)  # 100 values keep 2: indices 3 bytes
    cases = {
        "not in 1..4096": forged(codec, 100, 0, payload, scales),
        "not in 1..": forged(codec, 100, 5000, payload, scales),
        "needs": forged(codec, 100, 64, payload + b"\0", scales),
        "increase strictly": forged(codec, 100, 64, b"\x05\x50\x00" + payload[3:], scales),
        "inside it": forged(codec, 100, 64, b"\x05\x00\x7f" + payload[3:], scales),
    }
    bad_scale = b"\xff" * len(scales)
    cases["NaN or infinite"] = forged(codec, 100, 64, payload, bad_scale)
    cases["negative"] = forged(codec, 100, 64, payload, b"\x00\x80\x00\x3f")
    for words, msg in cases.items():
        with pytest.raises(InvalidArgument, match=words):
            check_tensor(msg)
    # k = 63 keeps as many of 100 values as 64 does: only the checksum tells them apart.
    other_k = forged(codec, 100, 64, payload, scales)
    other_k.sparse_k = 63
    with pytest.raises(InvalidArgument, match="checksum"):
        check_tensor(other_k)


def test_a_dense_tensor_must_not_carry_a_kept_count() -> None:
    msg = encode(torch.ones(4), "fp32")
    msg.sparse_k = 3
    with pytest.raises(InvalidArgument, match="dense tensor"):
        check_tensor(msg)


def test_a_huge_claimed_shape_is_refused_by_length_without_allocation() -> None:
    payload, scales = valid_parts(pb.CODEC_SPARSE_2BIT)
    with pytest.raises(InvalidArgument, match="needs"):
        check_tensor(forged(pb.CODEC_SPARSE_2BIT, 1 << 40, 1, payload, scales))


@pytest.mark.parametrize("codec", SPARSE)
def test_ties_at_the_boundary_keep_the_lowest_indices(codec: int) -> None:
    x = torch.zeros(2 * SPARSE_CHUNK)
    x[100:300] = -0.5  # 200 equal magnitudes compete for the 64 places of chunk 0
    x[SPARSE_CHUNK + 7] = 2.0  # chunk 1: one value, then 63 of the zeros
    x[SPARSE_CHUNK + 9 :] = 0.25
    enc = encode_sparse(x, codec, 64)
    assert enc.positions[:64].tolist() == list(range(100, 164))
    chunk1 = [SPARSE_CHUNK + 7, *range(SPARSE_CHUNK + 9, SPARSE_CHUNK + 72)]
    assert enc.positions[64:].tolist() == chunk1


def special_rows() -> list[torch.Tensor]:
    """Random values, many exact ties, zeros of both signs, subnormals, short tails."""
    g = torch.Generator().manual_seed(5)
    ties = torch.randint(-3, 4, (3 * SPARSE_CHUNK + 77,), generator=g).float()
    tiny = torch.randn(SPARSE_CHUNK + 5, generator=g) * 1e-42
    signed_zeros = torch.zeros(SPARSE_CHUNK)
    signed_zeros[::3] = -0.0
    signed_zeros[5] = -1.0
    return [randn(5 * SPARSE_CHUNK + 123, seed=9) * 1e3, ties, tiny, signed_zeros, randn(7)]


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("k", [1, 3, 64, 4095, 4096])
def test_the_c_selection_gives_the_torch_paths_bytes(codec: int, k: int, monkeypatch) -> None:
    monkeypatch.setenv("DILOCO_FP4_KERNEL", "native")
    if native.load() is None:
        pytest.skip("no C compiler")
    for x in special_rows():
        selected = encode_sparse(x, codec, k)
        monkeypatch.setenv("DILOCO_FP4_KERNEL", "torch")
        reference = encode_sparse(x, codec, k)
        monkeypatch.setenv("DILOCO_FP4_KERNEL", "native")
        for a, b in zip(
            (selected.indices, selected.codes, selected.scales),
            (reference.indices, reference.codes, reference.scales),
            strict=True,
        ):
            assert torch.equal(a, b)


def test_is_sparse_names_exactly_the_top_k_codecs() -> None:
    assert sorted(name for name in CODECS if is_sparse(name)) == ["sparse_2bit"]
    assert not is_sparse("no_such_codec")
