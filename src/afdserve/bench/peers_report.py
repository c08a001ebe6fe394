"""The peer benchmark's results: per point (batch size) and engine the median tok/s with its spread,
the ratio to vLLM, the memory-bandwidth bound and each engine's fraction of it; a table, a JSON
document and a PNG (``afdserve.bench.peers``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from afdserve.bench.peer_bound import Bound
from afdserve.bench.peers import REFERENCE


def points(summary: dict[str, dict[int, dict]], bounds: dict[int, Bound]) -> list[dict[str, Any]]:
    """One row per batch size: its bound and, per engine, the summary plus ``of_bound``."""
    rows = []
    for b, bound in sorted(bounds.items()):
        engines = {}
        for name, by_batch in summary.items():
            if b in by_batch:
                engines[name] = dict(by_batch[b], of_bound=by_batch[b]["median"] / bound.tok_s)
        rows.append({"batch": b, "bound": asdict(bound), "engines": engines})
    return rows


def table(rows: list[dict[str, Any]], new_tokens: dict[int, int], bandwidth: float) -> str:
    """The stdout table: one block per batch size, one line per engine."""
    lines = [f"memory-bandwidth bound: bytes a run moves / {bandwidth / 1e9:.1f} GB/s (torch copy, read + written)"]
    for row in rows:
        bd = row["bound"]
        lines.append("")
        lines.append(f"batch {row['batch']}, {new_tokens[row['batch']]} new tokens: bound {bd['tok_s']:,.0f} tok/s "
                     f"(decode step {bd['decode_step_bytes'] / 1e6:.1f} MB = weights {bd['weight_step_bytes'] / 1e6:.1f}"
                     f" + KV {bd['kv_step_bytes'] / 1e6:.2f}; experts per layer: {bd['experts_touched']:.2f}, "
                     f"{bd['basis']})")
        lines.append(f"  {'engine':<28} {'median tok/s':>12} {'min':>8} {'max':>8} {'vs ' + REFERENCE:>8} {'of bound':>9}")
        for name, e in row["engines"].items():
            ratio = f"{e['vs_' + REFERENCE]:.2f}x" if "vs_" + REFERENCE in e else "-"
            lines.append(f"  {name:<28} {e['median']:>12,.0f} {e['min']:>8,.0f} {e['max']:>8,.0f} {ratio:>8} "
                         f"{e['of_bound']:>8.0%}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Grouped bars per batch size: each engine's median tok/s with min-max whiskers, the bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for r in rows for n in r["engines"]))
    fig, axes = plt.subplots(1, len(rows), figsize=(4.5 * len(rows) + 1, 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for i, name in enumerate(names):
            e = row["engines"].get(name)
            if e is None:
                continue
            ax.bar(i, e["median"], color=f"C{i}", label=name,
                   yerr=[[e["median"] - e["min"]], [e["max"] - e["median"]]], capsize=4)
            ax.text(i, e["max"], f"{e['of_bound']:.0%}", ha="center", va="bottom", fontsize=8)
        ax.axhline(row["bound"]["tok_s"], color="k", ls="--", lw=1, label="memory-bandwidth bound")
        ax.set_title(f"batch {row['batch']}")
        ax.set_xticks([])
        ax.set_ylabel("tok/s (median, min-max; % of bound)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
