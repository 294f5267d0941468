"""Start a daemon as a process with its own log file, wait until it serves, stop it by PID.

    server = start_daemon("server", [*SERVER, "--insecure", "--listen", "127.0.0.1:0"],
                          workdir / "server.log", port_file=workdir / "server.port")
    server.port                  # the gRPC port it bound (read from its port file)
    learner = start_daemon("learner-0", [*LEARNER, "--server", f"127.0.0.1:{server.port}", ...],
                           workdir / "learner-0.log", metrics=True)
    learner.metrics_port()       # its /metrics port once it serves them, else None
    learner.stop(); server.stop()

The one launcher of `make run` (deploy/local_run.py), the chaos harness (deploy/cluster.py),
the benchmarks that run real daemons and the integration tests. Daemons bind port 0 and
write the port they got to a file (--port-file, --metrics-port-file), so runs never collide
on a fixed port. Processes are signalled through their own Popen (their PID), never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.retry import wait_until

REPO = Path(__file__).resolve().parent.parent
# `python -m` rather than the console scripts: works from a checkout that is not installed.
SERVER = [sys.executable, "-m", "server.main"]
LEARNER = [sys.executable, "-m", "learner.main"]
# Bounded, and generous: a daemon imports torch first, which takes a while on a busy machine.
START_TIMEOUT_S = 120.0


@dataclass
class Daemon:
    """A started daemon: its process, log file and the ports it reported."""

    name: str
    proc: subprocess.Popen
    log_path: Path | None
    port: int = 0  # the gRPC port from its port file; 0 when it was started without one
    metrics_port_file: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path is not None else ""

    def metrics_port(self) -> int | None:
        """The port of its /metrics endpoint, once the daemon has written it; else None."""
        return read_port_file(self.metrics_port_file) if self.metrics_port_file else None

    def signal(self, signum: int) -> None:
        """Send `signum` (e.g. SIGSTOP, SIGCONT, SIGHUP) if the process still runs."""
        if self.running():
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.running():
            self.proc.kill()
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM, after SIGCONT in case it is stopped; does not wait."""
        if self.running():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()

    def stop(self, timeout_s: float = 30.0) -> int:
        """terminate(); SIGKILL if it has not ended within `timeout_s`. Returns its exit code."""
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def wait(self, timeout_s: float | None = None) -> int:
        return self.proc.wait(timeout=timeout_s)


def start_daemon(
    name: str,
    argv: Sequence[str | os.PathLike],
    log_path: Path | None,
    *,
    port_file: Path | None = None,
    metrics: bool = False,
    append: bool = False,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> Daemon:
    """Start `argv` with stdout and stderr in `log_path` (None: this process's own).

    `port_file`: passed as --port-file; returns once the daemon has written it (it serves
    then), or raises RuntimeError if it exits first. `metrics`: serve /metrics on a free
    loopback port (--metrics-listen 127.0.0.1:0) and report it in a file next to the log; not
    waited for (Daemon.metrics_port). `append`: add to the log of the last start (a restart).
    """
    argv = [str(arg) for arg in argv]
    metrics_port_file = None
    if port_file is not None:
        port_file.unlink(missing_ok=True)  # a restart must not read its predecessor's port
        argv += ["--port-file", str(port_file)]
    if metrics:
        # A file of this process's own: a restarted daemon's must never be read as this one's.
        base = log_path or Path(cwd) / name
        metrics_port_file = base.with_name(f"{base.stem}.{uuid.uuid4().hex[:8]}.metrics-port")
        argv += ["--metrics-listen", "127.0.0.1:0", "--metrics-port-file", str(metrics_port_file)]
    log = open(log_path, "a" if append else "w") if log_path is not None else None
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None
        )
    finally:
        if log is not None:
            log.close()  # the child has its own descriptor
    daemon = Daemon(name, proc, log_path, metrics_port_file=metrics_port_file)
    if port_file is not None:
        daemon.port = wait_for_port_file(port_file, daemon, timeout_s)
    return daemon


def wait_for_port_file(path: Path, daemon: Daemon, timeout_s: float = START_TIMEOUT_S) -> int:
    """The port `daemon` writes to `path`; RuntimeError if it exits or times out first."""

    def written() -> int | None:
        if not daemon.running():
            raise RuntimeError(
                f"{daemon.name} exited with {daemon.proc.returncode} before serving"
                + (f"; see {daemon.log_path}" if daemon.log_path else "")
            )
        return read_port_file(path)

    try:
        return wait_until(written, timeout_s, f"{daemon.name} writing {path}")
    except TimeoutError as err:
        daemon.kill()
        raise RuntimeError(f"{err}; see {daemon.log_path}") from None


def read_port_file(path: Path) -> int | None:
    """The port in a port file (written atomically, common/atomic.py), or None if absent."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def stop_all(daemons: Sequence[Daemon], timeout_s: float = 30.0) -> None:
    """Stop daemons together: all are asked to end at once, then each is waited for (and
    killed past `timeout_s`). Stop learners before their server, so that they can leave."""
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        daemon.stop(timeout_s)
