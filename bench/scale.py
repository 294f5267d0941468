"""Scale benchmark: a 537 M-parameter model over 1, 2 and 4 aggregator shards on loopback.

    python bench/scale.py --quick      # 34 M params, 8 learners, 1/2/4 shards: < 3 min
    python bench/scale.py              # 537 M params, 8 learners; 134 M, 64 learners

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
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procfs  # noqa: E402
from common.codec import codec_id, encode_values  # noqa: E402
from common.fragment_wire import fragment_parts  # noqa: E402
from common.generated.diloco.v1 import aggregator_pb2 as pb  # noqa: E402
from common.retry import Stopped, call_with_retry  # noqa: E402
from common.rpc import LEARNER_ID_HEADER  # noqa: E402
from deploy.launcher import SERVER, Daemon, start_daemon, stop_all, wait_for_port_file  # noqa: E402
from learner.shards import ShardedClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FRAGMENTS = 4
TENSORS = 8  # two per fragment
PULLS_AT_ONCE = 16
FULL_SIDE, QUICK_SIDE = 8192, 2048  # 8 x side^2 parameters: 537 M, 34 M
QUICK_RUN_S = (10.0, 60.0)  # --quick: measured, then at most this much more for every figure
PER_SHARD = ("owned_fragments", "owned_mb", "idle_rss_mb", "peak_rss_mb", "rss_per_owned_model")


@dataclass(frozen=True)
class Model:
    """TENSORS square fp32 matrices of `side` x `side`, two per fragment."""

    side: int

    @property
    def specs(self) -> list[pb.ParamSpec]:
        shape = [self.side, self.side]
        return [pb.ParamSpec(name=f"w{i}", shape=shape, dtype="float32") for i in range(TENSORS)]

    @property
    def params(self) -> int:
        return TENSORS * self.side * self.side


class Fleet:
    """The simulated learners of one run and what they measured."""

    def __init__(self, addresses: list[str], model: Model, learners: int) -> None:
        self.addresses, self.model, self.learners = addresses, model, learners
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pushes = 0
        self.pull_latencies: list[float] = []
        self.errors: dict[str, int] = {}
        self.error_details: dict[str, str] = {}  # the first message of each code
        self.retried: dict[str, int] = {}  # pushes tried again, by the status that refused them
        self.sessions: list[str] = []
        self.clients: list[ShardedClient] = []
        self.latest = [0] * FRAGMENTS  # the newest version of each fragment (watch_loop)
        self.advanced = threading.Condition(self.lock)
        # Pull answers held at once in this process: 64 learners x 4 shards taking a 17 MB
        # update each at the same moment would hold gigabytes here, not in the servers.
        self.pulls = threading.BoundedSemaphore(PULLS_AT_ONCE)

    def client(self, i: int) -> ShardedClient:
        return ShardedClient(self.addresses, None, ((LEARNER_ID_HEADER, f"scale-{i}"),))

    def join_all(self, initial: list[bytes]) -> list[list[int]]:
        """Join every learner on every shard; learner 0 initialises each fragment. Returns
        the owner shard's fragments, per shard."""
        for i in range(self.learners + 1):  # the last: the probe, a learner that never pushes
            client = self.client(i)
            client.wait_ready(60)
            reply = client.join(f"scale-{i}", self.model.specs)
            self.clients.append(client)
            self.sessions.append(reply.session_id)
            if i == 0:
                for f in range(FRAGMENTS):
                    header = pb.PushHeader(
                        session_id=reply.session_id, fragment_id=f, base_version=-1,
                        kind=pb.PUSH_KIND_INITIAL,
                    )  # fmt: skip
                    client.push(header, initial[f])
        owned: list[list[int]] = [[] for _ in self.addresses]
        for f in range(FRAGMENTS):
            owned[self.clients[0].shard_of(f)].append(f)
        return owned

    def settled(self, min_versions: int) -> bool:
        """Every fragment has reached `min_versions` and, if that is at least 1, the probe
        has timed a pull."""
        with self.lock:
            reached = min(self.latest) >= min_versions
            return reached and (min_versions < 1 or bool(self.pull_latencies))

    def bytes_sent(self) -> int:
        """Bytes the learners handed to their channels (pushes, as they stream)."""
        return sum(client.traffic.sent for client in self.clients)

    def count_error(self, err: grpc.RpcError | ValueError) -> None:
        code = err.code().name if isinstance(err, grpc.RpcError) else type(err).__name__
        detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
        with self.lock:
            self.errors[code] = self.errors.get(code, 0) + 1
            self.error_details.setdefault(code, str(detail))

    def count_retry(self, err: grpc.RpcError, _delay_s: float) -> None:
        with self.lock:
            self.retried[err.code().name] = self.retried.get(err.code().name, 0) + 1

    def push_loop(self, i: int, fragments: list[int], payloads: list[bytes]) -> None:
        """One learner's thread for one shard: push each fragment, wait for the round it joined."""
        client, session = self.clients[i], self.sessions[i]
        versions, rounds = dict.fromkeys(fragments, 0), dict.fromkeys(fragments, 0)
        try:
            while not self.stop.is_set():
                for f in fragments:
                    header = pb.PushHeader(
                        session_id=session, fragment_id=f, base_version=versions[f],
                        inner_steps=50, tokens=50 * 2048, kind=pb.PUSH_KIND_DELTA,
                    )  # fmt: skip
                    # As a learner's sync thread does: a refusal with a retry hint (the
                    # push memory budget is in use) or a deadline is tried again.
                    answer = call_with_retry(
                        lambda h=header, f=f: client.push(h, payloads[f]), self.stop,
                        self.count_retry,
                    )  # fmt: skip
                    rounds[f] = answer.round_version
                    with self.lock:
                        self.pushes += 1
                for f in fragments:
                    with self.advanced:  # a watcher long-polls; learners wait here
                        while self.latest[f] < rounds[f] and not self.stop.is_set():
                            self.advanced.wait(1.0)
                    with self.pulls:  # the update, as a learner takes it at its merge
                        head, _ = client.pull(session, f, versions[f], self.latest[f], 0.0)
                    versions[f] = head.version
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)
        except Stopped:
            pass

    def watch_loop(self, f: int) -> None:
        """Long-poll one fragment's next version and wake the learners waiting for it."""
        client, session = self.clients[-1], self.sessions[-1]
        version = 0
        try:
            while not self.stop.is_set():
                head, _ = client.pull(session, f, version, version + 1, 5.0)
                if head.version > version:
                    version = head.version
                    with self.advanced:
                        self.latest[f] = version
                        self.advanced.notify_all()
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)

    def probe_loop(self) -> None:
        """Once a second, pull one available update of each fragment and time it, on
        channels of its own (a learner's are busy with its pushes)."""
        client, session = self.clients[-1], self.sessions[-1]
        try:
            while not self.stop.wait(1.0):
                for f in range(FRAGMENTS):
                    version = self.latest[f]
                    if version < 1:
                        continue
                    started = time.perf_counter()
                    client.pull(session, f, version - 1, version, 0.0)
                    with self.lock:
                        self.pull_latencies.append(time.perf_counter() - started)
        except (grpc.RpcError, ValueError) as err:  # ValueError: a channel closed at the end
            if not self.stop.is_set():
                self.count_error(err)


# Every shard alike: quorum rounds with a short grace window, no staleness refusals (pushes
# that miss a round join the next), leases that outlast a run, the servers' own layout.
SHARD_FLAGS = [
    "--insecure", "--listen", "127.0.0.1:0", "--mode", "quorum", "--grace-max-s", "0.5",
    "--max-staleness", "1000000", "--lease-s", "600", "--fragments", str(FRAGMENTS),
    "--layout", "balanced", "--log-level", "WARNING",
]  # fmt: skip


def start_shards(count: int, quorum: int, workdir: Path) -> list[Daemon]:
    """Start every shard at once (most of a start is importing torch), then wait for each."""
    shards: list[Daemon] = []
    try:
        for i in range(count):
            argv = [*SERVER, *SHARD_FLAGS, "--min-contributors", str(quorum)]
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
    quorum: int = 0,
) -> dict:  # fmt: skip
    """One run: `shards` servers, `learners` simulated learners, `duration_s` measured (and
    on until every fragment reached `min_versions` and a pull was timed, within `timeout_s`
    more). A round closes once `quorum` learners pushed (0: half) and 0.5 s of grace end."""
    quorum = quorum or max(1, learners // 2)
    initial, pushes = payloads
    begun = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="diloco-scale-"))
    daemons = start_shards(shards, quorum, workdir)
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
    finally:
        # Closing the channels cancels the calls in flight, so the threads end at once.
        fleet.stop.set()
        with fleet.advanced:
            fleet.advanced.notify_all()
        for client in fleet.clients:
            client.close()
        for thread in threads:
            thread.join(timeout=30)
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
        "pull_p50_s": statistics.median(latencies) if latencies else None,
        "pull_p99_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
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
    parser.add_argument("--many-side", type=int, default=4096, help="(4096: 134 M params)")
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
                    timeout_s, quorum=args.quorum)  # fmt: skip
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
    report = {"runs": runs, "wall_s": time.perf_counter() - started, "quick": args.quick}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {report['wall_s']:.0f} s")
    unmeasured = [r for r in runs if args.min_versions and r["pull_p50_s"] is None]
    bad = [r for r in runs if r["errors"] or r["rss_limit_hit"] or not r["pushes"]]
    return 1 if bad or unmeasured else 0


if __name__ == "__main__":
    sys.exit(main())
