"""The compose smoke test builds its base image from Debian's main archive, whatever else apt
lists (a security archive listed last has no Release file for the plain suite), and takes
its images from BASE_IMAGE and PROMETHEUS_IMAGE; it refuses to fill deploy/wheels/ from a Python
other than the built image's; it runs Compose as `docker-compose` or as the `docker compose`
plugin, whichever is installed."""

import subprocess

from deploy.compose_smoke import (
    DEFAULT_BASE,
    compose_command,
    images,
    main_archive_mirror,
    wheel_python_problem,
)

MAIN = """Types: deb
# a comment: with a colon
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
"""
SECURITY = """Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
"""


def test_the_main_archive_wins_over_a_security_archive_listed_after_it() -> None:
    assert main_archive_mirror([MAIN + "\n" + SECURITY]) == "http://mirror.example/debian"
    assert main_archive_mirror([SECURITY, MAIN]) == "http://mirror.example/debian"


def test_one_line_sources_are_read_too_options_and_comments_skipped() -> None:
    listed = (
        "# deb http://commented.example/debian bookworm main\n"
        "deb http://mirror.example/debian-security bookworm-security main\n"
        "deb-src http://source.example/debian bookworm main\n"
        "deb [ arch=amd64 signed-by=/usr/share/keyrings/k.gpg ] http://one.example/debian "
        "bookworm main  # the main archive\n"
    )
    assert main_archive_mirror([listed]) == "http://one.example/debian"
    assert main_archive_mirror([SECURITY, listed, MAIN]) == "http://one.example/debian"


def test_a_disabled_stanza_is_skipped() -> None:
    disabled = MAIN.replace("Components: main", "Components: main\nEnabled: no")
    assert main_archive_mirror([disabled]) == "http://deb.debian.org/debian"


def test_no_stanza_for_the_suite_falls_back_to_debians_default() -> None:
    assert main_archive_mirror([SECURITY]) == "http://deb.debian.org/debian"
    assert main_archive_mirror([]) == "http://deb.debian.org/debian"


def test_the_images_default_to_the_built_base_and_can_be_set_apart() -> None:
    assert images({}) == (DEFAULT_BASE, DEFAULT_BASE)
    assert images({"BASE_IMAGE": "py:3.11"}) == ("py:3.11", "py:3.11")
    assert images({"BASE_IMAGE": "py:3.11", "PROMETHEUS_IMAGE": "prom:2"}) == ("py:3.11", "prom:2")
    assert images({"BASE_IMAGE": ""}) == (DEFAULT_BASE, DEFAULT_BASE)  # empty: unset


def test_wheels_for_the_built_image_come_from_its_python_only() -> None:
    assert wheel_python_problem(DEFAULT_BASE, (3, 11)) is None
    problem = wheel_python_problem(DEFAULT_BASE, (3, 12))
    assert problem and "Python 3.11 but this is Python 3.12" in problem
    assert "PYTHON=python3.11" in problem
    assert wheel_python_problem("my/base:py312", (3, 12)) is None  # a base of the user's own


def test_compose_is_the_standalone_command_or_else_the_docker_plugin() -> None:
    def plugin(returncode: int):
        return lambda argv, **_: subprocess.CompletedProcess(argv, returncode)

    def which(installed: set[str]):
        return lambda tool: f"/usr/bin/{tool}" if tool in installed else None

    assert compose_command(which({"docker-compose"}), plugin(0)) == ["docker-compose"]
    assert compose_command(which(set()), plugin(0)) == ["docker", "compose"]
    assert compose_command(which(set()), plugin(1)) is None

    def no_docker(argv, **_):
        raise FileNotFoundError(argv[0])

    assert compose_command(which(set()), no_docker) is None
