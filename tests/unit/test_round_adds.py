"""A round's queued adds (server/round_adds.py): first in, first added, whoever runs them."""

from __future__ import annotations

import threading

import pytest
import torch

from server.round_adds import OrderedAdds


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


def test_a_failed_batch_raises_and_the_ones_behind_it_wait_for_the_next_run() -> None:
    adds, log, sums = OrderedAdds(), [], [torch.zeros(1)]
    failing = _Recorded(1, log, fail=True)
    adds.put([(_Recorded(0, log), 1.0), (failing, 1.0)], sums)
    behind = _Recorded(2, log)
    adds.put([(behind, 1.0)], sums)
    with pytest.raises(RuntimeError, match="add failed"):
        adds.run()
    assert failing.released and not behind.released  # its buffers went back all the same
    adds.run()
    assert log == [0, 2] and behind.released
