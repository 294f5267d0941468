"""The compose smoke test builds its base image from Debian's main archive, whatever else apt
lists (a security archive listed last has no Release file for the plain suite)."""

from deploy.compose_smoke import main_archive_mirror

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


def test_no_stanza_for_the_suite_falls_back_to_debians_default() -> None:
    assert main_archive_mirror([SECURITY]) == "http://deb.debian.org/debian"
    assert main_archive_mirror([]) == "http://deb.debian.org/debian"
