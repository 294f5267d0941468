"""Ingest benchmark: fp4 pushes through the real server against a bare gRPC byte stream.

    python bench/ingest.py            # 16 M-value fragment (64 MiB fp32), ~1 minute
    python bench/ingest.py --quick    # 4 M values, ~20 s

Both sides run one server process on loopback and the same client: `--streams` threads that
each send one stream after another, in chunks of common.wire.CHUNK_BYTES.
(a) grpc: a minimal servicer built by common.rpc.create_server (same options and thread pool)
    whose one client-streaming method takes raw bytes and only counts them: the ceiling.
(b) ingest: `diloco-server` in quorum mode; every push is a real fp4 pseudo-gradient from its
    own joined learner, received, validated, decoded and added to the open round (the round
    never closes during the run, so nothing but ingest is timed).
Reported: wire payload bytes per second of each, and ingest_vs_grpc = (b) / (a) (target >=
0.5, issue 7). Writes bench/results/ingest.json; `measure(quick)` returns the same dict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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

from common.generated.diloco.v1 import aggregator_pb2 as pb  # noqa: E402
from common.generated.diloco.v1 import aggregator_pb2_grpc as pb_grpc  # noqa: E402
from common.metrics_http import write_port_file  # noqa: E402
from common.rpc import create_channel, create_server  # noqa: E402
from common.wire import CHUNK_BYTES, chunks, encode_fragment  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SINK_METHOD = "/bench.Sink/Push"


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


def _start(argv: list[str], workdir: Path) -> tuple[subprocess.Popen, int]:
    port_file = workdir / f"port-{len(list(workdir.iterdir()))}"
    log = open(workdir / f"{port_file.name}.log", "w")
    proc = subprocess.Popen(
        [*argv, "--port-file", str(port_file)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    for _ in range(1200):  # bounded: the server writes its port once it serves
        if port_file.exists() and port_file.read_text() or proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is not None or not port_file.exists():
        raise RuntimeError(f"server did not start; see {log.name}")
    return proc, int(port_file.read_text())


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


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


def measure_grpc(payload: bytes, pushes: int, streams: int, workdir: Path) -> float:
    """(a): payload bytes per second of a bare byte stream."""
    proc, port = _start([sys.executable, __file__, "--serve-sink"], workdir)
    pieces = list(chunks(payload))
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        push = channel.stream_unary(SINK_METHOD)  # no (de)serializers: raw bytes
        push(iter(pieces), timeout=60)  # warm-up
        elapsed = _run_streams(lambda i: push(iter(pieces), timeout=600), pushes, streams)
    finally:
        channel.close()
        _stop(proc)
    return pushes * len(payload) / elapsed


def measure_ingest(
    shapes: list[tuple[int, ...]], payload: bytes, pushes: int, streams: int, workdir: Path
) -> tuple[float, float]:
    """(b): payload bytes per second of fp4 pushes into the real server; and its peak RSS."""
    argv = [sys.executable, "-m", "server.main", "--insecure", "--listen", "127.0.0.1:0",
            "--mode", "quorum", "--min-contributors", "1000000", "--max-staleness", "1000000",
            "--lease-s", "600", "--log-level", "WARNING"]  # fmt: skip
    proc, port = _start(argv, workdir)
    channel = create_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.AggregatorStub(channel)
    specs = [
        pb.ParamSpec(name=f"w{i}", shape=list(s), dtype="float32") for i, s in enumerate(shapes)
    ]
    try:
        # One learner per push (+1 that never pushes, so the round stays open): each pushes
        # once against version 0, as the aggregator takes one push per learner and version.
        sessions = [
            stub.Join(pb.JoinRequest(learner_id=f"ingest-{i}", fingerprint=specs)).session_id
            for i in range(pushes + 3)
        ]
        initial = encode_fragment([torch.zeros(s) for s in shapes], "fp32")
        _push(stub, sessions[-1], initial, pb.PUSH_KIND_INITIAL, -1)
        pieces = [pb.PushFragmentRequest(chunk=c) for c in chunks(payload)]
        _push(stub, sessions[-2], payload, pb.PUSH_KIND_DELTA, 0, pieces)  # warm-up

        def send(i: int) -> None:
            _push(stub, sessions[i], payload, pb.PUSH_KIND_DELTA, 0, pieces)

        elapsed = _run_streams(send, pushes, streams)
        peak_mb = _peak_rss_mb(proc.pid)
    finally:
        channel.close()
        _stop(proc)
    return pushes * len(payload) / elapsed, peak_mb


def _push(stub, session: str, payload: bytes, kind: int, base: int, pieces=None) -> None:
    header = pb.PushHeader(
        session_id=session, fragment_id=0, base_version=base, payload_bytes=len(payload),
        kind=kind, tokens=1000, inner_steps=10,
    )  # fmt: skip
    pieces = (
        pieces if pieces is not None else [pb.PushFragmentRequest(chunk=c) for c in chunks(payload)]
    )
    reply = stub.PushFragment(iter([pb.PushFragmentRequest(header=header), *pieces]), timeout=600)
    if not reply.accepted:
        raise RuntimeError(f"push refused: {reply}")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(quick: bool = False, streams: int = 4) -> dict:
    """Run (a) and (b) once and return the figures (for bench/perf suites)."""
    values = (1 << 22) if quick else (1 << 24)
    shapes = [(values // 1024, 1024)]
    pushes = 40 if quick else 80
    torch.manual_seed(0)
    payload = encode_fragment([torch.randn(s) * 1e-3 for s in shapes], "fp4_e2m1")
    with tempfile.TemporaryDirectory(prefix="diloco-ingest-") as tmp:
        workdir = Path(tmp)
        grpc_bps = measure_grpc(payload, pushes, streams, workdir)
        ingest_bps, peak_mb = measure_ingest(shapes, payload, pushes, streams, workdir)
    return {
        "fragment_values": values,
        "fp32_fragment_mb": values * 4 / 2**20,
        "payload_mb": len(payload) / 2**20,
        "chunk_bytes": CHUNK_BYTES,
        "pushes": pushes,
        "streams": streams,
        "cpus": os.cpu_count(),
        "grpc_mb_per_s": grpc_bps / 2**20,
        "ingest_mb_per_s": ingest_bps / 2**20,
        "ingest_vs_grpc": ingest_bps / grpc_bps,
        "ingest_server_peak_rss_mb": peak_mb,
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
