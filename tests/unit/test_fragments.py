"""Fragment layouts: strided, sequential, balanced, and where non-block parameters go."""

import pytest

from common.fragments import block_index, layout_fragments

# A GPT-like parameter list: embeddings, 4 blocks of 2 tensors, final norm.
NAMES = ["tok_emb.weight", "pos_emb.weight"]
NAMES += [f"blocks.{i}.{t}" for i in range(4) for t in ("attn.weight", "mlp.weight")]
NAMES += ["ln_f.weight"]
NUMELS = [100, 50] + [40, 80] * 4 + [10]


def blocks_of(group: list[int]) -> set:
    return {block_index(NAMES[i]) for i in group}


def test_strided_puts_block_i_in_fragment_i_mod_p() -> None:
    groups = layout_fragments(NAMES, NUMELS, 2, "strided")
    assert blocks_of(groups[0]) - {None} == {0, 2}
    assert blocks_of(groups[1]) - {None} == {1, 3}


def test_non_block_parameters_go_to_the_lightest_fragment_largest_first() -> None:
    # Blocks weigh 120 each (3 fragments: blocks {0, 3}, {1}, {2}); then tok_emb (100) goes
    # to fragment 1 (tie with 2, lowest id), pos_emb (50) to fragment 2, ln_f (10) to 2.
    groups = layout_fragments(NAMES, NUMELS, 3, "strided")
    assert [NAMES[i] for i in groups[1] if block_index(NAMES[i]) is None] == ["tok_emb.weight"]
    assert [NAMES[i] for i in groups[2] if block_index(NAMES[i]) is None] == [
        "pos_emb.weight",
        "ln_f.weight",
    ]
    assert all(block_index(NAMES[i]) is not None for i in groups[0])


def test_sequential_cuts_consecutive_runs() -> None:
    groups = layout_fragments(NAMES, NUMELS, 2, "sequential")
    assert blocks_of(groups[0]) - {None} == {0, 1}
    assert blocks_of(groups[1]) - {None} == {2, 3}


def test_every_parameter_in_exactly_one_fragment() -> None:
    for layout in ("strided", "sequential", "balanced"):
        for parts in (1, 2, 3, 4):
            groups = layout_fragments(NAMES, NUMELS, parts, layout)
            assert sorted(i for g in groups for i in g) == list(range(len(NAMES)))
            assert all(groups)


def test_balanced_evens_out_sizes() -> None:
    groups = layout_fragments(NAMES, NUMELS, 3, "balanced")
    loads = [sum(NUMELS[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(NUMELS)
    assert loads == [
        sum(NUMELS[i] for i in g) for g in layout_fragments(NAMES, NUMELS, 3, "balanced")
    ]


def test_block_names_of_common_model_families() -> None:
    assert block_index("model.layers.12.mlp.up_proj.weight") == 12
    assert block_index("transformer.h.3.attn.c_attn.weight") == 3
    assert block_index("lm_head.weight") is None


@pytest.mark.parametrize(
    "names, parts, layout, message",
    [
        (NAMES, 5, "strided", "needs at least 5 blocks"),
        (NAMES, 2, "zigzag", "layout must be one of"),
        (NAMES[:2], 3, "balanced", "cannot split 2 parameters"),
        (NAMES, 0, "strided", "fragments must be >= 1"),
    ],
)
def test_bad_layouts_are_refused(names, parts, layout, message) -> None:
    with pytest.raises(ValueError, match=message):
        layout_fragments(names, [1] * len(names), parts, layout)
