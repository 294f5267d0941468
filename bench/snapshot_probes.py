"""What bench/snapshots.py watches while a shard serves: when each snapshot was being written
(its .tmp dir), and a learner's heartbeats timed from a process of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from bench.scale_fleet import Fleet
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.rpc import LEARNER_ID_HEADER
from learner.client import AggregatorClient
from learner.shard_sessions import session_of

HEARTBEAT_EVERY_S, POLL_EVERY_S = 0.05, 0.01


class SnapshotWatch(threading.Thread):
    """Lists the state dir every POLL_EVERY_S: when each snapshot's .tmp dir lived, and the
    bytes of the complete dir it became."""

    def __init__(self, state_dir: Path, deadline: float) -> None:
        super().__init__(daemon=True)
        self.state_dir, self.deadline = state_dir, deadline
        self.stop = threading.Event()
        self.windows: list[dict] = []  # number, start_s, end_s (perf_counter), bytes or None

    def run(self) -> None:
        current: dict | None = None
        while not self.stop.wait(POLL_EVERY_S) and time.perf_counter() < self.deadline:
            tmp = sorted(n for n in os.listdir(self.state_dir) if n.endswith(".tmp"))
            now = time.perf_counter()
            number = int(tmp[0].split("-")[1].split(".")[0]) if tmp else None
            if current is not None and number != current["number"]:
                current["end_s"] = now
                current["bytes"] = dir_bytes(self.state_dir / f"snapshot-{current['number']:06d}")
                self.windows.append(current)
                current = None
            if current is None and number is not None:
                current = {"number": number, "start_s": now}
        if current is not None:  # still being written at the end: its time counts, no size
            self.windows.append(current | {"end_s": time.perf_counter(), "bytes": None})


def dir_bytes(path: Path) -> int | None:
    """The bytes of the files in `path`; None if it is not there (a failed snapshot)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    except FileNotFoundError:
        return None


def heartbeat_probe(address: str, learner_id: str, session: str, seconds: float) -> None:
    """Every HEARTBEAT_EVERY_S for `seconds`, the probe learner's heartbeat; prints each
    call's (start, end) on time.perf_counter's clock (CLOCK_MONOTONIC: the same in every
    process), an error as a call as long as it took. Run in a process of its own, as a
    learner's heartbeat comes from one: in this one it would queue behind the simulated
    learners' threads for the interpreter."""
    client = AggregatorClient(address, None, ((LEARNER_ID_HEADER, learner_id),))
    request = pb.HeartbeatRequest(session_id=session)
    deadline, spans, errors = time.perf_counter() + seconds, [], 0
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        try:
            client.heartbeat(request, timeout_s=5.0)
        except grpc.RpcError:
            errors += 1
        spans.append((started, time.perf_counter()))
        time.sleep(HEARTBEAT_EVERY_S)
    client.close()
    print(json.dumps({"spans": spans, "errors": errors}))


def start_heartbeat_probe(fleet: Fleet, address: str, seconds: float) -> subprocess.Popen:
    session = session_of(fleet.sessions[-1], 0, 1)
    code = (
        "import sys; from bench.snapshot_probes import heartbeat_probe; "
        "heartbeat_probe(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))"
    )
    argv = [address, f"scale-{fleet.learners}", session, str(seconds)]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, text=True, env=env
    )
