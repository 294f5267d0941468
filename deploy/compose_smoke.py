"""`make compose-smoke`: build the image, run the compose setup, kill and restart a learner.

    python deploy/compose_smoke.py [--timeout-s 600] [--keep]

Needs a running Docker engine and docker-compose (e.g. Debian's docker.io and docker-compose
packages). Works offline: if no base image is given (BASE_IMAGE), one is built from Debian
packages with debootstrap (root), including Debian's prometheus for the Prometheus
container; wheels come from pip's configured index into deploy/wheels/. Runs with
deploy/docker-compose.host.yml, so every container uses host networking on 127.0.0.1.
Grafana is left out here (no offline image); its provisioning is checked by
tests/unit/test_deploy_manifests.py.

Steps, each bounded in time: build; up server + 3 learners + Prometheus; wait until
Prometheus has every target up and every learner has finished outer steps; `kill -9` one
learner container and start it again; wait until it has rejoined (its outer-step counter
starts again from zero and reaches 1, and the server has 3 live learners); tear everything
down (always). Every check reads Prometheus, never the containers' logs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.retry import wait_until  # noqa: E402
from deploy.prometheus_api import instant_query  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
WHEELS = DEPLOY / "wheels"
DEFAULT_BASE = "local/py311-base:bookworm"
IMAGE = "decoupled-diloco:dev"
PROJECT = "diloco-smoke"
PROMETHEUS = "http://127.0.0.1:19090"
LEARNERS = ["learner-1", "learner-2", "learner-3"]
SERVICES = ["server", *LEARNERS, "prometheus"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(*argv: str, env: dict | None = None, quiet: bool = False) -> str:
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if quiet else ""
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({result.returncode}) {detail}")
    return result.stdout or ""


def main_archive_mirror(deb822_sources: list[str], suite: str = "bookworm") -> str:
    """The mirror of Debian's main archive for `suite` among apt's deb822 sources: the first
    stanza that lists the suite itself (not `-security` or `-updates`, whose archives have no
    Release file for the plain suite, so debootstrap cannot use them); Debian's default when
    none does."""
    for text in deb822_sources:
        for stanza in text.split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in stanza.splitlines() if ":" in line and line[0] != "#"
            )
            if suite in fields.get("Suites", "").split() and fields.get("URIs", "").strip():
                return fields["URIs"].split()[0]
    return "http://deb.debian.org/debian"


def ensure_base_image(base: str) -> None:
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode == 0:
        return
    if base != DEFAULT_BASE:
        raise RuntimeError(f"base image {base} not found")
    log(f"building {base} with debootstrap (about 2 minutes)")
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    mirror = main_archive_mirror([source.read_text() for source in sources])
    rootfs = Path("/tmp/diloco-rootfs")
    shutil.rmtree(rootfs, ignore_errors=True)
    packages = "python3,python3-venv,python3-pip,ca-certificates,prometheus"
    sh("debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs), mirror)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", base], stdin=tar.stdout, check=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def ensure_wheels() -> None:
    if any(WHEELS.glob("torch-*.whl")):
        return
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.startswith("torch")]
    torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")
    log(f"downloading wheels into {WHEELS}")
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(WHEELS)]
    sh(*pip, torch_spec, *deps, "setuptools>=68", "wheel")


def host_network_config(env: dict) -> str:
    """docker-compose.yml with the host-network override applied, as one file.

    Compose v1 cannot remove a key in an override, and published ports are refused with host
    networking, so they are dropped here (every port is then on 127.0.0.1 already).
    """
    merged = sh(
        "docker-compose", "-f", "deploy/docker-compose.yml",
        "-f", "deploy/docker-compose.host.yml", "config", env=env, quiet=True,
    )  # fmt: skip
    config = yaml.safe_load(merged)  # paths in it are absolute
    for service in config["services"].values():
        if service.get("network_mode") == "host":
            service.pop("ports", None)
    path = Path(tempfile.mkdtemp(prefix="diloco-smoke-")) / "docker-compose.yml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def values_by_instance(expr: str) -> dict[str, float]:
    results = instant_query(PROMETHEUS, expr)
    return {r["metric"].get("instance", ""): float(r["value"][1]) for r in results}


def instance_of(learner_id: str) -> str:
    """The scrape address (Prometheus' `instance`) of a learner's /metrics."""
    results = instant_query(PROMETHEUS, f'diloco_learner_info{{learner_id="{learner_id}"}}')
    if not results:
        raise RuntimeError(f"Prometheus has no diloco_learner_info for {learner_id}")
    return results[0]["metric"]["instance"]


def wait_for(what: str, check, deadline: float) -> None:
    log(f"waiting: {what}")
    try:
        wait_until(check, max(0.0, deadline - time.monotonic()), what, interval_s=2)
    except TimeoutError as err:
        raise RuntimeError(f"timed out waiting for: {err}") from None
    log(f"ok: {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=900, help="for the whole run")
    parser.add_argument("--keep", action="store_true", help="leave the containers running")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout_s
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            parser.exit(
                2, f"compose_smoke: error: {tool} not found (install Docker and docker-compose)\n"
            )
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        parser.exit(2, "compose_smoke: error: the Docker engine is not running (start dockerd)\n")
    base = os.environ.get("BASE_IMAGE", DEFAULT_BASE)
    started = time.monotonic()
    ensure_base_image(base)
    ensure_wheels()
    log("building the image")
    sh(
        "docker", "build", "-q", "--network", "host", "-f", "deploy/Dockerfile",
        "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, ".",
    )  # fmt: skip
    env = {**os.environ, "DILOCO_IMAGE": IMAGE, "PROMETHEUS_IMAGE": base}
    compose = ["docker-compose", "-p", PROJECT, "-f", host_network_config(env)]
    try:
        sh(*compose, "up", "-d", "--no-build", *SERVICES, env=env)
        wait_for(
            "Prometheus sees all 4 targets up",
            lambda: sum(values_by_instance("up").values()) == 4,
            deadline,
        )
        wait_for(
            "every learner has completed 2 outer steps",
            lambda: (
                (v := values_by_instance("diloco_learner_outer_steps_total"))
                and len(v) == 3
                and min(v.values()) >= 2
            ),
            deadline,
        )
        learner2 = instance_of("learner-2")
        log("kill -9 learner-2, then start it again")
        sh(*compose, "kill", "-s", "SIGKILL", "learner-2", env=env)
        sh(*compose, "start", "learner-2", env=env)  # a no-op if its restart policy was first

        def rejoined() -> bool:
            # A new process counts outer steps from zero: Prometheus sees the counter reset.
            steps = f'diloco_learner_outer_steps_total{{instance="{learner2}"}}'
            restarted = values_by_instance(f"resets({steps}[30m])").get(learner2, 0) >= 1
            trains = values_by_instance(steps).get(learner2, 0) >= 1  # joined, an outer step
            live = list(values_by_instance("diloco_server_live_learners").values())
            return restarted and trains and live == [3]

        wait_for(
            "learner-2 joined again, trains (an outer step), and the server has 3 live learners",
            rejoined,
            deadline,
        )
        versions = {
            r["metric"]["fragment"]: r["value"][1]
            for r in instant_query(PROMETHEUS, "diloco_server_fragment_version")
        }
        log(f"fragment versions now: {versions}")
        log(f"PASS in {time.monotonic() - started:.0f} s")
        return 0
    except RuntimeError as err:
        log(f"FAIL: {err}")
        subprocess.run([*compose, "logs", "--no-color", "--tail", "20"], cwd=REPO, env=env)
        return 1
    finally:
        if not args.keep:
            subprocess.run([*compose, "down", "-v"], cwd=REPO, env=env, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
