"""A real diloco-server with trace_exporter console: a learner's pushes and the rounds they
close come out as spans (common/tracing.py, wired in server/main.py)."""

from __future__ import annotations

import json

from deploy.launcher import stop_all
from tests.support.processes import learner_log, learner_process, server_process


def spans(log_text: str) -> list[dict]:
    """The console exporter's spans: JSON objects, each printed over several lines."""
    found, decoder, at = [], json.JSONDecoder(), 0
    while (at := log_text.find('{\n    "name": "diloco.', at)) >= 0:
        span, at = decoder.raw_decode(log_text, at)
        found.append(span)
    return found


def test_a_live_server_traces_each_push_and_round_close(tmp_path) -> None:
    server = server_process(tmp_path, "server", "--trace-exporter", "console")
    try:
        learner = learner_process(tmp_path, server.port, "a", "--max-outer-steps", "2")
        assert learner.wait(180) == 0, learner_log(tmp_path, "a")
    finally:
        stop_all([server])  # a stopped server flushes its spans
    traced = spans((tmp_path / "server.log").read_text())
    pushes = [s for s in traced if s["name"] == "diloco.push"]
    closes = [s for s in traced if s["name"] == "diloco.round_close"]
    assert pushes and closes, (tmp_path / "server.log").read_text()[-2000:]
    assert {s["attributes"]["learner"] for s in pushes} == {"a"}
    assert all(s["attributes"]["contributors"] == 1 for s in closes)
    assert {s["attributes"]["result"] for s in pushes} <= {"accepted", "ALREADY_EXISTS"}
