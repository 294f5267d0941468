"""Tables on stdout, JSON and PNG plots for the simulator's results.

matplotlib is imported inside the plot functions only, so the simulator itself runs where
it is not installed; asking for a plot without it fails with one clear sentence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.sim.paper import DECOUPLED_DILOCO_GOODPUT, TARGETS

RESULTS = Path(__file__).resolve().parent.parent / "results"


def table4_text(rows: list[dict]) -> str:
    """Paper vs ours, Gbit/s per target utilisation, one line per model and method."""
    head = "model  method                                    " + "  ".join(
        f"{u:>13.0%}" for u in TARGETS
    )
    lines = [head, "       (paper / ours Gbit/s)"]
    for row in rows:
        cells = "  ".join(
            f"{p:>6.1f}/{o:<6.1f}" for p, o in zip(row["paper_gbps"], row["ours_gbps"], strict=True)
        )
        lines.append(f"{row['model']:<6} {row['method']:<41} {cells}")
    return "\n".join(lines)


def goodput_text(curve: list[dict]) -> str:
    keys = [k for k in curve[0] if k.startswith("quorum_")]
    head = "failures/chip-year  elastic DP  " + "  ".join(
        f"{k.replace('_', ' '):>22}" for k in keys
    )
    lines = [
        head,
        "                    goodput     " + "  ".join(f"{'goodput (uptime)':>22}" for _ in keys),
    ]
    for point in curve:
        cells = "  ".join(f"{point[k]['goodput']:>13.1%} ({point[k]['uptime']:.1%})" for k in keys)
        lines.append(
            f"{point['failures_per_chip_year']:>18g}  {point['elastic_dp']['goodput']:>10.1%}  "
            f"{cells}"
        )
    lines.append(
        "paper (1.2M chips, 1/chip-year): "
        + ", ".join(f"{k} {v:.0%}" for k, v in DECOUPLED_DILOCO_GOODPUT.items())
    )
    return "\n".join(lines)


def write_json(payload: dict, path: Path) -> None:
    """JSON has no infinity: an unreachable target (inf Gbit/s) is written as null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=1) + "\n")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(
            "plots need matplotlib: pip install matplotlib, or pass --no-plots"
        ) from err
    return plt


def plot_table4(rows: list[dict], path: Path) -> None:
    """Bandwidth needed against target utilisation: paper dashed, ours solid, per model."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True)
    for ax, model in zip(axes, models, strict=True):
        for i, row in enumerate(r for r in rows if r["model"] == model):
            color = f"C{i}"
            xs = [u * 100 for u in TARGETS]
            ax.plot(xs, row["ours_gbps"], "-o", color=color, label=f"{row['method']} (ours)")
            ax.plot(xs, row["paper_gbps"], "--x", color=color, alpha=0.6)
        ax.set_yscale("log")
        ax.set_title(f"{model} (dashed: paper, solid: ours)")
        ax.set_xlabel("target compute utilisation (%)")
    axes[0].set_ylabel("WAN bandwidth needed (Gbit/s)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_goodput(curve: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [p["failures_per_chip_year"] for p in curve]
    ax.plot(rates, [p["elastic_dp"]["goodput"] for p in curve], "-o", label="elastic data-parallel")
    for i, key in enumerate(k for k in curve[0] if k.startswith("quorum_")):
        n = key.split("_")[1]
        ax.plot(
            rates,
            [p[key]["goodput"] for p in curve],
            "-o",
            color=f"C{i + 1}",
            label=f"quorum, {n} learners (goodput)",
        )
        ax.plot(
            rates,
            [p[key]["uptime"] for p in curve],
            ":",
            color=f"C{i + 1}",
            label=f"quorum, {n} learners (uptime)",
        )
    paper_x = 1.0
    for label, value in DECOUPLED_DILOCO_GOODPUT.items():
        ax.plot([paper_x], [value], "k*")
        ax.annotate(
            f"paper: {label}",
            (paper_x, value),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("failures per chip-year (1.2M chips)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
