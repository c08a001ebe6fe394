"""Command-line flags shared by every command that starts a deployment."""

from __future__ import annotations

import argparse

from afdserve.cluster import resolve_deployment
from afdserve.config import KV_CACHE_DTYPES, OVERFLOW_POLICIES, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None, help="local Hugging Face model folder (default: the built-in demo model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default auto: the checkpoint's dtype, bfloat16 for the demo model)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV-cache memory per attention worker")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV-cache storage: auto (the model's dtype) or fp8_e4m3 (alias fp8: e4m3 with a float32 "
                        "scale per block and KV head, half of bfloat16's bytes; attention computes in --dtype)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per worker process")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the attention half of decode steps (first compile ~10 s; off by default); "
                        "where decode steps are captured, the whole decode step per padded batch size")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: by default the colocated engine on a CUDA device captures its decode "
                        "steps, one graph per padded batch size, where the backends allow it (triton attention, "
                        "torch MoE)")
    g.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N: where the colocated engine and the attention workers keep weights, "
                        "KV cache and step tensors (default auto: cuda where torch sees a GPU, else cpu)")
    g.add_argument("--expert-device", default=None,
                   help="cpu, cuda or cuda:N for the expert workers (default: --device)")
    g.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="the hot path's backends, chosen once per worker: cpu (afdserve's C++ kernels), torch "
                        "(PyTorch, any device), auto (cpu where the kernels run the dtype on this CPU, else torch), "
                        "triton (Triton paged attention, the rest torch)")
    g.add_argument("--attention-backend", default=None, choices=["auto", "cpu", "torch", "triton"],
                   help="the attention backend (default: --backend)")
    g.add_argument("--moe-backend", default=None, choices=["auto", "cpu", "torch"],
                   help="the MoE experts' backend (default: --backend)")
    c = p.add_argument_group("prefix cache")
    c.add_argument("--no-prefix-cache", action="store_true",
                   help="disable automatic prefix caching (reuse of the KV blocks of repeated prompt prefixes)")
    c.add_argument("--prefix-cache-host-gb", type=float, default=1.0, metavar="GB",
                   help="host memory per attention worker for KV blocks evicted from the KV cache (0: none)")
    c.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="disk tier: KV blocks pushed out of host memory (and all cached blocks at shutdown) are "
                        "kept here, across restarts (default: no disk tier)")
    c.add_argument("--prefix-cache-disk-gb", type=float, default=10.0, metavar="GB",
                   help="size bound of the disk tier per attention worker")
    d = p.add_argument_group("deployment")
    d.add_argument("--attention-workers", type=int, default=1, help="attention workers (data parallel)")
    d.add_argument("--expert-workers", type=int, default=0, help="expert workers (expert parallel); 0 = colocated")
    d.add_argument("--prefill-workers", type=int, default=0, metavar="N",
                   help="prefill/decode disaggregation: N attention workers prefill new prompts (with "
                        "--decode-workers; the attention workers are then their sum)")
    d.add_argument("--decode-workers", type=int, default=0, metavar="M",
                   help="... and M decode them after their first token, the KV moving layer by layer")
    d.add_argument("--context-parallel-size", type=int, default=1, metavar="N",
                   help="context-parallel prefill: a long prompt (--cp-min-tokens) is split over N attention "
                        "workers, each computing its share in one step while a ring passes the KV "
                        "(N <= --attention-workers; not with --prefill-workers; default 1: off)")
    d.add_argument("--cp-min-tokens", type=int, default=4096, metavar="T",
                   help="with --context-parallel-size N > 1: prompts of at least T tokens go context parallel, "
                        "where every worker's share fits --max-num-batched-tokens (others prefill in chunks on "
                        "one worker, as usual)")
    d.add_argument("--cp-kv", default="auto", choices=["auto", "gather", "shard"],
                   help="after a context-parallel prefill: gather the prompt's KV on the first worker, which "
                        "decodes as usual, or keep it sharded (every decode step attends over the shards and "
                        "merges); auto: gathered where the request fits one worker's KV cache, else sharded")
    d.add_argument("--micro-batches", type=int, default=1, help="micro-batches of the ping-pong pipeline")
    d.add_argument("--gate", default="attention", choices=["attention", "expert"],
                   help="where the router runs: attention side (MegaScale-Infer) or expert side (JANUS)")
    d.add_argument("--expert-split", default=None,
                   help="experts per expert worker, comma-separated (default: as even as possible)")
    d.add_argument("--comm-transport", default="auto", choices=["auto", "shm", "tcp", "torch"],
                   help="M2N transport between workers (auto: shared memory on one host, TCP across hosts)")
    d.add_argument("--comm-timeout-ms", type=float, default=2000.0, metavar="MS",
                   help="how long a worker waits for a peer (per 256 tokens in flight) before it counts it as failed")
    d.add_argument("--on-expert-loss", default="wait", choices=["wait", "drop"],
                   help="while a lost expert worker is replaced: wait for it (outputs unchanged; tokens of "
                        "replicated experts go to a replica meanwhile), or drop its experts (top-(K-1) routing "
                        "over the rest, counted in /metrics)")
    d.add_argument("--expert-capacity-factor", type=float, default=None, metavar="F",
                   help="attention-side gate: each expert worker's slot per micro-batch holds F x the tokens it "
                        "gets when routing is uniform (default: every token; outputs never change)")
    d.add_argument("--on-expert-overflow", default="second-pass", choices=OVERFLOW_POLICIES,
                   help="tokens beyond an expert worker's capacity: sent in a second round (outputs unchanged) "
                        "or dropped for that worker's experts (top-k weights rescaled over the rest, counted in "
                        "/metrics)")
    d.add_argument("--no-lend-idle-cores", action="store_true",
                   help="local cluster: do not let expert workers borrow the cores of attention workers that wait "
                        "for their replies (by default they do, a slice of a MoE layer at a time)")
    d.add_argument("--heartbeat-timeout-ms", type=float, default=3000.0, metavar="MS",
                   help="how long the front end waits for a worker's heartbeat before it fences and replaces it "
                        "(a stalled or stopped process)")
    d.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome/Perfetto trace of every worker to PATH on shutdown")
    d.add_argument("--deployment", default=None, metavar="FILE",
                   help="deployment spec (TOML, e.g. from `afdserve plan --write-deployment`): workers per role, "
                        "micro-batches, gate, expert split, Ray resources; overrides the flags above (docs/ray.md)")
    d.add_argument("--cluster", default="local", choices=["local", "ray"],
                   help="where workers run: processes on this machine, or Ray actors across nodes (afdserve[ray])")
    d.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="--cluster ray: the Ray cluster to join (default: $RAY_ADDRESS, a local cluster, or a new one)")


def engine_config(args: argparse.Namespace, **extra: object) -> EngineConfig:
    kw = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              block_size=args.block_size, kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
              num_threads=args.num_threads,
              compile=args.compile, enforce_eager=args.enforce_eager, device=args.device,
              expert_device=args.expert_device, backend=args.backend,
              attention_backend=args.attention_backend, moe_backend=args.moe_backend,
              enable_prefix_caching=not args.no_prefix_cache,
              prefix_cache_host_gb=args.prefix_cache_host_gb, prefix_cache_dir=args.prefix_cache_dir,
              prefix_cache_disk_gb=args.prefix_cache_disk_gb,
              attention_workers=args.attention_workers, expert_workers=args.expert_workers,
              prefill_workers=getattr(args, "prefill_workers", 0), decode_workers=getattr(args, "decode_workers", 0),
              context_parallel_size=getattr(args, "context_parallel_size", 1),
              cp_min_tokens=getattr(args, "cp_min_tokens", 4096), cp_kv=getattr(args, "cp_kv", "auto"),
              micro_batches=args.micro_batches, gate=args.gate, comm_transport=args.comm_transport,
              comm_timeout_ms=getattr(args, "comm_timeout_ms", 2000.0),
              heartbeat_timeout_ms=getattr(args, "heartbeat_timeout_ms", 3000.0),
              on_expert_loss=getattr(args, "on_expert_loss", "wait"),
              expert_capacity_factor=getattr(args, "expert_capacity_factor", None),
              on_expert_overflow=getattr(args, "on_expert_overflow", "second-pass"),
              lend_idle_cores=not getattr(args, "no_lend_idle_cores", False),
              trace=args.trace, deployment=args.deployment, cluster=args.cluster, ray_address=args.ray_address,
              expert_split=[int(x) for x in args.expert_split.split(",")] if args.expert_split else None)
    kw.update(extra)
    return resolve_deployment(EngineConfig.from_kwargs(**kw))
