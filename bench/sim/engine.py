"""Virtual time: a clock, an event queue and a FIFO network link. Nothing here sleeps.

    clock = VirtualClock()
    queue = EventQueue(clock)
    queue.at(2.5, lambda: print(clock()))   # runs when the queue reaches t = 2.5 s
    queue.run(until_s=10.0, max_events=1_000)
    link = Link(bandwidth_bps=1e9, latency_s=0.01)
    start_s, arrival_s = link.send(ready_s=0.0, payload_bytes=125_000_000)  # 1 s + 10 ms

Why a simulator of its own instead of real sleeps: a plan for a 100B model across
datacenters spans hours of training; in virtual time one run of it costs milliseconds, so a
bisection over bandwidth can run hundreds of them. The clock only moves forward, so a bug
that schedules an event in the past fails loudly instead of silently reordering history.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


class VirtualClock:
    """Seconds since the start of the simulation; callable, like `time.monotonic`.

    The server's Aggregator takes any `clock` callable, so this object drives its leases and
    grace windows too.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, t_s: float) -> None:
        """Move the clock to `t_s`; moving backwards is a bug in the caller."""
        if t_s < self.now_s:
            raise ValueError(f"virtual clock cannot go back from {self.now_s} s to {t_s} s")
        self.now_s = t_s


class EventQueue:
    """Callbacks ordered by virtual time; ties run in the order they were scheduled."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, t_s: float, callback: Callable[[], None]) -> None:
        if t_s < self.clock.now_s:
            raise ValueError(f"event at {t_s} s is before the clock ({self.clock.now_s} s)")
        heapq.heappush(self._heap, (t_s, next(self._seq), callback))

    def after(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.at(self.clock.now_s + delay_s, callback)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until_s: float, max_events: int) -> int:
        """Run events up to `until_s` (inclusive); returns how many ran.

        `max_events` bounds the loop: a model that keeps scheduling events without moving
        time forward raises instead of hanging.
        """
        ran = 0
        while self._heap and self._heap[0][0] <= until_s:
            if ran >= max_events:
                raise RuntimeError(
                    f"simulation ran {max_events} events before t = {until_s} s; "
                    f"raise max_events or shorten the run"
                )
            t_s, _, callback = heapq.heappop(self._heap)
            self.clock.advance_to(t_s)
            callback()
            ran += 1
        self.clock.advance_to(max(self.clock.now_s, until_s))
        self.processed += ran
        return ran


@dataclass
class Link:
    """One direction of a network link: a FIFO served at `bandwidth_bps`, plus latency.

    A message occupies the link for its serialisation time (bits / bandwidth); latency delays
    its arrival but does not occupy the link, so back-to-back messages pipeline. Records the
    bytes sent and, per window of `window_s`, the bits serialised, for the peak rate.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    window_s: float = 1.0
    bytes_sent: int = 0
    busy_s: float = 0.0
    free_at_s: float = 0.0
    _window_bits: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {self.bandwidth_bps}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    def send(self, ready_s: float, payload_bytes: float) -> tuple[float, float]:
        """Queue a message that is ready at `ready_s`; returns (start_s, arrival_s)."""
        if payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
        start_s = max(ready_s, self.free_at_s)
        serialise_s = payload_bytes * 8 / self.bandwidth_bps
        self.free_at_s = start_s + serialise_s
        self.busy_s += serialise_s
        self.bytes_sent += int(payload_bytes)
        self._spread(start_s, self.free_at_s)
        return start_s, self.free_at_s + self.latency_s

    def _spread(self, start_s: float, end_s: float) -> None:
        """Credit the bits serialised in [start_s, end_s) to the windows they fall in.

        Windows the message covers entirely all carry the full rate; crediting the last of
        them is enough for the peak, and keeps a slow link with long messages cheap.
        """
        rate, window = self.bandwidth_bps, self.window_s
        first, last = int(start_s // window), int(end_s // window)
        bits = self._window_bits
        if first == last:
            bits[first] = bits.get(first, 0.0) + (end_s - start_s) * rate
            return
        bits[first] = bits.get(first, 0.0) + ((first + 1) * window - start_s) * rate
        bits[last] = bits.get(last, 0.0) + (end_s - last * window) * rate
        if last - first > 1:
            bits[last - 1] = window * rate

    def peak_bps(self, from_s: float = 0.0) -> float:
        """The highest mean rate over one window, counting windows that start at or after
        `from_s` (so a warm-up can be left out)."""
        first = int(from_s // self.window_s)
        rates = [bits / self.window_s for i, bits in self._window_bits.items() if i >= first]
        return max(rates, default=0.0)
