"""Bytes on the wire, per fragment and direction, counted where messages are sent or received.

Counts the serialized protobuf size of each gRPC message (HTTP/2 framing and TLS add a few
percent on top). Fragment -1 holds traffic that belongs to no fragment (Join, Heartbeat).
"""

from __future__ import annotations

import threading
from collections import defaultdict

NO_FRAGMENT = -1


class Traffic:
    """Thread-safe byte counters: sent and received, per fragment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: defaultdict[int, int] = defaultdict(int)
        self._received: defaultdict[int, int] = defaultdict(int)

    def count(self, fragment_id: int = NO_FRAGMENT, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent[fragment_id] += sent
            self._received[fragment_id] += received

    @property
    def sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    @property
    def received(self) -> int:
        with self._lock:
            return sum(self._received.values())

    def by_fragment(self) -> dict[int, dict[str, int]]:
        """{fragment: {"sent": bytes, "received": bytes}} for every fragment seen."""
        with self._lock:
            keys = sorted(set(self._sent) | set(self._received))
            return {k: {"sent": self._sent[k], "received": self._received[k]} for k in keys}
