"""Learner overhead: the DiLoCo machinery's cost per inner step, and the sync thread's stalls.

    python -m bench.learner_overhead            # ~2 minutes
    python -m bench.learner_overhead --quick    # ~1 minute

1. Step overhead. The same Learner (same model, data, AdamW, one torch thread) trains twice
   in its own process: `plain` calls its inner step in a bare loop; `diloco` runs the real
   learner loop against a real server process on loopback (Streaming DiLoCo, fp4 pushes and
   pulls, background sync thread). Time per inner step excludes evaluation (the plain loop
   has none) and is compared as diloco / plain − 1, alternating the two runs to cancel drift.
   Peak RSS of each process is reported too. The figure is the median over alternating
   pairs of each pair's ratio; the training thread's own sync CPU per step is reported too.
2. GIL stalls. While a background thread encodes a large fragment (fp4, C kernel) and pushes
   it over gRPC to the server, the main thread ticks in pure Python; the longest gap between
   ticks is the longest the training thread could have been held up. The baseline is the
   same ticking with nothing in the background.
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
from pathlib import Path

from bench.procfs import peak_rss_mb
from deploy.launcher import SERVER, Daemon, start_daemon

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _learner_config(server: str, learner_id: str, steps_per_outer: int):
    from common.config import build_config
    from learner.config import LearnerConfig

    settings = {
        "server": server,
        "learner_id": learner_id,
        "sync_every_steps": steps_per_outer,
        "torch_threads": 1,
        "eval_batches": 1,
        "status_every_s": 0,
        "insecure": True,
        "corpus_max_bytes": 1 << 20,
    }
    return build_config(LearnerConfig, settings)


class _Timed:
    """Wraps a method: total wall and main-thread CPU seconds spent in it."""

    def __init__(self, method) -> None:
        self.method, self.wall_s, self.cpu_s, self.calls = method, 0.0, 0.0, 0

    def __call__(self, *args):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return self.method(*args)
        finally:
            self.wall_s += time.perf_counter() - wall
            self.cpu_s += time.thread_time() - cpu
            self.calls += 1


def child(mode: str, server: str, steps: int, steps_per_outer: int) -> dict:
    """Train `steps` inner steps in this process; time per step and peak RSS.

    Per step counts the inner step plus, with DiLoCo, the sync work the training thread does
    after it (Learner._advance: start pushes, merge replies); evaluation, join and the final
    drain are not steps. Main-thread CPU time is reported next to wall time: with one torch
    thread it is the training thread's own work, and it is robust to other load.
    """
    from learner.trainer import Learner

    learner = Learner(_learner_config(server, f"overhead-{mode}-{os.getpid()}", steps_per_outer))
    inner = learner._inner_step = _Timed(learner._inner_step)
    sync = learner._advance = _Timed(learner._advance)
    if mode == "plain":
        for _ in range(steps):
            inner()
    else:
        learner.config.training.max_outer_steps = steps // steps_per_outer
        learner.run(threading.Event())
    return {
        "steps": inner.calls,
        "per_step_s": (inner.wall_s + sync.wall_s) / inner.calls,
        "per_step_cpu_s": (inner.cpu_s + sync.cpu_s) / inner.calls,
        "sync_cpu_s_per_step": sync.cpu_s / inner.calls,
        "peak_rss_mb": peak_rss_mb(),
    }


def gil_stalls(server: str, fragment_mib: int, pushes: int) -> dict:
    """Longest main-thread gap while a fragment is encoded and pushed, vs idle."""
    import torch

    from common.codec.fragment import encode_fragment
    from common.generated.diloco.v1 import aggregator_pb2 as pb
    from learner.client import AggregatorClient

    numel = fragment_mib * (1 << 20) // 4
    shapes = [(numel // 1024, 1024)]
    specs = [pb.ParamSpec(name="w", shape=list(shapes[0]), dtype="float32")]
    client = AggregatorClient(server)
    client.wait_ready(10)
    session = client.join(f"gil-{os.getpid()}", specs).session_id
    tensor = torch.randn(shapes[0])
    init = pb.PushHeader(session_id=session, fragment_id=0, base_version=-1)
    init.kind = pb.PUSH_KIND_INITIAL
    client.push(init, encode_fragment([tensor], "fp32"))
    done = threading.Event()

    def background() -> None:
        # One learner in sync mode: each push closes its round, so version i is next.
        for version in range(pushes):
            delta = encode_fragment([tensor * 1e-3], "fp4_e2m1")
            header = pb.PushHeader(
                session_id=session, fragment_id=0, base_version=version,
                inner_steps=1, tokens=1024, kind=pb.PUSH_KIND_DELTA,
            )  # fmt: skip
            client.push(header, delta)
        done.set()

    def max_gap_s(until: threading.Event | None, duration_s: float) -> tuple[float, float]:
        gaps, last = [], time.perf_counter()
        deadline = last + duration_s
        while (until is None or not until.is_set()) and last < deadline:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        gaps.sort()
        return gaps[-1], gaps[int(0.999 * (len(gaps) - 1))]

    idle_max, idle_p999 = max_gap_s(None, 1.0)
    started = time.perf_counter()
    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    busy_max, busy_p999 = max_gap_s(done, 120.0)
    elapsed = time.perf_counter() - started
    thread.join(timeout=30)
    client.leave(session)
    client.close()
    return {
        "fragment_mib": fragment_mib,
        "pushes": pushes,
        "push_s": elapsed / pushes,
        "max_stall_idle_ms": idle_max * 1e3,
        "max_stall_busy_ms": busy_max * 1e3,
        "p999_gap_busy_ms": busy_p999 * 1e3,
    }


def start_server(workdir: Path) -> tuple[Daemon, str]:
    workdir.mkdir(parents=True)
    server = start_daemon(
        "server",
        [*SERVER, "--insecure", "--listen", "127.0.0.1:0", "--mode", "sync",
         "--state-dir", workdir / "state", "--log-level", "WARNING"],
        workdir / "server.log",
        port_file=workdir / "port",
    )  # fmt: skip
    return server, f"127.0.0.1:{server.port}"


def run_child(mode: str, server: str, steps: int, steps_per_outer: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.learner_overhead", "--child", mode, "--server", server,
         "--steps", str(steps), "--steps-per-outer", str(steps_per_outer)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(quick: bool = False) -> dict:
    """Both figures, with a server process started and stopped here."""
    # Runs of the same loop differ by about +-3% here, so the full version alternates six
    # pairs and takes the median of the pairs' ratios, which drift between pairs cancels.
    steps, rounds = (60, 2) if quick else (150, 6)
    steps_per_outer = 30
    runs: dict[str, list[dict]] = {"plain": [], "diloco": []}
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        server, address = start_server(Path(tmp, "a"))
        try:
            for _ in range(rounds):
                for mode in ("plain", "diloco"):
                    runs[mode].append(run_child(mode, address, steps, steps_per_outer))
        finally:
            server.stop()
        server, address = start_server(Path(tmp, "b"))  # a run of a one-tensor model
        try:
            stalls = gil_stalls(address, fragment_mib=16 if quick else 64, pushes=3)
        finally:
            server.stop()
    plain = statistics.median(r["per_step_s"] for r in runs["plain"])
    diloco = statistics.median(r["per_step_s"] for r in runs["diloco"])
    pairs = [
        d["per_step_s"] / p["per_step_s"] - 1
        for p, d in zip(runs["plain"], runs["diloco"], strict=True)
    ]
    cpu_pairs = [
        d["per_step_cpu_s"] / p["per_step_cpu_s"] - 1
        for p, d in zip(runs["plain"], runs["diloco"], strict=True)
    ]
    return {
        "steps": steps,
        "sync_every_steps": steps_per_outer,
        "plain_step_s": plain,
        "diloco_step_s": diloco,
        "learner_step_overhead": statistics.median(pairs),
        "learner_step_overhead_pairs": pairs,
        "learner_step_cpu_overhead": statistics.median(cpu_pairs),
        # The training thread's own CPU for the sync work after each step (pushes started,
        # replies merged), as a share of a plain step: the machinery's direct cost.
        "sync_share_of_step": statistics.median(r["sync_cpu_s_per_step"] for r in runs["diloco"])
        / statistics.median(r["per_step_cpu_s"] for r in runs["plain"]),
        "plain_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["plain"]),
        "diloco_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["diloco"]),
        "runs": runs,
        "gil": stalls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", choices=["plain", "diloco"], help=argparse.SUPPRESS)
    parser.add_argument("--server", default="", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--steps-per-outer", type=int, default=30, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "learner_overhead.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.server, args.steps, args.steps_per_outer)))
        return
    result = measure(args.quick)
    args.out.write_text(json.dumps(result, indent=1))
    gil = result["gil"]
    print(
        f"inner step: plain {result['plain_step_s'] * 1e3:.1f} ms, with DiLoCo "
        f"{result['diloco_step_s'] * 1e3:.1f} ms -> "
        f"overhead {result['learner_step_overhead']:+.2%} "
        f"(median of {len(result['learner_step_overhead_pairs'])} alternating pairs: "
        + ", ".join(f"{x:+.1%}" for x in result["learner_step_overhead_pairs"])
        + f"; main-thread CPU {result['learner_step_cpu_overhead']:+.2%}; the sync work on "
        f"the training thread {result['sync_share_of_step']:.2%} of a step)"
        f"\npeak RSS: plain {result['plain_peak_rss_mb']:.0f} MB, "
        f"with DiLoCo {result['diloco_peak_rss_mb']:.0f} MB"
        f"\nGIL: longest main-thread gap while pushing a {gil['fragment_mib']} MiB fragment "
        f"{gil['max_stall_busy_ms']:.1f} ms (idle {gil['max_stall_idle_ms']:.2f} ms)"
    )


if __name__ == "__main__":
    main()
