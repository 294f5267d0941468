"""matplotlib for the benchmarks' figures, which are optional: without it (`pip install -e
'.[bench]'` adds it) a benchmark still prints and writes its JSON and says that no plot was
written, instead of failing after its runs."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (said once per call) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot written")
        return None
    return plt
