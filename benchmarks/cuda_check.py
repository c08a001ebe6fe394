"""The CUDA checks of issue 13, in one run on a GPU machine (``python benchmarks/cuda_check.py``).

1. ``probe``: what this torch's CUDA ``_grouped_mm`` takes (dtypes, row alignment).
2. ``identity``: tiny random checkpoints of each architecture (Mixtral, Qwen2-MoE, Qwen3-MoE,
   DeepSeek-V3, gpt-oss): afdserve on CUDA, colocated and disaggregated (1 attention + 1 expert
   worker, m = 2, both processes on the one GPU), greedy, float32, against transformers on CUDA.
3. ``gemm``: the expert grouped GEMM (``model.experts.grouped_swiglu``, bf16) in TFLOP/s at the demo
   model's shapes and at a Mixtral-8x7B layer's, beside a dense 8192^3 bf16 product measured here.
4. ``attention``: a decode batch through an attention layer (``AttentionPart.forward`` over the
   paged KV cache) on the torch and the triton attention backends, in GB/s of KV cache and weights
   read, beside a device-to-device copy measured here; ``identity`` also runs colocated on triton.
5. ``speed``: bf16 decode tok/s of the demo model's shapes (random weights) at batch 1, 64 and 256:
   transformers, afdserve colocated (with ``--compile`` also colocated with ``compile=True``) and
   afdserve 1 + 1 (m = 2), in alternating rounds, medians.
6. ``profile``: ``torch.profiler`` and cProfile over colocated generates at the largest batch: wall time, GPU
   kernel time, host syncs, the operators with the most self CPU and self CUDA time.

Each section prints its table and the whole result goes to ``--json``; a failing section prints
its traceback and the others still run. Needs a CUDA device and transformers.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models: the test checkpoints
import tiny_models as tm  # noqa: E402

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, timed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def probe() -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for rows in (32, 37):
            x = torch.randn(rows, 64, device="cuda", dtype=dtype)
            w = torch.randn(3, 96, 64, device="cuda", dtype=dtype)
            offs = torch.tensor([10, 20, rows], device="cuda", dtype=torch.int32)
            key = f"{str(dtype).split('.')[-1]} rows={rows}"
            try:
                y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                ref = torch.cat([x[:10] @ w[0].T, x[10:20] @ w[1].T, x[20:] @ w[2].T])
                out[key] = f"ok, rel err {float((y.float() - ref.float()).norm() / ref.float().norm()):.1e}"
            except Exception as e:  # noqa: BLE001 -- the probe reports what this build refuses
                out[key] = f"refused: {str(e).splitlines()[0][:160]}"
    for k, v in out.items():
        print(f"  _grouped_mm {k}: {v}")
    return out


def afd_greedy(path: Path, prompts: list[list[int]], n: int, dtype: str = "float32", **kw) -> list[list[int]]:
    from afdserve import LLM, SamplingParams

    with LLM(str(path), device="cuda", dtype=dtype, num_kv_blocks=128, startup_timeout_s=120, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0,
                                                                                       ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def checkpoint(root: Path, arch: str) -> Path:
    path = root / arch
    if arch.startswith("deepseek"):
        return tm.make_deepseek_checkpoint(path, int(arch[-1]))
    if arch == "gpt_oss":  # gpt-oss's own clamp: transformers before 5.18 ignores the config's swiglu_limit
        return tm.make_gpt_oss_checkpoint(path, swiglu_limit=7.0)
    return tm.make_checkpoint(path, arch)


def identity(root: Path, archs: list[str]) -> dict:
    """afdserve first, then the transformers reference on CUDA; should transformers fail on CUDA
    (a CUDA error spoils this process's context), the reference comes from transformers on the CPU
    and the row says so."""
    prompts = [[5, 9, 13], list(range(3, 40)), [7] * 11, list(range(60, 81))]
    res = {}
    for arch in archs:
        path = checkpoint(root, arch)
        got = {}
        runs = [("colocated", {}), ("disaggregated 1+1 m=2", dict(expert_workers=1, micro_batches=2))]
        if not arch.startswith("deepseek"):  # MLA: the torch attention backend
            runs.append(("colocated triton attention", dict(attention_backend="triton")))
        for name, kw in runs:
            try:
                got[name] = afd_greedy(path, prompts, 16, **kw)
            except Exception as e:  # noqa: BLE001 -- reported, the next deployment still runs
                traceback.print_exc()
                got[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row = {"reference": "transformers float32 on CUDA"}
        try:
            want = tm.hf_greedy(path, prompts, 16, device="cuda")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["reference"] = f"transformers float32 on the CPU (on CUDA: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
            want = tm.hf_greedy(path, prompts, 16)
        for name, out in got.items():
            if isinstance(out, str):
                row[name] = out
            else:
                same = sum(g == w for g, w in zip(out, want))
                row[name] = f"{same}/{len(prompts)} identical" + ("" if same == len(prompts) else f": {out} vs {want}")
            print(f"  {arch:12s} {name:24s} {row[name]}", flush=True)
        print(f"  {arch:12s} reference: {row['reference']}", flush=True)
        res[arch] = row
    return res


def gemm() -> dict:
    from afdserve.model.experts import grouped_swiglu

    res = {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: a @ b)
    res["dense 8192^3"] = {"tflops": 2 * 8192**3 / t / 1e12, "ms": t * 1e3}
    del a, b
    # (name, experts, hidden, intermediate, rows = tokens x top-k)
    for name, e, h, i, rows in (("demo b64", 8, 256, 1024, 128), ("demo b256", 8, 256, 1024, 512),
                                ("mixtral-8x7b 4096 tokens", 8, 4096, 14336, 8192),
                                ("mixtral-8x7b 512 tokens", 8, 4096, 14336, 1024)):
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
        counts = torch.multinomial(torch.ones(e), rows, replacement=True).bincount(minlength=e).to("cuda")
        offs = torch.cumsum(counts, 0).to(torch.int32)
        t_all = cuda_time(lambda: grouped_swiglu(x, w13, w2, counts))
        t_gu = cuda_time(lambda: torch._grouped_mm(x, w13.transpose(1, 2), offs=offs))
        flops, weight_bytes = 6 * rows * h * i, 3 * e * h * i * 2
        res[name] = {"swiglu_tflops": flops / t_all / 1e12, "swiglu_ms": t_all * 1e3,
                     "gate_up_tflops": 4 * rows * h * i / t_gu / 1e12,
                     "weights_gbps": weight_bytes / t_all / 1e9}
        del x, w13, w2
    for k, v in res.items():
        print("  " + k.ljust(28) + "  ".join(f"{m} {x:,.1f}" for m, x in v.items()))
    return res


def attention() -> dict:
    res = {}
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    t = cuda_time(lambda: dst.copy_(src))
    res["d2d copy"] = {"gbps": 2 * n / t / 1e9}
    del src, dst
    # (name, heads, kv heads, head dim, hidden, batch, context)
    for name, nh, nkv, hd, hidden, s, ctx in (("demo b256 ctx 96", 8, 2, 32, 256, 256, 96),
                                              ("mixtral b64 ctx 4096", 32, 8, 128, 4096, 64, 4096),
                                              ("mixtral b256 ctx 2048", 32, 8, 128, 4096, 256, 2048)):
        for backend in ("torch", "triton"):  # the triton kernel reads the cache in place
            try:
                res[f"{name} {backend}"] = _attention_point(backend, nh, nkv, hd, hidden, s, ctx)
            except Exception as e:  # noqa: BLE001 -- reported, the next point still runs
                traceback.print_exc()
                res[f"{name} {backend}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    for k, v in res.items():
        print("  " + k.ljust(34) + "  ".join(f"{m} {x:,.2f}" if isinstance(x, float) else f"{m} {x}"
                                              for m, x in v.items()))
    return res


def _attention_point(backend: str, nh: int, nkv: int, hd: int, hidden: int, s: int, ctx: int) -> dict:
    from afdserve.backends import choose
    from afdserve.backends.step import StepBuffers, StepLayout
    from afdserve.model.attention import AttentionPart
    from afdserve.model.layers import prepare_all
    from afdserve.model.rope import Rope

    cfg = _attn_cfg(hidden, nh, nkv, hd)
    part = AttentionPart(cfg, torch.bfloat16).to("cuda")
    for p in part.parameters():
        p.data.normal_(0, 0.02)
    backends = choose("cuda", torch.bfloat16, attention=backend)
    prepare_all(part, backends)
    part.bind(backends)
    bs = 16
    blocks = (ctx + bs - 1) // bs
    perm = torch.randperm(s * blocks).view(s, blocks).tolist()  # scattered blocks, as after churn
    k_cache = torch.randn(s * blocks * bs, nkv, hd, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    layout = StepLayout.from_blocks([1] * s, [ctx] * s, perm, bs)
    step = backends.attention.prepare(layout, (0,), StepBuffers("cuda"))
    x = torch.randn(s, hidden, device="cuda", dtype=torch.bfloat16)
    step.cos, step.sin = Rope.from_config({"rope_theta": cfg.rope_theta}, hd, ctx + 1).cos_sin(step.positions,
                                                                                               x.dtype)
    t = cuda_time(lambda: part(x, step, k_cache, v_cache))
    kv_bytes = 2 * s * ctx * nkv * hd * 2
    w_bytes = sum(p.numel() * p.element_size() for p in part.parameters())
    return {"ms": t * 1e3, "gbps": (kv_bytes + w_bytes) / t / 1e9, "kv_mib": kv_bytes / 2**20}


def _attn_cfg(hidden: int, nh: int, nkv: int, hd: int):
    from afdserve.model.config import ModelConfig
    import transformers as tf

    hf = tf.MixtralConfig(hidden_size=hidden, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
                          num_hidden_layers=1, num_local_experts=2, intermediate_size=64, vocab_size=64)
    return ModelConfig.from_dict(hf.to_dict())


def demo_checkpoint(root: Path, tokenizer: Path) -> Path:
    import transformers as tf

    from afdserve.model.demo import DEMO_CONFIG

    path = root / "demo"
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(**{k: v for k, v in DEMO_CONFIG.items() if k not in ("architectures", "model_type")})
    tf.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the demo model's real tokenizer
        shutil.copy(tokenizer / name, path / name)
    return path


def demo_engine(batch: int, new_tokens: int) -> dict:
    """``LLM`` settings of the bf16 demo-model engines on CUDA for up to ``batch`` 32-token prompts."""
    return dict(device="cuda", dtype="bfloat16", max_num_seqs=batch, max_model_len=32 + new_tokens + 16,
                max_num_batched_tokens=max(2048, batch * 48), startup_timeout_s=120)


def speed(root: Path, tokenizer: Path, batches: list[int], new_tokens: int, rounds: int, compiled: bool) -> dict:
    import transformers as tf

    from afdserve import LLM, SamplingParams

    path = demo_checkpoint(root, tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, 32000, (b, 32), generator=gen).tolist() for b in batches}
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    hf.generation_config.eos_token_id = None

    def run_hf(p):
        ids = torch.tensor(p, device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    kw = demo_engine(max(batches), new_tokens)
    engines = {"transformers": run_hf}
    llms = []
    variants = [("afdserve colocated", {}), ("afdserve 1+1 m=2", dict(expert_workers=1, micro_batches=2))]
    if compiled:  # the attention half of decode steps through torch.compile (compiled in the warm-up round)
        variants.insert(1, ("afdserve colocated compile", dict(compile=True)))
    for name, extra in variants:
        try:
            llm = LLM(str(path), **kw, **extra)
        except Exception:  # noqa: BLE001 -- the other engines still run
            traceback.print_exc()
            continue
        llms.append(llm)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engines[name] = (lambda llm, params: lambda p: [list(o.outputs[0].token_ids) for o in
                                                         llm.generate([{"prompt_token_ids": q} for q in p], params)])(llm, params)
    times: dict = {e: {b: [] for b in batches} for e in engines}
    agree: dict = {}
    for r in range(rounds + 1):  # round 0 warms up
        for b in batches:
            ref = None
            for e, fn in list(engines.items()):
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = fn(prompts[b])
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    del engines[e]
                    continue
                if r:
                    times[e][b].append(b * new_tokens / dt)
                ref = out if e == "transformers" else ref
                if e != "transformers" and ref is not None:
                    agree[f"{e} b{b}"] = sum(x == y for x, y in zip(out, ref)) / b
    for llm in llms:
        llm.shutdown()
    res = {e: {b: statistics.median(v) if v else None for b, v in d.items()} for e, d in times.items()}
    print("  engine".ljust(24) + "".join(f"b{b} tok/s".rjust(14) for b in batches))
    for e, d in res.items():
        print(f"  {e:22s}" + "".join((f"{d[b]:14,.0f}" if d[b] else "           n/a") for b in batches))
    print("  greedy agreement with transformers (bf16: near ties may differ):",
          {k: round(v, 2) for k, v in agree.items()})
    return {"tok_s": res, "runs": times, "agreement": agree}


def profile(root: Path, tokenizer: Path, batch: int, new_tokens: int) -> dict:
    """Where a colocated bf16 decode's time goes on CUDA: ``torch.profiler`` over one ``generate``
    of ``batch`` prompts (after a warm-up): wall time, the time kernels kept the GPU busy, the host
    syncs, and the operators with the most self CPU and self CUDA time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from afdserve import LLM, SamplingParams

    path = demo_checkpoint(root, tokenizer)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": p} for p in torch.randint(3, 32000, (batch, 32), generator=gen).tolist()]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(path), **demo_engine(batch, new_tokens)) as llm:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        with cProfile.Profile() as cprof:  # the Python side: which functions the host spends the step in
            llm.generate(prompts, params)
            torch.cuda.synchronize()
    stats = pstats.Stats(cprof)
    py_top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (file, line, fn) -> (cc, nc, tt, ct, ..)
    py_rows = [(f"{Path(k[0]).name}:{k[1]} {k[2]}"[:70], round(v[2] * 1e3, 1), round(v[3] * 1e3, 1), v[1])
               for k, v in py_top]
    events = prof.key_averages()
    cuda_us = sum(e.self_device_time_total for e in events)  # kernel and copy time (a lower bound on busy)
    syncs = {e.key: e.count for e in events if any(k in e.key for k in ("Synchronize", "cudaMemcpy", "item", "nonzero"))}
    top = lambda key: [(e.key[:60], round(getattr(e, key) / 1e3, 2), e.count)  # noqa: E731
                       for e in sorted(events, key=lambda e: -getattr(e, key))[:12]]
    ops_cpu_us = sum(e.self_cpu_time_total for e in events)  # inside operators; the rest of the wall is Python
    res = {"batch": batch, "new_tokens": new_tokens, "wall_ms": wall * 1e3, "gpu_busy_ms": cuda_us / 1e3,
           "operators_cpu_ms": ops_cpu_us / 1e3,
           "syncs_and_copies": syncs, "top_self_cpu_ms": top("self_cpu_time_total"),
           "top_self_cuda_ms": top("self_device_time_total"), "python_top_tottime_ms": py_rows}
    print(f"  batch {batch}, {new_tokens} new tokens: wall {wall * 1e3:,.0f} ms, GPU kernels {cuda_us / 1e3:,.0f} ms, "
          f"host inside operators {ops_cpu_us / 1e3:,.0f} ms (the rest: Python)")
    print("  syncs and copies:", syncs)
    for name, rows in (("self CPU", res["top_self_cpu_ms"]), ("self CUDA", res["top_self_cuda_ms"])):
        print(f"  top {name} (ms, calls):")
        for k, ms, n in rows:
            print(f"    {k:60s} {ms:10.2f} {n:8d}")
    print("  Python (cProfile, another generate): function, own ms, cumulative ms, calls")
    for k, tt, ct, n in py_rows:
        print(f"    {k:70s} {tt:9.1f} {ct:9.1f} {n:8d}")
    return res


def run_unit(sec: str, a: argparse.Namespace, root: Path) -> object:
    if sec == "probe":
        return probe()
    if sec.startswith("identity:"):
        return identity(root, [sec.split(":", 1)[1]])
    if sec == "gemm":
        return gemm()
    if sec == "attention":
        return attention()
    if sec == "profile":
        return profile(root, Path(a.tokenizer), max(int(b) for b in a.batches.split(",")), a.new_tokens)
    if sec == "speed":
        return speed(root, Path(a.tokenizer), [int(b) for b in a.batches.split(",")], a.new_tokens, a.rounds,
                     a.compile)
    raise SystemExit(f"cuda_check: unknown section {sec!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="probe,identity,gemm,attention,speed,profile")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokenizer", default=None,
                    help="folder with the demo model's tokenizer.json (default: the demo model, built if needed)")
    ap.add_argument("--compile", action="store_true", help="speed: also afdserve colocated with compile=True")
    ap.add_argument("--unit-timeout", type=float, default=300.0, help="seconds each unit may take")
    ap.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # one unit, run in its own process
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_check: this machine has no CUDA device")
    root = Path(tempfile.mkdtemp(prefix="afdserve-cuda-"))
    if a.unit is not None:  # a child: one unit, its result as JSON on the last line
        res = run_unit(a.unit, a, root)
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return
    if a.tokenizer is None:
        from afdserve.model.demo import demo_model_path

        a.tokenizer = str(demo_model_path())
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(f"torch {torch.__version__} on {result['device']}", flush=True)
    units = [u for sec in a.sections.split(",")
             for u in ([f"identity:{x}" for x in a.archs.split(",")] if sec == "identity" else [sec])]
    for unit in units:  # each in its own process: a CUDA error in one leaves the others a clean context
        print(f"== {unit}", flush=True)
        t0 = time.perf_counter()
        argv = [sys.executable, __file__, "--unit", unit, "--tokenizer", a.tokenizer, "--batches", a.batches,
                "--new-tokens", str(a.new_tokens), "--rounds", str(a.rounds)] + (["--compile"] if a.compile else [])
        # a unit that outlives its time is killed (its workers follow their parent) and reported
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1") if unit.startswith("identity:") else None
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=a.unit_timeout, env=env)
            out, why = proc.stdout, f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out, why = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""), \
                f"timed out after {a.unit_timeout:.0f} s"
        lines = out.splitlines()
        print("\n".join(ln for ln in lines if not ln.startswith("RESULT ")), flush=True)
        got = [ln[7:] for ln in lines if ln.startswith("RESULT ")]
        result[unit] = json.loads(got[-1]) if got else {"error": why}
        print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
