"""Text and JSON renderings of search results (used by the CLI and the docs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from afdserve.planner.search import HeteroComparison, Plan, SearchResult

__all__ = ["plans_table", "plans_json", "pair_matrix", "comparison_table", "comparison_json", "format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _gb(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def _flags(p: Plan) -> str:
    out = []
    if not p.comm_hidden:
        out.append("Tc>=Tf")
    if not p.pipeline_full:
        out.append(f"m<{p.min_micro_batches}")
    if abs(p.balance_ratio - 1.0) > 0.2:
        out.append("unbal")
    return ",".join(out) or "ok"


def plans_table(plans: Sequence[Plan], top: int = 10) -> str:
    header = [
        "#",
        "attn",
        "expert",
        "tp_a",
        "tp_e",
        "n_a",
        "n_e",
        "m",
        "batch",
        "Ta ms",
        "Te ms",
        "Tc ms",
        "TBT ms",
        "tok/s",
        "tok/s/GPU",
        "tok/s/cost",
        "tok/s/kW",
        "GB/attn GPU",
        "GB/exp GPU",
        "pipeline",
    ]
    rows = []
    for i, p in enumerate(plans[:top], 1):
        rows.append(
            [
                str(i),
                p.attention_gpu,
                p.expert_gpu,
                str(p.tp_a),
                str(p.tp_e),
                str(p.n_a),
                str(p.n_e),
                str(p.micro_batches),
                f"{p.batch:,}",
                f"{p.ta_s * 1e3:.3f}",
                f"{p.te_s * 1e3:.3f}",
                f"{p.tc_s * 1e3:.3f}",
                f"{p.tbt_s * 1e3:.1f}",
                _num(p.throughput_tok_s),
                _num(p.throughput_per_gpu),
                _num(p.throughput_per_cost),
                _num(p.throughput_per_watt * 1e3),
                _gb(p.attention_mem_per_gpu_gb),
                _gb(p.expert_mem_per_gpu_gb),
                _flags(p),
            ]
        )
    return format_table(header, rows)


def pair_matrix(result: SearchResult) -> str:
    """Best objective value for every attention-GPU (rows) x expert-GPU (columns) pair searched."""
    best: dict[tuple[str, str], float] = {}
    for p in result.plans:  # best first
        best.setdefault((p.attention_gpu, p.expert_gpu), p.objective_value(result.objective))
    att = list(dict.fromkeys(a for a, _ in best))
    exp = list(dict.fromkeys(e for _, e in best))
    rows = [[f"attn {a}", *(_num(best.get((a, e))) for e in exp)] for a in att]
    return format_table([f"best tok/s/{result.objective}", *(f"exp {e}" for e in exp)], rows)


def plans_json(result: SearchResult, top: int | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    plans = result.plans if top is None else result.plans[:top]
    return {
        "plans": [p.to_json() for p in plans],
        "objective": result.objective,
        "estimate": result.estimate,
        "notes": result.notes,
        **(meta or {}),
    }


def _short(p: Plan | None) -> list[str]:
    if p is None:
        return ["-"] * 6
    return [
        f"{p.attention_gpu}+{p.expert_gpu}",
        f"{p.tp_a}/{p.tp_e}",
        f"{p.n_a}/{p.n_e}",
        str(p.micro_batches),
        f"{p.tbt_s * 1e3:.0f}",
        _num(p.throughput_per_cost) if p.throughput_per_cost is not None else _num(p.throughput_per_gpu),
    ]


def comparison_table(rows: Sequence[HeteroComparison]) -> str:
    header = [
        "model",
        "hetero attn+exp",
        "tp a/e",
        "n_a/n_e",
        "m",
        "TBT ms",
        "tok/s/cost",
        "homog attn+exp",
        "tp a/e",
        "n_a/n_e",
        "m",
        "TBT ms",
        "tok/s/cost",
        "hetero/homog",
    ]
    body = []
    for c in rows:
        gain = c.gain
        body.append(
            [c.model, *_short(c.best_hetero), *_short(c.best_homogeneous), "-" if gain is None else f"{gain:.2f}x"]
        )
    return format_table(header, body)


def comparison_json(rows: Sequence[HeteroComparison]) -> dict[str, Any]:
    return {
        "comparisons": [
            {
                "model": c.model,
                "objective": c.objective,
                "best_hetero": None if c.best_hetero is None else c.best_hetero.to_json(),
                "best_homogeneous": None if c.best_homogeneous is None else c.best_homogeneous.to_json(),
                "gain": c.gain,
            }
            for c in rows
        ]
    }
