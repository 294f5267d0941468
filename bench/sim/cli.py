"""The planning simulator: plan a DiLoCo-family run in virtual time (seconds, not hours).

    python -m bench.sim.cli all        # Table 4 + goodput curve -> bench/results/sim.json, PNGs
    python -m bench.sim.cli run --params 10e9 --layers 48 --step-time-s 0.8 \\
        --method streaming --fragments 16 --overlap 1 --codec fp4_e2m1 --bandwidth-gbps 2
    python -m bench.sim.cli sweep --params 10e9 --layers 48 --step-time-s 0.8 --islands 4 \\
        --method streaming --fragments 16 --overlap 1 --target 0.9
    python -m bench.sim.cli failures --chips 1200000 --failures-per-chip-year 1 --learners 8
    python -m bench.sim.cli shards     # aggregator shards for 95% utilisation, 10B and 100B
"""

from __future__ import annotations

import argparse
import time

from bench.sim import report, reproduce, shards
from bench.sim.goodput import FailureScenario, QuorumSetup, elastic_dp_goodput, quorum_goodput
from bench.sim.model import ModelSpec
from bench.sim.throughput import Method, Scenario, required_bandwidth, simulate


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.sim.cli", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    full = sub.add_parser("all", help="Table 4 and the goodput curve, with JSON and plots")
    full.add_argument("--out", default=str(report.RESULTS / "sim.json"))
    full.add_argument("--no-plots", action="store_true")
    for name in ("run", "sweep"):
        p = sub.add_parser(name, help="one scenario" if name == "run" else "bandwidth bisection")
        p.add_argument("--params", type=float, default=10e9)
        p.add_argument("--layers", type=int, default=48)
        p.add_argument("--vocab-size", type=int, default=32_000)
        p.add_argument("--step-time-s", type=float, default=0.8)
        p.add_argument("--islands", type=int, default=2, help="replicas in the all-reduce")
        p.add_argument("--latency-ms", type=float, default=0.0)
        p.add_argument("--method", choices=("dp", "diloco", "streaming"), default="streaming")
        p.add_argument("--sync-every-steps", "-H", type=int, default=100)
        p.add_argument("--fragments", "-P", type=int, default=0, help="0: layers / 3")
        p.add_argument("--overlap", type=int, default=0, help="tau, inner steps")
        p.add_argument("--codec", default="bf16")
        if name == "run":
            p.add_argument("--bandwidth-gbps", type=float, required=True)
        else:
            p.add_argument("--target", type=float, default=0.9)
    f = sub.add_parser("failures", help="goodput of elastic DP and quorum at one failure rate")
    f.add_argument("--chips", type=int, default=1_200_000)
    f.add_argument("--failures-per-chip-year", type=float, default=1.0)
    f.add_argument("--recovery-s", type=float, default=30.0)
    f.add_argument("--learners", type=int, default=8)
    f.add_argument("--min-quorum", type=int, default=0, help="0: half the learners")
    f.add_argument("--bandwidth-gbps", type=float, default=100.0)
    f.add_argument("--duration-h", type=float, default=2.0)
    s = sub.add_parser("shards", help="aggregator shards a target utilisation needs")
    s.add_argument("--learners", type=int, nargs="+", default=[8, 16, 64])
    s.add_argument("--cores", type=float, nargs="+", default=[1, 8], help="ingest cores/shard")
    s.add_argument("--nic-gbps", type=float, default=25.0, help="each shard's NIC")
    s.add_argument("--learner-gbps", type=float, default=100.0, help="each learner's link")
    s.add_argument("--cpu-s-per-gb", type=float, default=0.0, help="0: bench/results/ingest.json")
    s.add_argument("--sync-every-steps", "-H", type=int, default=100)
    s.add_argument("--fragments", "-P", type=int, default=0, help="0: layers / 3")
    s.add_argument("--overlap", type=int, default=5, help="tau, inner steps")
    s.add_argument("--codec", default="fp4_e2m1")
    s.add_argument("--target", type=float, default=0.95)
    s.add_argument("--rss-per-owned", type=float, default=4.0, help="RSS / owned fp32 bytes")
    s.add_argument("--shard-ram-gb", type=float, default=256.0)
    s.add_argument("--out", default=str(report.RESULTS / "sim_shards.json"))
    return ap


def _shards(args: argparse.Namespace) -> None:
    cpu_s_per_gb = args.cpu_s_per_gb or shards.measured_cpu_s_per_gb()
    tier = shards.ShardTier(
        shards=1,
        nic_bps=args.nic_gbps * 1e9,
        cpu_s_per_gb=cpu_s_per_gb,
        learner_bps=args.learner_gbps * 1e9,
    )
    method = Method(
        name="streaming",
        sync_every_steps=args.sync_every_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap,
        codec=args.codec,
    )
    memory = (args.rss_per_owned, args.shard_ram_gb * 1e9)
    rows = shards.plan_rows(
        shards.PLAN_MODELS, args.learners, args.cores, tier, method, args.target, memory
    )
    print(f"ingest {cpu_s_per_gb:.2f} CPU s per GB pushed; NIC {args.nic_gbps:g} Gbit/s per shard")
    print(shards.plan_text(rows, args.target))
    settings = {"cpu_s_per_gb": cpu_s_per_gb, "nic_gbps": args.nic_gbps, "target": args.target}
    settings |= {"rss_per_owned": args.rss_per_owned, "shard_ram_gb": args.shard_ram_gb}
    report.write_json({**settings, "rows": rows}, report.Path(args.out))
    print(f"wrote {args.out}")


def _method(args: argparse.Namespace) -> tuple[Scenario, Method]:
    spec = ModelSpec.of_size(args.params, args.layers, args.vocab_size)
    scenario = Scenario(
        spec=spec,
        step_time_s=args.step_time_s,
        replicas=args.islands,
        latency_s=args.latency_ms / 1e3,
    )
    if args.method == "dp":
        return scenario, Method(name="dp", codec=args.codec)
    fragments = 1 if args.method == "diloco" else (args.fragments or max(1, args.layers // 3))
    return scenario, Method(
        name=args.method,
        sync_every_steps=args.sync_every_steps,
        fragments=fragments,
        overlap_steps=args.overlap,
        codec=args.codec,
    )


def _all(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    rows = reproduce.table4_rows()
    print(report.table4_text(rows))
    problems, far = reproduce.ordering_problems(rows), reproduce.outside_factor(rows)
    print(f"ordering vs paper: {'same' if not problems else problems}")
    print(f"cells outside 2x of the paper: {far or 'none'}")
    curve = reproduce.goodput_curve()
    print(report.goodput_text(curve))
    wall_s = time.perf_counter() - started
    print(f"wall time {wall_s:.1f} s")
    payload = {
        "table4": rows,
        "table4_ordering_problems": problems,
        "table4_outside_2x": far,
        "goodput_curve": curve,
        "wall_s": wall_s,
    }
    report.write_json(payload, report.Path(args.out))
    if not args.no_plots:
        report.plot_table4(rows, report.RESULTS / "sim_table4.png")
        report.plot_goodput(curve, report.RESULTS / "sim_goodput.png")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "all":
            _all(args)
        elif args.command == "shards":
            _shards(args)
        elif args.command == "run":
            scenario, method = _method(args)
            r = simulate(scenario, method, args.bandwidth_gbps * 1e9)
            print(
                f"utilisation {r.utilisation:.1%}  "
                f"blocked {r.blocked_s_per_step * 1e3:.1f} ms/step  "
                f"link {r.bytes_per_link_per_step / 1e6:.1f} MB/step  "
                f"largest sync {r.largest_sync_bytes / 1e6:.1f} MB  "
                f"peak {r.peak_bandwidth_bps / 1e9:.2f} Gbit/s  "
                f"mean {r.mean_bandwidth_bps / 1e9:.2f} Gbit/s"
            )
        elif args.command == "sweep":
            scenario, method = _method(args)
            bps = required_bandwidth(scenario, method, args.target)
            print(f"{bps / 1e9:.3g} Gbit/s per island link for {args.target:.0%} utilisation")
        else:
            scenario = FailureScenario(
                chips=args.chips,
                failures_per_chip_year=args.failures_per_chip_year,
                recovery_s=args.recovery_s,
                duration_s=args.duration_h * 3600,
            )
            dp = elastic_dp_goodput(scenario)
            q = quorum_goodput(
                scenario,
                QuorumSetup(
                    learners=args.learners,
                    min_quorum=args.min_quorum,
                    bandwidth_bps=args.bandwidth_gbps * 1e9,
                ),
            )
            print(
                f"elastic DP goodput {dp.goodput:.1%}; quorum ({args.learners} learners) "
                f"goodput {q.goodput:.1%}, uptime {q.uptime:.1%}, {q.failures} failures"
            )
    except ValueError as err:  # a bad setting: one sentence, no traceback
        raise SystemExit(f"bench.sim.cli: {err}") from None


if __name__ == "__main__":
    main()
