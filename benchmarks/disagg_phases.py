"""Where the disaggregated deployment loses to colocated: prefill and decode apart.

Two engines on the same checkpoint (bf16) and cores, both loaded in this process: colocated with
``--cores`` threads, and 1 attention + 1 expert worker (m = 2) with ``--cores // 2`` threads each
(``--compare-lending``: also one whose expert worker does not borrow the waiting attention worker's
core, ``lend_idle_cores=False``).
Per batch size, each round times ``generate`` for 1 new token (prefill and the first token) and for
N new tokens, the engines alternating; decode step = (t(N) - t(1)) / (N - 1). Medians of the rounds.
Where /proc exists it also reads each process's CPU time (user + system) around every call, and
prints the CPU each process of an engine spends per decode step, the same difference: how busy
each core is, whatever the traces call waiting. The colocated engine runs in this process (its
OpenMP threads spin a while before they sleep, so its figure is an upper bound on its work); the
disaggregated one's front end is this process too.

    python benchmarks/disagg_phases.py [--batches 64,256] [--rounds 3] [--compare-lending]
                                       [--json out/disagg_phases.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from afdserve.engine.stats import cpu_seconds, process_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--compare-lending", action="store_true",
                    help="also run the disaggregated deployment with lend_idle_cores=False")
    ap.add_argument("--json", default="out/disagg_phases.json")
    args = ap.parse_args()
    from afdserve import LLM, SamplingParams
    from afdserve.engine.builder import resolve_model

    torch.set_num_threads(args.cores)
    batches = [int(b) for b in args.batches.split(",")]
    path, big = str(resolve_model(args.model)), max(batches)
    common = dict(dtype="bfloat16", max_num_seqs=big, max_model_len=args.prompt_len + args.new_tokens + 1,
                  max_num_batched_tokens=max(2048, big * args.prompt_len))
    procs: dict[str, dict[int, str]] = {}  # engine -> its processes (pid -> label)

    def load(name: str, **kw) -> LLM:
        before = set(process_tree(os.getpid()))
        llm = LLM(path, **kw, **common)
        procs[name] = {os.getpid(): "front end" if kw.get("expert_workers") else "engine (this process)",
                       **{pid: title(pid) for pid in process_tree(os.getpid()) if pid not in before}}
        return llm

    engines = {"colocated": load("colocated", num_threads=args.cores, expert_workers=0),
               "1a+1e m2": load("1a+1e m2", num_threads=max(1, args.cores // 2), attention_workers=1,
                                expert_workers=1, micro_batches=2)}
    if args.compare_lending:
        engines["1a+1e m2 no lending"] = load("1a+1e m2 no lending", num_threads=max(1, args.cores // 2),
                                              attention_workers=1, expert_workers=1, micro_batches=2,
                                              lend_idle_cores=False)
    rng = random.Random(0)
    vocab = engines["colocated"].engine.vocab_size

    def cpu(name: str) -> dict[str, float]:
        return {label: process_cpu_s(pid) for pid, label in procs[name].items()}

    def timed(name: str, batch: int, n: int) -> tuple[float, dict[str, float]]:
        """Seconds of one ``generate``, and the CPU seconds each process of the engine spent in it."""
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
                   for _ in range(batch)]
        c0, t0 = cpu(name), time.perf_counter()
        engines[name].generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        t = time.perf_counter() - t0
        return t, {label: v - c0[label] for label, v in cpu(name).items()}

    rows = []
    try:
        for batch in batches:
            times = {(e, n): [] for e in engines for n in (1, args.new_tokens)}
            cpus = {(e, n): [] for e in engines for n in (1, args.new_tokens)}
            for name in engines:  # warm-up
                timed(name, batch, args.new_tokens)
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for name in order:
                    for n in (1, args.new_tokens):
                        t, c = timed(name, batch, n)
                        times[name, n].append(t)
                        cpus[name, n].append(c)
            row = {"batch": batch}
            for name in engines:
                first = statistics.median(times[name, 1])
                full = statistics.median(times[name, args.new_tokens])
                step = (full - first) / (args.new_tokens - 1)
                # per process: the median over rounds of (CPU of the N-token call - CPU of the 1-token call)
                dec = {label: statistics.median((b[label] - a[label]) / (args.new_tokens - 1)
                                                for a, b in zip(cpus[name, 1], cpus[name, args.new_tokens]))
                       for label in procs[name].values()}
                row[name] = {"prefill_ms": round(first * 1e3, 1), "decode_step_ms": round(step * 1e3, 2),
                             "total_ms": round(full * 1e3, 1), "tok_per_s": round(batch * args.new_tokens / full),
                             "decode_cpu_ms_per_step": {k: round(v * 1e3, 2) for k, v in dec.items()},
                             "prefill_cpu_ms": {label: round(statistics.median(c[label] for c in cpus[name, 1]) * 1e3,
                                                             1) for label in procs[name].values()}}
            rows.append(row)
    finally:
        for llm in engines.values():
            llm.shutdown()
    w = max(len(n) for n in engines) + 10
    print(f"{'batch':>6} {'engine':<{w}} {'prefill ms':>11} {'decode ms/step':>15} {'tok/s':>7}")
    for row in rows:
        for name in engines:
            r = row[name]
            print(f"{row['batch']:>6} {name:<{w}} {r['prefill_ms']:>11.1f} {r['decode_step_ms']:>15.2f} "
                  f"{r['tok_per_s']:>7}")
        c = row["colocated"]
        for name in list(engines)[1:]:  # of colocated
            d = row[name]
            row[f"ratio {name}"] = {"prefill": round(c["prefill_ms"] / d["prefill_ms"], 3),
                                    "decode_step": round(c["decode_step_ms"] / d["decode_step_ms"], 3),
                                    "tok_per_s": round(d["tok_per_s"] / c["tok_per_s"], 3)}
            print(f"{'':>6} {'ratio ' + name:<{w}} {c['prefill_ms'] / d['prefill_ms']:>10.2f}x "
                  f"{c['decode_step_ms'] / d['decode_step_ms']:>14.2f}x {d['tok_per_s'] / c['tok_per_s']:>6.2f}x")
    if any(sum(row[name]["decode_cpu_ms_per_step"].values()) > 0 for row in rows for name in engines):
        print("CPU per decode step, each process (ms; in parentheses: of the decode step's wall time)")
        for row in rows:
            for name in engines:
                r = row[name]
                print(f"{row['batch']:>6} {name:<{w}} " + ", ".join(
                    f"{label} {ms:.2f} ({ms / r['decode_step_ms']:.0%})"
                    for label, ms in r["decode_cpu_ms_per_step"].items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "disagg_phases", "model": path, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, "rounds": args.rounds, "cores": args.cores, "rows": rows},
                      f, indent=1)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run so far: nanoseconds from each thread's schedstat
    where the kernel has them (the ticks of /proc/<pid>/stat are 10 ms), else those ticks."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        total = 0
        for t in tasks:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        return cpu_seconds(pid) or 0.0


def title(pid: int) -> str:
    """A process's title ("afdserve: attention0" for a worker), else its pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        name = ""
    return name.removeprefix("afdserve: ") if name.startswith("afdserve: ") else f"pid {pid}"


if __name__ == "__main__":
    main()
