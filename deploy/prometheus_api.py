"""Read Prometheus data: an instant query against a Prometheus server, or one scrape of a
daemon's /metrics endpoint (for the harnesses, the compose smoke test and the tests).

    instant_query("http://127.0.0.1:9090", "diloco_server_live_learners")
    samples = scrape(port)                        # None while the endpoint does not answer
    samples.value("diloco_learner_eval_loss")
    samples.by_label("diloco_server_fragment_version", "fragment")   # {"0": 3.0, "1": 2.0}
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def instant_query(base_url: str, expr: str) -> list[dict]:
    """The result vector of `expr` now; empty while the server is not answering yet."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())["data"]["result"]
    except OSError:
        return []


@dataclass(frozen=True)
class Samples:
    """One scrape: every sample's value by its name (counters end in _total) and labels."""

    values: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels; NaN if there is none."""
        return self.values.get((name, frozenset(labels.items())), math.nan)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The samples of `name`, by the value of their label `label`."""
        return {
            dict(labels)[label]: value
            for (sample, labels), value in self.values.items()
            if sample == name and label in dict(labels)
        }

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.values


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 2.0) -> Samples | None:
    """The samples at http://host:port/metrics, or None if it does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as reply:
            text = reply.read().decode()
    except (OSError, http.client.HTTPException):  # the daemon is down, stopped or starting
        return None
    return Samples(
        {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
    )
