"""The papers' published figures the simulator is checked against (quoted, not computed).

Streaming DiLoCo Table 4 — Douillard et al., "Streaming DiLoCo with overlapping
communication: Towards a Distributed Free Lunch", arXiv 2501.18512 (v1, Jan 2025), Table 4:
"Simulation: we estimate the step time (pure compute) of 10B and 100B based on the required
flops using Kaplan et al. (2020) rule and using a MFU of 60%. For all DiLoCo and Streaming
DiLoCo-variants, we use H=100. For all Streaming DiLoCo-variants, we use a fragment size of
3 layers." Cells: Gbit/s to reach a compute utilisation of 50/80/90/95/99 %.
(The paper reads its values off a discrete, log-spaced bandwidth grid — steps of about
1.21x — so each cell is the first grid point that reaches the target.)

Decoupled DiLoCo — arXiv 2604.21428 (2026): modelled goodput at 1.2 million chips with one
failure per chip-year: 58 % for elastic data-parallel, 88 % for Decoupled DiLoCo with 8
learners and 93 % with 16 learners.
"""

from __future__ import annotations

TARGETS = (0.50, 0.80, 0.90, 0.95, 0.99)

# (model label, transformer layers, step time in seconds)
TABLE4_MODELS = (("1B", 24, 0.1), ("10B", 48, 0.8), ("100B", 108, 4.9))

TABLE4_METHODS = (
    "Data-Parallel",
    "Vanilla DiLoCo",
    "Streaming DiLoCo",
    "Streaming DiLoCo w/ overlapped com.",
    "Streaming DiLoCo w/ overlapped FP4 com.",
)

# STREAMING_DILOCO_TABLE4[model][method] = Gbit/s for TARGETS, as printed in arXiv 2501.18512.
STREAMING_DILOCO_TABLE4: dict[str, dict[str, tuple[float, ...]]] = {
    "1B": {
        "Data-Parallel": (86.8, 152.6, 184.2, 222.3, 569.0),
        "Vanilla DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
        "Streaming DiLoCo": (1.4, 5.2, 9.1, 16.0, 28.1),
        "Streaming DiLoCo w/ overlapped com.": (1.4, 4.3, 6.2, 9.1, 11.0),
        "Streaming DiLoCo w/ overlapped FP4 com.": (0.4, 0.9, 1.7, 2.0, 3.0),
    },
    "10B": {
        "Data-Parallel": (104.8, 222.3, 222.3, 268.3, 471.5),
        "Vanilla DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8),
        "Streaming DiLoCo": (1.7, 5.2, 9.1, 13.3, 19.3),
        "Streaming DiLoCo w/ overlapped com.": (1.7, 3.6, 5.2, 6.2, 7.5),
        "Streaming DiLoCo w/ overlapped FP4 com.": (0.4, 0.9, 1.4, 1.4, 1.7),
    },
    "100B": {
        "Data-Parallel": (184.2, 323.8, 390.7, 390.7, 471.5),
        "Vanilla DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2),
        "Streaming DiLoCo": (2.4, 6.2, 9.1, 11.0, 19.3),
        "Streaming DiLoCo w/ overlapped com.": (1.7, 3.6, 4.3, 5.2, 5.2),
        "Streaming DiLoCo w/ overlapped FP4 com.": (0.5, 0.9, 1.1, 1.1, 1.4),
    },
}

# DECOUPLED_DILOCO_GOODPUT[method] = goodput at 1.2M chips, 1 failure per chip-year.
DECOUPLED_DILOCO_CHIPS = 1_200_000
DECOUPLED_DILOCO_FAILURES_PER_CHIP_YEAR = 1.0
DECOUPLED_DILOCO_GOODPUT: dict[str, float] = {
    "elastic data-parallel": 0.58,
    "quorum, 8 learners": 0.88,
    "quorum, 16 learners": 0.93,
}
