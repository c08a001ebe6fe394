"""Plot: the objective (throughput per cost by default) against ``n_a`` for each ``m``."""

from __future__ import annotations

from pathlib import Path

from afdserve.planner.catalog import GPUSpec
from afdserve.planner.profile import Profile
from afdserve.planner.plan import Plan
from afdserve.planner.search import sweep
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec

__all__ = ["plot_objective_vs_na"]

_LABEL = {
    "cost": "throughput per cost (tok/s per price unit)",
    "gpu": "throughput per GPU (tok/s)",
    "watt": "throughput per watt (tok/s/W)",
}


def plot_objective_vs_na(
    path: str | Path,
    spec: ModelSpec,
    best: Plan,
    gpu_a: GPUSpec,
    gpu_e: GPUSpec,
    objective: str,
    config: SearchConfig | None = None,
    profile: Profile | None = None,
    estimate: bool = True,
) -> None:
    """Sweep ``n_a`` and ``m`` at the best plan's GPUs, TP sizes and experts per node; write a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = sweep(spec, best, gpu_a, gpu_e, config, profile)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for m, points in sorted(data.items()):
        xs = [n for n, p in points if p is not None]
        ys = [p.objective_value(objective) for _, p in points if p is not None]
        if xs:
            ax.plot(xs, ys, marker="o", ms=3, label=f"m = {m}")
    ax.scatter(
        [best.n_a],
        [best.objective_value(objective)],
        s=120,
        facecolors="none",
        edgecolors="k",
        zorder=5,
        label="chosen plan",
    )
    ax.set_xlabel("attention nodes n_a")
    ax.set_ylabel(_LABEL.get(objective, objective))
    src = "roofline estimate" if estimate else "profile"
    ax.set_title(
        f"{spec.name}: attention {gpu_a.name} (tp {best.tp_a}), experts {gpu_e.name} (tp {best.tp_e}), "
        f"n_e = {best.n_e} [{src}]",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
    plt.close(fig)
