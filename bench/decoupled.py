"""Does quorum mode beat sync mode in wall-clock when one learner is slow and one keeps dying?

    python bench/decoupled.py            # 2 x 240 s
    python bench/decoupled.py --quick    # 2 x 100 s (under 5 minutes with start-up)

K = 4 learners as real processes against a real server (deploy/cluster.py, P = 2):
learner-3 runs 2x slower, learner-2 is killed (kill -9) every --kill-every-s and restarted
at once. Every learner pads its steps with idle time (--slowdown 3, the slow one 6), so the
four together need about one core: each then runs at its own speed as if on its own machine.
Without that, on a 2-core host a learner waiting in sync mode frees the CPU for the others
and makes waiting look cheaper than it is on separate machines. The same setup runs in
`sync` mode and in `quorum` mode (K = 1 plus the grace window; with dynamic local updates, so
the slow learner syncs after half as many of its own steps, unless
--no-dynamic-local-updates). Reported for each mode:

- the eval loss of the global parameters against wall-clock time, as learner-0 reports it
  (full speed, never killed; mean of its last 3 evaluations, since one eval set is small);
- time to a target loss: the higher of the two modes' final losses, so both reach it;
  speedup_quorum_vs_sync = time(sync) / time(quorum);
- goodput = useful tokens / capacity tokens. Useful: tokens carried by closed rounds (the
  server's merged-tokens counter). Capacity: for each learner, its own compute speed (tokens
  per compute second, its slowdown included) times the run's length less its evaluation
  time, i.e. what it would have trained had it never waited, died or restarted.

Every figure comes from the daemons' Prometheus endpoints (deploy/watch.py) and the
learners' summary files. Writes bench/results/decoupled.json and decoupled.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.plotting import pyplot  # noqa: E402
from deploy.cluster import Cluster  # noqa: E402
from deploy.watch import LearnerPoint, ServerPoint, Watch, counter_total, eval_points  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LEARNERS = 4
FRAGMENTS = 2
SLOW, KILLED, WATCHED = 3, 2, 0
PACE = 3  # every step takes 3x its compute time (the slow learner's 6x): see the docstring


def round_stats(server: list[ServerPoint]) -> dict:
    """How full the rounds were and how stale the pushes: the cost of drifting out of phase.

    Staleness of a push = versions its fragment had moved past the push's base when it
    arrived (the server discounts such a contribution by 1/(1 + staleness))."""
    rounds, pushes = counter_total(server, "rounds"), counter_total(server, "pushes")
    return {
        "rounds": int(rounds),
        "mean_contributors": counter_total(server, "contributions") / max(1, rounds),
        "pushes": int(pushes),
        "mean_staleness": counter_total(server, "staleness") / max(1, pushes),
        "mean_discount": counter_total(server, "discount") / max(1, pushes),
    }


def run_mode(
    mode: str, workdir: Path, duration_s: float, kill_every_s: float, dynamic: bool
) -> dict:
    pace = {i: ["--slowdown", str(PACE * (2 if i == SLOW else 1))] for i in range(LEARNERS)}
    if dynamic and mode != "sync":
        for flags in pace.values():
            flags.append("--dynamic-local-updates")
    cluster = Cluster(workdir, LEARNERS, FRAGMENTS, mode=mode, learner_flags=pace)
    cluster.start()
    watch = Watch(cluster.daemons, cluster.now)
    watch.start()
    kills = 0
    try:
        next_kill = kill_every_s
        while cluster.now() < duration_s:
            if cluster.now() >= next_kill:
                cluster.learners[KILLED].kill()
                cluster.start_learner(KILLED)
                kills += 1
                next_kill += kill_every_s
            time.sleep(0.2)
    finally:
        cluster.stop_learners()
        watch.stop()  # after the learners' last merges, before the server goes
        cluster.stop()
    wall_s = cluster.now()  # from before the start to after the stop
    round_tokens = counter_total(watch.server, "merged_tokens")
    capacity = 0.0
    for i in range(LEARNERS):
        summary = json.loads((workdir / f"learner-{i}.json").read_text())
        speed = summary["tokens"] / max(summary["compute_s"], 1e-9)
        eval_share = summary["eval_s"] / max(summary["train_wall_s"], 1e-9)
        capacity += speed * wall_s * (1 - eval_share)
    return {
        "mode": mode,
        "kills": kills,
        "wall_s": wall_s,
        "curve": eval_curve(watch.learners.get(f"learner-{WATCHED}", [])),
        "useful_tokens": int(round_tokens) // FRAGMENTS,
        "capacity_tokens": int(capacity),
        "goodput": round_tokens / FRAGMENTS / capacity,
        "round_stats": round_stats(watch.server),
    }


def eval_curve(points: list[LearnerPoint]) -> list[tuple[float, float]]:
    """(seconds since start, mean of the last 3 eval losses) at each evaluation."""
    curve, recent = [], []
    for t, loss in eval_points(points):
        recent = [*recent[-2:], loss]
        curve.append((t, sum(recent) / len(recent)))
    return curve


def time_to(curve: list[tuple[float, float]], target: float) -> float:
    return next((t for t, loss in curve if loss <= target), float("inf"))


def plot(results: dict[str, dict], target: float, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, result in results.items():
        t, loss = zip(*result["curve"], strict=True)
        ax.plot(t, loss, label=f"{mode} (goodput {result['goodput']:.2f})")
    ax.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("eval loss (global parameters, learner-0)")
    ax.set_title("K=4, one learner 2x slower, one killed periodically")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=240.0, help="per mode")
    parser.add_argument("--kill-every-s", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="100 s per mode, a kill every 40 s")
    parser.add_argument("--out", type=Path, default=RESULTS / "decoupled.json")
    parser.add_argument(
        "--no-dynamic-local-updates",
        dest="dynamic",
        action="store_false",
        help="quorum learners keep H steps per sync whatever their speed",
    )
    args = parser.parse_args()
    if args.quick:
        args.duration_s, args.kill_every_s = 100.0, 40.0
    root = Path(tempfile.mkdtemp(prefix="diloco-decoupled-"))
    print(f"workdir {root}", flush=True)
    results = {}
    for mode in ("sync", "quorum"):
        print(f"running {mode} for {args.duration_s:.0f} s", flush=True)
        results[mode] = run_mode(
            mode, root / mode, args.duration_s, args.kill_every_s, args.dynamic
        )
    finals = {mode: r["curve"][-1][1] for mode, r in results.items()}
    target = max(finals.values())
    times = {mode: time_to(r["curve"], target) for mode, r in results.items()}
    report = {
        "quick": args.quick,
        "duration_s": args.duration_s,
        "kill_every_s": args.kill_every_s,
        "dynamic_local_updates_in_quorum": args.dynamic,
        "target_eval_loss": target,
        "final_eval_loss": finals,
        "time_to_target_s": times,
        "speedup_quorum_vs_sync": times["sync"] / times["quorum"],
        "goodput_quorum": results["quorum"]["goodput"],
        "goodput_sync": results["sync"]["goodput"],
        "modes": results,
    }
    print(
        f"\n{'mode':<8} {'final loss':>10} {'t->target s':>12} {'goodput':>8} {'kills':>6} "
        f"{'rounds':>7} {'per round':>9} {'staleness':>9}"
    )
    for mode, r in results.items():
        rs = r["round_stats"]
        print(
            f"{mode:<8} {finals[mode]:>10.4f} {times[mode]:>12.1f} {r['goodput']:>8.3f} "
            f"{r['kills']:>6} {rs['rounds']:>7} {rs['mean_contributors']:>9.2f} "
            f"{rs['mean_staleness']:>9.2f}"
        )
    print(f"target {target:.4f}; speedup quorum vs sync {report['speedup_quorum_vs_sync']:.2f}x")
    checks = {
        "quorum >= 1.4x faster to target": report["speedup_quorum_vs_sync"] >= 1.4,
        "quorum goodput >= 0.85": report["goodput_quorum"] >= 0.85,
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    report["checks"] = checks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(results, target, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
