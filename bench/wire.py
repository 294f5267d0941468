"""The hand-written wire code against the protobuf library, measured side by side in one run.

    .venv/bin/python -m bench.wire                 # 16 M values (an 8 MB fp4 push), 7 repeats
    .venv/bin/python -m bench.wire --values 4194304 --repeats 3

common/codec/framing.py reads and writes three things by hand instead of through protobuf;
each is kept only if it beats the library here. For each, the same bytes are made or read
both ways (checked equal), and the median time of each is printed with their ratio:

- push_encode: a fragment's fp4 encoding framed around the codec's own buffers
  (fragment_parts) against EncodedFragment(...).SerializeToString().
- snapshot_answer: a pull's fp32 snapshot of the parameters as shared parts read in place
  (snapshot_parts) against serializing the message of the parameters' bytes, which a server
  would hold once per version being streamed.
- push_parse: a received push read in place in its buffer (parse_fragment_view, the scanner)
  against protobuf's parse of the same bytes (parse_fragment on a copy, as a server without
  the scanner must make from its receive buffer).
- chunk_receive: a push's 1 MiB chunk messages read as views (parse_push_request) against
  PushFragmentRequest.FromString(...).chunk, then copied into the receive buffer either way.

Writes bench/results/wire.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from common.codec.fragment import CHUNK_BYTES, chunks, encode_fragment, snapshot_parts
from common.codec.framing import fragment_parts, parse_push_request, tensor_crc32
from common.codec.tensor import encode_values, parse_fragment, parse_fragment_view
from common.generated.diloco.v1 import aggregator_pb2 as pb

RESULTS = Path(__file__).resolve().parent / "results"


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def library_fragment(tensors: list[tuple]) -> bytes:
    """The EncodedFragment of (codec, shape, payload, scales) tensors through protobuf."""
    message = pb.EncodedFragment(
        tensors=[
            pb.EncodedTensor(
                codec=codec,
                shape=list(shape),
                payload=bytes(payload),
                scales=bytes(scales),
                crc32=tensor_crc32(payload, scales),
            )
            for codec, shape, payload, scales in tensors
        ]
    )
    return message.SerializeToString()


def push_encode(params: list[torch.Tensor], repeats: int) -> dict:
    encoded = [(pb.CODEC_FP4_E2M1, t.shape, *encode_values(t, pb.CODEC_FP4_E2M1)) for t in params]
    hand = lambda: b"".join(fragment_parts(encoded))  # noqa: E731
    library = lambda: library_fragment(encoded)  # noqa: E731
    if hand() != library():
        raise AssertionError("the hand-framed push differs from protobuf's serialization")
    return compare(hand, library, repeats)


def snapshot_answer(params: list[torch.Tensor], repeats: int) -> dict:
    def hand() -> int:
        return sum(len(part) for part in snapshot_parts(params))

    def library() -> int:  # with the same check: a snapshot refuses a value that is not finite
        if not all(bool(torch.isfinite(t).all()) for t in params):
            raise ValueError("cannot encode a tensor with NaN or infinite values")
        fp32 = [(pb.CODEC_FP32, t.shape, memoryview(t.numpy()).cast("B"), b"") for t in params]
        return len(library_fragment(fp32))

    if hand() != library():
        raise AssertionError("the snapshot's parts and protobuf's serialization differ in size")
    return compare(hand, library, repeats)


def push_parse(params: list[torch.Tensor], repeats: int) -> dict:
    data = encode_fragment(params, "fp4_e2m1")
    buffer = np.frombuffer(bytearray(data), dtype=np.uint8)
    view = memoryview(buffer)
    shapes = [tuple(t.shape) for t in params]
    hand = lambda: [len(t.payload) for t in parse_fragment_view(view, shapes)]  # noqa: E731
    library = lambda: [len(t.payload) for t in parse_fragment(bytes(view), shapes)]  # noqa: E731
    if hand() != library():
        raise AssertionError("the scanner and protobuf read different tensors")
    return compare(hand, library, repeats)


def chunk_receive(params: list[torch.Tensor], repeats: int) -> dict:
    data = encode_fragment(params, "fp4_e2m1")
    messages = [pb.PushFragmentRequest(chunk=piece).SerializeToString() for piece in chunks(data)]
    target = np.empty(len(data), dtype=np.uint8)

    def receive(read: Callable[[bytes], bytes | memoryview]) -> int:
        filled = 0
        for message in messages:
            piece = np.frombuffer(read(message), dtype=np.uint8)
            target[filled : filled + piece.size] = piece
            filled += piece.size
        return filled

    hand = lambda: receive(parse_push_request)  # noqa: E731
    library = lambda: receive(lambda m: pb.PushFragmentRequest.FromString(m).chunk)  # noqa: E731
    if hand() != library() or target.tobytes() != data:
        raise AssertionError("the chunk views and protobuf's chunks differ")
    return compare(hand, library, repeats)


def compare(hand: Callable, library: Callable, repeats: int) -> dict:
    hand_s, library_s = median_s(hand, repeats), median_s(library, repeats)
    return {"hand_s": hand_s, "library_s": library_s, "library_over_hand": library_s / hand_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.wire", description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 24, help="values of the fragment")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each, median")
    parser.add_argument("--out", type=Path, default=RESULTS / "wire.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    # Four tensors, as a fragment of a transformer's blocks: one large, three small.
    sizes = [args.values * 7 // 8, args.values // 16, args.values // 32, args.values // 32]
    params = [torch.randn(n, generator=gen) for n in sizes]
    figures = {
        "values": sum(sizes),
        "chunk_bytes": CHUNK_BYTES,
        "repeats": args.repeats,
        "push_encode": push_encode(params, args.repeats),
        "snapshot_answer": snapshot_answer(params, args.repeats),
        "push_parse": push_parse(params, args.repeats),
        "chunk_receive": chunk_receive(params, args.repeats),
    }
    for name in ("push_encode", "snapshot_answer", "push_parse", "chunk_receive"):
        f = figures[name]
        print(
            f"{name:16s} hand {f['hand_s'] * 1e3:8.2f} ms   protobuf {f['library_s'] * 1e3:8.2f}"
            f" ms   protobuf / hand {f['library_over_hand']:6.1f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
