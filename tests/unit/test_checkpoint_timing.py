"""The timing figures across a resume: a learner restored from its resume file (the built-in
job's checkpoint, or DilocoSync.state_dict()) reports the utilisation and step time that the
same run without the restart would, and an older file without the timing still loads.

No server and no sleeps: the session's join is stood in for, and steps report their compute
seconds explicitly (as the built-in job does) or read a fake clock.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from common.config import build_config
from learner import api
from learner.api import DilocoSync
from learner.checkpoint import JobCheckpoint, load_checkpoint, save_checkpoint
from learner.config import LearnerConfig
from learner.heartbeat import Heartbeat, Membership
from learner.island import Island
from learner.streaming import FragmentReplica, SyncStats
from tests.support.fakes import FakeClock

STEP_S = 0.25  # compute seconds of each inner step
WALL_S = 0.4  # training wall seconds of each inner step, evaluation included
EVAL_S = 0.05  # of that, evaluating
BLOCKED_S = 0.02  # of that, waiting at a merge


class JoinedSync:
    """Stands in for the StreamingSync a join builds: no fragment is due; each merge phase
    waits BLOCKED_S, as a merge point that waited for a push would."""

    def __init__(self) -> None:
        self.replicas: list = []
        self.stats = SyncStats()

    def push_phase(self, step: int, inner_step: int | None = None) -> None:
        pass

    def merge_phase(self, step: int) -> list[int]:
        self.stats.blocked_s += BLOCKED_S
        return []

    def load_globals(self, keep: object = ()) -> None:
        pass


def library_sync(monkeypatch) -> DilocoSync:
    """A DilocoSync whose open() joins nothing: the join's StreamingSync is JoinedSync,
    whose blocked seconds go on from the resumed run's, as SyncSession._join seeds them."""
    sync = DilocoSync(
        nn.Linear(2, 2), learner_id="a", insecure=True, server="127.0.0.1:1", sync_every_steps=4
    )

    def join(stop: threading.Event) -> None:
        sync.session.sync = JoinedSync()
        sync.session.sync.stats.blocked_s = sync.progress.blocked_on_sync_s

    monkeypatch.setattr(sync.session, "open", join)
    return sync


def reported_step_time_s(sync: DilocoSync) -> float:
    """The step time a heartbeat sends the server (which paces the others by it)."""
    sent = []

    class Client:
        def heartbeat(self, request):
            sent.append(request.step_time_s)
            return SimpleNamespace(fragment_versions=[], median_step_time_s=0.0, schedule_step=0)

    session = sync.session
    Heartbeat(
        Client(), "a", sync.progress, session.pacer, lambda: Membership("s"), lambda: 0
    ).beat()
    return sent[0]


def test_a_resumed_sync_goes_on_with_its_step_time_compute_and_blocked_seconds(
    monkeypatch,
) -> None:
    first = library_sync(monkeypatch)
    with first:
        for _ in range(6):
            first.step(compute_s=STEP_S)
        saved = first.state_dict()
    second = library_sync(monkeypatch)
    second.load_state_dict(saved)
    with second:
        for _ in range(4):
            second.step(compute_s=2 * STEP_S)  # the restarted learner runs slower
        p = second.progress
        # What the run without a restart reports: 10 steps, 6 of 0.25 s and 4 of 0.5 s.
        assert p.inner_steps == 10
        assert p.compute_s == pytest.approx(6 * STEP_S + 4 * 2 * STEP_S)
        assert reported_step_time_s(second) == pytest.approx(3.5 / 10)
        assert p.step_time_s() == pytest.approx(3.5 / 10)
        assert p.blocked_on_sync_s == pytest.approx(10 * BLOCKED_S)
        assert second.stats.blocked_s == pytest.approx(10 * BLOCKED_S)


def test_the_first_step_after_a_resume_does_not_count_the_restart_as_compute(
    monkeypatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(api.time, "perf_counter", clock)
    first = library_sync(monkeypatch)
    with first:
        clock.now += STEP_S
        first.step()
        saved = first.state_dict()
    clock.now += 3600.0  # down for an hour, then a new process starts
    second = library_sync(monkeypatch)
    second.load_state_dict(saved)
    clock.now += 30.0  # loading the model, the data: not an inner step's compute either
    with second:
        clock.now += STEP_S
        second.step()
    assert second.progress.compute_s == pytest.approx(2 * STEP_S)


def test_a_state_saved_without_timing_still_loads_and_times_the_steps_since(
    monkeypatch,
) -> None:
    """A state_dict() without the timing counters (of a DilocoSync that did not save them):
    the steps before the resume are untimed, so the step time is that of the steps since
    instead of their compute spread over every step taken."""
    sync = library_sync(monkeypatch)
    sync.load_state_dict({"inner_steps": 100, "outer_steps": 25, "tokens": 100, "fragments": []})
    with sync:
        for _ in range(4):
            sync.step(compute_s=STEP_S)
        assert sync.progress.inner_steps == 104
        assert sync.progress.compute_s == pytest.approx(4 * STEP_S)
        assert reported_step_time_s(sync) == pytest.approx(STEP_S)
        assert sync.progress.step_time_s() == pytest.approx(STEP_S)


def test_a_join_goes_on_with_the_blocked_seconds_of_the_resumed_run(monkeypatch) -> None:
    """SyncSession's join (the real one, its server stood in for) seeds the new sync's
    counter with the resumed run's, which the step's test above stands in for."""
    model = nn.Linear(2, 2)
    sync = DilocoSync(model, learner_id="a", insecure=True, server="127.0.0.1:1")
    saved = {"inner_steps": 8, "outer_steps": 2, "tokens": 8, "fragments": []}
    sync.load_state_dict(saved | sync.progress.timing_state() | {"blocked_on_sync_s": 1.5})
    session = sync.session
    replica = FragmentReplica(0, [0, 1], [(2, 2), (2,)])
    replica.params, replica.version = [p.detach().clone() for p in model.parameters()], 0
    reply = SimpleNamespace(session_id="s", fragments=[], mode="sync", schedule_step=0,
                            server_epoch=1, layout="strided")  # fmt: skip
    monkeypatch.setattr(session.client, "join", lambda *args: reply)
    monkeypatch.setattr(session.client, "away", lambda: set())
    monkeypatch.setattr(session.replicas, "load", lambda *args: ([replica], {0}))
    session._join(session.resume)
    assert sync.stats.blocked_s == 1.5
    sync.close(drain=False)
    assert sync.progress.blocked_on_sync_s == 1.5


# -- the built-in job's checkpoint ------------------------------------------------------------


class Job:
    """What JobCheckpoint reads and writes of the built-in job (learner/trainer.py), its
    DilocoSync never opened: the progress counters are set as the training loop sets them."""

    def __init__(self, directory: Path) -> None:
        settings = {"learner_id": "a", "insecure": True, "server": "127.0.0.1:1"}
        self.config = build_config(LearnerConfig, settings | {"checkpoint_dir": str(directory)})
        self.model = nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.batches = SimpleNamespace(
            position=0, state_dict=lambda: {"position": 0}, load_state_dict=lambda state: None
        )
        self.island = Island()
        self.sync = DilocoSync(self.model, config=self.config.library())
        self.progress = self.sync.progress  # rank 0's progress is the sync's
        specs = [(n, list(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]
        self.checkpoint = JobCheckpoint(self, directory, specs)

    def train(self, steps: int) -> None:
        """`steps` inner steps as the training loop counts them: compute, wall, evaluation."""
        p = self.progress
        p.inner_steps += steps
        p.compute_s += steps * STEP_S
        p.train_wall_s += steps * WALL_S  # train_wall_s goes on from the checkpoint's
        p.eval_s += steps * EVAL_S
        p.blocked_on_sync_s += steps * BLOCKED_S

    def close(self) -> None:
        self.sync.close(drain=False)


def utilisation(job: Job) -> float:
    p = job.progress
    return p.compute_s / (p.train_wall_s - p.eval_s)


def test_a_resumed_jobs_utilisation_and_step_time_are_those_of_a_run_without_restart(
    tmp_path: Path,
) -> None:
    unbroken, first = Job(tmp_path / "unbroken"), Job(tmp_path / "ckpt")
    unbroken.train(12)
    first.train(8)
    first.checkpoint.save()
    first.close()
    second = Job(tmp_path / "ckpt")
    second.checkpoint.restore()
    assert second.progress.resumed_at_inner_step == 8
    second.train(4)
    # 12 steps of 0.25 s compute in 0.4 - 0.05 s of busy wall each: 0.714..., not
    # 12 * 0.25 / (4 * 0.35) = 2.1 (the steps before the restart timed, their wall not).
    assert utilisation(second) == pytest.approx(utilisation(unbroken)) == pytest.approx(0.25 / 0.35)
    assert second.progress.step_time_s() == pytest.approx(unbroken.progress.step_time_s())
    assert second.progress.timing_state() == pytest.approx(unbroken.progress.timing_state())
    # The sync the job drives holds the same: its state_dict() (a user's resume file) too.
    saved = second.sync.state_dict()
    assert saved["compute_s"] == pytest.approx(12 * STEP_S)
    assert saved["blocked_on_sync_s"] == pytest.approx(12 * BLOCKED_S)
    unbroken.close()
    second.close()


def test_an_older_job_checkpoint_loads_and_times_the_steps_since(tmp_path: Path) -> None:
    """A checkpoint of format 1 written with compute_s but not the rest of the timing: it
    loads, and the figures cover the time since the resume rather than dividing the
    compute of 8 + 4 steps by the wall time of 4."""
    first = Job(tmp_path)
    first.train(8)
    first.checkpoint.save()
    first.close()
    state = load_checkpoint(tmp_path)
    for name in ("train_wall_s", "eval_s", "blocked_on_sync_s", "untimed_steps"):
        state["progress"].pop(name, None)
    save_checkpoint(tmp_path, state)
    second = Job(tmp_path)
    second.checkpoint.restore()
    assert second.progress.inner_steps == 8
    second.train(4)
    assert utilisation(second) == pytest.approx(0.25 / 0.35)
    assert second.progress.step_time_s() == pytest.approx(STEP_S)
    assert second.progress.compute_s == pytest.approx(4 * STEP_S)
    second.close()
