"""Ping-pong pipeline benchmark on the demo model (expert weights dominate, so experts are
memory-bound at small batch), all deployments measured side by side in one run:

  1. micro-batches m = 1..4 with one attention and one expert worker (MegaScale-Infer Fig. 14)
  2. n_a = 1..k attention workers in front of fixed expert workers (Fig. 15)
  3. colocated against disaggregated on the same number of cores (Fig. 13)

Decode throughput excludes prefill: (time for N tokens - time for 1 token) per generated token.
Each worker process uses one thread; the colocated engine uses as many threads as the
disaggregated deployment has processes. Workers do not lend idle cores to each other unless
``--lend-idle-cores``: the benchmark measures what the pipeline overlaps, as on separate devices
(lent cores fill m=1's bubbles too, a different mechanism; docs/runtime.md).

    python benchmarks/pingpong.py [--batch 64] [--tokens 48] [--json out/pingpong.json] [--trace-dir out]
                                  [--lend-idle-cores] [--dtype bfloat16]
                                  [--cluster ray [--ray-address ADDRESS]]

With ``--cluster ray`` the disaggregated deployments run as Ray actors (attention workers on nodes
with the ``attention_node`` resource, expert workers on ``expert_node`` nodes; docs/ray.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


# The demo architecture (8 layers, 8 experts, hidden 256) with a 4096-token vocabulary, so the LM
# head does not dominate a step; 8 KV heads, so attention's KV-cache reads can balance the experts at
# modest contexts; and top-4 routing (as DBRX), so a micro-batch of a few hundred tokens gives each
# expert enough tokens that re-reading its weights per micro-batch (memory-bound, ~0.6 ms an expert
# here) is a small part of Te. Experts hold 95% of the weights.
BENCH_MODEL = {"vocab_size": 4096, "num_key_value_heads": 8, "num_experts_per_tok": 4}


def bench_model(path: str) -> str:
    from afdserve.model.demo import build_demo_model

    p = os.path.expanduser(path)
    if not os.path.exists(os.path.join(p, "config.json")):
        tmp = p + ".tmp"
        build_demo_model(tmp, overrides=BENCH_MODEL)
        os.replace(tmp, p)
    return p


def decode_window(engine, prompts: list[dict], tokens: int) -> tuple[float, float]:
    """Runs the prompts to ``tokens`` new tokens each and returns (decode tokens/s, time between
    tokens) over the steady state: from when every sequence has its first token until the first one
    finishes. One prefill per measurement; works for every deployment (``EngineClient``)."""
    from afdserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"b{i}")
    counts: dict[str, int] = {}
    t_start = n_start = None
    t_end = n_end = None
    while engine.has_unfinished():
        outs = engine.get_outputs(timeout=1.0)
        now = time.perf_counter()
        for o in outs:
            if o.error:
                raise RuntimeError(o.error)
            counts[o.request_id] = len(o.outputs[0].token_ids)
        if t_start is None and len(counts) == len(prompts):
            t_start, n_start = now, sum(counts.values())
        if t_start is not None and t_end is None and any(o.finished for o in outs):
            t_end, n_end = now, sum(counts.values())
    if t_start is None or t_end is None or n_end == n_start:
        raise RuntimeError("no steady decode window: raise --tokens")
    rate = (n_end - n_start) / (t_end - t_start)
    return rate, len(prompts) / rate


def measure(kw: dict, batch: int, tokens: int, prompt_len: int, vocab: int, model: str | None,
            trace: str | None = None, repeats: int = 3, ms: list[int] | None = None) -> dict:
    """Decode windows of one deployment, ``repeats`` of them; the median window is kept. Returns
    ``{None: result}``, or with ``ms`` ``{m: result}``: the deployment's attention workers then switch
    m between windows, in rounds (m order rotated each round), so every m runs on the same
    processes, caches and memory placement, and this machine's speed drift (up to ~30 % within a
    minute here) hits all of them alike."""
    from afdserve import LLM, SamplingParams
    from afdserve.runtime.trace_plot import load
    from afdserve.runtime.trace_steps import decode_windows

    settings: list[int | None] = list(ms) if ms else [None]
    if ms:
        kw = dict(kw, micro_batches=max(ms))
    if trace:
        kw = dict(kw, trace=trace)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(batch)]
    runs: dict[int | None, list[tuple[float, float]]] = {s: [] for s in settings}
    # the whole batch prefills in one step, so every sequence then decodes in lockstep
    with LLM(model, max_num_seqs=batch, max_num_batched_tokens=batch * (prompt_len + 1), **kw) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        if trace:
            llm.engine.traces()  # keep only the measured runs
        for r in range(repeats):
            for m in settings[r % len(settings):] + settings[:r % len(settings)]:
                if m is not None:
                    llm.engine.set_micro_batches(m)
                runs[m].append(decode_window(llm.engine, prompts, tokens))
    spans = load(trace) if trace else None  # the trace is written on shutdown
    per_worker = batch // kw.get("attention_workers", 1)  # each attention worker steps over its share
    out: dict = {}
    for m in settings:
        rate, tbt = sorted(runs[m])[len(runs[m]) // 2]
        windows = decode_windows(spans, per_worker, m) if spans else []
        out[m] = {"tbt_ms": tbt * 1e3, "decode_tok_s": rate, "runs_tok_s": [x for x, _ in runs[m]],
                  "busy": decode_busy(spans, windows), "layer_ms": layer_times(spans, windows)}
        if ms:  # ratio of each round's windows, measured within seconds of each other
            out[m]["round_ratios_vs_first"] = [a[0] / b[0] for a, b in zip(runs[m], runs[ms[0]])]
    return out


def decode_busy(spans: dict[str, list[dict]] | None, windows: list[tuple[float, float]]) -> dict[str, float] | None:
    """Each worker's busy fraction over the trace's decode stretches (``trace_steps.decode_windows``)."""
    from afdserve.runtime.trace_plot import usage

    if not windows:
        return None
    busy: dict[str, float] = {}
    total = sum(hi - lo for lo, hi in windows)
    for lo, hi in windows:
        for u in usage(spans, (lo, hi)):
            busy[u.worker] = busy.get(u.worker, 0.0) + u.busy * (hi - lo) / total
    return busy


def layer_times(spans: dict[str, list[dict]] | None, windows: list[tuple[float, float]]) -> dict[str, float] | None:
    """Ta and Te as the paper defines them, over the trace's decode stretches: the median time of one
    micro-batch's attention (the attention worker's layer spans, LM head and combines left out) and of
    its experts (the expert worker's layer spans) in one layer, in ms."""
    from afdserve.runtime.trace_steps import within

    def median(worker: str, name: str) -> float | None:
        d = sorted(e["dur"] for e in within(spans.get(worker, []), windows)
                   if e["name"] == name and e.get("args", {}).get("phase") is None)
        return d[len(d) // 2] / 1e3 if d else None

    if not windows:
        return None
    ta, te = median("attention0", "attention"), median("expert0", "expert")
    return None if ta is None or te is None else {"ta": ta, "te": te}


def draw_steps(trace: str, batch: int, ms: list[int], out_dir: str, steps: int = 2) -> None:
    """``pingpong_m{m}.png``: the timeline of about ``steps`` steady decode steps run with m micro-batches."""
    from afdserve.runtime.trace_plot import load, plot, steady_window
    from afdserve.runtime.trace_steps import decode_steps

    spans = load(trace)  # a second read of the trace (measure's was for the busy fractions)
    lo, _ = steady_window(spans, trim=0.0)
    for m in ms:
        run = sorted(decode_steps(spans, batch, m), key=lambda e: e["ts"])
        if len(run) < steps + 3:
            continue
        first = run[len(run) // 2]  # a step in the middle of the measured windows
        out = os.path.join(out_dir, f"pingpong_m{m}.png")
        plot(spans, out, (first["ts"] - lo) / 1e3, steps * first["dur"] / 1e3,
             title=f"m = {m}: about {steps} decode steps (batch {batch}; numbers: micro-batch)")
        print(f"   timeline: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512, help="concurrent sequences (m and colocated series)")
    ap.add_argument("--na-batch", type=int, default=128, help="concurrent sequences per attention worker (n_a series)")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=128,
                    help="context; sets Ta against Te (128 in bf16: Ta ~ Te here, per layer as the paper defines "
                         "them and by busy fraction; the m series prints both)")
    ap.add_argument("--repeats", type=int, default=3, help="decode windows per deployment (the median is kept)")
    ap.add_argument("--m-values", default="1,2,3,4", help="micro-batch counts of the m series (first = baseline)")
    ap.add_argument("--m-repeats", type=int, default=5, help="rounds over the m values (one window of each per round)")
    ap.add_argument("--max-attention-workers", type=int, default=3)
    ap.add_argument("--json", default="out/pingpong.json")
    ap.add_argument("--trace-dir", default="out")
    ap.add_argument("--only", default="m,na,coloc", help="which comparisons to run")
    ap.add_argument("--model", default=None, help="HF model folder (default: the benchmark variant of the demo model)")
    ap.add_argument("--bench-model-dir", default="~/.cache/afdserve/pingpong-model-v2")
    ap.add_argument("--dtype", default="bfloat16", help="weights and activations (the engine's default is float32)")
    ap.add_argument("--lend-idle-cores", action="store_true",
                    help="let expert workers borrow the cores of waiting attention workers (the engine's default)")
    ap.add_argument("--cluster", default="local", choices=["local", "ray"],
                    help="disaggregated deployments as local processes or Ray actors (docs/ray.md)")
    ap.add_argument("--ray-address", default=None, help="--cluster ray: the Ray cluster to join")
    args = ap.parse_args()
    if args.cluster == "ray":
        import ray

        ray.init(address=args.ray_address)  # once: every deployment below joins this connection
    os.makedirs(args.trace_dir, exist_ok=True)
    from afdserve.model.config import ModelConfig
    model = args.model or bench_model(args.bench_model_dir)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    one = dict(num_threads=1, kv_cache_gb=2.0, lend_idle_cores=args.lend_idle_cores, dtype=args.dtype)
    res: dict = {"batch": args.batch, "tokens": args.tokens, "cores": os.cpu_count(),
                 "lend_idle_cores": args.lend_idle_cores}

    def go(name: str, kw: dict, batch: int, trace: bool = True) -> dict:
        traced = trace and kw.get("expert_workers", 0) > 0  # only worker processes record traces
        path = os.path.join(args.trace_dir, f"trace_{name}.json") if traced else None
        if args.cluster == "ray" and kw.get("expert_workers", 0) > 0:
            kw = dict(kw, cluster="ray")
        r = measure(kw, batch, args.tokens, args.prompt_len, vocab, model, path, args.repeats)[None]
        r["trace"] = path
        busy = "" if not r["busy"] else "  busy " + ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items())
        print(f"  {name:<28} {r['decode_tok_s']:>8.1f} tok/s  TBT {r['tbt_ms']:>7.2f} ms{busy}", flush=True)
        return r

    if "m" in args.only:
        ms = [int(x) for x in args.m_values.split(",")]
        print(f"1. micro-batches (1 attention + 1 expert worker, 1 thread each; one deployment switching m "
              f"between decode windows, {args.m_repeats} rounds)")
        path = os.path.join(args.trace_dir, "trace_a1_e1_mseries.json")
        kw = dict(expert_workers=1, **one) | (dict(cluster="ray") if args.cluster == "ray" else {})
        res["micro_batches"] = measure(kw, args.batch, args.tokens, args.prompt_len, vocab, model, path,
                                       args.m_repeats, ms=ms)
        for m, r in res["micro_batches"].items():
            r["trace"] = path
            busy = "" if not r["busy"] else "  busy " + ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items())
            if r["layer_ms"]:
                busy += f"  per layer Ta {r['layer_ms']['ta']:.1f} ms, Te {r['layer_ms']['te']:.1f} ms"
            print(f"  {'a1_e1_m' + str(m):<28} {r['decode_tok_s']:>8.1f} tok/s  TBT {r['tbt_ms']:>7.2f} ms{busy}")
        draw_steps(path, args.batch, ms, args.trace_dir)
        base = res["micro_batches"][ms[0]]["decode_tok_s"]
        for m, r in res["micro_batches"].items():
            r["speedup_vs_m1"] = r["decode_tok_s"] / base
        print("   speed-up over m=1: " + ", ".join(f"m={m}: {r['speedup_vs_m1']:.2f}x"
                                                   for m, r in res["micro_batches"].items()))
        print("   per-round ratios: " + "; ".join(f"m={m}: " + ", ".join(f"{x:.2f}" for x in r["round_ratios_vs_first"])
                                                for m, r in res["micro_batches"].items() if m != ms[0]))
    if "na" in args.only:
        print("2. attention workers in front of 1 expert worker (m=2, same batch per attention worker)")
        res["attention_workers"] = {
            n: go(f"a{n}_e1_m2", dict(attention_workers=n, expert_workers=1, micro_batches=2, **one),
                  args.na_batch * n) for n in range(1, args.max_attention_workers + 1)}
    if "coloc" in args.only:
        print("3. colocated vs disaggregated on 2 cores")
        res["colocated_vs_disaggregated"] = {
            "colocated_2_threads": go("colocated", dict(num_threads=2, kv_cache_gb=2.0, dtype=args.dtype), args.batch),
            "disaggregated_a1_e1_m2": go("disagg", dict(expert_workers=1, micro_batches=2, **one), args.batch),
        }
        c = res["colocated_vs_disaggregated"]
        c["ratio"] = c["disaggregated_a1_e1_m2"]["decode_tok_s"] / c["colocated_2_threads"]["decode_tok_s"]
        print(f"   disaggregated / colocated throughput: {c['ratio']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
