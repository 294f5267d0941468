"""What the aggregator reports as it works, for metrics; the default listener ignores it all.

The Aggregator calls these under its lock, so a listener must be quick and must not call
back into the aggregator (server/metrics.py only updates counters and histograms).
"""

from __future__ import annotations


class AggregatorEvents:
    """No-op listener; server/metrics.py's ServerMetrics records each event."""

    def contribution(self, staleness_versions: int) -> None:
        """A pseudo-gradient was accepted, computed this many versions behind the global."""

    def round_closed(self, contributors: int, round_s: float, outer_step_s: float) -> None:
        """A round closed: how many pushes it took, how long it stayed open, the outer step."""

    def influence_bounded(self, action: str) -> None:
        """One push was bounded (server/influence.py): `action` is weight_capped,
        norm_clipped or claim_refused."""

    def snapshot_written(self, seconds: float) -> None:
        """A durable snapshot of the whole state was written."""
