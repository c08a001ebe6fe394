"""Text and JSON renderings of the planner's results, hardware catalog, model presets and profiles
(used by the CLI and the docs)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from afdserve.planner.alternatives import TERMS
from afdserve.planner.catalog import GPUSpec
from afdserve.planner.plan import Plan
from afdserve.planner.profile import Profile
from afdserve.planner.search import HeteroComparison, SearchResult
from afdserve.planner.search_config import SearchConfig
from afdserve.planner.spec import ModelSpec
from afdserve.planner.verdict import Comparison

__all__ = ["plans_table", "plans_json", "pair_matrix", "comparison_table", "comparison_json", "format_table",
           "gpu_table", "model_table", "search_header", "profile_summary", "families_table",
           "cases_summary"]


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


def gpu_table(gpus: Iterable[GPUSpec]) -> str:
    """The hardware catalog, one GPU a row."""
    rows = [
        [
            g.name,
            "-" if g.price is None else f"{g.price:.2f}",
            f"{g.memory_gb:g}",
            f"{g.mem_bw_gbs:g}",
            f"{g.tflops:g}",
            f"{g.power_w:g}",
            f"{g.net_gbps:g}",
            f"{g.intra_node_gbs:g}",
            str(g.nvlink_domain),
        ]
        for g in gpus
    ]
    return format_table(["GPU", "price", "GB", "GB/s", "TFLOPS", "W", "net Gb/s", "NVLink/PCIe GB/s", "GPUs/domain"],
                        rows)


def _params(spec: ModelSpec) -> str:
    n = spec.total_params
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def model_table(specs: Iterable[ModelSpec]) -> str:
    """Model specs, one a row."""
    rows = [
        [
            s.name,
            str(s.num_layers),
            str(s.hidden_size),
            str(s.intermediate_size),
            str(s.num_experts),
            str(s.top_k),
            f"{s.gqa_group:g}",
            str(s.num_shared_experts),
            f"{s.bytes_per_param:g}",
            _params(s),
        ]
        for s in specs
    ]
    return format_table(["model", "L", "h", "h'", "E", "K", "g", "shared", "B/param", "params"], rows)


def search_header(spec: ModelSpec, cfg: SearchConfig, profile_path: Path | None, estimate: bool) -> str:
    """The model, the search settings and where the constants came from."""
    src = (
        f"profile {profile_path}"
        if profile_path and not estimate
        else (
            f"profile {profile_path} + roofline estimate"
            if profile_path
            else "roofline ESTIMATE from catalog specs (not measured; pass --profile for measured constants)"
        )
    )
    return (
        f"model {spec.name}: L={spec.num_layers} h={spec.hidden_size} h'={spec.intermediate_size} "
        f"E={spec.num_experts} K={spec.top_k} g={spec.gqa_group:g} params={_params(spec)}\n"
        f"SLO {cfg.slo_s * 1e3:g} ms, seq_len {cfg.seq_len:g}, N_m {cfg.max_micro_batches}; constants: {src}"
    )


def profile_summary(prof: Profile) -> str:
    """A profile's constants, one per line."""
    lines = [f"model {prof.model}; device {prof.device}"]
    for a in prof.attention:
        lines.append(f"attention (tp {a.tp}): Ta = (k1_tok + k1_ctx*s)*b + k2: k1_tok {a.k1_tok * 1e6:.3f} us, "
                     f"k1_ctx {a.k1_ctx * 1e9:.3f} ns, k2 {a.k2 * 1e6:.1f} us "
                     f"(rmse {0 if a.rmse_s is None else a.rmse_s * 1e6:.1f} us, {a.n_samples} points)")
    for e in prof.expert:
        lines.append(f"experts x{e.experts_per_node:<2} Te = k3*b_e + k4: k3 {e.k3 * 1e6:.3f} us, "
                     f"k4 {e.k4 * 1e6:.1f} us (rmse {0 if e.rmse_s is None else e.rmse_s * 1e6:.1f} us)")
    if prof.network is not None:
        n = prof.network
        u = n.util_curve()
        lines.append(f"M2N one-way: latency {n.latency_s * 1e6:.1f} us, bandwidth {n.bandwidth_Bps / 1e9:.2f} GB/s; "
                     f"Util(64 KiB) {u(65536):.2f}, Util(1 MiB) {u(1 << 20):.2f}")
    lines.append(f"step overhead: {prof.step_fixed_s * 1e3:.3f} ms + {prof.step_per_token_s * 1e6:.1f} us/sequence")
    if prof.runtime is not None and (prof.runtime.lm_head_s or prof.runtime.lm_head_per_token_s):
        lines.append(f"LM head per micro-batch: {prof.runtime.lm_head_s * 1e3:.3f} ms + "
                     f"{prof.runtime.lm_head_per_token_s * 1e6:.1f} us/sequence")
    if prof.runtime is not None:
        r = prof.runtime
        lines.append(f"runtime: send {r.send_s * 1e6:.1f} us + {r.send_per_byte_s * 1e12:.1f} ps/B "
                     f"(+{r.ring_s * 1e6:.1f} us to a sleeper), take {r.take_s * 1e6:.1f} us, "
                     f"wake-up {r.wake_s * 1e6:.1f} us, dispatch +{r.dispatch_per_worker_s * 1e6:.1f} us/expert "
                     f"worker, {r.cores} cores; computing at once: attention x{r.corun_attention:.3f}, "
                     f"experts x{r.corun_expert:.3f}")
    return "\n".join(lines)


def families_table(c: Comparison) -> str:
    """The best plan of each family (best first), what bounds its batch, and its GPU-us per output
    token by what they are spent on; then the winner and the reason."""
    header = ["family", "layout", "GPUs", "n", "requests", "req/GPU", "batch limit", "TBT ms", "tok/s/GPU",
              "tok/s/cost", "GB w/GPU", "tok/expert", "us/tok attn", "exp W", "exp C", "comm", "idle"]
    rows = [[p.family, p.layout, p.gpus, str(p.num_gpus), f"{p.batch:,}", f"{p.requests_per_gpu:.0f}",
             p.limit, f"{p.tbt_s * 1e3:.1f}", _num(p.throughput_per_gpu), _num(p.throughput_per_cost),
             f"{p.weights_gb_per_gpu:.1f}", f"{p.tokens_per_expert:.0f}",
             *(f"{p.terms[k] * 1e6:.1f}" for k in TERMS)] for p in c.best]
    w = c.winner
    tail = [f"ranked by throughput per {c.objective}", f"winner: {'-' if w is None else w.family} -- {c.reason}"]
    return "\n".join([format_table(header, rows), *(f"note: {n}" for n in c.notes), *tail])


def cases_summary(runs: Sequence[tuple[str, Comparison]]) -> str:
    """One line per case: the winning family, its layout and GPUs, and the reason."""
    rows = [[name, c.model, "-" if c.winner is None else c.winner.family,
             "-" if c.winner is None else f"{c.winner.layout} on {c.winner.gpus}", c.reason] for name, c in runs]
    return format_table(["case", "model", "winner", "layout", "why"], rows)
