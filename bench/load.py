"""Load test: many lightweight learners push and pull against one server on loopback.

    python bench/load.py                       # 64 learners, 120 s
    python bench/load.py --quick --learners 32 # 45 s
    python bench/load.py --quick --model-mib 64 # the model-proportional part of the memory
    python bench/load.py --quick --slopes      # + 8 learners at 4 and 32 MiB: the two slopes

The server runs as its own process (quorum mode, K = 8, 1 fragment, fp4 pulls, a 300 s lease:
LEASE_S) so its memory can be read from /proc. Each simulated learner is a thread with its own
channel: it joins, pulls a snapshot, then loops push -> pull (waiting for the round to close, as
a sync-mode learner does at its merge point) for the whole run, sending a pre-encoded fp4
pseudo-gradient (no training: the load is the wire and the server). Reported: pushes per
second, push latency p50/p99, the server's RSS over time against the fp32 model size (and the
peak RSS of this process, which holds every simulated learner), and
every error by status; errors other than the intended rejections (none are intended here)
count as unexpected. server_rss_vs_model = (peak RSS - RSS once serving, before any push) /
fp32 model size, for this one run: at 4 MiB it is mostly the per-learner part (gRPC
streams, threads, pushes in flight), not copies of the model.

--slopes separates the two (target: <= 4 model copies + a fixed overhead, whatever the
learner count) with two more servers, each with SLOPE_LEARNERS learners, at --model-mib and
--slope-model-mib:
  server_rss_model_copies  = Δ(peak above idle) / Δ(model size) between the two models: the
                             model-sized copies the server holds (target <= 4)
  server_rss_mb_per_learner = Δ(peak above idle) / Δ(learners) between SLOPE_LEARNERS and
                             --learners, at --model-mib
Writes bench/results/load.json.
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
from collections import Counter
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.procfs import rss_mb  # noqa: E402
from common.codec.fragment import encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb  # noqa: E402
from common.retry import Stopped, call_with_retry  # noqa: E402
from common.rpc import LEARNER_ID_HEADER  # noqa: E402
from deploy.launcher import SERVER, start_daemon  # noqa: E402
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
        self.version, self.wait_for = -1, 0

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
            # An outage is retried as a learner retries it (common/retry.py), and counted;
            # any other refusal is counted and ends this learner, as it would a real one.
            call_with_retry(lambda: self._exchange(client, session), self.stop, self._count)
        except Stopped:
            pass
        except grpc.RpcError as err:
            self._count(err)
        finally:
            client.close()

    def _exchange(self, client: AggregatorClient, session: str) -> None:
        """Push -> pull until stopped; the version pushed against survives a retry."""
        while not self.stop.is_set():
            # Like a learner at its merge point: wait (long-poll) for the round it pushed to
            # to close, then push against the new version.
            header, _ = client.pull(session, 0, self.version, self.wait_for, wait_timeout_s=5.0)
            if header.version < self.wait_for:
                continue  # the round is still open: wait again
            self.version = max(self.version, header.version)
            self.wait_for = self.version + 1
            push = pb.PushHeader(
                session_id=session, fragment_id=0, base_version=self.version,
                inner_steps=50, tokens=50 * 2048, kind=pb.PUSH_KIND_DELTA,
            )  # fmt: skip
            started = time.perf_counter()
            client.push(push, self.payload)
            self.latencies.append(time.perf_counter() - started)

    def _count(self, err: grpc.RpcError, delay_s: float = 0.0) -> None:
        self.errors[err.code().name] += 1


# The simulated learners send no heartbeats (a real learner renews its lease every lease_s / 3
# on a thread of its own): only their pushes and pulls renew it, and with hundreds of them on a
# loaded machine two of those can be more than 30 s apart, which expires the session (NOT_FOUND).
LEASE_S = 300

# Learners of the two runs --slopes adds: K, so every round can close without a grace window.
SLOPE_LEARNERS = 8


def run(learners: int, model_mib: int, duration_s: float, server_env: list[str]) -> dict:
    """One server under `learners` simulated learners for `duration_s`; see the docstring."""
    shapes = model_shapes(model_mib)
    workdir = Path(tempfile.mkdtemp(prefix="diloco-load-"))
    server = start_daemon(
        "server",
        [*SERVER, "--insecure", "--listen", "127.0.0.1:0", "--mode", "quorum",
         "--min-contributors", "8", "--grace-max-s", "0.5", "--max-staleness", "1000000",
         "--lease-s", str(LEASE_S), "--log-level", "WARNING"],
        workdir / "server.log",
        port_file=workdir / "port",
        env={**os.environ, **dict(kv.split("=", 1) for kv in server_env)},
    )  # fmt: skip
    port = server.port
    try:
        # The fixed overhead (interpreter, torch, gRPC): RSS once serving, before any push.
        startup_mb = rss_mb(server.pid)
        torch.manual_seed(0)
        payload = encode_fragment([torch.randn(s) * 1e-3 for s in shapes], "fp4_e2m1")
        stop = threading.Event()
        fleet = [Learner(i, port, shapes, payload, stop) for i in range(learners)]
        started = time.perf_counter()
        fleet[0].start()
        if not fleet[0].joined.wait(60):
            raise RuntimeError(f"the first learner could not initialise; see {workdir}")
        for learner in fleet[1:]:
            learner.start()
        samples, client_peak_mb = [], 0.0
        while time.perf_counter() - started < duration_s:
            samples.append((round(time.perf_counter() - started, 1), rss_mb(server.pid)))
            client_peak_mb = max(client_peak_mb, rss_mb(os.getpid()))
            time.sleep(1.0)
        stop.set()
        for learner in fleet:
            learner.join(timeout=60)
        elapsed = time.perf_counter() - started
    finally:
        server.stop()
    latencies = sorted(t for learner in fleet for t in learner.latencies)
    errors: Counter[str] = Counter()
    for learner in fleet:
        errors.update(learner.errors)
    model_mb = sum(a * b for a, b in shapes) * 4 / 2**20
    peak = max(mb for _, mb in samples)
    return {
        "learners": learners,
        "model_mib": model_mib,
        "server_env": server_env,
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
        "server_rss_above_idle_mb": peak - startup_mb,
        # Peak above the fixed overhead, in fp32 models, for this run's learners and model.
        "server_rss_vs_model": (peak - startup_mb) / model_mb,
        "server_rss_growth_mb_second_half": samples[-1][1] - samples[len(samples) // 2][1],
        # This process: the simulated learners' threads, channels and pulled payloads.
        "bench_client_rss_peak_mb": client_peak_mb,
    }


def slopes(report: dict, args: argparse.Namespace) -> dict:
    """The model copies and the MB per learner (module docstring), from two more runs."""
    small = run(SLOPE_LEARNERS, args.model_mib, args.duration_s, args.server_env)
    big = run(SLOPE_LEARNERS, args.slope_model_mib, args.duration_s, args.server_env)
    runs = [small, big]
    copies = (big["server_rss_above_idle_mb"] - small["server_rss_above_idle_mb"]) / (
        big["model_mb"] - small["model_mb"]
    )
    out = {"server_rss_model_copies": copies}
    if args.learners != SLOPE_LEARNERS:
        out["server_rss_mb_per_learner"] = (
            report["server_rss_above_idle_mb"] - small["server_rss_above_idle_mb"]
        ) / (args.learners - SLOPE_LEARNERS)
    out["slope_runs"] = runs
    out["unexpected_errors"] = sum(r["unexpected_errors"] for r in [report, *runs])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="45 s a run")
    parser.add_argument(
        "--model-mib", type=int, default=4, help="fp32 model size in MiB (default 4)"
    )
    parser.add_argument(
        "--slopes",
        action="store_true",
        help=f"also run {SLOPE_LEARNERS} learners at --model-mib and --slope-model-mib",
    )
    parser.add_argument("--slope-model-mib", type=int, default=32, help="(default 32)")
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
    if args.slopes and args.slope_model_mib <= args.model_mib:
        parser.error("--slope-model-mib must be larger than --model-mib")
    if args.quick:
        args.duration_s = 45.0
    report = run(args.learners, args.model_mib, args.duration_s, args.server_env)
    if args.slopes:
        report.update(slopes(report, args))
    summary = {k: v for k, v in report.items() if k not in ("server_rss_mb", "slope_runs")}
    print(json.dumps(summary, indent=1))
    for r in report.get("slope_runs", []):
        print(
            f"slope run: {r['learners']} learners, {r['model_mib']} MiB: peak "
            f"{r['server_rss_peak_mb']:.0f} MB, {r['server_rss_above_idle_mb']:.0f} MB above idle"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["unexpected_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
