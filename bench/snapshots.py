"""Snapshot benchmark: what writing a state-dir snapshot costs a shard while it serves.

    python bench/snapshots.py --quick   # 134 M params, 30 s measured: about a minute
    python bench/snapshots.py           # 537 M params on one shard, 240 s measured

One `diloco-server` (bench/scale.py's shard: quorum mode, K = half the learners, P = 4
fragments of two side x side fp32 tensors each, fp4 pulls) with a state dir and a snapshot
every --every-versions closed rounds (each fragment's round counts), under bench/scale.py's
simulated learners (threads pushing a pre-encoded fp4 pseudo-gradient, waiting for the round,
pulling its update) and three probes: a heartbeat every 50 ms from a process of its own (as a
learner's comes), the scale probe's pull of one available update of each fragment every
0.5 s, and a thread that lists the state dir every 10 ms and records when each
`snapshot-<n>.tmp/` appeared and went (renamed to `snapshot-<n>/` when whole), and then the
whole snapshot's bytes.

One run, its time split by the snapshots: a call (start, end) that overlaps a window in which
a .tmp dir existed is "during", any other "without". Both classes come from the same server
at the same time, interleaved, so they share the load, the machine's other work and the
write-ahead log's fsync of every round (an fp32 mean per version: as many bytes a round as the
fragment's parameters); a second run without a state dir would have charged that log to the
snapshots too, and drifted with whatever else the machine did between the runs.

In bench/results/snapshots.json (--quick: snapshots_quick.json):
  snapshot_mb_s        bytes of the complete snapshot dirs / the time their .tmp dirs lived
                       (the whole write: each fragment's state copied under the lock, its
                       safetensors and update chains written and fsynced, CRCs, the manifest
                       and the rename); metric_snapshot_s is the server's own timer
                       (diloco_server_snapshot_write_seconds _sum / _count over the window)
  disk_mb_s            this process writing as many bytes as the largest snapshot to one file
                       in 256 MiB blocks (as the writer), then fsync, in the state dir's
                       parent on the same filesystem, after the server stopped (then
                       deleted), the faster of through the page cache and O_DIRECT;
                       MB = 1e6 bytes
  disk_serving_mb_s    the same write while the server still serves the learners, between two
                       snapshots (None if a snapshot overlapped three tries): the disk and the
                       CPUs as busy as a snapshot finds them, less the snapshot itself
  write_vs_disk        snapshot_mb_s / disk_mb_s (target >= 0.5); write_vs_disk_serving
                       snapshot_mb_s / disk_serving_mb_s
  writer_alone_mb_s    the snapshot writer alone on the idle machine, after the run: four
                       fragments of the server's shapes through formats.prepare_fragment and
                       write_fragment (as a snapshot: the copy, safetensors, update chains,
                       CRCs, fsyncs);
                       writer_alone_vs_disk = writer_alone_mb_s / disk_mb_s
  heartbeat, push, pull  p50 / p99 (nearest rank) and count, during and without; a push is
                       a learner's whole call, retries after a retry hint included
  ingest_during_per_s, ingest_without_per_s  pushes accepted (a push's end) inside / outside
                       the windows, per second of each; ingest_ratio = during / without
                       (target >= 0.8). A snapshot starts as a round closes, when learners
                       pull and push again: ingest_same_phase_per_s counts the pushes in
                       windows as long as the median snapshot that start at the round closes
                       (as the watchers saw them) that started none, and
                       ingest_ratio_same_phase = during / that
Targets at full size: heartbeat p99 during a snapshot <= 0.1 s, ingest_ratio >= 0.8,
write_vs_disk >= 0.5. --quick measures alike on a smaller model.

Full size (side 8192): the server's RSS peaks at about 3.5 fp32 models (about 7.5 GB, as in
bench/results/scale.json) plus one fragment's state while a snapshot copies it, and this
process at 1-2 GB; the run stops early (`rss_limit_hit`) past --rss-limit-gb. Disk: two kept
snapshots and one being written (at most 10-14 bytes a parameter each) with their logs
(every-versions x 4 bytes a fragment's parameter each): about 32 GB at the defaults; the run
refuses to start with less free.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from threading import Thread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procfs  # noqa: E402
from bench.disk_speed import disk_write_s, write_between_snapshots, writer_alone_s  # noqa: E402
from bench.scale import FULL_SIDE, payloads_of, start_shards  # noqa: E402
from bench.scale_fleet import FRAGMENTS, Fleet, Model  # noqa: E402
from bench.snapshot_probes import SnapshotWatch, start_heartbeat_probe  # noqa: E402
from deploy.launcher import read_port_file, stop_all  # noqa: E402
from deploy.prometheus_api import scrape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_SIDE, QUICK_RUN_S, PULL_PROBE_EVERY_S = 4096, 30.0, 0.5
# Disk need per parameter: three snapshots (two kept, one being written) of at most fp32
# parameters, momentum and residual in fp32 and the update chains (update_log_fraction 0.5).
SNAPSHOT_BYTES_PER_PARAM = 4 + 4 + 4 + 2
METRIC = "diloco_server_snapshot_write_seconds"


def run(args: argparse.Namespace, model: Model) -> dict:
    """One server under load with snapshots; see the module docstring."""
    n = args.learners
    quorum = args.quorum or max(1, n // 2)
    initial, pushes = payloads_of(model)
    workdir = Path(tempfile.mkdtemp(prefix="diloco-snapshots-", dir=args.dir))
    state_dir = workdir / "state"
    flags = [
        "--state-dir",
        str(state_dir),
        "--snapshot-every-versions",
        str(args.every_versions),
        "--metrics-listen",
        "127.0.0.1:0",
        "--metrics-port-file",
        str(workdir / "metrics"),
        *shlex.split(args.shard_flags),
    ]
    begun = time.perf_counter()
    daemons = start_shards(1, quorum, workdir, flags)
    pid, metrics_port = daemons[0].pid, read_port_file(workdir / "metrics")
    address = f"127.0.0.1:{daemons[0].port}"
    fleet = Fleet([address], model, args.learners)
    threads: list[threading.Thread] = []
    heartbeats: list[tuple[float, float]] = []  # the probe process's calls
    limit_hit, peak_mb = False, procfs.rss_mb(pid)
    rss_limit_mb = 1024 * (args.rss_limit_gb or 0.8 * available_gb())
    try:
        fleet.join_all(initial)
        setup_s = time.perf_counter() - begun
        started = time.perf_counter()
        deadline = started + args.duration_s
        watch = SnapshotWatch(state_dir, deadline)
        every = list(range(FRAGMENTS))  # one shard owns them all
        threads = [Thread(target=fleet.push_loop, args=(i, every, pushes)) for i in range(n)]
        threads += [Thread(target=fleet.watch_loop, args=(f,)) for f in every]
        threads.append(Thread(target=fleet.probe_loop, args=(PULL_PROBE_EVERY_S,)))
        before = scrape(metrics_port) if metrics_port else None
        cpu_before = procfs.cpu_s(pid)
        probe = start_heartbeat_probe(fleet, address, args.duration_s)
        watch.start()
        for thread in threads:
            thread.daemon = True  # closing the channels ends them (Fleet.close)
            thread.start()
        while not limit_hit and time.perf_counter() < deadline:
            rss = procfs.rss_mb(pid)
            peak_mb = max(peak_mb, rss)
            limit_hit = rss + procfs.rss_mb(os.getpid()) > rss_limit_mb
            time.sleep(0.25)
        ended = time.perf_counter()
        after = scrape(metrics_port) if metrics_port else None
        cpu_s = procfs.cpu_s(pid) - cpu_before
        watch.stop.set()
        watch.join(timeout=5)
        largest = max((w["bytes"] for w in watch.windows if w["bytes"]), default=0)
        loaded_disk_s = write_between_snapshots(state_dir, workdir, largest) if largest else None
        probed = json.loads(probe.communicate(timeout=60)[0])
        heartbeats = [tuple(span) for span in probed["spans"]]
        if probed["errors"]:
            fleet.errors["heartbeat"] = probed["errors"]
    finally:
        fleet.close(threads)
        stop_all(daemons)
        shutil.rmtree(state_dir, ignore_errors=True)  # gigabytes; the logs stay on a failure
    disk_bytes = largest or model.params * 10
    disk_s = disk_write_s(workdir, disk_bytes)
    alone_bytes, alone_s = writer_alone_s(workdir, model)
    shutil.rmtree(workdir, ignore_errors=True)
    return figures(watch.windows, fleet, heartbeats, (started, ended)) | {
        "disk_mb_s": disk_bytes / disk_s / 1e6,
        "disk_serving_mb_s": disk_bytes / loaded_disk_s / 1e6 if loaded_disk_s else None,
        "disk_test_bytes": disk_bytes,
        "writer_alone_mb_s": alone_bytes / alone_s / 1e6,
        "metric_snapshot_s": metric_mean(before, after),
        "model_params": model.params,
        "learners": args.learners,
        "quorum": quorum,
        "every_versions": args.every_versions,
        "duration_s": ended - started,
        "setup_s": setup_s,
        "server_cpu_s": cpu_s,
        "server_peak_rss_mb": peak_mb,
        "bench_peak_rss_mb": procfs.peak_rss_mb(),
        "errors": fleet.errors,
        "error_details": fleet.error_details,
        "retried": fleet.retried,
        "rss_limit_hit": limit_hit,
    }


def figures(windows: list[dict], fleet: Fleet, heartbeats: list, measured: tuple) -> dict:
    """The snapshot speed, latencies and ingest, during and without (module docstring)."""
    started, ended = measured
    spans = [(max(w["start_s"], started), min(w["end_s"], ended)) for w in windows]
    during_s = sum(e - s for s, e in spans)
    complete = [w for w in windows if w["bytes"]]
    out: dict = {
        "snapshots": len(complete),
        "snapshot_bytes": [w["bytes"] for w in complete],
        "snapshot_s": [w["end_s"] - w["start_s"] for w in complete],
        "snapshot_time_fraction": during_s / (ended - started),
    }
    write_s = sum(out["snapshot_s"])
    out["snapshot_mb_s"] = sum(out["snapshot_bytes"]) / write_s / 1e6 if write_s else None

    def overlaps(s: float, e: float) -> bool:
        return any(s < we and e > ws for ws, we in spans)

    for name, calls in (
        ("heartbeat", heartbeats),
        ("push", fleet.push_spans),
        ("pull", fleet.pull_spans),
    ):
        calls = [(s, e) for s, e in calls if s >= started and e <= ended]
        for cls, inside in (("during", True), ("without", False)):
            latencies = sorted(e - s for s, e in calls if overlaps(s, e) == inside)
            p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
            out[f"{name}_{cls}"] = {"p50_s": p50, "p99_s": p99, "n": len(latencies)}
    accepted = [e for _, e in fleet.push_spans if started <= e <= ended]
    inside = sum(any(ws <= e <= we for ws, we in spans) for e in accepted)
    out["ingest_during_per_s"] = inside / during_s if during_s else None
    without_s = ended - started - during_s
    out["ingest_without_per_s"] = (len(accepted) - inside) / without_s if without_s else None
    out |= same_phase_ingest(spans, fleet.closes, accepted, measured)
    return out


def same_phase_ingest(spans: list, closes: list[float], accepted: list[float], measured) -> dict:
    """Ingest in the same phase of the rounds, with and without a snapshot: a snapshot starts
    as a round closes, when the learners pull rather than push, so "without" here counts the
    pushes accepted in windows as long as the median snapshot that start at the round
    closes that started none (and overlap none), per second of them."""
    if not spans:
        return {}
    length = statistics.median(e - s for s, e in spans)
    started, ended = measured
    free = [
        (c, c + length)
        for c in closes
        if started <= c and c + length <= ended
        and not any(c < we and c + length > ws for ws, we in spans)
    ]  # fmt: skip
    if not free:
        return {}
    merged: list[list[float]] = []  # the windows may overlap: count each push once
    for s, e in sorted(free):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    seconds = sum(e - s for s, e in merged)
    count = sum(any(s <= t <= e for s, e in merged) for t in accepted)
    return {"ingest_same_phase_per_s": count / seconds, "same_phase_windows": len(free)}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    return values[math.ceil(q * len(values)) - 1] if values else None


def metric_mean(before, after) -> float | None:
    """The server's mean snapshot write time over the window, from its histogram."""
    if before is None or after is None:
        return None
    count = after.value(f"{METRIC}_count") - before.value(f"{METRIC}_count")
    total = after.value(f"{METRIC}_sum") - before.value(f"{METRIC}_sum")
    return total / count if count > 0 else None


def available_gb() -> float:
    return procfs.field_kib("/proc/meminfo", "MemAvailable") / 2**20


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(r: dict) -> dict:
    """The ratios, and the table printed."""
    r["write_vs_disk"] = ratio(r["snapshot_mb_s"], r["disk_mb_s"])
    r["write_vs_disk_serving"] = ratio(r["snapshot_mb_s"], r["disk_serving_mb_s"])
    r["writer_alone_vs_disk"] = ratio(r["writer_alone_mb_s"], r["disk_mb_s"])
    r["ingest_ratio"] = ratio(r["ingest_during_per_s"], r["ingest_without_per_s"])
    r["ingest_ratio_same_phase"] = ratio(r["ingest_during_per_s"], r.get("ingest_same_phase_per_s"))
    f = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
    sizes = r["snapshot_bytes"]
    median_mb = statistics.median(sizes) / 1e6 if sizes else None
    median_s = statistics.median(r["snapshot_s"]) if sizes else None
    print(
        f"{r['model_params'] / 1e6:.0f} M params, {r['learners']} learners (K {r['quorum']}), "
        f"a snapshot every {r['every_versions']} versions, {r['duration_s']:.0f} s measured, "
        f"{r['snapshots']} snapshots ({100 * r['snapshot_time_fraction']:.0f}% of the time)"
    )
    print(
        f"snapshot write {f(r['snapshot_mb_s'], '.0f')} MB/s (median {f(median_mb, '.0f')} MB "
        f"in {f(median_s, '.2f')} s; server timer {f(r['metric_snapshot_s'], '.2f')} s), "
        f"disk {r['disk_mb_s']:.0f} MB/s: ratio {f(r['write_vs_disk'], '.2f')} (target >= 0.5); "
        f"disk while serving {f(r['disk_serving_mb_s'], '.0f')} MB/s: ratio "
        f"{f(r['write_vs_disk_serving'], '.2f')}; the writer alone, idle, "
        f"{r['writer_alone_mb_s']:.0f} MB/s: {f(r['writer_alone_vs_disk'], '.2f')} of the disk"
    )
    head = f"{'during p50':>10} {'p99':>7} {'n':>5}   {'without p50':>11} {'p99':>7} {'n':>5}"
    print(f"{'':10} {head}   p99 ratio")
    for name in ("heartbeat", "push", "pull"):
        d, w = r[f"{name}_during"], r[f"{name}_without"]
        print(
            f"{name:10} {f(d['p50_s']):>10} {f(d['p99_s']):>7} {d['n']:>5}   "
            f"{f(w['p50_s']):>11} {f(w['p99_s']):>7} {w['n']:>5}   "
            f"{f(ratio(d['p99_s'], w['p99_s']), '.2f')}"
        )
    print(
        f"ingest     {f(r['ingest_during_per_s'], '.2f')} pushes/s during, "
        f"{f(r['ingest_without_per_s'], '.2f')} without: ratio {f(r['ingest_ratio'], '.2f')} "
        f"(target >= 0.8); against windows as long that start at round closes without a "
        f"snapshot, {f(r.get('ingest_same_phase_per_s'), '.2f')}: ratio "
        f"{f(r['ingest_ratio_same_phase'], '.2f')}; errors {r['error_details'] or 'none'}, "
        f"retried {r['retried']}"
        f"{', RSS LIMIT HIT' if r['rss_limit_hit'] else ''}"
    )
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="134 M params, 30 s: about a minute")
    parser.add_argument("--side", type=int, help="8 x side^2 params (default 8192: 537 M)")
    parser.add_argument("--duration-s", type=float, default=240.0, help="measured")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--quorum", type=int, default=0, help="learners a round needs (0: half)")
    parser.add_argument("--every-versions", type=int, default=8, help="closed rounds a snapshot")
    parser.add_argument("--shard-flags", default="", help="more diloco-server flags")
    parser.add_argument(
        "--dir",
        type=Path,
        help="where the state dir goes (its filesystem is "
        "the one measured); default: the system's temporary directory",
    )
    parser.add_argument("--rss-limit-gb", type=float, default=0.0, help="0: 0.8 x MemAvailable")
    parser.add_argument(
        "--out", type=Path, help="default: snapshots.json, --quick snapshots_quick.json"
    )
    args = parser.parse_args()
    if args.learners < 1 or args.every_versions < 1:
        parser.error("--learners and --every-versions must be >= 1")
    if args.quick:
        args.duration_s = QUICK_RUN_S
    model = Model(args.side or (QUICK_SIDE if args.quick else FULL_SIDE))
    parent = args.dir or Path(tempfile.gettempdir())
    logs = 3 * args.every_versions * 4 / FRAGMENTS  # the logs kept, bytes a parameter
    need_gb = model.params * (3 * SNAPSHOT_BYTES_PER_PARAM + logs) / 1e9
    if (free_gb := shutil.disk_usage(parent).free / 1e9) < need_gb:
        parser.error(
            f"{parent} has {free_gb:.0f} GB free and the state dir may need {need_gb:.0f} GB: "
            "give --dir on a larger disk, or a smaller --side"
        )
    out = args.out or RESULTS / ("snapshots_quick.json" if args.quick else "snapshots.json")
    started = time.perf_counter()
    r = report(run(args, model))
    r |= {
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
        "shard_flags": args.shard_flags,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out} in {r['wall_s']:.0f} s")
    return 1 if r["errors"] or r["rss_limit_hit"] or not r["snapshots"] else 0


if __name__ == "__main__":
    sys.exit(main())
