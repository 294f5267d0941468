"""The main job (`make run`): one aggregator and N learners as separate processes on loopback.

    python deploy/local_run.py --duration-s 180 --learners 2 --fragments 2

Streaming DiLoCo by default: P = 2 fragments, 4-bit pushes and pulls, overlapped merges.
The server binds a free port and writes it to a file; learners train on the built-in corpus
until the duration passes, then leave; their status and final lines come here, then a summary.
Exits 1 if a learner exits non-zero or the global model's eval loss falls by less than
--min-loss-drop: from the initial global parameters to the final ones (see `report`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deploy.launcher import LEARNER, SERVER, Daemon, start_daemon, stop_all  # noqa: E402


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
        help="fail unless the global model's eval loss fell by this much",
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
    server = start_daemon(
        "server",
        [*SERVER, "--insecure", "--listen", "127.0.0.1:0", "--fragments", args.fragments],
        workdir / "server.log",
        port_file=workdir / "port",
    )
    print(f"server on 127.0.0.1:{server.port} (log: {server.log_path})", flush=True)
    learners: list[Daemon] = []
    try:
        for i in range(args.learners):
            flags = {
                "--server": f"127.0.0.1:{server.port}",
                "--learner-id": f"learner-{i}",
                "--learners-per-host": args.learners,
                "--duration-s": args.duration_s,
                "--sync-every-steps": args.sync_every_steps,
                "--summary-file": workdir / f"learner-{i}.json",
            }
            argv = [x for pair in flags.items() for x in pair]
            # Their output goes to ours: status lines with the eval loss, then their final lines.
            learners.append(
                start_daemon(f"learner-{i}", [*LEARNER, "--insecure", *argv, *extra], None)
            )
        codes = [learner.wait() for learner in learners]
    finally:
        stop_all(learners)
        server.stop()
    if any(codes):
        print(f"FAILED: learner exit codes {codes}", file=sys.stderr)
        return 1
    summaries = [
        json.loads((workdir / f"learner-{i}.json").read_text()) for i in range(args.learners)
    ]
    return report(summaries, args.min_loss_drop)


def report(summaries: list[dict], min_loss_drop: float) -> int:
    """Print a line per learner, then judge the global model. Each learner first evaluates the
    global parameters it joined with: the first to join the initial ones, a later one a trained
    model (so its own drop is small). Initial loss: the highest first one; final: the highest
    last one, so every learner's last view of the global model must have fallen enough."""
    print("\nlearner     outer  tokens      sent MB  recv MB  eval loss first -> last")
    for s in summaries:
        losses = s["eval_losses"] or [math.nan]  # nan: it stopped before evaluating
        print(
            f"{s['learner_id']:<11} {s['outer_steps']:>5}  {s['tokens']:>10,}  "
            f"{s['bytes_sent'] / 1e6:>7.2f}  {s['bytes_received'] / 1e6:>7.2f}  "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}"
        )
    evaluated = [s["eval_losses"] for s in summaries if s["eval_losses"]]
    initial = max((losses[0] for losses in evaluated), default=math.nan)
    final = max((losses[-1] for losses in evaluated), default=math.nan)
    print(f"\nglobal model eval loss: {initial:.3f} (initial) -> {final:.3f} (final)")
    if final < initial - min_loss_drop:  # never true with nan: no learner evaluated
        return 0
    print(f"FAILED: the global model's eval loss did not fall by {min_loss_drop}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
