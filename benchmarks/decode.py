"""Decode throughput and time per output token, afdserve (colocated) against transformers.generate.

Both run the same checkpoint (the demo model by default) in this process, with the same thread
count, the same prompts and greedy decoding. Time per output token (TPOT) is measured as
(time for N tokens - time for 1 token) / (N - 1), so prefill is excluded.

    python benchmarks/decode.py [--model PATH] [--batch-sizes 1,2,4,...] [--json out/decode.json]
    python benchmarks/decode.py --host-model --parts 256   # the host work of a step, in its parts

``--parts B``: one thread runs the whole colocated engine, so its step is the critical path; at
batch B (fresh prompts, ``--max-tokens`` new tokens, greedy, ``--dtype``) it splits a
``generate`` into scheduling and input preparation (``Engine.begin``), the forward
(``ModelRunner.forward``), sampling and stop checks (``Engine.finish``), the front end's outputs
(``OutputProcessor.process``: detokenization, output objects) and the rest (request intake, the
loop), per step of the batch, medians of ``--repeats`` runs. ``--host-model``: peers.py's
near-free checkpoint (its forward costs almost nothing), so what remains is host work.
``--busy K``: K other processes spin on the CPU meanwhile (a shared machine); OpenMP's spinning is
set by ``GOMP_SPINCOUNT`` in the environment (afdserve's default 3000 where it is imported before
torch; this script imports torch first, so set it to compare, e.g. 300000, libgomp's own default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

import torch


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_afdserve(llm, prompts, n: int, repeats: int) -> tuple[float, float]:
    from afdserve import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run(k: int):
        return lambda: llm.generate(inputs, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))

    return _time(run(1), repeats), _time(run(n), repeats)


def bench_hf(model, prompts, n: int, repeats: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(k: int):
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                                      do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        return _time(run(1), repeats), _time(run(n), repeats)


def parts(path, batch: int, prompt_len: int, new_tokens: int, repeats: int, threads: int, dtype: str) -> dict:
    """Seconds per step of each part of a colocated generate (see the module's docstring)."""
    import statistics

    from afdserve import LLM, SamplingParams
    from afdserve.engine.engine import Engine
    from afdserve.engine.output_processor import OutputProcessor
    from afdserve.engine.runner import ModelRunner

    spent: dict[str, float] = {}

    def timed(cls, name: str, part: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0
        setattr(cls, name, wrapper)

    for cls, name, part in ((Engine, "begin", "schedule+inputs"), (ModelRunner, "forward", "forward"),
                            (Engine, "finish", "sample+finish"), (OutputProcessor, "process", "outputs")):
        timed(cls, name, part)
    llm = LLM(str(path), dtype=dtype, num_threads=threads, max_num_seqs=batch,
              max_num_batched_tokens=batch * (prompt_len + 1), max_model_len=prompt_len + new_tokens)
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    runs = []
    for r in range(repeats + 1):  # the first: one-off costs
        inputs = [{"prompt_token_ids": p} for p in _prompts(batch, prompt_len, vocab, seed=100 + r)]
        spent.clear()
        t0 = time.perf_counter()
        llm.generate(inputs, params)
        total = time.perf_counter() - t0
        run = {k: v / new_tokens for k, v in spent.items()}
        run["rest"] = total / new_tokens - sum(run.values())
        run["step"] = total / new_tokens
        if r:
            runs.append(run)
    llm.shutdown()
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--json", default="out/decode.json")
    ap.add_argument("--parts", type=int, default=None, metavar="B",
                    help="instead: the parts of a colocated step at batch B (host work, see above)")
    ap.add_argument("--host-model", action="store_true", help="peers.py's near-free checkpoint (HOST_MODEL)")
    ap.add_argument("--dtype", default="bfloat16", help="--parts: the engine's dtype")
    ap.add_argument("--busy", type=int, default=0, metavar="K", help="K processes spin on the CPU meanwhile")
    args = ap.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for p in busy:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> None:

    torch.set_num_threads(args.threads)
    from afdserve import LLM
    from afdserve.engine.builder import resolve_model

    if args.host_model:
        from peers import host_model_path  # benchmarks/peers.py, beside this file

        args.model = str(host_model_path())
    path = resolve_model(args.model)
    if args.parts:
        res = parts(path, args.parts, args.prompt_len, args.max_tokens, args.repeats, args.threads, args.dtype)
        print(f"model {path}  threads {args.threads}  batch {args.parts}  prompt {args.prompt_len}  "
              f"new tokens {args.max_tokens}  busy {args.busy}  GOMP_SPINCOUNT "
              f"{os.environ.get('GOMP_SPINCOUNT', 'unset')}  (ms per step, median of {args.repeats})")
        print("  ".join(f"{k} {v * 1e3:.2f}" for k, v in res.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                                       "torch": torch.__version__, "busy": args.busy,
                                       "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")},
                           "model": str(path), "batch": args.parts,
                           "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "dtype": args.dtype,
                           "ms_per_step": {k: v * 1e3 for k, v in res.items()}}, f, indent=1)
            print(f"wrote {args.json}")
        return
    llm = LLM(str(path), dtype="float32", max_num_seqs=max(64, max(map(int, args.batch_sizes.split(",")))))
    vocab = llm.engine.vocab_size
    hf = None
    if not args.no_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
    warm = _prompts(2, args.prompt_len, vocab, seed=1)  # first calls pay one-off costs
    bench_afdserve(llm, warm, 4, 1)
    if hf is not None:
        bench_hf(hf, warm, 4, 1)
    rows = []
    print(f"model {path}  threads {args.threads}  prompt {args.prompt_len}  new tokens {args.max_tokens}")
    print(f"{'batch':>5} | {'afdserve tok/s':>14} {'TPOT ms':>8} | {'HF tok/s':>9} {'TPOT ms':>8} | {'speed-up':>8}")
    for b in map(int, args.batch_sizes.split(",")):
        prompts = _prompts(b, args.prompt_len, vocab)
        t1, tn = bench_afdserve(llm, prompts, args.max_tokens, args.repeats)
        ours_tpot = (tn - t1) / (args.max_tokens - 1)
        row = {"batch": b, "afdserve_tpot_ms": ours_tpot * 1e3, "afdserve_decode_tok_s": b / ours_tpot}
        if hf is not None:
            h1, hn = bench_hf(hf, prompts, args.max_tokens, args.repeats)
            hf_tpot = (hn - h1) / (args.max_tokens - 1)
            row.update(hf_tpot_ms=hf_tpot * 1e3, hf_decode_tok_s=b / hf_tpot, speedup=hf_tpot / ours_tpot)
        rows.append(row)
        print(f"{b:>5} | {row['afdserve_decode_tok_s']:>14.1f} {row['afdserve_tpot_ms']:>8.2f} | "
              f"{row.get('hf_decode_tok_s', float('nan')):>9.1f} {row.get('hf_tpot_ms', float('nan')):>8.2f} | "
              f"{row.get('speedup', float('nan')):>7.2f}x")
    llm.shutdown()
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                                   "torch": torch.__version__},
                       "model": str(path), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                       "results": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
