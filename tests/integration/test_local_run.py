"""`make run`'s launcher: a server and two learner processes, a summary, exit 0."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.conftest import REPO, TINY_LEARNER_FLAGS


def test_local_run_trains_and_summarises(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "deploy/local_run.py",
            "--duration-s",
            "3",
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
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout.split("eval loss first -> last")[1].strip().splitlines()
    assert [line.split()[0] for line in table] == ["learner-0", "learner-1"]
    server_log = (tmp_path / "server.log").read_text()
    assert "fragment=1 version=" in server_log  # Streaming DiLoCo: two fragments by default
