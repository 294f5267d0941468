"""A shard's state at a glance, as one JSON-ready dict: what the status page shows and what
/status.json serves to scripts.

    report = shard_report(service.aggregator, service.servicer.traffic, config, metrics_port)
    pages = status_pages(service.aggregator, service.servicer.traffic, config, lambda: port)

Fragments (version, owner, last close, the open round: pushes, live learners not heard from,
quorum, grace window left), learners (live, last push, staleness, tokens, weight share,
refused pushes), the state dir (newest snapshot and log: age and size; the error that stopped
it, if any), bytes in and out, and the shard map with each shard's page. Every value is read
through the aggregator's readings (server/readings.py) or from the state dir's files, read
only: building a report changes nothing and holds the aggregator's lock only for each read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.metrics_http import Page
from common.traffic import Traffic
from server.state.store import StateStore
from server.status_page import render_status

if TYPE_CHECKING:
    from server.aggregator import Aggregator
    from server.config import ServerConfig


def status_pages(
    aggregator: Aggregator, traffic: Traffic, config: ServerConfig, port: Callable[[], int]
) -> dict[str, Page]:
    """/status (HTML) and /status.json for the metrics server (common/metrics_http.py);
    `port`: the metrics port, once bound."""

    def report() -> dict[str, Any]:
        return shard_report(aggregator, traffic, config, port())

    return {
        "/status": lambda: ("text/html; charset=utf-8", render_status(report()).encode()),
        "/status.json": lambda: ("application/json", json.dumps(report()).encode()),
    }


def shard_report(
    aggregator: Aggregator, traffic: Traffic, config: ServerConfig, metrics_port: int
) -> dict[str, Any]:
    """The shard's status (module docstring); `metrics_port`: where this page is served."""
    sharding = config.sharding
    shard_map, _ = aggregator.owned()
    fragments = [
        {
            "fragment": row.fragment_id,
            "version": row.version,
            "owner": sharding.shard_index,
            "last_close_s_ago": row.closed_s_ago,
            "round": asdict(row.round),
        }
        for row in aggregator.fragment_rows()
    ]
    return {
        "generated_at": time.time(),
        "shard": {
            "index": sharding.shard_index,
            "count": sharding.shard_count,
            "mode": config.rounds.mode,
            "map_id": shard_map.map_id if shard_map is not None else "",
            "untrusted_learners": config.rounds.untrusted_learners,
        },
        "fragments": fragments,
        "learners": [asdict(row) for row in aggregator.learner_rows()],
        "state": state_dir_status(config.persistence.state_dir, aggregator.state_failure()),
        "bytes": {"received": traffic.received, "sent": traffic.sent},
        "shards": shard_links(config, metrics_port),
        "setting_changes": [
            {"setting": name, "was": was, "now": now}
            for name, was, now in aggregator.setting_changes
        ],
    }


def state_dir_status(state_dir: str, failure: str | None) -> dict[str, Any]:
    """The newest snapshot's and log's age and bytes, read from the files (None: no state dir
    or no such file yet), and the error that stopped the dir, if one did."""
    status: dict[str, Any] = {"dir": state_dir, "error": failure, "snapshot": None, "log": None}
    if not state_dir or not Path(state_dir).is_dir():
        return status
    now, store = time.time(), StateStore(state_dir, read_only=True)
    try:
        numbers = store.snapshots()
        if numbers:
            files = [p for p in store.snapshot_dir(numbers[0]).iterdir() if p.is_file()]
            newest = max(p.stat().st_mtime for p in files)
            size = sum(p.stat().st_size for p in files)
            status["snapshot"] = {"number": numbers[0], "age_s": now - newest, "bytes": size}
        log = store.log_path.stat()
        status["log"] = {"age_s": now - log.st_mtime, "bytes": log.st_size}
    except FileNotFoundError:  # a snapshot or log replaced while read: the next report has it
        pass
    return status


def shard_links(config: ServerConfig, metrics_port: int) -> list[dict[str, Any]]:
    """Every shard's gRPC address and status page: shard_status_urls where it is set, else
    the shard's host with this shard's metrics port (the same port on every shard)."""
    sharding, urls = config.sharding, config.observability.status_urls()
    addresses = sharding.addresses() or [""] * sharding.shard_count
    links = []
    for index, address in enumerate(addresses):
        host = address.rpartition(":")[0] if address else ""
        url = urls[index] if urls else (f"http://{host}:{metrics_port}/status" if host else "")
        if index == sharding.shard_index and not urls:
            url = "/status"  # this page, wherever the browser reached it
        links.append({"index": index, "address": address, "status_url": url})
    return links
