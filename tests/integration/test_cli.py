"""The console scripts: bad flags end in one clear line, and a missing server is reported."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.processes import REPO, TINY_LEARNER_FLAGS


def run(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("server.main", ["--lease-s", "0"], "lease_s must be > 0"),
        ("server.main", ["--mode", "gossip"], "mode must be one of"),
        ("server.main", ["--listen", "nowhere"], "listen must be host:port"),
        ("server.main", [], "set tls_cert and tls_key to serve over TLS, or insecure"),
        ("server.main", ["--tls-cert", "/no.crt", "--tls-key", "/no.key"], "cannot read tls_key"),
        ("learner.main", ["--tls-ca", "/no/ca.crt"], "cannot read tls_ca file /no/ca.crt"),
        ("learner.main", ["--push-codec", "fp5"], "push_codec must be one of"),
        ("learner.main", ["--n-embd", "30", "--n-head", "4"], "n_embd (30) must be divisible"),
        ("learner.main", ["--corpus", "/no/such/folder"], "corpus folder /no/such/folder"),
        ("learner.main", ["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N"),
        ("learner.main", ["--server", "a:1,b"], "server must be host:port, got 'b'"),
        ("learner.main", ["--lr-schedule", "cosine"], "lr_schedule_steps must be >= 1"),
        ("server.main", ["--shard-count", "2", "--shard-index", "2"], "shard_index must be in"),
        ("server.main", ["--shard-count", "3", "--fragments", "2"], "must not exceed fragments"),
        ("learner.status", ["--server", "nowhere"], "server must be host:port"),
    ],
)
def test_bad_flags_give_one_clear_error(module: str, args: list[str], message: str) -> None:
    result = run(module, *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]


def test_learner_reports_an_unreachable_server() -> None:
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run(
        "learner.main",
        "--server",
        f"127.0.0.1:{port}",
        *TINY_LEARNER_FLAGS,
        "--connect-timeout-s",
        "1",
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"cannot reach the server at 127.0.0.1:{port}" in result.stderr


def test_status_reports_an_unreachable_server() -> None:
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = run("learner.status", "--server", f"127.0.0.1:{port}", "--insecure")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"diloco-status: error: cannot reach the server at 127.0.0.1:{port} (is it up, and do "
        "both sides agree on TLS or insecure?)"
    )
