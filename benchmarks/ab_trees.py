"""Paired A/B throughput of two source trees of afdserve, in one session with alternating rounds.

This machine's speed drifts a lot within a minute, so base and new run back to back for every
(deployment, batch), in swapped order on odd rounds, and each round gives one paired ratio new/base.
Each side imports afdserve from its own tree (``PYTHONPATH=<tree>/src``) in one long-lived engine
subprocess per deployment (JSON lines on stdin/stdout); greedy token ids of both sides must match.

    python benchmarks/ab_trees.py --base REV [--new PATH_OR_REV] [--rounds 5] [--batches 8,64]
        [--prompt-len 32] [--max-tokens 64] [--deployments colocated,disagg] [--json out/ab_trees.json]
        [--model PATH]
        [--threads N] [--new-options '{"compile": true}'] [--base-options '{...}'] [--fresh-prompts]
        [--params '{"temperature": 0.8, "top_p": 0.95, "frequency_penalty": 0.5}']

Without ``--fresh-prompts`` every round sends the same prompts, so after the first round their
prefills hit the prefix cache and tok/s is nearly all decode; with it, every call sends new prompts
(the same on both sides) and tok/s includes the prefills.

``--params``: the requests' sampling params (SamplingParams keywords; default greedy). Each call
also reports the median time of ``Engine._sample`` (sampling, stop checks, outputs) over its steps
that sample the whole batch: the sampling of a decode step. Token ids are compared only where the
params make them deterministic (greedy, or a seed).

--base/--new take a git revision (checked out into a temporary worktree, removed at exit) or the
path of a source tree; --new defaults to this checkout, uncommitted changes included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = {  # engine options; each deployment uses the machine's 2 cores
    "colocated": dict(num_threads=2),
    "disagg": dict(expert_workers=1, attention_workers=1, micro_batches=2, num_threads=1),
    # more worker processes than cores: what a change does where peers share a core
    "disagg2x2": dict(expert_workers=2, attention_workers=2, micro_batches=2, num_threads=1),
}


def worker(cfg: dict) -> None:
    """Engine subprocess: load the model once, answer {"batch", "max_tokens"} lines until stdin closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (engine, its worker processes) goes to the log
    tree = Path(cfg["tree"]).resolve()
    sys.path.insert(0, str(tree / "src"))
    import afdserve

    if not Path(afdserve.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"imported afdserve from {afdserve.__file__}, not from the tree {tree}")
    import torch
    from afdserve import LLM, SamplingParams
    from afdserve.engine.engine import Engine as EngineCore
    from afdserve.model.demo import demo_model_path

    sample_times: list[tuple[int, float]] = []  # (rows, seconds) of each Engine._sample call
    sample = EngineCore._sample

    def timed_sample(self, logits, seqs, *a, **kw):
        t0 = time.perf_counter()
        out = sample(self, logits, seqs, *a, **kw)
        sample_times.append((len(seqs), time.perf_counter() - t0))
        return out

    EngineCore._sample = timed_sample

    model = Path(cfg["model"]) if cfg.get("model") else demo_model_path()
    model_cfg = json.loads((model / "config.json").read_text())
    vocab, max_b, block = model_cfg["vocab_size"], cfg["max_batch"], 16
    blocks = max(math.ceil(model_cfg["max_position_embeddings"] / block),  # one max-length sequence
                 max_b * (math.ceil((cfg["prompt_len"] + cfg["max_tokens"]) / block) + 1))
    llm = LLM(cfg.get("model"), cfg["dtype"], max_num_seqs=max_b, block_size=block, num_kv_blocks=blocks,
              **DEPLOYMENTS[cfg["deployment"]] | cfg["options"])

    def generate(batch: int, max_tokens: int, seed: int) -> tuple[float, list[list[int]]]:
        rng = random.Random(seed)  # the same prompts on both sides
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(cfg["prompt_len"])]}
                   for _ in range(batch)]
        params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | cfg["params"])
        sample_times.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate(max_b, 4, -1)  # warm-up: first calls pay one-off costs
    proto.write(json.dumps({"ready": True, "afdserve": afdserve.__file__, "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        seconds, ids = generate(cmd["batch"], cmd["max_tokens"], cmd["seed"])
        digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
        whole = [t for rows, t in sample_times if rows == cmd["batch"]]
        proto.write(json.dumps({"seconds": seconds, "tokens": sum(map(len, ids)), "token_ids_hash": digest,
                                "sample_s": statistics.median(whole) if whole else float("nan")}) + "\n")
    llm.shutdown()


class Engine:
    """Parent-side handle of one engine subprocess (one tree, one deployment)."""

    def __init__(self, name: str, cfg: dict, log: Path, timeout: float):
        self.name, self.log, self.timeout = name, log, timeout
        path = [str(Path(cfg["tree"]) / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))  # also inherited by the engine's workers
        with open(log, "w") as err:  # own session: killed with its workers, and Ctrl-C reaches only us
            self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], cwd=cfg["tree"],
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.info = self._reply()
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # EOF: the process died or closed stdout

    def _reply(self) -> dict:
        try:
            line = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            raise self._error(f"gave no reply within {self.timeout:.0f} s") from None
        if line is None:
            raise self._error(f"died (exit code {self.proc.wait()})")
        return json.loads(line)

    def _error(self, what: str) -> RuntimeError:
        lines = self.log.read_text(errors="replace").splitlines()[-30:]
        tail = "; its log ends:\n    " + "\n    ".join(lines) if lines else "; its log is empty"
        return RuntimeError(f"engine {self.name} {what}{tail}")

    def run(self, batch: int, max_tokens: int, seed: int) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"batch": batch, "max_tokens": max_tokens, "seed": seed}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._error(f"died (exit code {self.proc.wait()})") from None
        return self._reply()

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the engine shuts down
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine and any worker processes it left behind
        except ProcessLookupError:
            pass
        self.proc.wait()


def git(*args: str, cwd: Path = REPO) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve_tree(spec: str, tmp: Path, name: str, worktrees: list[Path]) -> Path:
    """A directory is used as is; anything else is a revision checked out into a temporary worktree."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    path = tmp / name
    git("worktree", "add", "--detach", str(path), git("rev-parse", "--verify", spec + "^{commit}"))
    worktrees.append(path)
    return path


def revision(tree: Path) -> str:
    rev = git("rev-parse", "HEAD", cwd=tree)
    return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", cwd=tree) else "")


# the measures of a call, with their table columns' widths (base, new) and decimals
KEYS = {"tok_s": (10, 9, 1), "decode_tok_s": (10, 9, 1), "sample_ms": (11, 10, 2)}


def deterministic(params: dict) -> bool:
    """Whether requests with these SamplingParams keywords give the same tokens on both sides."""
    return params.get("temperature", 0) == 0 or params.get("top_k") == 1 or params.get("seed") is not None


def run_rounds(args, engines: dict, batches: list[int]) -> list[dict]:
    raw = []
    for r in range(args.rounds):
        order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
        for dep in args.deployments:
            for b in batches:
                rec = {"round": r, "deployment": dep, "batch": b, "order": order}
                # the same prompts every round (after the first, their prefills hit the prefix cache), or
                # with --fresh-prompts new ones for every call (the same on both sides)
                seeds = (b, b) if not args.fresh_prompts else (1000 * (2 * r + 1) + b, 1000 * (2 * r + 2) + b)
                for side in order:
                    one = engines[side, dep].run(b, 1, seeds[0])
                    full = engines[side, dep].run(b, args.max_tokens, seeds[1])
                    rec[side] = {"t1": one["seconds"], "tN": full["seconds"], "tokens": full["tokens"],
                                 "hash1": one["token_ids_hash"], "hashN": full["token_ids_hash"],
                                 "tok_s": full["tokens"] / full["seconds"],
                                 "decode_tok_s": b * (args.max_tokens - 1) / (full["seconds"] - one["seconds"])
                                 if full["seconds"] > one["seconds"] else float("nan"),
                                 "sample_ms": 1000 * full["sample_s"]}
                for key in KEYS:
                    rec["ratio_" + key] = rec["new"][key] / rec["base"][key]
                raw.append(rec)
                print(f"  round {r} {dep:>9} batch {b:>3}: new/base {rec['ratio_tok_s']:.3f} "
                      f"(decode {rec['ratio_decode_tok_s']:.3f}, sampling ms {rec['base']['sample_ms']:.2f} -> "
                      f"{rec['new']['sample_ms']:.2f})", flush=True)
    return raw


def summarize(raw: list[dict], args, batches: list[int]) -> list[dict]:
    rows = []
    for dep in args.deployments:
        for b in batches:
            recs = [x for x in raw if x["deployment"] == dep and x["batch"] == b]
            row = {"deployment": dep, "batch": b, "identical": all(
                x["base"][h] == x["new"][h] == (x if args.fresh_prompts else recs[0])["base"][h]
                for x in recs for h in ("hash1", "hashN")) if deterministic(args.params) else None}
            for key in KEYS:
                ratios = [x["ratio_" + key] for x in recs]
                row.update({f"base_{key}": statistics.median(x["base"][key] for x in recs),
                            f"new_{key}": statistics.median(x["new"][key] for x in recs),
                            f"ratio_{key}": statistics.median(ratios),
                            f"ratio_{key}_min": min(ratios), f"ratio_{key}_max": max(ratios)})
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'deployment':>10} {'batch':>5} | {'base tok/s':>10} {'new tok/s':>9} {'new/base [min, max]':>21} | "
          f"{'base dec/s':>10} {'new dec/s':>9} {'new/base [min, max]':>21} | "
          f"{'base smp ms':>11} {'new smp ms':>10} {'new/base [min, max]':>21} | identical")
    for r in rows:
        cells = [f"{r['base_' + k]:>{wb}.{d}f} {r['new_' + k]:>{wn}.{d}f} "
                 f"{r['ratio_' + k]:>6.3f} [{r['ratio_' + k + '_min']:.3f}, {r['ratio_' + k + '_max']:.3f}]"
                 for k, (wb, wn, d) in KEYS.items()]
        same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        print(f"{r['deployment']:>10} {r['batch']:>5} | {cells[0]} | {cells[1]} | {cells[2]} | {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision (or tree path) of the baseline")
    ap.add_argument("--new", default=str(REPO), help="tree path or git revision (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--deployments", default="colocated,disagg")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per engine start or command")
    ap.add_argument("--json", default="out/ab_trees.json")
    ap.add_argument("--threads", type=int, help="torch threads per engine process (default: the deployment's; "
                    "1 on a loaded machine, where 2 threads per process wait on each other)")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="new prompts for every call (the same on both sides): prefills are computed, not found "
                         "in the prefix cache, so tok/s includes them")
    ap.add_argument("--new-options", type=json.loads, default={},
                    help="JSON object of engine options (LLM keywords) given to the new side only")
    ap.add_argument("--base-options", type=json.loads, default={},
                    help="JSON object of engine options (LLM keywords) given to the base side only")
    ap.add_argument("--params", type=json.loads, default={},
                    help="JSON object of SamplingParams keywords for every request (default: greedy)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    args.deployments = args.deployments.split(",")
    if unknown := set(args.deployments) - set(DEPLOYMENTS):
        ap.error(f"unknown deployments {sorted(unknown)}; known: {sorted(DEPLOYMENTS)}")
    if args.max_tokens < 2 or args.rounds < 1:
        ap.error("--max-tokens must be >= 2 and --rounds >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on kill too

    tmp = Path(tempfile.mkdtemp(prefix="ab_trees_"))
    worktrees: list[Path] = []
    engines: dict = {}
    try:
        trees = {"base": resolve_tree(args.base, tmp, "base", worktrees),
                 "new": resolve_tree(args.new, tmp, "new", worktrees)}
        revs = {side: revision(tree) for side, tree in trees.items()}
        for side, tree in trees.items():
            print(f"{side:>4}: {tree} @ {revs[side]}")
        for dep in args.deployments:  # started one at a time, so loads don't compete
            for side, tree in trees.items():
                options = ({"num_threads": args.threads} if args.threads else {}) \
                    | (args.new_options if side == "new" else args.base_options)
                cfg = {"tree": str(tree), "deployment": dep, "dtype": args.dtype, "max_batch": max(batches),
                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "options": options,
                       "params": args.params,
                       "model": args.model and str(Path(args.model).resolve())}
                print(f"starting {side} {dep} ...", flush=True)
                engines[side, dep] = Engine(f"{side}/{dep}", cfg, tmp / f"{side}-{dep}.log", args.timeout)
        imported = {f"{side}/{dep}": e.info for (side, dep), e in engines.items()}
        raw = run_rounds(args, engines, batches)
    finally:
        for engine in engines.values():
            engine.close()
        for path in worktrees:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)  # e.g. after an interrupted add

    rows = summarize(raw, args, batches)
    print_table(rows)
    import torch

    result = {"machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
              "trees": {side: {"spec": getattr(args, side), "path": str(trees[side]), "revision": revs[side]}
                        for side in trees},
              "engines": imported,
              "settings": {k: getattr(args, k) for k in ("rounds", "prompt_len", "max_tokens", "dtype", "deployments",
                                                          "fresh_prompts", "threads", "new_options",
                                                          "base_options", "params")}
              | {"batches": batches, "engine_options": {d: DEPLOYMENTS[d] for d in args.deployments}},
              "summary": rows, "rounds": raw}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if any(r["identical"] is False for r in rows):
        sys.exit("greedy token ids differ between base and new (see 'identical' above)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        try:
            main()
        except RuntimeError as e:  # a dead or hung engine, a bad revision: the message says it all
            sys.exit(f"ab_trees: {e}")
        except KeyboardInterrupt:
            sys.exit("ab_trees: interrupted (engines stopped, worktrees removed)")
