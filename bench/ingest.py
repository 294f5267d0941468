"""Ingest benchmark: fp4 pushes through the real server against a bare gRPC byte stream.

    python bench/ingest.py            # 16 M-value fragment (64 MiB fp32), ~1 minute
    python bench/ingest.py --quick    # 4 M values, ~20 s

Both sides run one server process on loopback and the same client: `--streams` threads that
each send one stream after another, in chunks of common.codec.fragment.CHUNK_BYTES, every message
serialized before the clock starts, so the client (which shares this machine's CPUs with the
server) does the same work per byte on both sides.
(a) grpc: a minimal servicer built by common.rpc.create_server (same options and thread pool)
    whose one client-streaming method takes raw bytes and only counts them: the ceiling.
(b) ingest: `diloco-server` in quorum mode; every push is a real fp4 pseudo-gradient from its
    own joined learner, received, validated, decoded and added to the open round (the round
    never closes during the run, so nothing but ingest is timed).
(a) and (b) are measured alternately, ROUNDS times each, and ingest_vs_grpc is the median of
the rounds' ratios: the machine is shared, and its load drifted between the two halves of a
sequential run (the same code measured 0.3 to 1.2 that way). Reported: wire payload bytes per
second of each (median of the rounds), ingest_vs_grpc = (b) / (a) (target >= 0.8),
and each server's CPU time per push (less sensitive to other load than the rates); and, in
this process, three server paths against what they replace (server_paths). Writes
bench/results/ingest.json; `measure(quick)` returns the same dict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import procfs  # noqa: E402
from common.codec.fragment import CHUNK_BYTES, chunks, encode_fragment  # noqa: E402
from common.generated.diloco.v1 import aggregator_pb2 as pb  # noqa: E402
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc  # noqa: E402
from common.metrics_http import write_port_file  # noqa: E402
from common.rpc import LEARNER_ID_HEADER, create_channel, create_server  # noqa: E402
from deploy.launcher import start_daemon  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SINK_METHOD = "/bench.Sink/Push"
PUSH_METHOD = "/diloco.v1.Aggregator/PushFragment"
ROUNDS = 9


def serve_sink(port_file: str) -> None:
    """(a)'s server: count the bytes of a raw client stream, answer with nothing."""

    def push(request_iterator, context) -> bytes:
        for _ in request_iterator:
            pass
        return b""

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
    )
    server, port = create_server("127.0.0.1:0")
    server.add_generic_rpc_handlers((handler,))
    server.start()
    write_port_file(port_file, port)
    server.wait_for_termination()


def _run_streams(send: Callable[[int], None], pushes: int, streams: int) -> float:
    """Run `send(i)` for i in range(pushes) on `streams` threads; returns the seconds taken."""
    lock, next_push, errors = threading.Lock(), [0], []

    def worker() -> None:
        while True:
            with lock:
                i, next_push[0] = next_push[0], next_push[0] + 1
            if i >= pushes or errors:
                return
            try:
                send(i)
            except grpc.RpcError as err:
                errors.append(err)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, first: {errors[0]}")
    return elapsed


class _Server:
    """A server process on loopback, a channel to it, and its CPU time."""

    def __init__(self, argv: list[str], workdir: Path) -> None:
        name = f"server-{len(list(workdir.glob('*.log')))}"
        port_file = workdir / f"{name}.port"
        self.daemon = start_daemon(name, argv, workdir / f"{name}.log", port_file=port_file)
        self.channel = create_channel(f"127.0.0.1:{self.daemon.port}")

    def cpu_s(self) -> float:
        return procfs.cpu_s(self.daemon.pid)

    def timed(
        self, send: Callable[[int], None], pushes: range, streams: int
    ) -> tuple[float, float]:
        """(seconds, server CPU seconds) to run `send(i)` for i in `pushes`."""
        cpu = self.cpu_s()
        elapsed = _run_streams(lambda k: send(pushes[k]), len(pushes), streams)
        return elapsed, self.cpu_s() - cpu

    def close(self) -> None:
        self.channel.close()
        self.daemon.stop()


class _Sink(_Server):
    """(a): a bare byte stream, the payload's chunks as they are."""

    def __init__(self, payload: bytes, workdir: Path) -> None:
        super().__init__([sys.executable, __file__, "--serve-sink"], workdir)
        self._pieces = list(chunks(payload))
        self._push = self.channel.stream_unary(SINK_METHOD)  # no (de)serializers: raw bytes
        self.send(-1)  # warm-up

    def send(self, i: int) -> None:
        self._push(iter(self._pieces), timeout=600)


class _Ingest(_Server):
    """(b): fp4 pushes into diloco-server, one joined learner per push."""

    def __init__(
        self, shapes: list[tuple[int, ...]], payload: bytes, pushes: int, workdir: Path
    ) -> None:
        argv = [sys.executable, "-m", "server.main", "--insecure", "--listen", "127.0.0.1:0",
                "--mode", "quorum", "--min-contributors", "1000000", "--max-staleness", "1000000",
                "--lease-s", "600", "--log-level", "WARNING"]  # fmt: skip
        super().__init__(argv, workdir)
        stub = pb_grpc.AggregatorStub(self.channel)
        specs = [
            pb.ParamSpec(name=f"w{i}", shape=list(s), dtype="float32") for i, s in enumerate(shapes)
        ]
        # One learner per push (+1 that never pushes, so the round stays open): each pushes
        # once against version 0, as the aggregator takes one push per learner and version.
        # Each calls under its own id, as learners do, so the per-learner rate limit allows it.
        self._ids = [f"ingest-{i}" for i in range(pushes + 2)]
        self._sessions = [
            stub.Join(pb.JoinRequest(learner_id=i, fingerprint=specs), metadata=_as(i)).session_id
            for i in self._ids
        ]
        self._payload_bytes = len(payload)
        self._push = self.channel.stream_unary(
            PUSH_METHOD, response_deserializer=pb.PushFragmentResponse.FromString
        )  # requests go as serialized bytes
        self._pieces = [
            pb.PushFragmentRequest(chunk=c).SerializeToString() for c in chunks(payload)
        ]
        initial = encode_fragment([torch.zeros(s) for s in shapes], "fp32")
        self._send(-1, pb.PUSH_KIND_INITIAL, -1, [
            pb.PushFragmentRequest(chunk=c).SerializeToString() for c in chunks(initial)
        ], len(initial))  # fmt: skip
        self.send(-2)  # warm-up

    def send(self, i: int) -> None:
        self._send(i, pb.PUSH_KIND_DELTA, 0, self._pieces, self._payload_bytes)

    def _send(self, i: int, kind: int, base: int, pieces: list[bytes], size: int) -> None:
        header = pb.PushHeader(
            session_id=self._sessions[i], fragment_id=0, base_version=base, payload_bytes=size,
            kind=kind, tokens=1000, inner_steps=10,
        )  # fmt: skip
        first = pb.PushFragmentRequest(header=header).SerializeToString()
        reply = self._push(iter([first, *pieces]), timeout=600, metadata=_as(self._ids[i]))
        if not reply.accepted:
            raise RuntimeError(f"push refused: {reply}")

    def peak_rss_mb(self) -> float:
        return procfs.peak_rss_mb(self.daemon.pid)


def _as(learner_id: str) -> tuple[tuple[str, str]]:
    return ((LEARNER_ID_HEADER, learner_id),)


def _median_ms(run: Callable[[], object], repeats: int = 5) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def server_paths(shapes: list[tuple[int, ...]], payload: bytes) -> dict:
    """Three of the server's ingest paths against what they replace, in this process, per
    push: adding DEFERRED_PUSHES + 1 fp4 pushes to a round's sum in one pass vs one add each
    (server/rounds/ingest.py add_in_turn); that pass with the widest instruction set this CPU has
    vs with AVX2 at most (common/fp4_accumulate.c); and reading a push's chunks as views vs
    protobuf's parse and field read (common/codec/framing.py)."""
    from common.codec import native
    from common.codec.framing import parse_push_request
    from server.rounds.ingest import IngestSlot, add_in_turn
    from server.rounds.round import DEFERRED_PUSHES

    count = DEFERRED_PUSHES + 1
    slots = [IngestSlot() for _ in range(count)]
    bodies = [(slot.parse(payload, shapes), 0.5 + i / 8) for i, slot in enumerate(slots)]
    if not all(body.combinable() for body, _ in bodies):
        raise RuntimeError("fp4 pushes must be combinable (is the C kernel built?)")
    sums = [torch.zeros(s) for s in shapes]
    together = _median_ms(lambda: add_in_turn(bodies, sums)) / count
    one_by_one = _median_ms(lambda: [body.add_to(sums, w) for body, w in bodies]) / count
    kernel = native.load()
    assert kernel is not None  # the bodies are combinable
    widest = kernel.limit_isa(native.ISA_AVX2)
    try:
        together_avx2 = _median_ms(lambda: add_in_turn(bodies, sums)) / count
    finally:
        kernel.limit_isa(widest)
    messages = [pb.PushFragmentRequest(chunk=c).SerializeToString() for c in chunks(payload)]
    protobuf = _median_ms(lambda: [pb.PushFragmentRequest.FromString(m).chunk for m in messages])
    views = _median_ms(lambda: [parse_push_request(m) for m in messages])
    return {
        "pushes_added_together": count,
        "add_ms_per_push_together": together,
        "add_ms_per_push_one_by_one": one_by_one,
        "add_together_speedup": one_by_one / together,
        "add_ms_per_push_together_avx2": together_avx2,
        "add_widest_isa_vs_avx2": together_avx2 / together,
        "chunks_ms_per_push_views": views,
        "chunks_ms_per_push_protobuf": protobuf,
    }


def measure(quick: bool = False, streams: int = 4) -> dict:
    """Run (a) and (b) alternately, ROUNDS times each, and return the figures (for bench/perf
    suites)."""
    values = (1 << 22) if quick else (1 << 24)
    shapes = [(values // 1024, 1024)]
    per_round = 30 if quick else 40  # a batch of ~0.2 s at least: shorter ones were mostly noise
    pushes = ROUNDS * per_round
    torch.manual_seed(0)
    payload = encode_fragment([torch.randn(s) * 1e-3 for s in shapes], "fp4_e2m1")
    load_before = os.getloadavg()[0]
    grpc_runs, ingest_runs = [], []  # (seconds, server CPU seconds) per round
    with tempfile.TemporaryDirectory(prefix="diloco-ingest-") as tmp:
        workdir = Path(tmp)
        sink = _Sink(payload, workdir)
        try:
            ingest = _Ingest(shapes, payload, pushes, workdir)
            try:
                for r in range(ROUNDS):
                    batch = range(r * per_round, (r + 1) * per_round)
                    grpc_runs.append(sink.timed(sink.send, batch, streams))
                    ingest_runs.append(ingest.timed(ingest.send, batch, streams))
                peak_mb = ingest.peak_rss_mb()
            finally:
                ingest.close()
        finally:
            sink.close()
    batch_bytes = per_round * len(payload)
    grpc_rates = [batch_bytes / seconds for seconds, _ in grpc_runs]
    ingest_rates = [batch_bytes / seconds for seconds, _ in ingest_runs]
    ratios = [b / a for a, b in zip(grpc_rates, ingest_rates, strict=True)]
    return {
        "fragment_values": values,
        "fp32_fragment_mb": values * 4 / 2**20,
        "payload_mb": len(payload) / 2**20,
        "chunk_bytes": CHUNK_BYTES,
        "pushes": pushes,
        "streams": streams,
        "rounds": ROUNDS,
        "cpus": os.cpu_count(),
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "grpc_mb_per_s": statistics.median(grpc_rates) / 2**20,
        "ingest_mb_per_s": statistics.median(ingest_rates) / 2**20,
        "ingest_vs_grpc": statistics.median(ratios),
        "ingest_vs_grpc_rounds": ratios,
        "grpc_server_cpu_ms_per_push": 1e3 * sum(c for _, c in grpc_runs) / pushes,
        "ingest_server_cpu_ms_per_push": 1e3 * sum(c for _, c in ingest_runs) / pushes,
        "ingest_server_peak_rss_mb": peak_mb,
        "server_paths": server_paths(shapes, payload),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 M values, fewer pushes")
    parser.add_argument("--streams", type=int, default=4, help="concurrent client streams")
    parser.add_argument("--out", type=Path, default=RESULTS / "ingest.json")
    parser.add_argument("--serve-sink", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sink:
        serve_sink(args.port_file)
        return 0
    report = measure(args.quick, args.streams)
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
