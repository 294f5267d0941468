"""The status page in a real browser, against a live run of 2 shards and 2 learners.

Needs Debian's `chromium` and the `playwright` package (the dev extra). Without them the
browser test skips, unless DILOCO_REQUIRE_BROWSER=1 (set by .ci/run), when it fails instead.
DILOCO_STATUS_SCREENSHOT=path.png writes the page's screenshot there (docs/status_page.png).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.retry import wait_until
from deploy.launcher import Daemon, stop_all
from tests.support.processes import free_ports, learner_process, server_process

WAIT_S = 180.0
SHARDS = 2


def fetch(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.read()
    except (urllib.error.URLError, OSError):
        return None


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[dict]:
    """2 shards (each owning one of 2 fragments, sync mode, a state dir each) and 2 learners
    pushing to both; yields each shard's status page URL."""
    tmp_path = tmp_path_factory.mktemp("status")
    ports = free_ports(2 * SHARDS)  # the shard map and the links list them all before start
    grpc_ports, metrics_ports = ports[:SHARDS], ports[SHARDS:]
    addresses = ",".join(f"127.0.0.1:{p}" for p in grpc_ports)
    urls = [f"http://127.0.0.1:{p}/status" for p in metrics_ports]
    started: list[Daemon] = []
    try:
        for i in range(SHARDS):
            flags = ["--shard-index", str(i), "--shard-count", str(SHARDS), "--fragments", "2"]
            flags += ["--layout", "balanced"]
            flags += ["--shard-addresses", addresses, "--shard-status-urls", ",".join(urls)]
            flags += ["--metrics-listen", f"127.0.0.1:{metrics_ports[i]}"]
            flags += ["--state-dir", str(tmp_path / f"state-{i}"), "--lease-s", "20"]
            started.append(server_process(tmp_path, f"shard-{i}", *flags, port=grpc_ports[i]))
        for name in ("alice", "bob"):
            started.append(learner_process(tmp_path, grpc_ports[0], name, "--server", addresses))
        yield {"urls": urls, "tmp_path": tmp_path}
    finally:
        stop_all(started[::-1])


def report(url: str) -> dict | None:
    body = fetch(url + ".json")
    return None if body is None else json.loads(body)


def versions(url: str) -> dict[int, int]:
    status = report(url)
    return {} if status is None else {f["fragment"]: f["version"] for f in status["fragments"]}


def test_the_json_shows_each_shards_fragments_learners_and_traffic(run: dict) -> None:
    def moving() -> list[dict] | None:
        reports = [report(url) for url in run["urls"]]
        if any(
            r is None or not r["fragments"] or r["fragments"][0]["version"] < 2 for r in reports
        ):
            return None
        return reports

    reports = wait_until(moving, WAIT_S, "both shards' fragments at version 2", 0.5)
    for index, status in enumerate(reports):
        assert status["shard"] == {
            "index": index, "count": SHARDS, "mode": "sync", "map_id": status["shard"]["map_id"],
            "untrusted_learners": False,
        }  # fmt: skip
        assert [f["fragment"] for f in status["fragments"]] == [index]  # one fragment each
        learners = {x["learner_id"]: x for x in status["learners"]}
        assert set(learners) == {"alice", "bob"} and all(x["live"] for x in learners.values())
        assert all(x["weight_share"] == pytest.approx(0.5) for x in learners.values())
        assert all(x["tokens"] > 0 for x in learners.values())
        assert status["bytes"]["received"] > 0 and status["bytes"]["sent"] > 0
        assert status["state"]["error"] is None and status["state"]["log"] is not None
        assert [s["status_url"] for s in status["shards"]] == run["urls"]


def test_a_browser_renders_the_page_sees_versions_move_and_follows_the_shard_links(
    run: dict, tmp_path: Path
) -> None:
    sync_playwright = browser_or_skip()
    urls = run["urls"]
    wait_until(lambda: versions(urls[0]).get(0, -1) >= 1, WAIT_S, "shard 0 past version 1", 0.5)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"))
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}"))
            page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.goto(urls[0])
            assert page.title() == f"diloco shard 0 of {SHARDS}"
            learners = page.locator("#learners tbody tr td:first-child").all_inner_texts()
            assert sorted(learners) == ["alice", "bob"]
            first = int(page.locator("#fragments tbody tr td:nth-child(2)").inner_text())
            # The page reloads itself: the version shown rises without any action of ours.
            page.wait_for_function(
                f"Number(document.querySelector('#fragments tbody td:nth-child(2)')"
                f".textContent) > {first}",
                timeout=WAIT_S * 1000,
            )
            if target := os.environ.get("DILOCO_STATUS_SCREENSHOT"):
                page.screenshot(path=target, full_page=True)
            page.locator("#shards a", has_text=urls[1]).click()
            page.wait_for_url(urls[1])
            assert page.title() == f"diloco shard 1 of {SHARDS}"
            assert page.locator("#fragments tbody tr td:first-child").inner_text() == "1"
        finally:
            browser.close()
    # Chromium's own "favicon.ico" 404 is a console error too: the page must not cause one.
    assert problems == []


def browser_or_skip():
    """playwright's sync API, once chromium and playwright are both there."""
    required = os.environ.get("DILOCO_REQUIRE_BROWSER") == "1"
    missing = [] if shutil.which("chromium") else ["chromium (apt-get install chromium)"]
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("playwright (pip install playwright)")
    if missing:
        (pytest.fail if required else pytest.skip)(f"not installed: {', '.join(missing)}")
    return sync_playwright
