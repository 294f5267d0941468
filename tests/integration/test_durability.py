"""kill -9 of a real server process loses no version it ever served."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from common.codec.fragment import decode_fragment, encode_fragment
from common.generated.diloco.v1 import aggregator_pb2 as pb
from common.retry import wait_until
from learner.client import AggregatorClient
from tests.support.processes import server_process

SHAPES = [(64, 32), (32,)]
FINGERPRINT = [
    pb.ParamSpec(name=f"blocks.{i}.w", shape=s, dtype="float32") for i, s in enumerate(SHAPES)
]


def start_server(
    tmp_path: Path, state_dir: Path, name: str, *flags: str, port: int = 0
) -> tuple[subprocess.Popen, int]:
    flags = ("--state-dir", str(state_dir), "--lease-s", "30", *flags)
    server = server_process(tmp_path, name, *flags, port=port)
    return server.proc, server.port


def test_kill_9_mid_round_then_restart_loses_no_served_version(tmp_path) -> None:
    state_dir = tmp_path / "state"
    server, port = start_server(tmp_path, state_dir, "first", "--pull-codec", "fp32")
    served: dict[int, list[torch.Tensor]] = {}
    try:
        client = AggregatorClient(f"127.0.0.1:{port}")
        client.wait_ready(30)
        a, b = (client.join(name, FINGERPRINT).session_id for name in ("a", "b"))
        init = pb.PushHeader(session_id=a, kind=pb.PUSH_KIND_INITIAL, base_version=-1)
        client.push(init, encode_fragment([torch.ones(s) for s in SHAPES], "fp32"))
        for version in range(12):
            header, payload = client.pull(a, 0, -1)
            served[header.version] = decode_fragment(payload, SHAPES)
            for session, scale in ((a, 0.01), (b, -0.02)):
                push = pb.PushHeader(
                    session_id=session, kind=pb.PUSH_KIND_DELTA, base_version=header.version
                )
                delta = [torch.full(s, scale * (version + 1)) for s in SHAPES]
                client.push(push, encode_fragment(delta, "fp32"))
                if version == 11:
                    break  # a has pushed, b has not: the round is open when the server dies
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        client.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    restarted, port2 = start_server(tmp_path, state_dir, "second", "--pull-codec", "fp32")
    try:
        client = AggregatorClient(f"127.0.0.1:{port2}")
        client.wait_ready(30)
        session = client.join("l0", FINGERPRINT).session_id
        header, payload = client.pull(session, 0, -1)
        newest_served = max(served)
        assert header.version >= newest_served
        if header.version == newest_served:
            params = decode_fragment(payload, SHAPES)
            assert all(
                torch.equal(a, b) for a, b in zip(params, served[newest_served], strict=True)
            )
        client.close()
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=30)


def wait_for_log(proc: subprocess.Popen, path: Path, text: str, count: int = 1) -> None:
    """Bounded wait until `text` appears `count` times in a process's log."""

    def seen() -> bool:
        if path.read_text().count(text) >= count:
            return True
        assert proc.poll() is None, f"process exited early:\n{path.read_text()[-3000:]}"
        return False

    try:
        wait_until(seen, 60, repr(text))
    except TimeoutError as err:
        raise AssertionError(f"{err}:\n{path.read_text()[-3000:]}") from None


@pytest.mark.slow
def test_learner_trains_through_a_server_crash_and_resyncs(tmp_path, start_learner) -> None:
    state_dir = tmp_path / "state"
    flags = ("--mode", "quorum", "--fragments", "2", "--lease-s", "5")
    server, port = start_server(tmp_path, state_dir, "first", *flags)
    learner = start_learner(
        port,
        "l0",
        "--n-layer",
        "2",
        "--max-outer-steps",
        "1000000",
        "--summary-file",
        str(tmp_path / "l0.json"),
    )
    log_path = tmp_path / "l0.log"
    try:
        wait_for_log(learner, log_path, "outer_step=", count=4)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        # Training on without the server, retrying its pushes and pulls (common/retry.py).
        wait_for_log(learner, log_path, "UNAVAILABLE (attempt")
        server, _ = start_server(tmp_path, state_dir, "second", *flags, port=port)
        wait_for_log(learner, log_path, "joined shard 0 again")  # the only shard rejoined
        restored_log = (tmp_path / "second.log").read_text()
        # Rounds close again on the restarted server.
        wait_for_log(server, tmp_path / "second.log", " version=", count=6)
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    summary = json.loads((tmp_path / "l0.json").read_text())
    assert summary["rejoins"] >= 1
    assert "restored from" in restored_log
    restored = json.loads(restored_log.split("versions ")[1].split(" (replayed")[0])
    # Training went on after the restart: the server moved past the restored versions.
    assert all(v > r for v, r in zip(summary["versions"], restored, strict=True))


def test_a_state_dir_that_fails_turns_health_not_serving(
    tmp_path, start_service, monkeypatch
) -> None:
    """Orchestrators see a shard that takes no new versions: NOT_SERVING on both health
    ports, and the metric says so."""
    import errno
    import os

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from common.rpc import create_channel
    from server.state.params import ParamSpec
    from server.state.store import StateDirFailed

    service = start_service(state_dir=str(tmp_path / "state"), health_listen="127.0.0.1:0")
    agg = service.aggregator
    session = agg.join("a", [ParamSpec("w", (8,), "float32")]).session_id
    agg.initialize(session, 0, [torch.zeros(8)])
    real, calls = os.fsync, []

    def fails_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fails_once)
    with pytest.raises(StateDirFailed):
        agg.push(session, 0, 0, [torch.full((8,), 1e-3)])
    failed = "diloco_server_state_dir_failed"
    assert service.metrics.registry.get_sample_value(failed) == 1.0
    not_serving, request = (
        health_pb2.HealthCheckResponse.NOT_SERVING,
        health_pb2.HealthCheckRequest(),
    )
    for port in (service.port, service.health_port):
        with create_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda s=stub: s.Check(request).status == not_serving, 10, "NOT_SERVING")
