"""Load test: many lightweight learners push and pull against one server on loopback.

    python bench/load.py                       # 64 learners, 120 s
    python bench/load.py --quick --learners 32 # 45 s
    python bench/load.py --quick --model-mib 64 # the model-proportional part of the memory

The server runs as its own process (quorum mode, K = 8, 1 fragment, fp4 pulls) so its memory
can be read from /proc. Each simulated learner is a thread with its own channel: it joins,
pulls a snapshot, then loops push -> pull (waiting for the round to close, as a learner at
its merge point does) for the whole run, sending a pre-encoded fp4 pseudo-gradient (no
training: the load is the wire and the server). Reported: pushes per
second, push latency p50/p99, the server's RSS over time against the fp32 model size, and
every error by status; errors other than the intended rejections (none are intended here)
count as unexpected. server_rss_vs_model = (peak RSS - RSS once serving, before any push) /
fp32 model size. Writes bench/results/load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.generated.diloco.v1 import aggregator_pb2 as pb  # noqa: E402
from common.rpc import LEARNER_ID_HEADER  # noqa: E402
from common.wire import encode_fragment  # noqa: E402
from learner.client import AggregatorClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def model_shapes(model_mib: int) -> list[tuple[int, int]]:
    """Two float32 matrices of model_mib / 2 MiB each; 4 MiB: (1024, 512) and (512, 1024)."""
    return [(256 * model_mib, 512), (512, 256 * model_mib)]


def model_specs(shapes: list[tuple[int, int]]) -> list[pb.ParamSpec]:
    return [
        pb.ParamSpec(name=f"w{i}", shape=list(shape), dtype="float32")
        for i, shape in enumerate(shapes)
    ]


INTENDED = set()  # rejections this workload should provoke: none


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Learner(threading.Thread):
    def __init__(
        self, i: int, port: int, shapes: list, payload: bytes, stop: threading.Event
    ) -> None:
        super().__init__(daemon=True)
        self.i, self.port, self.payload, self.stop = i, port, payload, stop
        self.shapes = shapes
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.joined = threading.Event()  # learner 0: set once the model is initialised

    def run(self) -> None:
        # Each simulated learner names itself, as real ones do: rate limits are per learner.
        metadata = ((LEARNER_ID_HEADER, f"load-{self.i}"),)
        client = AggregatorClient(f"127.0.0.1:{self.port}", None, metadata)
        try:
            client.wait_ready(30)
            session = client.join(f"load-{self.i}", model_specs(self.shapes)).session_id
            if self.i == 0:
                init = pb.PushHeader(session_id=session, fragment_id=0, base_version=-1)
                init.kind = pb.PUSH_KIND_INITIAL
                client.push(init, encode_fragment([torch.zeros(s) for s in self.shapes], "fp32"))
            self.joined.set()
            version, wait_for = -1, 0
            while not self.stop.is_set():
                try:
                    # Like a learner at its merge point: wait (long-poll) for the round it
                    # pushed to to close, then push against the new version.
                    header, _ = client.pull(session, 0, version, wait_for, wait_timeout_s=5.0)
                    if header.version < wait_for:
                        continue  # the round is still open: wait again
                    version = max(version, header.version)
                    wait_for = version + 1
                    push = pb.PushHeader(
                        session_id=session, fragment_id=0, base_version=version,
                        inner_steps=50, tokens=50 * 2048, kind=pb.PUSH_KIND_DELTA,
                    )  # fmt: skip
                    started = time.perf_counter()
                    client.push(push, self.payload)
                    self.latencies.append(time.perf_counter() - started)
                except grpc.RpcError as err:
                    self.errors[err.code().name] += 1
                    time.sleep(0.05)
        finally:
            client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="45 s")
    parser.add_argument(
        "--model-mib", type=int, default=4, help="fp32 model size in MiB (default 4)"
    )
    parser.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the server, e.g. MALLOC_MMAP_THRESHOLD_=131072",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args()
    if args.model_mib < 1:
        parser.error(f"--model-mib must be >= 1, got {args.model_mib}")
    shapes = model_shapes(args.model_mib)
    if args.quick:
        args.duration_s = 45.0
    workdir = Path(tempfile.mkdtemp(prefix="diloco-load-"))
    port_file = workdir / "port"
    server_log = open(workdir / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "server.main", "--insecure", "--listen", "127.0.0.1:0",
         "--port-file", str(port_file), "--mode", "quorum", "--min-contributors", "8",
         "--grace-max-s", "0.5", "--max-staleness", "1000000", "--lease-s", "30",
         "--log-level", "WARNING"],
        cwd=Path(__file__).resolve().parent.parent, stdout=server_log, stderr=subprocess.STDOUT,
        env={**os.environ, **dict(kv.split("=", 1) for kv in args.server_env)},
    )  # fmt: skip
    try:
        for _ in range(600):  # bounded: the server writes its port once it serves
            if port_file.exists() or server.poll() is not None:
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        # The fixed overhead (interpreter, torch, gRPC): RSS once serving, before any push.
        startup_mb = rss_mb(server.pid)
        torch.manual_seed(0)
        payload = encode_fragment([torch.randn(s) * 1e-3 for s in shapes], "fp4_e2m1")
        stop = threading.Event()
        learners = [Learner(i, port, shapes, payload, stop) for i in range(args.learners)]
        started = time.perf_counter()
        learners[0].start()
        if not learners[0].joined.wait(60):
            raise RuntimeError(f"the first learner could not initialise; see {workdir}")
        for learner in learners[1:]:
            learner.start()
        samples = []
        while time.perf_counter() - started < args.duration_s:
            samples.append((round(time.perf_counter() - started, 1), rss_mb(server.pid)))
            time.sleep(1.0)
        stop.set()
        for learner in learners:
            learner.join(timeout=60)
        elapsed = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=30)
    latencies = sorted(t for learner in learners for t in learner.latencies)
    errors: Counter[str] = Counter()
    for learner in learners:
        errors.update(learner.errors)
    model_mb = sum(a * b for a, b in shapes) * 4 / 2**20
    peak = max(mb for _, mb in samples)
    report = {
        "learners": args.learners,
        "model_mib": args.model_mib,
        "server_env": args.server_env,
        "duration_s": elapsed,
        "pushes": len(latencies),
        "pushes_per_s": len(latencies) / elapsed,
        "push_latency_p50_s": statistics.median(latencies) if latencies else None,
        "push_latency_p99_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "errors": dict(errors),
        "unexpected_errors": sum(n for code, n in errors.items() if code not in INTENDED),
        "model_mb": model_mb,
        "server_rss_mb": samples,
        "server_rss_peak_mb": peak,
        "server_rss_startup_mb": startup_mb,
        # Issue 7 target: <= 4 (peak above the fixed overhead, in fp32 models).
        "server_rss_vs_model": (peak - startup_mb) / model_mb,
        "server_rss_growth_mb_second_half": samples[-1][1] - samples[len(samples) // 2][1],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "server_rss_mb"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["unexpected_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
