"""Split a model's parameters into P fragments (Streaming DiLoCo).

    layout_fragments(names, numels, num_fragments=2, layout="strided") -> [[0, 1, 5], [2, 3, 4]]

Layouts:
- `strided` (default): transformer block i goes to fragment i mod P, so every fragment spans
  the depth of the network (the Streaming DiLoCo paper's best pattern).
- `sequential`: blocks are cut into P consecutive runs.
- `balanced`: greedy bin-packing of single tensors by size (largest first, into the lightest
  fragment), for models that are not a stack of blocks.

For `strided` and `sequential`, a parameter is in block i when its name contains
`blocks.i.`, `layers.i.` or `h.i.`. Parameters outside the blocks (embeddings, final norm,
output head) are placed after the blocks, largest first, each into the fragment that holds
the fewest values at that point (ties: the lowest fragment id). That keeps the largest
fragment, and so the peak bytes of one sync, close to 1/P of the model even when the
embeddings are a large share of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

LAYOUTS = ("strided", "sequential", "balanced")
_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


def block_index(name: str) -> int | None:
    """The transformer block a parameter belongs to, or None outside the blocks."""
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


def layout_fragments(
    names: Sequence[str], numels: Sequence[int], num_fragments: int, layout: str = "strided"
) -> list[list[int]]:
    """Parameter indices of each fragment; raises ValueError if a fragment would be empty."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if num_fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {num_fragments}")
    if len(names) < num_fragments:
        raise ValueError(f"cannot split {len(names)} parameters into {num_fragments} fragments")
    if num_fragments == 1:
        return [list(range(len(names)))]  # any model is one fragment, whatever the layout
    if layout == "balanced":
        groups = _balanced(numels, num_fragments)
    else:
        groups = _by_block(names, numels, num_fragments, layout)
    return [sorted(g) for g in groups]


def _by_block(
    names: Sequence[str], numels: Sequence[int], parts: int, layout: str
) -> list[list[int]]:
    blocks = [block_index(n) for n in names]
    distinct = sorted({b for b in blocks if b is not None})
    if len(distinct) < parts:
        raise ValueError(
            f"{layout} layout needs at least {parts} blocks (named blocks.i / layers.i / h.i), "
            f"the model has {len(distinct)}; use --layout balanced"
        )
    rank = {b: i for i, b in enumerate(distinct)}
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    outside = []
    for index, block in enumerate(blocks):
        if block is None:
            outside.append(index)
            continue
        r = rank[block]
        part = r % parts if layout == "strided" else r * parts // len(distinct)
        groups[part].append(index)
        loads[part] += numels[index]
    _place_greedily(outside, numels, groups, loads)
    return groups


def _balanced(numels: Sequence[int], parts: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(parts)]
    _place_greedily(range(len(numels)), numels, groups, [0] * parts)
    return groups


def _place_greedily(
    indices: Iterable[int], numels: Sequence[int], groups: list[list[int]], loads: list[int]
) -> None:
    """Largest first, each tensor into the lightest fragment; ties by index, so every
    machine computes the same layout."""
    for index in sorted(indices, key=lambda i: (-numels[i], i)):
        lightest = min(range(len(groups)), key=lambda p: (loads[p], p))
        groups[lightest].append(index)
        loads[lightest] += numels[index]
