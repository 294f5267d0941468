"""What a daemon's start costs, in CPU seconds: why a restart is slow on a busy machine.

    .venv/bin/python -m bench.startup --out bench/results/startup.json

Each phase runs in a fresh Python process (nothing imported yet) and is measured in that
process's CPU time, which a loaded machine stretches in wall-clock time but hardly changes:

- `import torch`, and importing each daemon's entry module (server.main, learner.main);
- the learner's first AdamW (torch imports its compiler, torch._dynamo, on the first call
  of an optimizer method, to mark those methods as not to be compiled);
- the learner's corpus: finding the stdlib's text files without walking site-packages and
  the test suite (learner/data.py's text_files), against a walk of the whole folder
  (Path.rglob) that finds the same files, and loading the corpus (1 MB).

Medians of `--repeats` processes. In the chaos harness (deploy/chaos.py) a killed daemon's
restart pays all of this before it serves or joins.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from deploy.launcher import REPO

_TIMED = """
import time
from pathlib import Path
{setup}
started = time.process_time()
{code}
print(time.process_time() - started)
"""
_CORPUS = "from learner.data import STDLIB_SKIP, TEXT_SUFFIXES, load_corpus, stdlib_dir, text_files"
PHASES = {
    "import_torch": ("", "import torch"),
    "import_server_main": ("", "import server.main"),
    "import_learner_main": ("", "import learner.main"),
    "first_adamw": (
        "import torch",
        "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])",
    ),
    "corpus_files_pruned_walk": (_CORPUS, "files = text_files(stdlib_dir(), STDLIB_SKIP)"),
    "corpus_files_full_walk": (
        _CORPUS,
        "root = stdlib_dir()\n"
        "files = sorted(p for p in root.rglob('*') if p.suffix in TEXT_SUFFIXES and p.is_file()"
        " and p.relative_to(root).parts[0] not in STDLIB_SKIP)",
    ),
    "load_corpus_1mb": (_CORPUS, "load_corpus('stdlib', 1_000_000)"),
}


def cpu_seconds(setup: str, code: str) -> float:
    """The CPU time `code` takes in a fresh interpreter, after `setup`."""
    script = _TIMED.format(setup=setup, code=code)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    figures = {
        name: statistics.median(cpu_seconds(setup, code) for _ in range(args.repeats))
        for name, (setup, code) in PHASES.items()
    }
    result = {"cpu_s": figures, "repeats": args.repeats}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
