"""A serving benchmark's results: throughput, latency percentiles, TBT SLO attainment; printed as a
table, written as JSON and plotted.

* TTFT: from sending a request to its first token; also split by prefix-cache hit (requests whose
  usage reported ``prompt_tokens_details.cached_tokens`` > 0) and miss.
* TBT (time between tokens): every gap between consecutive output tokens of a request (a chunk of
  k tokens after a gap g counts as k gaps of g/k).
* TPOT: a request's mean TBT, (latency - TTFT) / (output tokens - 1).
* TBT SLO attainment: the share of completed requests whose TPOT is within the SLO (and, as
  ``tbt_slo_token_share``, the share of all token gaps within it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from afdserve.bench.loadgen import RequestResult

PERCENTILES = (50, 90, 99)


def _pcts(values: list[float], scale: float) -> dict[str, float | None]:
    if not values:
        return {"mean": None} | {f"p{p}": None for p in PERCENTILES}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean())} | {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}


def summarize(results: list[RequestResult], duration_s: float, slo_tbt_ms: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.cancelled]
    gaps = [g for r in done for g in r.gaps]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.ttft is not None and r.output_len > 1]
    slo = slo_tbt_ms / 1000
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    errors: dict[str, int] = {}
    for r in failed:
        key = str(r.status) if r.status not in (None, 200) else (r.error or "error").split(":")[0]
        errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results), "completed": len(done), "failed": len(failed),
        "cancelled": sum(r.cancelled for r in results), "errors": errors,
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": _pcts([r.ttft for r in done if r.ttft is not None], 1000),
        "ttft_cache_hit_ms": _pcts([r.ttft for r in done if r.ttft is not None and (r.cached_tokens or 0) > 0], 1000),
        "ttft_cache_miss_ms": _pcts([r.ttft for r in done if r.ttft is not None and r.cached_tokens == 0], 1000),
        "cache_hit_requests": sum((r.cached_tokens or 0) > 0 for r in done),
        "cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "tbt_ms": _pcts(gaps, 1000),
        "tpot_ms": _pcts(tpot, 1000),
        "e2e_latency_s": _pcts([r.latency for r in done], 1),
        "slo_tbt_ms": slo_tbt_ms,
        "tbt_slo_attainment": (sum(t <= slo for t in tpot) / len(tpot)) if tpot else None,
        "tbt_slo_token_share": (sum(g <= slo for g in gaps) / len(gaps)) if gaps else None,
    }


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(s: dict[str, Any]) -> str:
    rows = [
        ("requests (completed / failed / cancelled)", f"{s['completed']} / {s['failed']} / {s['cancelled']}"),
        ("duration (s)", _f(s["duration_s"], "{:.1f}")),
        ("request throughput (req/s)", _f(s["request_throughput"], "{:.3f}")),
        ("output token throughput (tok/s)", _f(s["output_token_throughput"])),
        ("total token throughput (tok/s)", _f(s["total_token_throughput"])),
    ]
    for key, label in (("ttft_ms", "TTFT (ms)"), ("ttft_cache_hit_ms", "  prefix-cache hits"),
                       ("ttft_cache_miss_ms", "  misses"), ("tbt_ms", "TBT (ms)"), ("tpot_ms", "TPOT (ms)"),
                       ("e2e_latency_s", "E2E latency (s)")):
        d = s[key]
        rows.append((f"{label} mean / p50 / p90 / p99",
                     " / ".join(_f(d[k], "{:.2f}" if key == "e2e_latency_s" else "{:.1f}")
                                for k in ("mean", "p50", "p90", "p99"))))
    rows.insert(5, ("prefix-cache hits (requests / cached prompt tokens)",
                    f"{s['cache_hit_requests']} / {s['cached_tokens']} of {s['input_tokens']}"))
    att = s["tbt_slo_attainment"]
    tok = s["tbt_slo_token_share"]
    rows.append((f"TBT SLO {s['slo_tbt_ms']:g} ms: requests / token gaps within",
                 f"{_f(None if att is None else 100 * att)}% / {_f(None if tok is None else 100 * tok)}%"))
    if s["errors"]:
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items()))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_json(path: str | Path, summary: dict[str, Any], config: dict[str, Any],
               results: list[RequestResult]) -> None:
    per_request = [{k: v for k, v in asdict(r).items() if k != "gaps"} | {"num_gaps": len(r.gaps)} for r in results]
    doc = _finite({"config": config, "summary": summary, "requests": per_request})
    Path(path).write_text(json.dumps(doc, indent=1, allow_nan=False))


def _finite(obj: Any) -> Any:
    """JSON has no infinity: non-finite floats become strings ("inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def plot(path: str | Path, results: list[RequestResult], summary: dict[str, Any], title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    gaps = np.sort(np.asarray([g for r in done for g in r.gaps]) * 1000)
    if len(gaps):
        ax[0].plot(gaps, np.arange(1, len(gaps) + 1) / len(gaps))
    ax[0].axvline(summary["slo_tbt_ms"], color="r", ls="--", label=f"SLO {summary['slo_tbt_ms']:g} ms")
    ax[0].set(xlabel="time between tokens (ms)", ylabel="CDF", title="TBT")
    ax[0].legend()
    ax[1].scatter([r.start for r in done], [1000 * (r.ttft or 0) for r in done], s=6)
    ax[1].set(xlabel="request sent at (s)", ylabel="TTFT (ms)", title="time to first token")
    if done:
        end = max(r.start + r.latency for r in done)
        bins = np.arange(0, end + 5, 5.0)
        finish = [r.start + r.latency for r in done]
        counts, _ = np.histogram(finish, bins=bins, weights=[r.output_len for r in done])
        ax[2].step(bins[:-1], counts / 5.0, where="post")
    ax[2].set(xlabel="time (s)", ylabel="output tokens/s (by completion, 5 s bins)", title="throughput")
    fig.suptitle(title or "afdserve bench serve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
