"""The benchmarks' figures are optional: without matplotlib they say so and go on."""

from __future__ import annotations

import sys

from bench import plotting


def test_without_matplotlib_no_plot_is_written_and_the_reason_printed(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plotting.pyplot() is None
    assert (
        "matplotlib missing (pip install -e '.[bench]'): no plot written" in capsys.readouterr().out
    )
