"""Scale benchmark: a 537 M-parameter model over 1, 2 and 4 aggregator shards on loopback.

    python bench/scale.py --quick      # 34 M params, 8 learners, 1/2/4 shards: < 3 min
    python bench/scale.py              # 537 M params, 8 learners, then 64

Each shard is its own `diloco-server` process (quorum mode, K = half the learners, P = 4
fragments of two side x side fp32 tensors each, balanced layout, fp4 pulls), so its memory
and CPU time are read from /proc. The simulated learners are threads of this process: each
learner has one thread per shard (as a real learner has one sync thread per shard) that
pushes a pre-encoded fp4 pseudo-gradient of each fragment that shard owns, then pulls the
round's update once it has closed and pushes again (no training: the load is the wire).
A probe (one more learner, joined but never pushing, on channels of its own) pulls one update
of each fragment (its current version from the one before, already available, so no
waiting) once a second; that is the pull latency.

Per run (one shard count, one learner count), in bench/results/scale.json:
  rss_per_owned_model  max over shards of (peak RSS - RSS once serving, before the model
                       arrived) / fp32 bytes of the fragments the shard owns
  pushes_per_s         fragment pushes accepted per second, all shards together, over the
                       measured window (after every learner joined)
  cpu_s_per_gb         CPU seconds of all shards in that window / wire GB (1e9 bytes) the
                       learners streamed to them in it (pushes still in flight included)
  cpu_s_per_accepted_gb  the same CPU seconds / payload GB of the pushes accepted in it
  pull_p50_s, pull_p99_s  the probe's one-update pull latency
  retried              pushes tried again after a retry hint or a deadline, by status
`--quick` measures them all alike (side 2048, 10 s a run and on until every fragment has a
new version, 60 s at most) into scale_quick.json: a small model's figures, its RSS ratios
mostly the shards' fixed buffers. A run stops early (`rss_limit_hit`) if the shards and this
process together pass --rss-limit-gb, so a benchmark never takes the shared machine's memory
from under other work. One watcher per fragment long-polls its next version; learners wait
for it, then pull the update (at most PULLS_AT_ONCE at once in this process, for its memory).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procfs  # noqa: E402
from bench.scale_fleet import FRAGMENTS, TENSORS, Fleet, Model  # noqa: E402
from common.codec.framing import fragment_parts
from common.codec.tensor import codec_id, encode_values
from deploy.launcher import SERVER, Daemon, start_daemon, stop_all, wait_for_port_file  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FULL_SIDE, QUICK_SIDE = 8192, 2048  # 8 x side^2 parameters: 537 M, 34 M
QUICK_RUN_S = (10.0, 60.0)  # --quick: measured, then at most this much more for every figure
PER_SHARD = ("owned_fragments", "owned_mb", "idle_rss_mb", "peak_rss_mb", "rss_per_owned_model")


# Every shard alike: quorum rounds with a short grace window, no staleness refusals (pushes
# that miss a round join the next), leases that outlast a run, the servers' own layout.
SHARD_FLAGS = [
    "--insecure", "--listen", "127.0.0.1:0", "--mode", "quorum", "--grace-max-s", "0.5",
    "--max-staleness", "1000000", "--lease-s", "600", "--fragments", str(FRAGMENTS),
    "--layout", "balanced", "--log-level", "WARNING",
]  # fmt: skip


def start_shards(count: int, quorum: int, workdir: Path, flags: Sequence[str] = ()) -> list[Daemon]:
    """Start every shard at once (most of a start is importing torch), then wait for each."""
    shards: list[Daemon] = []
    try:
        for i in range(count):
            argv = [*SERVER, *SHARD_FLAGS, *flags, "--min-contributors", str(quorum)]
            argv += ["--shard-index", str(i), "--shard-count", str(count)]
            argv += ["--port-file", str(workdir / f"shard-{i}.port")]
            shards.append(start_daemon(f"shard-{i}", argv, workdir / f"shard-{i}.log"))
        for i, shard in enumerate(shards):
            shard.port = wait_for_port_file(workdir / f"shard-{i}.port", shard)
    except BaseException:
        stop_all(shards)
        raise
    return shards


def run(
    shards: int, learners: int, model: Model, payloads: tuple[list[bytes], list[bytes]],
    duration_s: float, rss_limit_mb: float, min_versions: int = 0, timeout_s: float = 600.0,
    quorum: int = 0, flags: Sequence[str] = (),
) -> dict:  # fmt: skip
    """One run: `shards` servers (started with `flags` more), `learners` simulated learners,
    `duration_s` measured (and on until every fragment reached `min_versions` and a pull was
    timed, within `timeout_s` more). A round closes once `quorum` learners pushed (0: half)
    and 0.5 s of grace end."""
    quorum = quorum or max(1, learners // 2)
    initial, pushes = payloads
    begun = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="diloco-scale-"))
    daemons = start_shards(shards, quorum, workdir, flags)
    pids = [d.pid for d in daemons]
    idle_mb = [procfs.rss_mb(pid) for pid in pids]
    peak_mb = list(idle_mb)
    fleet = Fleet([f"127.0.0.1:{d.port}" for d in daemons], model, learners)
    threads: list[threading.Thread] = []
    limit_hit = False
    try:
        owned = fleet.join_all(initial)
        threads = [
            threading.Thread(target=fleet.push_loop, args=(i, owned[s], pushes), daemon=True)
            for i in range(learners)
            for s in range(shards)
        ]
        threads.append(threading.Thread(target=fleet.probe_loop, daemon=True))
        for f in range(FRAGMENTS):
            threads.append(threading.Thread(target=fleet.watch_loop, args=(f,), daemon=True))
        setup_s = time.perf_counter() - begun
        cpu_before = [procfs.cpu_s(pid) for pid in pids]
        sent_before = fleet.bytes_sent()
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        while not limit_hit and (
            (elapsed := time.perf_counter() - started) < duration_s
            or (not fleet.settled(min_versions) and elapsed < duration_s + timeout_s)
        ):
            rss = [procfs.rss_mb(pid) for pid in pids]
            peak_mb = [max(p, r) for p, r in zip(peak_mb, rss, strict=True)]
            limit_hit = sum(rss) + procfs.rss_mb(os.getpid()) > rss_limit_mb
            time.sleep(0.25)
        elapsed = time.perf_counter() - started
        cpu_s = sum(procfs.cpu_s(pid) for pid in pids) - sum(cpu_before)
        pushed_gb = (fleet.bytes_sent() - sent_before) / 1e9  # pushes in flight count too
        pushes_done = fleet.pushes
        accepted_gb = pushes_done * len(pushes[0]) / 1e9
    finally:
        fleet.close(threads)
        stop_all(daemons)
    tensor_mb = model.side * model.side * 4 / 2**20
    owned_mb = [tensor_mb * TENSORS / FRAGMENTS * len(fs) for fs in owned]
    ratios = [(p - i) / o for p, i, o in zip(peak_mb, idle_mb, owned_mb, strict=True)]
    latencies = sorted(fleet.pull_latencies)
    return {
        "shards": shards,
        "learners": learners,
        "quorum": quorum,
        "model_params": model.params,
        "model_mb": tensor_mb * TENSORS,
        "rss_per_owned_model": max(ratios),
        "pushes_per_s": pushes_done / elapsed,
        "cpu_s_per_gb": cpu_s / pushed_gb if pushed_gb else None,
        # Over the accepted pushes' payloads only (pushes_done x one payload's bytes):
        # streamed bytes include the parts of pushes refused for want of budget.
        "cpu_s_per_accepted_gb": cpu_s / accepted_gb if accepted_gb else None,
        "pull_p50_s": statistics.median(latencies) if latencies else None,
        # Nearest rank: the smallest latency with at least 99% of them at or below it.
        "pull_p99_s": latencies[math.ceil(0.99 * len(latencies)) - 1] if latencies else None,
        "per_shard": [
            dict(zip(PER_SHARD, row, strict=True))
            for row in zip(owned, owned_mb, idle_mb, peak_mb, ratios, strict=True)
        ],
        "pushes": pushes_done,
        "pushed_gb": pushed_gb,
        "cpu_s": cpu_s,
        "duration_s": elapsed,
        "setup_s": setup_s,
        "pulls_timed": len(latencies),
        "errors": fleet.errors,
        "error_details": fleet.error_details,
        "retried": fleet.retried,
        "rss_limit_hit": limit_hit,
    }


def payloads_of(model: Model) -> tuple[list[bytes], list[bytes]]:
    """Per fragment: the initial fp32 values (zeros) and a pushed fp4 pseudo-gradient. Every
    fragment has the same shapes, so one encoding of each serves all of them (encoding
    half a billion values takes minutes on a busy machine; the server's work per push does
    not depend on the values)."""
    torch.manual_seed(0)
    shape = (model.side, model.side)
    zeros = (codec_id("fp32"), shape, *encode_values(torch.zeros(shape), codec_id("fp32")))
    delta = torch.randn(shape) * 1e-3
    fp4 = (codec_id("fp4_e2m1"), shape, *encode_values(delta, codec_id("fp4_e2m1")))
    per_fragment = TENSORS // FRAGMENTS
    initial = b"".join(fragment_parts([zeros] * per_fragment))
    push = b"".join(fragment_parts([fp4] * per_fragment))
    return [initial] * FRAGMENTS, [push] * FRAGMENTS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="34 M params, 10 s a run: < 3 min")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured, per run")
    parser.add_argument("--min-versions", type=int, default=1, help="and on until reached")
    parser.add_argument("--quorum", type=int, default=0, help="learners a round needs (0: half)")
    parser.add_argument("--side", type=int, help="8 x side^2 params (default 8192: 537 M)")
    parser.add_argument("--many-learners", type=int, default=64)
    parser.add_argument("--many-side", type=int, default=FULL_SIDE, help="(8192: 537 M params)")
    parser.add_argument("--shard-flags", default="", help='more diloco-server flags, e.g. '
                        '"--outer-state-dtype bfloat16"')  # fmt: skip
    parser.add_argument("--rss-limit-gb", type=float, default=0.0, help="0: 0.8 x MemAvailable")
    parser.add_argument("--out", type=Path, help="default: scale.json, --quick scale_quick.json")
    args = parser.parse_args()
    if any(n not in range(1, FRAGMENTS + 1) for n in args.shards):
        parser.error(f"--shards must each be in 1..{FRAGMENTS}, got {args.shards}")
    duration_s, timeout_s = QUICK_RUN_S if args.quick else (args.duration_s, 600.0)
    side = args.side or (QUICK_SIDE if args.quick else FULL_SIDE)
    out = args.out or RESULTS / ("scale_quick.json" if args.quick else "scale.json")
    available_gb = procfs.field_kib("/proc/meminfo", "MemAvailable") / 2**20
    rss_limit_mb = 1024 * (args.rss_limit_gb or 0.8 * available_gb)
    plans = [(8, side)] + ([] if args.quick else [(args.many_learners, args.many_side)])
    started = time.perf_counter()
    runs = []
    for learners, side in plans:
        model = Model(side)
        payloads = payloads_of(model)
        for n in args.shards:
            r = run(n, learners, model, payloads, duration_s, rss_limit_mb, args.min_versions,
                    timeout_s, quorum=args.quorum, flags=shlex.split(args.shard_flags))  # fmt: skip
            runs.append(r)
            print(
                f"{n} shard(s), {learners} learners, {model.params / 1e6:.0f} M params: "
                f"RSS/owned {r['rss_per_owned_model']:.2f}, {r['pushes_per_s']:.2f} pushes/s, "
                f"{r['cpu_s_per_gb'] or float('nan'):.2f} CPU s/GB, pull p50 "
                f"{r['pull_p50_s'] or float('nan'):.2f} s, errors {r['error_details']}, "
                f"retried {r['retried']}"
                f"{', RSS LIMIT HIT' if r['rss_limit_hit'] else ''}",
                flush=True,
            )
        del payloads
    report = {"runs": runs, "wall_s": time.perf_counter() - started, "quick": args.quick,
              "shard_flags": args.shard_flags}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {report['wall_s']:.0f} s")
    unmeasured = [r for r in runs if args.min_versions and r["pull_p50_s"] is None]
    bad = [r for r in runs if r["errors"] or r["rss_limit_hit"] or not r["pushes"]]
    return 1 if bad or unmeasured else 0


if __name__ == "__main__":
    sys.exit(main())
