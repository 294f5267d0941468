"""The main job (`make run`): one aggregator and N learners as separate processes on loopback.

    python deploy/local_run.py --duration-s 180 --learners 2 --fragments 2

Streaming DiLoCo by default: P = 2 fragments, 4-bit pushes and pulls, overlapped merges.
The server binds a free port and writes it to a file; learners train on the built-in corpus
until the duration passes, then leave. Prints every learner's eval loss as it falls, then a
summary; exits non-zero if any process failed or the eval loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python -m` rather than the console scripts: works from a checkout that is not installed.
SERVER = [sys.executable, "-m", "server.main"]
LEARNER = [sys.executable, "-m", "learner.main"]


def wait_for_port(port_file: Path, server: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if server.poll() is not None:
            raise RuntimeError(f"diloco-server exited with {server.returncode} before serving")
        time.sleep(0.05)
    raise RuntimeError(f"diloco-server did not start within {timeout_s} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--sync-every-steps", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's P")
    parser.add_argument("--workdir", default="", help="where logs and summaries go")
    parser.add_argument(
        "--min-loss-drop",
        type=float,
        default=0.5,
        help="fail unless every learner's eval loss fell by this much",
    )
    parser.add_argument(
        "learner_flags",
        nargs=argparse.REMAINDER,
        help="after --: more diloco-learner flags, e.g. -- --n-layer 4",
    )
    args = parser.parse_args()
    extra = args.learner_flags[1:] if args.learner_flags[:1] == ["--"] else args.learner_flags
    if args.learners < 1 or args.duration_s <= 0:
        parser.error("--learners must be >= 1 and --duration-s > 0")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="diloco-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    server_log = open(workdir / "server.log", "w")
    server = subprocess.Popen(
        [
            *SERVER,
            "--insecure",  # loopback only
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            workdir / "port",
            "--fragments",
            str(args.fragments),
        ],
        stdout=server_log,
        stderr=subprocess.STDOUT,
    )
    learners: list[subprocess.Popen] = []
    try:
        port = wait_for_port(workdir / "port", server, timeout_s=60)
        print(f"server on 127.0.0.1:{port} (log: {workdir / 'server.log'})", flush=True)
        for i in range(args.learners):
            flags = {
                "--server": f"127.0.0.1:{port}",
                "--learner-id": f"learner-{i}",
                "--learners-per-host": args.learners,
                "--duration-s": args.duration_s,
                "--sync-every-steps": args.sync_every_steps,
                "--summary-file": workdir / f"learner-{i}.json",
            }
            argv = [str(x) for pair in flags.items() for x in pair]
            learners.append(subprocess.Popen([*LEARNER, "--insecure", *argv, *extra]))
        codes = [p.wait() for p in learners]
    finally:
        for proc in [*learners, server]:
            if proc.poll() is None:
                proc.terminate()
        server.wait(timeout=30)
    if any(codes):
        print(f"FAILED: learner exit codes {codes}", file=sys.stderr)
        return 1
    summaries = [
        json.loads((workdir / f"learner-{i}.json").read_text()) for i in range(args.learners)
    ]
    return report(summaries, args.min_loss_drop)


def report(summaries: list[dict], min_loss_drop: float) -> int:
    print("\nlearner     outer  tokens      sent MB  recv MB  eval loss first -> last")
    fell = True
    for s in summaries:
        first, last = s["eval_losses"][0], s["eval_losses"][-1]
        fell &= last < first - min_loss_drop
        print(
            f"{s['learner_id']:<11} {s['outer_steps']:>5}  {s['tokens']:>10,}  "
            f"{s['bytes_sent'] / 1e6:>7.2f}  {s['bytes_received'] / 1e6:>7.2f}  "
            f"{first:.3f} -> {last:.3f}"
        )
    if not fell:
        print(f"FAILED: eval loss did not fall by {min_loss_drop}", file=sys.stderr)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
