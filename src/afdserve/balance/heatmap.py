"""Per-layer expert load heatmap of a :class:`LoadSnapshot` (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from afdserve.balance.load import LoadSnapshot
from afdserve.errors import ConfigError


def draw_heatmap(
    snapshot: LoadSnapshot,
    out: str | Path,
    *,
    layers: Sequence[int] | None = None,
    relative: bool = False,
    coactivation_layer: int | None = None,
    title: str | None = None,
) -> Path:
    """Writes a PNG: rows are layers, columns experts, colour the tokens per step each expert got.

    ``relative`` colours load divided by the layer's mean instead (1 = perfectly balanced). A side
    panel shows each layer's max/mean load. ``coactivation_layer`` adds that layer's expert x expert
    co-activation matrix.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(range(snapshot.num_layers)) if layers is None else [int(l) for l in layers]
    for l in rows + ([coactivation_layer] if coactivation_layer is not None else []):
        if not 0 <= l < snapshot.num_layers:
            raise ConfigError(f"layer {l} not in the snapshot (it has {snapshot.num_layers} layers)")
    if coactivation_layer is not None and snapshot.coactivation is None:
        raise ConfigError("the snapshot has no co-activation counts")
    load = snapshot.tokens_per_step()[rows]
    mean = load.mean(axis=1, keepdims=True)
    imbalance = np.divide(load.max(axis=1), mean[:, 0], out=np.zeros(len(rows)), where=mean[:, 0] > 0)
    shown = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0) if relative else load

    panels = 3 if coactivation_layer is not None else 2
    ratios = [8, 1.2] + ([5] if panels == 3 else [])
    height = max(2.5, min(0.28 * len(rows) + 1.6, 14.0))
    width = 12.0 + (5.0 if panels == 3 else 0.0)
    fig, axes = plt.subplots(1, panels, figsize=(width, height), gridspec_kw={"width_ratios": ratios}, squeeze=False)
    ax, side = axes[0][0], axes[0][1]
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([str(l) for l in rows], fontsize=7 if len(rows) > 24 else 9)
    cb = fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)
    cb.set_label("load / layer mean" if relative else "tokens per step")
    side.barh(range(len(rows)), imbalance, color="tab:red")
    side.set_ylim(len(rows) - 0.5, -0.5)
    side.set_yticks([])
    side.set_xlabel("max / mean")
    if panels == 3:
        co = snapshot.coactivation_per_step()[coactivation_layer]
        cax = axes[0][2]
        im2 = cax.imshow(co, interpolation="nearest", cmap="magma")
        cax.set_title(f"co-activation, layer {coactivation_layer}", fontsize=10)
        cax.set_xlabel("expert")
        cax.set_ylabel("expert")
        fig.colorbar(im2, ax=cax, fraction=0.046, pad=0.02).set_label("tokens per step")
    fig.suptitle(title or f"expert load over {snapshot.steps} steps ({snapshot.num_experts} experts)")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
