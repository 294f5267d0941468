"""`make compose-smoke`: build the image, run 2 aggregator shards and 3 learners, kill a shard.

    python deploy/compose_smoke.py [--timeout-s 600] [--keep]

Needs a running Docker engine and Compose: the `docker-compose` command (e.g. Debian's docker.io
and docker-compose packages), or else the Docker CLI's `docker compose` plugin. Works offline:
if no base image is given (BASE_IMAGE), one is built from Debian packages with debootstrap
(root), including Debian's prometheus for the Prometheus container (PROMETHEUS_IMAGE, by
default the base image: it needs a `prometheus` command); wheels come from pip's configured
index into deploy/wheels/. Runs with deploy/docker-compose.host.yml, so every container uses
host networking on 127.0.0.1. Grafana is left out here (no offline image); its provisioning
is checked by tests/unit/test_deploy_manifests.py.

Steps, each bounded in time: build; up 2 server shards + 3 learners + Prometheus; wait until
Prometheus has every target up, every learner has finished outer steps and each shard has
closed a round of the fragment it owns; `kill -9` shard 1; check that shard 0's fragment
versions keep rising while shard 1 is down (at least OUTAGE_VERSIONS more);
start shard 1 again and wait until it is back with no served version lost (its fragment
at or past the version it had when killed) and advancing again; tear everything down
(always). Every check reads Prometheus, never the containers' logs.
"""

from __future__ import annotations

import argparse
import os
import re
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
IMAGE_PYTHON = (3, 11)  # Debian bookworm's python3, in DEFAULT_BASE
IMAGE = "decoupled-diloco:dev"
PROJECT = "diloco-smoke"
PROMETHEUS = "http://127.0.0.1:19090"
SHARDS = ["server-0", "server-1"]
LEARNERS = ["learner-1", "learner-2", "learner-3"]
SERVICES = [*SHARDS, *LEARNERS, "prometheus"]
OUTAGE_VERSIONS = 2  # versions the live shard must close while the other is down


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(*argv: str, env: dict | None = None, quiet: bool = False) -> str:
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or "")[-2000:] if quiet else ""
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({result.returncode}) {detail}")
    return result.stdout or ""


# `deb [options] URI suite components`; the options, if any, in brackets (spaces allowed).
ONE_LINE_SOURCE = re.compile(r"deb\s+(?:\[[^\]]*\]\s*)?(?P<uri>\S+)\s+(?P<suite>\S+)")


def apt_entries(text: str) -> list[tuple[str, list[str]]]:
    """(URI, suites) of each `deb` source in one apt sources file, deb822 stanzas
    (`*.sources`) or one-line entries (`sources.list`, `*.list`: `deb [options] URI suite
    components`)."""
    entries = []
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(":", 1) for line in stanza.splitlines() if ":" in line and line[0] != "#"
        )
        enabled = fields.get("Enabled", "yes").strip().lower() != "no"
        if enabled and fields.get("URIs", "").strip():
            entries.append((fields["URIs"].split()[0], fields.get("Suites", "").split()))
    for line in text.splitlines():
        one_line = ONE_LINE_SOURCE.match(line.split("#", 1)[0].strip())
        if one_line:
            entries.append((one_line["uri"], [one_line["suite"]]))
    return entries


def main_archive_mirror(sources: list[str], suite: str = "bookworm") -> str:
    """The mirror of Debian's main archive for `suite` among apt's sources files: the first
    entry that lists the suite itself (not `-security` or `-updates`, whose archives have no
    Release file for the plain suite, so debootstrap cannot use them); Debian's default when
    none does."""
    for text in sources:
        for uri, suites in apt_entries(text):
            if suite in suites:
                return uri
    return "http://deb.debian.org/debian"


def apt_sources_files() -> list[Path]:
    """apt's sources files in apt's order: sources.list, then sources.list.d/ by name."""
    listed = Path("/etc/apt/sources.list")
    extra = sorted(Path("/etc/apt/sources.list.d").glob("*"))
    return [p for p in [listed, *extra] if p.suffix in (".list", ".sources") and p.is_file()]


def images(environ: dict[str, str]) -> tuple[str, str]:
    """(base image, Prometheus image): BASE_IMAGE, or the one built here, which also holds
    Debian's prometheus; PROMETHEUS_IMAGE, or the base image (so a BASE_IMAGE without a
    `prometheus` command needs a PROMETHEUS_IMAGE too)."""
    base = environ.get("BASE_IMAGE") or DEFAULT_BASE
    return base, environ.get("PROMETHEUS_IMAGE") or base


def ensure_base_image(base: str) -> None:
    """The base image, built with debootstrap if it is the default one and absent; a
    BASE_IMAGE that is not local is a RuntimeError (nothing is pulled)."""
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode == 0:
        return
    if base != DEFAULT_BASE:
        raise RuntimeError(
            f"base image {base} is not in the local Docker engine (pull or build it first, or "
            "leave BASE_IMAGE unset to build one with debootstrap)"
        )
    log(f"building {base} with debootstrap (about 2 minutes)")
    mirror = main_archive_mirror([source.read_text() for source in apt_sources_files()])
    log(f"debootstrap mirror: {mirror}")
    rootfs = Path("/tmp/diloco-rootfs")
    shutil.rmtree(rootfs, ignore_errors=True)
    packages = "python3,python3-venv,python3-pip,ca-certificates,prometheus,gcc,libc6-dev"
    sh("debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs), mirror)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", base], stdin=tar.stdout, check=True)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)


def wheel_python_problem(base: str, host: tuple[int, int]) -> str | None:
    """Why pip on this host cannot fill deploy/wheels/ for the image, or None: pip downloads
    wheels for its own Python, and the image built here runs Debian bookworm's 3.11."""
    if base != DEFAULT_BASE or host == IMAGE_PYTHON:
        return None
    image, here = ".".join(map(str, IMAGE_PYTHON)), ".".join(map(str, host))
    return (
        f"the base image runs Python {image} but this is Python {here}, so pip here would "
        f"download wheels the image cannot install: run it from a Python {image} venv "
        f"(make compose-smoke PYTHON=python{image}, after make clean) or put {image} wheels in "
        "deploy/wheels/"
    )


def ensure_wheels(base: str) -> None:
    if any(WHEELS.glob("torch-*.whl")):
        return
    problem = wheel_python_problem(base, sys.version_info[:2])
    if problem:
        raise RuntimeError(problem)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.startswith("torch")]
    torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")
    log(f"downloading wheels into {WHEELS}")
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(WHEELS)]
    sh(*pip, torch_spec, *deps, "setuptools>=68", "wheel")


def compose_command(which=shutil.which, run=subprocess.run) -> list[str] | None:
    """How to call Compose here: the `docker-compose` command if there is one, else the
    Docker CLI's compose plugin (`docker compose`), else None."""
    if which("docker-compose"):
        return ["docker-compose"]
    try:
        plugin = run(["docker", "compose", "version"], capture_output=True).returncode == 0
    except FileNotFoundError:  # no docker at all
        return None
    return ["docker", "compose"] if plugin else None


def host_network_config(compose: list[str], env: dict) -> str:
    """docker-compose.yml with the host-network override applied, as one file.

    Compose v1 cannot remove a key in an override, and published ports are refused with host
    networking, so they are dropped here (every port is then on 127.0.0.1 already).
    """
    # -p: Compose v2 writes each volume's full name, project included, into the merged file.
    merged = sh(
        *compose, "-p", PROJECT, "-f", "deploy/docker-compose.yml",
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


def owned_versions(shard: int, over_time: str = "") -> dict[str, float]:
    """The versions of the fragments a shard owns ({} while it is down; a fragment without
    values yet, at -1, is left out). `over_time`: e.g. max_over_time, over the last 10 min."""
    expr = f'diloco_server_fragment_version{{shard="{shard}"}}'
    expr = f"{over_time}({expr}[10m]) >= 0" if over_time else f"{expr} >= 0"
    return {r["metric"]["fragment"]: float(r["value"][1]) for r in instant_query(PROMETHEUS, expr)}


def shard_up(shard: int) -> bool:
    return [float(r["value"][1]) for r in instant_query(PROMETHEUS, f'up{{shard="{shard}"}}')] == [
        1
    ]


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
    if shutil.which("docker") is None:
        parser.exit(2, "compose_smoke: error: docker not found (install Docker)\n")
    compose_tool = compose_command()
    if compose_tool is None:
        parser.exit(
            2,
            "compose_smoke: error: neither docker-compose nor the docker compose plugin found "
            "(install one, e.g. Debian's docker-compose)\n",
        )
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        parser.exit(2, "compose_smoke: error: the Docker engine is not running (start dockerd)\n")
    base, prometheus_image = images(dict(os.environ))
    started = time.monotonic()
    try:
        ensure_wheels(base)  # first: a Python mismatch ends it before debootstrap runs
        ensure_base_image(base)
    except RuntimeError as err:
        parser.exit(2, f"compose_smoke: error: {err}\n")
    log("building the image")
    sh(
        "docker", "build", "-q", "--network", "host", "-f", "deploy/Dockerfile",
        "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, ".",
    )  # fmt: skip
    env = {**os.environ, "DILOCO_IMAGE": IMAGE, "PROMETHEUS_IMAGE": prometheus_image}
    compose = [*compose_tool, "-p", PROJECT, "-f", host_network_config(compose_tool, env)]
    try:
        sh(*compose, "up", "-d", "--no-build", *SERVICES, env=env)
        targets = len(SHARDS) + len(LEARNERS)
        wait_for(
            f"Prometheus sees all {targets} targets up",
            lambda: sum(values_by_instance("up").values()) == targets,
            deadline,
        )
        wait_for(
            "every learner has completed 2 outer steps and each shard has closed a round",
            lambda: (
                (v := values_by_instance("diloco_learner_outer_steps_total"))
                and len(v) == len(LEARNERS)
                and min(v.values()) >= 2
                and all(min(owned_versions(i).values(), default=0) >= 1 for i in (0, 1))
            ),
            deadline,
        )
        log("kill -9 shard 1 (server-1)")
        sh(*compose, "kill", "-s", "SIGKILL", "server-1", env=env)
        wait_for("Prometheus sees shard 1 down", lambda: not shard_up(1), deadline)
        killed_at = owned_versions(1, "max_over_time")  # the newest it was seen to serve
        before = owned_versions(0)
        log(f"at the kill: shard 0 {before}, shard 1 {killed_at}")
        wait_for(
            f"shard 0 closes {OUTAGE_VERSIONS} more versions of each fragment it owns",
            lambda: all(
                owned_versions(0).get(f, -1) >= v + OUTAGE_VERSIONS for f, v in before.items()
            ),
            deadline,
        )
        if shard_up(1):
            raise RuntimeError("shard 1 came back before the check ended: no outage measured")
        log(f"during the outage: shard 0 {owned_versions(0)}; start shard 1 again")
        sh(*compose, "start", "server-1", env=env)
        wait_for(
            "shard 1 is scraped again",
            lambda: shard_up(1) and owned_versions(1).keys() == killed_at.keys(),
            deadline,
        )
        back = owned_versions(1)  # its first scrape: what it restored from its state dir
        if any(back[f] < v for f, v in killed_at.items()):
            raise RuntimeError(f"shard 1 lost served versions: {killed_at} before, {back} after")
        wait_for(
            "shard 1 closes a new round of each fragment it owns",
            lambda: all(owned_versions(1).get(f, -1) >= v + 1 for f, v in back.items()),
            deadline,
        )
        versions = {i: owned_versions(i) for i in (0, 1)}
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
