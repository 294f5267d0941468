"""`make wan-sim` (root): learners behind slow WAN links, streaming+fp4 vs per-step sync.

    python deploy/wan_sim.py --link-mbit 20 --delay-ms 50 --duration-s 60

Builds network namespaces, one for the server and one per learner, each learner joined to the
server by a veth pair shaped with `tbf` to --link-mbit in both directions, plus --delay-ms of
one-way latency from a small proxy of ours in the server's namespace (netem is unavailable).
Then runs the same learners twice over the same links:

- streaming+fp4: Streaming DiLoCo as `make run` trains it (P=2, H=50, 4-bit pushes and
  pulls) but with τ = --overlap-steps (default 5, the top of the paper's range: a sync must
  cross the link twice plus two round trips of latency while training goes on);
- dp: per-step data-parallel sync through the same server (H=1, one fragment, fp32 both
  ways, waiting for the result every step, as all-reduce would).

Reports compute utilisation per learner (inner-step compute seconds / training wall seconds,
evaluation excluded) and bytes per link counted by the kernel (tbf's counters), and writes
bench/results/wan.json. Traffic stays inside the namespaces it creates; they are deleted at
the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from deploy.launcher import Daemon, start_daemon, stop_all  # noqa: E402

RESULTS = REPO / "bench" / "results" / "wan.json"
SUBNET = "10.231"  # inside namespaces this script creates, never routed anywhere else
GRPC_PORT = 50051
TAG = f"dw{os.getpid() % 10000}"

MODES = {
    "streaming_fp4": {
        "server": ["--fragments", "2", "--pull-codec", "fp4_e2m1"],
        "learner": ["--sync-every-steps", "50", "--push-codec", "fp4_e2m1"],
    },
    "dp": {
        "server": ["--fragments", "1", "--pull-codec", "fp32"],
        "learner": [
            "--sync-every-steps", "1", "--overlap-steps", "0", "--merge-alpha", "0",
            "--push-codec", "fp32",
        ],
    },
}  # fmt: skip


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


class Network:
    """Namespaces `TAG-srv` and `TAG-l<k>`; learner k reaches the server at SUBNET.k.1."""

    def __init__(self, learners: int, mbit: float) -> None:
        self.server_ns = f"{TAG}-srv"
        self.learner_ns = [f"{TAG}-l{k}" for k in range(1, learners + 1)]
        self.mbit = mbit

    def __enter__(self) -> Network:
        ip("netns", "add", self.server_ns)
        ip("-n", self.server_ns, "link", "set", "lo", "up")
        for k, ns in enumerate(self.learner_ns, start=1):
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            srv_if, l_if = f"{TAG}s{k}", f"{TAG}l{k}"
            ip("link", "add", srv_if, "type", "veth", "peer", "name", l_if)
            ip("link", "set", srv_if, "netns", self.server_ns)
            ip("link", "set", l_if, "netns", ns)
            for where, dev, addr in ((self.server_ns, srv_if, 1), (ns, l_if, 2)):
                ip("-n", where, "addr", "add", f"{SUBNET}.{k}.{addr}/24", "dev", dev)
                ip("-n", where, "link", "set", dev, "up")
                self._shape(where, dev)
        return self

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{self.mbit}mbit"
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", rate, "burst", "64kbit", "latency", "400ms"],
            check=True,
        )  # fmt: skip

    def sent_bytes(self, k: int) -> tuple[int, int]:
        """(learner k -> server, server -> learner k) bytes the links' qdiscs sent."""
        return (
            _qdisc_sent(self.learner_ns[k - 1], f"{TAG}l{k}"),
            _qdisc_sent(self.server_ns, f"{TAG}s{k}"),
        )

    def __exit__(self, *exc) -> None:
        for ns in [self.server_ns, *self.learner_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _qdisc_sent(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, *argv]


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    flags = MODES[mode]
    if mode == "streaming_fp4":
        tau = ["--overlap-steps", str(args.overlap_steps)]
        flags = {**flags, "learner": [*flags["learner"], *tau]}
    with Network(args.learners, args.link_mbit) as net:
        procs: list[Daemon] = []

        def spawn(name: str, argv: list[str], port_file: Path | None = None) -> Daemon:
            log = workdir / f"{mode}-{name}.log"
            procs.append(start_daemon(name, argv, log, port_file=port_file))
            return procs[-1]

        try:
            server = spawn(
                "server",
                in_ns(net.server_ns, "-m", "server.main", "--insecure", "--listen", "127.0.0.1:0",
                      *flags["server"]),
                port_file=workdir / f"{mode}-port",
            )  # fmt: skip
            upstream = f"127.0.0.1:{server.port}"
            for k in range(1, args.learners + 1):
                spawn(
                    f"proxy{k}",
                    in_ns(net.server_ns, "-m", "deploy.faultproxy",
                          "--listen", f"{SUBNET}.{k}.1:{GRPC_PORT}", "--upstream", upstream,
                          "--delay-ms", str(args.delay_ms)),
                )  # fmt: skip
            learners = []
            for k in range(1, args.learners + 1):
                learners.append(
                    spawn(
                        f"learner{k}",
                        in_ns(net.learner_ns[k - 1], "-m", "learner.main", "--insecure",
                              "--server", f"{SUBNET}.{k}.1:{GRPC_PORT}",
                              "--learner-id", f"wan-{k}",
                              "--duration-s", str(args.duration_s),
                              "--learners-per-host", str(args.learners),
                              "--summary-file", str(workdir / f"{mode}-learner{k}.json"),
                              *flags["learner"], *args.learner_flags),
                    )
                )  # fmt: skip
            codes = [p.wait(args.duration_s * 3 + 120) for p in learners]
            if any(codes):
                raise RuntimeError(f"{mode}: learner exit codes {codes}; see {workdir}")
            per_learner = []
            for k in range(1, args.learners + 1):
                s = json.loads((workdir / f"{mode}-learner{k}.json").read_text())
                up, down = net.sent_bytes(k)
                busy_wall = s["train_wall_s"] - s["eval_s"]
                per_learner.append(
                    {
                        "learner": k,
                        "utilization": s["compute_s"] / busy_wall,
                        "compute_s": s["compute_s"],
                        "train_wall_s": s["train_wall_s"],
                        "eval_s": s["eval_s"],
                        "blocked_on_sync_s": s["blocked_on_sync_s"],
                        "inner_steps": s["inner_steps"],
                        "final_eval_loss": s["eval_losses"][-1],
                        "link_bytes_up": up,
                        "link_bytes_down": down,
                    }
                )
            return {"learners": per_learner}
        finally:
            stop_all(procs[::-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=20.0)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way added latency")
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=60.0, help="per mode")
    parser.add_argument("--modes", default="streaming_fp4,dp")
    parser.add_argument(
        "--overlap-steps", type=int, default=5, help="streaming's τ: steps a sync may travel"
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("learner_flags", nargs="*", help="after --: more learner flags")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        parser.exit(2, "wan_sim: error: needs root and iproute2 (ip, tc) for namespaces\n")
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.exit(2, f"wan_sim: error: unknown modes {sorted(unknown)}\n")
    workdir = Path(tempfile.mkdtemp(prefix="diloco-wan-"))
    report: dict = {
        "link_mbit": args.link_mbit,
        "delay_ms": args.delay_ms,
        "learners": args.learners,
        "duration_s": args.duration_s,
        "overlap_steps_streaming": args.overlap_steps,
        "logs": str(workdir),
    }
    for mode in modes:
        print(f"running {mode} for {args.duration_s:.0f} s over {args.link_mbit} Mbit/s links")
        result = run_mode(mode, args, workdir)
        report[mode] = result
        mean = sum(x["utilization"] for x in result["learners"]) / len(result["learners"])
        report[f"utilization_{mode}"] = mean
        for x in result["learners"]:
            print(
                f"  learner {x['learner']}: utilisation {x['utilization']:.3f}, "
                f"{x['inner_steps']} steps, up {x['link_bytes_up'] / 1e6:.1f} MB, "
                f"down {x['link_bytes_down'] / 1e6:.1f} MB, eval loss {x['final_eval_loss']:.3f}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith("utilization")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
