"""server/rounds/ingest.py: a push added from its wire encoding equals the decoded path bit for bit,
and is refused for exactly the inputs (and with the words) that decode and decode_fragment
refuse: all three read it through one parser (common/codec/framing.py)."""

import threading
import zlib

import pytest
import torch

from common.codec.fp4 import NOT_FINITE
from common.codec.fragment import decode_fragment, encode_fragment
from common.codec.tensor import decode, encode, parse_fragment
from common.errors import InvalidArgument
from common.generated.diloco.v1 import aggregator_pb2 as pb
from server.rounds.ingest import CHUNK_VALUES, DenseBody, IngestSlot, IngestSlots

# One tensor crosses chunk boundaries with an odd tail; one is smaller than a block.
SHAPES = [(3, CHUNK_VALUES // 2 + 17), (5,), (0, 4)]
CODECS = ["fp32", "bf16", "fp4_e2m1", "fp4_e3m0", "sparse_2bit"]


def deltas(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 1e-3 for s in SHAPES]


def bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for t in tensors]


@pytest.mark.parametrize("codec", CODECS)
def test_sum_from_wire_encoding_is_bit_identical_to_decoded_sum(codec: str) -> None:
    slot = IngestSlot()
    dense_sums = wire_sums = None
    for seed, scale in [(1, 0.37), (2, 1.0), (3, 1 / 3)]:
        data = encode_fragment(deltas(seed), codec)
        dense = DenseBody(decode_fragment(data, SHAPES))
        body = slot.parse(data, SHAPES)
        assert body.shapes == dense.shapes
        assert body.max_abs == dense.max_abs
        assert body.norm == pytest.approx(dense.norm, rel=1e-12)
        dense_sums = dense.add_to(dense_sums, scale)
        wire_sums = body.add_to(wire_sums, scale)
        for a, b in zip(bits(dense_sums), bits(wire_sums), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("codec", ["fp32", "fp4_e2m1", "sparse_2bit"])
def test_sums_into_a_reused_buffer_and_from_a_released_payload_are_the_same(codec: str) -> None:
    slot, data = IngestSlot(), encode_fragment(deltas(4), codec)
    fresh = slot.parse(data, SHAPES).add_to(None, 0.5)
    payload = bytearray(data)
    body = slot.parse(payload, SHAPES, release=True)
    assert len(payload) == 0  # freed as soon as protobuf parsed it
    reused = body.add_to([torch.full(s, 7.0) for s in SHAPES], 0.5, overwrite=True)
    dense = DenseBody(decode_fragment(data, SHAPES))
    dense_reused = dense.add_to([torch.full(s, 7.0) for s in SHAPES], 0.5, overwrite=True)
    for a, b, c in zip(bits(fresh), bits(reused), bits(dense_reused), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def fp32_tensor_with(value: float) -> pb.EncodedTensor:
    t = torch.zeros(SHAPES[0])
    t.view(-1)[CHUNK_VALUES + 3] = value  # in the second chunk
    return encode(t, "fp32") if value == 0 else _forged_fp32(t)


def _forged_fp32(t: torch.Tensor) -> pb.EncodedTensor:
    """encode() refuses non-finite values; a hostile learner does not."""

    payload = t.numpy().tobytes()
    return pb.EncodedTensor(
        codec=pb.CODEC_FP32, shape=list(t.shape), payload=payload, crc32=zlib.crc32(payload)
    )


def _rest(codec: str) -> list[pb.EncodedTensor]:
    return [encode(t, codec) for t in deltas(9)[1:]]


def malformed() -> list[bytes]:
    good = pb.EncodedFragment.FromString(encode_fragment(deltas(5), "fp4_e2m1"))
    cases = [b"\xff\xff\xff", encode_fragment(deltas(5)[:2], "fp4_e2m1")]
    mixed = pb.EncodedFragment()
    mixed.CopyFrom(good)
    mixed.tensors[1].CopyFrom(encode(deltas(5)[1], "fp32"))
    cases.append(mixed.SerializeToString())
    for field, value in [("shape", [3, 7]), ("payload", b"x"), ("crc32", 1)]:
        bad = pb.EncodedFragment()
        bad.CopyFrom(good)
        if field == "shape":
            del bad.tensors[0].shape[:]
            bad.tensors[0].shape.extend(value)
        else:
            setattr(bad.tensors[0], field, value)
        cases.append(bad.SerializeToString())
    for scale_byte in (255, 254):  # a NaN scale; a top code scaled to infinity
        bad = pb.EncodedFragment()
        bad.CopyFrom(good)
        t = bad.tensors[0]
        scales = bytearray(t.scales)
        scales[CHUNK_VALUES // 32 + 1] = scale_byte
        payload = bytearray(t.payload)
        payload[CHUNK_VALUES // 2 + 40] = 0x77  # two codes of 6.0 in that block
        t.scales, t.payload = bytes(scales), bytes(payload)

        t.crc32 = zlib.crc32(t.scales, zlib.crc32(t.payload))
        cases.append(bad.SerializeToString())
    for value in (float("nan"), float("inf")):
        frag = pb.EncodedFragment(tensors=[fp32_tensor_with(value), *_rest("fp32")])
        cases.append(frag.SerializeToString())
    return cases


@pytest.mark.parametrize("index", range(len(malformed())))
def test_refuses_what_decode_fragment_refuses_with_the_same_reason(index: int) -> None:
    data = malformed()[index]
    with pytest.raises(InvalidArgument) as decoded:
        decode_fragment(data, SHAPES)
    with pytest.raises(InvalidArgument) as ingested:
        IngestSlot().parse(data, SHAPES)
    assert str(ingested.value) == str(decoded.value)


def bad_tensors() -> dict[str, pb.EncodedTensor]:
    """One fault each, in a tensor of shape SHAPES[0] (or claiming another shape)."""
    good = encode(deltas(6)[0], "fp4_e2m1")
    cases: dict[str, pb.EncodedTensor] = {}

    def case(name: str, change) -> None:
        msg = pb.EncodedTensor()
        msg.CopyFrom(good)
        change(msg)
        cases[name] = msg

    def reshape(msg: pb.EncodedTensor, shape: list[int]) -> None:
        del msg.shape[:]
        msg.shape.extend(shape)

    def rescale(msg: pb.EncodedTensor, block: int, byte: int, codes: int | None = None) -> None:
        scales, payload = bytearray(msg.scales), bytearray(msg.payload)
        scales[block] = byte
        if codes is not None:
            payload[16 * block] = codes
        msg.scales, msg.payload = bytes(scales), bytes(payload)
        msg.crc32 = zlib.crc32(msg.scales, zlib.crc32(msg.payload))

    case("negative dimension", lambda m: reshape(m, [-3, -(CHUNK_VALUES // 2 + 17)]))
    case("other shape", lambda m: reshape(m, [3, 7]))
    case("unknown codec", lambda m: setattr(m, "codec", 99))
    case("short payload", lambda m: setattr(m, "payload", m.payload[:-1]))
    case("extra scale", lambda m: setattr(m, "scales", m.scales + b"\x00"))
    case("checksum", lambda m: setattr(m, "crc32", m.crc32 ^ 1))
    case("NaN scale", lambda m: rescale(m, CHUNK_VALUES // 32 + 1, 255))
    case("infinite fp4", lambda m: rescale(m, CHUNK_VALUES // 32 + 1, 254, 0x77))
    case("NaN after infinity", lambda m: (rescale(m, 0, 254, 0x77), rescale(m, 5, 255)))
    for value in (float("nan"), float("inf")):
        cases[f"fp32 {value}"] = fp32_tensor_with(value)
    return cases


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("name", list(bad_tensors()))
def test_one_parser_refuses_for_decode_decode_fragment_and_ingest(
    monkeypatch, kernel: str, name: str
) -> None:
    """The same bad tensor, alone (decode) or in a push (decode_fragment, the server's ingest
    with and without the C kernel, from bytes and from a receive buffer), is refused with the
    same words; the parser refuses everything but bad values itself, before any value is
    decoded."""
    monkeypatch.setenv("DILOCO_FP4_KERNEL", kernel)
    msg = bad_tensors()[name]
    rest = _rest("fp32" if msg.codec == pb.CODEC_FP32 else "fp4_e2m1")
    for other in rest:
        other.codec = msg.codec  # one codec, even an unknown one: the fault is msg's own
    data = pb.EncodedFragment(tensors=[msg, *rest]).SerializeToString()
    refusals = []
    for reader in (
        lambda: decode(msg, SHAPES[0]),
        lambda: decode_fragment(data, SHAPES),
        lambda: IngestSlot().parse(data, SHAPES),
        lambda: IngestSlot().parse(memoryview(bytearray(data)), SHAPES),  # a receive buffer
        lambda: list(parse_fragment(data, SHAPES)),
    ):
        try:
            reader()
        except InvalidArgument as err:
            refusals.append(str(err))
    if name.startswith("fp32") or name == "infinite fp4":  # the values: read by the decoders
        assert refusals[:4] == [NOT_FINITE] * 4
    else:
        assert len(refusals) == 5 and len(set(refusals)) == 1, refusals


def test_slots_bound_concurrent_pushes() -> None:
    slots = IngestSlots(2)
    entered, release = threading.Semaphore(0), threading.Event()

    def push() -> None:
        with slots.take():
            entered.release()
            release.wait(10)

    threads = [threading.Thread(target=push, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    assert entered.acquire(timeout=10) and entered.acquire(timeout=10)
    assert not entered.acquire(timeout=0.2)  # the third waits for a slot
    release.set()
    assert entered.acquire(timeout=10)
    for t in threads:
        t.join(10)
    with pytest.raises(ValueError, match="slot count"):
        IngestSlots(0)
