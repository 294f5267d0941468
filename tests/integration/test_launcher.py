"""deploy/launcher.py: a daemon's port from its port file, a clear error when it dies first,
and stop() ending even a stopped (SIGSTOP) process."""

from __future__ import annotations

import signal
import sys

import pytest

from deploy.launcher import start_daemon

# A stand-in daemon: writes its metrics port file, then its port file (the order diloco-server
# follows: /metrics is up before the port file says it serves), then idles. The other order
# raced the test on a busy machine: start_daemon returns once the port file is there.
FAKE = """
import pathlib, sys, time
args = sys.argv[1:]
for flag, port in (("--metrics-port-file", "9876"), ("--port-file", "4321")):
    if flag in args:
        pathlib.Path(args[args.index(flag) + 1]).write_text(port + "\\n")
print("up", flush=True)
time.sleep(120)
"""


def test_port_file_log_metrics_port_and_stop(tmp_path) -> None:
    daemon = start_daemon(
        "fake", [sys.executable, "-c", FAKE], tmp_path / "fake.log",
        port_file=tmp_path / "fake.port", metrics=True,
    )  # fmt: skip
    assert daemon.port == 4321 and daemon.metrics_port() == 9876
    daemon.signal(signal.SIGSTOP)
    assert daemon.stop(timeout_s=30) == -signal.SIGTERM  # SIGCONT first, then SIGTERM
    assert daemon.log_text() == "up\n"


def test_a_daemon_that_exits_before_serving_names_its_log(tmp_path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('bad flag')"]
    with pytest.raises(RuntimeError, match="exited with 1 before serving; see .*bad.log"):
        start_daemon("bad", argv, tmp_path / "bad.log", port_file=tmp_path / "bad.port")
    assert "bad flag" in (tmp_path / "bad.log").read_text()
