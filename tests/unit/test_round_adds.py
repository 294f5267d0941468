"""A round's queued adds (server/rounds/round.py): first in, first added, whoever runs them; a
failure reaches its own push; the aggregator counts pushes while an add runs."""

from __future__ import annotations

import threading

import pytest
import torch

import server.rounds.round
from server.aggregator import Aggregator
from server.config import aggregator_config
from server.rounds.round import OrderedAdds
from tests.support.fakes import FINGERPRINT, FakeClock, tensors


class _Recorded:
    """A push body that records the order it was added in (add_in_turn's one-by-one path)."""

    def __init__(self, name: int, log: list[int], fail: bool = False) -> None:
        self.name, self._log, self._fail = name, log, fail
        self.released = False

    def combinable(self) -> bool:
        return False

    def release(self) -> None:
        self.released = True

    def add_to(self, sums, scale, overwrite=False):
        if self._fail:
            raise RuntimeError("add failed")
        self._log.append(self.name)
        sums[0].add_(scale)
        return sums


def test_batches_are_added_in_the_order_queued_whoever_runs_them() -> None:
    adds, log, sums = OrderedAdds(), [], [torch.zeros(1)]
    for batch in range(20):
        adds.put([(_Recorded(3 * batch + i, log), 1.0) for i in range(3)], sums)
    start = threading.Barrier(4)

    def run() -> None:
        start.wait()
        adds.run()

    runners = [threading.Thread(target=run) for _ in range(4)]
    for t in runners:
        t.start()
    for t in runners:
        t.join(timeout=30)
    assert log == list(range(60)) and sums[0].item() == 60.0
    adds.run()  # nothing left: nothing happens
    assert len(log) == 60


def test_a_run_returns_only_once_the_batch_being_added_is_in() -> None:
    adds, log, sums = OrderedAdds(), [], [torch.zeros(1)]
    entered, release = threading.Event(), threading.Event()

    class Blocking(_Recorded):
        def add_to(self, sums, scale, overwrite=False):
            entered.set()
            assert release.wait(30)
            return super().add_to(sums, scale, overwrite)

    adds.put([(Blocking(0, log), 1.0)], sums)
    first = threading.Thread(target=adds.run)
    first.start()
    assert entered.wait(30)  # the first runner is inside the add, the queue already empty
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (adds.run(), second_done.set()))
    second.start()
    assert not second_done.wait(0.2)  # a close must not read the sum now
    release.set()
    first.join(timeout=30)
    assert second_done.wait(30) and log == [0] and sums[0].item() == 1.0
    second.join(timeout=30)


def test_a_failed_batch_fails_its_own_push_and_the_ones_behind_are_still_added() -> None:
    adds, log, sums = OrderedAdds(), [], [torch.zeros(1)]
    failing = _Recorded(1, log, fail=True)
    first = adds.put([(_Recorded(0, log), 1.0), (failing, 1.0)], sums)
    behind = _Recorded(2, log)
    second = adds.put([(behind, 1.0)], sums)
    adds.run()  # whoever runs it does not get the error
    assert log == [0, 2] and failing.released and behind.released
    with pytest.raises(RuntimeError, match="add failed"):
        first.check()
    second.check()


def _pushes(block: threading.Event | None, entered: threading.Event | None) -> Aggregator:
    """Four learners push to one sync round, the second one's add blocking on `block`."""
    agg = Aggregator(
        aggregator_config(pull_codec="fp32", outer_state_dtype="float32"), clock=FakeClock()
    )
    sessions = [agg.join(f"l{i}", FINGERPRINT).session_id for i in range(4)]
    agg.initialize(sessions[0], 0, tensors(0))
    agg.push(sessions[0], 0, 0, tensors(1))  # the round's first push starts its sum
    if block is None:
        for i in (1, 2, 3):
            agg.push(sessions[i], 0, 0, tensors(1 + i))
        return agg
    second = threading.Thread(target=agg.push, args=(sessions[1], 0, 0, tensors(2)))
    third_done, version = threading.Event(), []

    def third() -> None:
        agg.push(sessions[2], 0, 0, tensors(3))
        third_done.set()

    try:
        second.start()
        assert entered is not None and entered.wait(30)  # its add runs
        threading.Thread(target=third, daemon=True).start()
        # The lock is free while the second push's add runs: the third is counted
        # meanwhile, and waits for the add before its own before it returns.
        probe = threading.Thread(target=lambda: version.append(agg.version(0)), daemon=True)
        probe.start()
        probe.join(10)
        assert version == [0], "the aggregator's lock was held while a push was added"
        assert not third_done.wait(0.2)
    finally:
        block.set()
    second.join(timeout=30)
    assert third_done.wait(30)
    agg.push(sessions[3], 0, 0, tensors(4))  # the last push closes the round
    return agg


def test_the_aggregator_counts_pushes_while_an_add_runs_and_closes_with_every_add(
    monkeypatch,
) -> None:
    reference = _pushes(None, None)
    add_in_turn = server.rounds.round.add_in_turn
    entered, block, calls = threading.Event(), threading.Event(), []

    def blocking_first(batch, sums):
        calls.append(len(batch))
        if len(calls) == 1:
            entered.set()
            assert block.wait(30)
        add_in_turn(batch, sums)

    monkeypatch.setattr(server.rounds.round, "add_in_turn", blocking_first)
    agg = _pushes(block, entered)
    assert calls == [1, 1, 1] and agg.version(0) == reference.version(0) == 1
    for got, want in zip(agg.params(0), reference.params(0), strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
