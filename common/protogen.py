"""Regenerate the Python gRPC stubs from proto/ (what `make proto` runs).

    python -m common.protogen            # rewrite common/generated/
    python -m common.protogen --check    # exit 1 if the committed stubs are stale

protoc names imports after the .proto path under the include root (`from diloco.v1 import
aggregator_pb2`); the generated package lives under common/generated, so that one import is
rewritten to a relative one.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
GENERATED = REPO / "common" / "generated"
_ABSOLUTE_IMPORT = re.compile(r"^from diloco\.v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under proto/ into out_dir; returns the files written."""
    from grpc_tools import protoc  # a development dependency, needed only here

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(map(str, protos)))
    written = sorted(p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in written:
        path.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1", path.read_text()))
    for path in written:
        folder = path.parent
        while folder != out_dir:
            (folder / "__init__.py").touch()
            folder = folder.parent
    (out_dir / "__init__.py").touch()
    return written


def stale_files(committed: Path = GENERATED) -> list[str]:
    """Generated files that differ from (or are missing in) the committed tree."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = []
        for path in sorted(fresh.rglob("*.py*")):
            rel = path.relative_to(fresh)
            other = committed / rel
            if not other.exists() or not filecmp.cmp(path, other, shallow=False):
                stale.append(str(rel))
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated code (run `make proto`): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    GENERATED.mkdir(parents=True, exist_ok=True)
    generate(GENERATED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
