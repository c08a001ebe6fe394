"""``afdserve profile``: measure this machine's k1..k4, Util and runtime costs, and fit a profile.

Everything is timed with the code the runtime runs, one thread per process as the workers use:

* **attention worker** (``k1_tok``, ``k1_ctx``, ``k2``; :mod:`.harness_attention`): one decode
  micro-batch through one layer in the order the attention worker's ``PipelinedRunner`` runs it;
* **expert worker** (``k3``, ``k4``; :mod:`.harness_expert`) for every number of experts a worker
  can hold (divisors of ``E``);
* **M2N transport** (``latency``, ``bandwidth`` => ``Util``; send / take CPU costs, wake-up
  latency; :mod:`.harness_transport`): ``afdserve.comm`` between this process and a second one;
* **per-step overhead** outside the layers and the **LM head** of a micro-batch
  (:mod:`.harness_step`): the real ``Engine`` driving the attention worker's ``PipelinedRunner``;
* **co-running** (:mod:`.corun`): how much an attention worker's and an expert worker's work slow
  down while the other role computes on another core;
* **lent cores** (:mod:`.harness_lend`): what the fused MoE and the LM head gain on every core over
  one thread (the cores waiting workers lend them).

**Caches.** Every timed call is preceded by evicting the caches (:class:`.CacheFlusher`; ``evict=False``
disables this; it makes CPU timings up to 2x optimistic).

**Noise.** Compute is timed in the measuring thread's CPU time (not inflated when other processes
take turns on its core), median of ``repeats`` calls; the grid is measured ``passes`` times and
every point keeps its least median (other processes' memory traffic only ever adds time).  Round
trips are wall time: profile an idle machine.

The fitted constants are saved with :func:`afdserve.planner.save_profile` and read by
``afdserve plan --profile`` and :func:`afdserve.planner.predict_iteration_time`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from afdserve.comm import CommConfig
from afdserve.comm.memcpy import memcpy_gbps
from afdserve.model.config import ModelConfig
from afdserve.model.demo import demo_model_path
from afdserve.planner import (
    NetworkProfile,
    Profile,
    WireFormat,
    fit_affine,
    fit_attention,
    fit_expert,
    fit_network,
    fit_nondecreasing,
    fit_runtime,
)
from afdserve.profiling.cache_flusher import CacheFlusher
from afdserve.profiling.corun import measure_corun
from afdserve.profiling.grid import DEFAULT_GRID, ProfileGrid, attention_points
from afdserve.profiling.harness_attention import measure_attention, measure_colocated_attention
from afdserve.profiling.harness_expert import measure_expert
from afdserve.profiling.harness_lend import measure_lend
from afdserve.profiling.harness_step import measure_step
from afdserve.profiling.harness_transport import measure_transport
from afdserve.profiling.probes import cpu_cores, cpu_name, idle_fraction, llc_bytes

__all__ = ["run_profile"]


def _model_name(path: Path) -> str:
    try:
        if path.resolve() == demo_model_path().resolve():
            return "demo"
    except OSError:
        pass
    return path.name or str(path)


def run_profile(
    model: str | Path | None = None,
    grid: ProfileGrid = DEFAULT_GRID,
    *,
    dtype: str = "float32",
    evict: bool = True,
    gpu: str = "cpu",
    log: Callable[[str], None] = lambda s: None,
) -> Profile:
    """Measures everything (see the module docstring) and fits a :class:`Profile`."""
    torch.set_num_threads(1)
    path = demo_model_path() if model is None else Path(model).expanduser()
    cfg = ModelConfig.from_pretrained(path)
    flush = CacheFlusher(evict)
    t_start = time.perf_counter()
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()

    idle = idle_fraction()
    log(f"profiling {path} ({dtype}) on {cpu_name()}, {cpu_cores()} cores; LLC {llc_bytes() >> 20} MiB"
        f"{' evicted before every timed call' if evict else ' (warm: not evicted)'}; machine {idle:.0%} idle")
    if idle < 0.8:
        log("warning: other processes are using the CPUs; compute is timed in CPU time, but the transport's "
            "latencies (wall time) will be inflated -- profile an idle machine")
    passes = max(1, grid.passes)
    quiet = (lambda s: None) if passes > 1 else log

    def least(runs: list[list[list[float]]], key: int) -> list[list[float]]:
        """Per point, the pass with the least time: other processes' work only ever adds time."""
        return [min(rows, key=lambda r: r[key]) for rows in zip(*runs)]

    log(f"attention worker, per micro-batch and layer ({passes} passes x {grid.repeats} calls):")
    points = attention_points(grid, cfg.num_experts)
    att = least([measure_attention(path, points, grid.repeats, flush, dtype, log=quiet) for _ in range(passes)], 3)
    for b, s, n_e, t in att:
        log(f"  b={int(b):<4} s={int(s):<5} n_e={int(n_e):<2} {t * 1e6:9.1f} us")
    colo_points = sorted({(b, s) for b, s, _ in points})
    colo = least([measure_colocated_attention(path, colo_points, grid.repeats, flush, dtype, log=quiet)
                  for _ in range(passes)], 2)
    for b, s, t in colo:
        log(f"  colocated b={int(b):<4} s={int(s):<5} {t * 1e6:9.1f} us")
    log("expert worker, per layer:")
    E = cfg.num_experts
    epns = tuple(e for e in (grid.experts_per_node or range(1, E + 1)) if 1 <= e <= E and E % e == 0)
    exp_runs = [measure_expert(path, epns, grid.pairs_per_expert, grid.repeats, flush, dtype, log=quiet)
                for _ in range(passes)]
    exp = {e: least([run[e] for run in exp_runs], 1) for e in epns}
    for e, rows in exp.items():
        log(f"  experts={e:<3} " + "  ".join(f"{int(p)} pairs {t * 1e6:.0f} us" for p, t in rows))
    log("M2N transport (afdserve.comm between two processes):")
    tr = measure_transport(cfg.hidden_size, cfg.top_k, grid.msg_tokens, grid.transport_repeats, dtype, log=log)
    log("two workers computing at once (each on its own core):")
    corun_a, corun_e = measure_corun(path, grid.repeats * passes, flush, dtype, log=log) if grid.corun else (1.0, 1.0)
    log("engine step outside the layers:")
    step_runs = [measure_step(path, grid.step_batches, grid.repeats, flush, dtype, log=quiet) for _ in range(passes)]
    step = least([r[0] for r in step_runs], 1)
    lm_head = least([r[1] for r in step_runs], 1)
    begins = least([r[2] for r in step_runs], 1)
    for (b, t), (_, h) in zip(step, lm_head):
        log(f"  b={int(b):<4} overhead {t * 1e3:8.3f} ms   LM head {h * 1e3:8.3f} ms")

    att_1 = [[r[0], r[1], r[3]] for r in att if r[2] == 1]
    try:
        network = fit_network(tr.oneway)
    except ValueError:  # sizes too small (or too noisy) to see the bandwidth: bound it by memcpy's
        network = NetworkProfile(latency_s=float(np.median([r[1] for r in tr.oneway])),
                                 bandwidth_Bps=memcpy_gbps(64 << 20, 3) * 1e9)
        log(f"  (one-way time does not grow with these sizes: bandwidth bounded by memcpy, "
            f"{network.bandwidth_Bps / 1e9:.1f} GB/s)")
    prof = Profile(
        model=_model_name(path),
        attention=(fit_attention(att_1, tp=1, gpu=gpu, relative=True),),
        expert=tuple(fit_expert(rows, tp=1, experts_per_node=e, gpu=gpu, relative=True) for e, rows in exp.items()),
        network=network,
        wire=WireFormat(act_bytes=elem, meta_bytes_per_token=cfg.top_k * 8, dispatch="routed"),
        device=f"{cpu_name()} ({cpu_cores()} cores, 1 thread per worker)",
    )
    (fixed, per_tok), _ = fit_affine([[1.0] * len(step), [r[0] for r in step]], [r[1] for r in step], relative=True)
    runtime = fit_runtime(tr, att, cpu_cores(), CommConfig().spin_s)
    if any(r[1] > 0 for r in lm_head):
        (h0, h1), _ = fit_affine([[1.0] * len(lm_head), [r[0] for r in lm_head]], [r[1] for r in lm_head],
                                 relative=True)
        runtime = replace(runtime, lm_head_s=h0, lm_head_per_token_s=h1,
                          lm_head_points=tuple(sorted((r[0], r[1]) for r in lm_head)))
    (b0, b1), _ = fit_affine([[1.0] * len(begins), [r[0] for r in begins]], [r[1] for r in begins], relative=True)
    colo_fit = fit_attention(colo, relative=True)
    runtime = replace(runtime, corun_attention=corun_a, corun_expert=corun_e, begin_s=b0, begin_per_token_s=b1,
                      colocated_k1_tok=colo_fit.k1_tok, colocated_k1_ctx=colo_fit.k1_ctx, colocated_k2=colo_fit.k2)
    if grid.lend and cpu_cores() > 1:
        log(f"lent cores: speed-ups on {cpu_cores()} threads over one:")
        head_x, moe_x = measure_lend(path, grid.step_batches, grid.pairs_per_expert, cpu_cores(), grid.repeats, flush,
                                     dtype, log=log)
        runtime = replace(runtime, lend_lm_head_points=fit_nondecreasing(head_x),
                          lend_expert_points=fit_nondecreasing(moe_x))
        samples_lend = {"lend_lm_head": head_x, "lend_expert": moe_x}
    else:
        samples_lend = {}
    samples: dict[str, list[list[float]]] = {"attention": att_1}
    samples["attention_workers"] = [list(map(float, r)) for r in att]
    samples["expert"] = [[float(e), r[0], r[1]] for e, rows in exp.items() for r in rows]
    samples.update({f"transport_{k}": v for k, v in tr.as_dict().items()})
    samples["step"] = step
    samples["lm_head"] = lm_head
    samples["begin"] = begins
    samples["colocated_attention"] = colo
    samples.update(samples_lend)
    took = time.perf_counter() - t_start
    notes = (f"afdserve profile: {len(att)} attention, {sum(len(v) for v in exp.values())} expert, "
             f"{len(tr.oneway)} transport, {len(step)} step points; least of {passes} passes' medians of "
             f"{grid.repeats} calls "
             f"({grid.transport_repeats} round trips); caches {'evicted before each call' if evict else 'warm'}; "
             f"dtype {dtype}; torch {torch.__version__}; {took:.0f} s; machine {idle:.0%} idle at the start")
    samples["network"] = [list(map(float, r)) for r in tr.oneway]
    return replace(prof, step_fixed_s=fixed, step_per_token_s=per_tok, runtime=runtime,
                   samples=samples, notes=notes)
