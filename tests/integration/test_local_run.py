"""`make run`'s launcher: a server and two learner processes, a summary, exit 0.

The learners stop after a number of outer steps, not after a duration: on a loaded machine a
few seconds may hold too few steps for the global model to learn anything; --duration-s only
bounds the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.processes import REPO, TINY_LEARNER_FLAGS


def test_local_run_trains_and_summarises(tmp_path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "deploy/local_run.py",
            "--duration-s",
            "120",
            "--learners",
            "2",
            "--workdir",
            str(tmp_path),
            "--min-loss-drop",
            "0.5",
            "--",
            *TINY_LEARNER_FLAGS,
            "--n-layer",
            "2",
            "--max-outer-steps",
            "10",  # measured: the global eval loss falls by about 2 in 10 outer steps
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can stop the launcher's children too
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout + stderr
    table, verdict = stdout.split("eval loss first -> last")[1].strip().split("\n\n")
    assert [line.split()[0] for line in table.splitlines()] == ["learner-0", "learner-1"]
    assert verdict.startswith("global model eval loss:")
    server_log = (tmp_path / "server.log").read_text()
    assert "fragment=1 version=" in server_log  # Streaming DiLoCo: two fragments by default
