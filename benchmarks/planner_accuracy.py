"""Planner against reality: predicted vs measured decode iteration time of local deployments.

Takes a fresh profile of this machine (``afdserve profile``; or ``--profile PATH``), then for each
deployment ``(n_a, n_e, m, batch)`` -- ``batch`` sequences per attention worker, ``n_a * batch`` in
all -- runs the demo model on the real runtime (``LLM(attention_workers=n_a, expert_workers=n_e,
micro_batches=m, num_threads=1)``) and measures the decode iteration time without prefill::

    step = (T(N tokens) - T(1 token)) / (N - 1)        (best of --repeats interleaved runs of each,
                                                        as benchmarks/pingpong.py: other processes
                                                        on the machine only ever add time)

and predicts it with ``planner.predict_local`` (the simulated runtime, and the paper's analytic
pipeline model for reference) at the mean context length of those decode steps.  Prints the error
table and writes JSON.

This machine's speed drifts by up to ~30 % within a minute (other tenants of the host; invisible from
inside), so by default the prediction for a deployment is the mean of the predictions with two
quick profiles taken right before and right after its measurement (``afdserve profile --quick``,
~15 s each); the prediction with the single full profile taken at the start is shown as well.
Runs during which other processes on this machine used the CPUs are repeated.  The errors are
reported against the best of the runs and against their median ((median T(N) - median T(1)) /
(N - 1)): the best run is often an outlier, while the profile is a typical (median-based) cost.

Deployments with more worker processes than cores time-share the cores; the runtime model simulates
that (processor sharing over the profile's core count).  The table marks them.  ``n_e = 0`` is the
colocated engine (one process, one thread; ``planner.predict_colocated``).

    python benchmarks/planner_accuracy.py [--profile out/profile.json] [--json out/planner_accuracy.json]
    python benchmarks/planner_accuracy.py --summarize out/planner_accuracy.json   # reprint, no measuring
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# (n_a, n_e, m, sequences per attention worker); n_e = 0: colocated
DEFAULT_DEPLOYMENTS = ("1,0,1,16;1,0,1,64;1,0,1,256;1,1,1,16;1,1,2,64;1,1,3,96;1,1,2,256;1,1,1,128;"
                       "2,1,2,32;1,2,2,32;2,2,2,64")


def parse_deployments(text: str) -> list[tuple[int, int, int, int]]:
    out = []
    for part in text.split(";"):
        if part.strip():
            vals = tuple(int(x) for x in part.split(","))
            if len(vals) != 4 or min(vals[0], vals[2], vals[3]) < 1 or vals[1] < 0 or (vals[1] == 0 and vals[0] != 1):
                raise argparse.ArgumentTypeError(f"deployment {part!r}: expected n_a,n_e,m,batch (positive; "
                                                 "n_e = 0 with n_a = 1: colocated)")
            out.append(vals)
    return out  # type: ignore[return-value]


def wait_idle(threshold: float, max_wait_s: float) -> float:
    """Waits (up to ``max_wait_s``) until the machine's CPUs were at least ``threshold`` idle over a
    second; returns the last idle fraction.  Other processes' work only adds to a measurement."""
    from afdserve.profiling import idle_fraction

    end = time.monotonic() + max_wait_s
    idle = idle_fraction(1.0)
    while idle < threshold and time.monotonic() < end:
        idle = idle_fraction(1.0)
    return idle


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_snapshot(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds the whole machine was busy, CPU seconds of these processes), from /proc."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]  # everything but idle and iowait
    ours = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return busy / _TICK, ours / _TICK


def pin_workers(llm, cores: list[int]) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Pins the deployment's worker processes round-robin to ``cores`` (attention workers first),
    as ``planner.runtime_sim.pinned_round_robin`` assumes."""
    workers = getattr(llm.engine, "workers", {})
    order = sorted((n for n in workers if n.startswith("attention")), key=lambda n: int(n[9:]))
    order += sorted((n for n in workers if n.startswith("expert")), key=lambda n: int(n[6:]))
    out = {}
    for i, name in enumerate(order):
        os.sched_setaffinity(workers[name].pid, {cores[i % len(cores)]})
        out[name] = cores[i % len(cores)]
    return out


def measure(n_a: int, n_e: int, m: int, batch: int, tokens: int, prompt_len: int, repeats: int,
            vocab: int, idle: float = 0.0, max_wait_s: float = 0.0, pin: bool = False,
            max_foreign: float = 0.05, attempts: int = 4) -> dict:
    """Decode step of the real runtime: (T(N) - T(1)) / (N - 1), best of ``repeats`` runs each.

    A run during which other processes used more than ``max_foreign`` of a core (the machine's busy
    CPU time minus this deployment's, from /proc) is repeated, up to ``attempts`` times."""
    from afdserve import LLM, SamplingParams

    rng = random.Random(1000 * n_a + 100 * n_e + 10 * m + batch)
    total = n_a * batch
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(total)]
    kw = dict(attention_workers=n_a, expert_workers=n_e, micro_batches=m, num_threads=1, kv_cache_gb=0.25,
              max_num_seqs=batch)
    t_start = time.perf_counter()
    with LLM(None, **kw) as llm:
        pinned = pin_workers(llm, sorted(os.sched_getaffinity(0))) if pin else None
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))  # warm-up

        idles: list[float] = []
        foreign: list[float] = []
        pids = [os.getpid()] + [w.pid for w in getattr(llm.engine, "workers", {}).values()]

        def run(n: int) -> float:
            best = None
            for _ in range(attempts):
                if idle > 0:
                    idles.append(wait_idle(idle, max_wait_s))
                b0, o0 = cpu_snapshot(pids)
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                dt = time.perf_counter() - t0
                b1, o1 = cpu_snapshot(pids)
                f = max(0.0, (b1 - b0) - (o1 - o0)) / dt
                foreign.append(f)
                best = dt if best is None else min(best, dt)
                if f <= max_foreign:
                    return dt
            return best

        t1, tn = [], []
        for _ in range(repeats):  # interleaved, so slow phases of a noisy machine hit both
            t1.append(run(1))
            tn.append(run(tokens))
    step = (min(tn) - min(t1)) / (tokens - 1)
    per_run = [(b - a) / (tokens - 1) for a, b in zip(t1, tn)]
    return {"step_s": step, "step_median_s": (statistics.median(tn) - statistics.median(t1)) / (tokens - 1),
            "step_runs_s": per_run, "t1_s": t1, "tn_s": tn, "idle_before_runs": idles, "pinned": pinned,
            "foreign_cpu": foreign,
            "wall_s": time.perf_counter() - t_start}


def diagnose(n_a: int, n_e: int, m: int, batch: int, tokens: int, prompt_len: int, vocab: int, path: str,
             pin: bool = False) -> dict:
    """One traced run: medians of the workers' spans (ms), for comparing the model's parts."""
    from afdserve import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(n_a * batch)]
    with LLM(None, attention_workers=n_a, expert_workers=n_e, micro_batches=m, num_threads=1, kv_cache_gb=0.25,
             max_num_seqs=batch, trace=path) as llm:
        if pin:
            pin_workers(llm, sorted(os.sched_getaffinity(0)))
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        llm.engine.traces()  # drop the warm-up's spans
        pids = [os.getpid()] + [w.pid for w in llm.engine.workers.values()]
        b0, o0 = cpu_snapshot(pids)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        dt = time.perf_counter() - t0
        b1, o1 = cpu_snapshot(pids)
        per = llm.engine.traces()
    from afdserve.runtime.trace import write_chrome_trace

    write_chrome_trace(path, per)
    out: dict = {}
    for worker, evs in per.items():
        spans: dict[str, list[float]] = {}
        steps = sorted((e for e in evs if e.get("ph") == "X" and e["name"] == "step"), key=lambda e: e["ts"])
        for e in evs:
            if e.get("ph") != "X":
                continue
            name = e["name"] + ("/" + e["args"]["phase"] if e["args"].get("phase") else "")
            if name == "step" and e is steps[0]:
                continue  # prefill
            spans.setdefault(name, []).append(e["dur"] / 1e3)
            if e["name"] == "expert":
                spans.setdefault("expert_senders", []).append(float(e["args"].get("senders", 1)))
        if len(steps) > 2:  # decode step period (start to start), excluding the prefill step
            spans["step_period"] = [(b["ts"] - a["ts"]) / 1e3 for a, b in zip(steps[1:], steps[2:])]
        out[worker] = {k: statistics.median(v) for k, v in spans.items()}
        out[worker]["count"] = {k: len(v) for k, v in spans.items()}
    out["cpu"] = {"wall_s": dt, "ours_cpu_s": o1 - o0, "foreign_cpu_s": max(0.0, (b1 - b0) - (o1 - o0))}
    return out


def with_median(x: dict) -> dict:
    """Adds the errors against the median of the runs to a row's ``x = row[mode]`` (for JSON written
    before they were recorded)."""
    med = x["measurement"]["step_median_s"] * 1e3
    x["median_ms"] = med
    x["error_median"] = x["predicted_ms"] / med - 1
    x["one_profile_error_median"] = x["one_profile_ms"] / med - 1
    return x


def deployment_line(row: dict, mode: str, bracket: bool) -> str:
    x, meas = row[mode], row[mode]["measurement"]
    return (f"  n_a={row['n_a']} n_e={row['n_e']} m={row['m']} batch={row['batch_per_attention_worker']:<3} "
            f"{mode:>8}: measured {x['measured_ms']:7.1f} ms, median {x['median_ms']:7.1f} ms  "
            + (f"predicted {x['predicted_ms']:7.1f} ms ({x['error'] * 100:+.1f}%; median "
               f"{x['error_median'] * 100:+.1f}%)  " if bracket else "")
            + f"one profile {x['one_profile_ms']:7.1f} ms ({x['one_profile_error'] * 100:+.1f}%; median "
            f"{x['one_profile_error_median'] * 100:+.1f}%)  [runs "
            f"{', '.join(f'{v * 1e3:.1f}' for v in meas['step_runs_s'])}; other processes "
            f"<= {max(meas['foreign_cpu']):.0%} of a core]")


def fmt_table(rows: list[dict], cores: int, modes: list[str], bracket: bool) -> str:
    head = ["n_a", "n_e", "m", "batch/attn", "batch", "procs"]  # n_e 0: colocated
    for mode in modes:
        head += [f"{mode} ms"]
        if bracket:
            head += ["predicted", "error"]
        head += ["1 profile", "error", "median ms", "error"]
    head += ["analytic", "error"]
    lines = []
    for r in rows:
        line = [str(r["n_a"]), str(r["n_e"]), str(r["m"]), str(r["batch_per_attention_worker"]),
                str(r["global_batch"]), f"{r['processes']}{'*' if r['processes'] > cores else ''}"]
        for mode in modes:
            x = r[mode]
            line += [f"{x['measured_ms']:.1f}"]
            if bracket:
                line += [f"{x['predicted_ms']:.1f}", f"{x['error'] * 100:+.1f}%"]
            line += [f"{x['one_profile_ms']:.1f}", f"{x['one_profile_error'] * 100:+.1f}%"]
            med_err = x["error_median"] if bracket else x["one_profile_error_median"]
            line += [f"{x['median_ms']:.1f}", f"{med_err * 100:+.1f}%"]
        ref = r[modes[0]]["measured_ms"]
        line += [f"{r['analytic_ms']:.1f}", f"{(r['analytic_ms'] / ref - 1) * 100:+.1f}%"]
        lines.append(line)
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def print_report(report: dict) -> None:
    """The table and the summary lines of a report (as written to --json)."""
    rows, modes, bracket, cores = report["rows"], report["modes"], report["bracket"], report["cores"]
    print(f"decode iteration time, demo model, {report['tokens']} tokens after a {report['prompt_len']}-token "
          f"prompt (mean context {rows[0]['seq_len']:g}); {cores} cores; * = more worker processes than cores "
          "(they time-share)")
    if bracket:
        print("predicted: mean of the predictions with quick profiles taken right before and right after the "
              "deployment's measurement; 1 profile: with the full profile taken at the start")
    print(f"{modes[0]} ms: best of {report['repeats']} runs (the errors before 'median ms' are against it); "
          f"median ms: (median T(N) - median T(1)) / (N - 1), and {'predicted' if bracket else '1 profile'}'s "
          "error against it")
    print(fmt_table(rows, cores, modes, bracket))
    for stat, suffix in (("best of runs", ""), ("median of runs", "_median")):
        print(f"errors against the {stat}:")
        for mode in modes:
            for key, label in ((("error", "predicted"),) if bracket else ()) + (("one_profile_error", "1 profile"),):
                for name, sel in (("all", rows), ("fit the cores", [r for r in rows if not r["shares_cores"]]),
                                  ("share cores", [r for r in rows if r["shares_cores"]])):
                    if sel:
                        errs = [abs(r[mode][key + suffix]) for r in sel]
                        print(f"{mode:>8} {label:>9} {stat:>14} {name:>13}: {len(sel)} deployments, mean |error| "
                              f"{statistics.mean(errs) * 100:.1f}%, max {max(errs) * 100:.1f}%, within "
                              "20/15/10/5%: " + "/".join(str(sum(e <= x for e in errs))
                                                         for x in (0.20, 0.15, 0.10, 0.05)) + f" of {len(sel)}")


def summarize(path: Path) -> int:
    report = json.loads(path.read_text())
    for row in report["rows"]:
        for mode in report["modes"]:
            with_median(row[mode])
            print(deployment_line(row, mode, report["bracket"]))
    print()
    print_report(report)
    print(f"load average before {report['loadavg_before'][0]:.2f}, after {report['loadavg_after'][0]:.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, help="use this profile (only) instead of measuring fresh ones")
    ap.add_argument("--profile-out", type=Path, default=Path("out/profile.json"),
                    help="where to save the fresh full profile (default out/profile.json)")
    ap.add_argument("--quick-profile", action="store_true", help="the first profile with the quick grid too")
    ap.add_argument("--no-bracket", action="store_true",
                    help="do not re-profile (quick grid) between deployments; predict with the first profile only")
    ap.add_argument("--deployments", type=parse_deployments, default=parse_deployments(DEFAULT_DEPLOYMENTS),
                    help=f"n_a,n_e,m,batch per attention worker; ';'-separated (default {DEFAULT_DEPLOYMENTS})")
    ap.add_argument("--modes", default="unpinned",
                    help="unpinned: the OS places the workers (the runtime as it is); pinned: workers pinned "
                         "round-robin to the cores, attention workers first (comma-separated; default unpinned)")
    ap.add_argument("--tokens", type=int, default=24, help="N: tokens generated per sequence (default 24)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of T(1) and T(N) per deployment (best of)")
    ap.add_argument("--json", type=Path, default=Path("out/planner_accuracy.json"))
    ap.add_argument("--wait-idle", type=float, default=0.85, metavar="FRACTION",
                    help="before each timed run wait until the CPUs were this idle over a second (0: don't; "
                         "default 0.85)")
    ap.add_argument("--max-wait", type=float, default=120.0, help="longest wait for an idle machine per run (s)")
    ap.add_argument("--max-foreign", type=float, default=0.05,
                    help="repeat a run (up to 4 times) when other processes used more than this fraction of a "
                         "core meanwhile (default 0.05)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also one traced run per deployment: median spans per worker (in the JSON)")
    ap.add_argument("--summarize", type=Path, metavar="JSON",
                    help="measure nothing: reprint the per-deployment lines, the table and the summaries of a "
                         "saved --json")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if args.tokens < 3:
        ap.error("--tokens must be >= 3")
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if not modes or any(x not in ("pinned", "unpinned") for x in modes):
        ap.error("--modes: pinned and/or unpinned")

    from afdserve.model.config import ModelConfig
    from afdserve.model.demo import demo_model_path
    from afdserve.planner import load_model_spec, load_profile, predict_local, profile_summary, save_profile
    from afdserve.profiling import DEFAULT_GRID, QUICK_GRID, cpu_cores, run_profile

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    bracket = not (args.profile or args.no_bracket)
    if args.profile:
        prof = load_profile(args.profile)
        print(f"profile {args.profile}")
    else:
        print("profiling this machine (afdserve profile) ...", flush=True)
        if args.wait_idle > 0:
            wait_idle(args.wait_idle, args.max_wait)
        prof = run_profile(None, QUICK_GRID if args.quick_profile else DEFAULT_GRID)
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(prof, args.profile_out)
        print(f"wrote {args.profile_out} ({time.perf_counter() - t0:.0f} s)")
    print(profile_summary(prof))
    spec = load_model_spec("demo")
    vocab = ModelConfig.from_pretrained(demo_model_path()).vocab_size
    cores = prof.runtime.cores if prof.runtime is not None else cpu_cores()
    # mean context over the decode steps 2..N: the step producing token k attends prompt_len + k tokens
    seq_len = args.prompt_len + (args.tokens + 2) / 2

    def calibrate() -> "object":
        if args.wait_idle > 0:
            wait_idle(args.wait_idle, args.max_wait)
        return run_profile(None, QUICK_GRID)

    rows = []
    before = calibrate() if bracket else prof
    for n_a, n_e, m, b in args.deployments:
        ana = predict_local(prof, n_a, n_e, m, b, seq_len, spec, method="analytic")
        row: dict = {"n_a": n_a, "n_e": n_e, "m": m, "batch_per_attention_worker": b, "global_batch": n_a * b,
                     "processes": n_a + n_e, "colocated": n_e == 0, "shares_cores": n_a + n_e > cores,
                     "seq_len": seq_len,
                     "analytic_ms": ana.iteration_s * 1e3}
        meas = {mode: measure(n_a, n_e, m, b, args.tokens, args.prompt_len, args.repeats, vocab, args.wait_idle,
                              args.max_wait, pin=mode == "pinned", max_foreign=args.max_foreign) for mode in modes}
        after = calibrate() if bracket else prof
        for mode in modes:
            pinned = mode == "pinned"
            one = predict_local(prof, n_a, n_e, m, b, seq_len, spec, pinned=pinned)
            around = [predict_local(p, n_a, n_e, m, b, seq_len, spec, pinned=pinned) for p in (before, after)]
            pred_s = statistics.mean(p.iteration_s for p in around)
            step = meas[mode]["step_s"]
            row[mode] = {"measured_ms": step * 1e3, "predicted_ms": pred_s * 1e3, "error": pred_s / step - 1,
                         "predicted_before_after_ms": [p.iteration_s * 1e3 for p in around],
                         "one_profile_ms": one.iteration_s * 1e3, "one_profile_error": one.iteration_s / step - 1,
                         "prediction": {"method": one.method, "ta_ms": one.ta_s * 1e3, "te_ms": one.te_s * 1e3,
                                        "outside_layers_ms": (one.iteration_s - one.pipeline_s) * 1e3,
                                        "micro_batches": list(one.micro_batch_sizes), "busy": list(one.busy)},
                         "measurement": meas[mode], "loadavg": os.getloadavg()}
            with_median(row[mode])
            print(deployment_line(row, mode, bracket), flush=True)
        before = after
        if args.diagnose:
            trace = str(args.json.parent / f"trace_a{n_a}_e{n_e}_m{m}_b{b}.json")
            row["trace_medians_ms"] = diagnose(n_a, n_e, m, b, args.tokens, args.prompt_len, vocab, trace,
                                               pin=modes[0] == "pinned")
            for w, med in row["trace_medians_ms"].items():
                print(f"    {w}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items() if k != "count"))
        rows.append(row)
    load1 = os.getloadavg()
    report = {"profile": str(args.profile or args.profile_out), "device": prof.device, "cores": cores,
              "tokens": args.tokens, "prompt_len": args.prompt_len, "repeats": args.repeats, "modes": modes,
              "bracket": bracket, "rows": rows, "loadavg_before": load0, "loadavg_after": load1}
    print()
    print_report(report)
    print(f"load average before {load0[0]:.2f}, after {load1[0]:.2f}; {time.perf_counter() - t0:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
