"""Engine and deployment options; invalid values fail at start-up naming the field."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, fields
from pathlib import Path

from afdserve.errors import ConfigError


BACKENDS = ("auto", "cpu", "torch", "triton")  # afdserve.backends.NAMES
OVERFLOW_POLICIES = ("second-pass", "drop")  # tokens over an expert worker's capacity (afdserve.runtime.dispatch)
MAX_POOL_WORKERS = 64  # workers per pool (attention, expert) that a deployment or a resize may ask for


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpuinfo(field: str) -> str:
    """A field of this CPU in /proc/cpuinfo ("flags", "model name"...); the platform's processor
    name where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_root() -> Path:
    """Where afdserve keeps what it builds once per machine (the demo model, the compiled kernels):
    ``$AFDSERVE_CACHE``, default ``~/.cache/afdserve``."""
    env = os.environ.get("AFDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "afdserve"


def micro_batch_sizes(tokens: int, micro_batches: int) -> list[int]:
    """How a step of ``tokens`` tokens is cut into micro-batches: ``micro_batches`` (at most one per
    token) of about equal token counts. The one rule the pipeline, the stats and the planner share."""
    if tokens <= 0:
        return []
    m = max(1, min(micro_batches, tokens))
    bounds = [round(tokens * i / m) for i in range(m + 1)]
    return [bounds[i + 1] - bounds[i] for i in range(m)]


def is_capacity_factor(f: object) -> bool:
    """A valid ``expert_capacity_factor``: a finite number > 0 (None, no limit, is checked apart)."""
    return isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < float("inf")


def is_device_name(name: object) -> bool:
    """``cpu``, ``cuda`` or ``cuda:N`` (whether that device exists is checked where it is used)."""
    if not isinstance(name, str):
        return False
    kind, _, index = name.partition(":")
    return name == "cpu" or (kind == "cuda" and (name == "cuda" or index.isdigit()))


DEMO_DTYPE = "bfloat16"  # the built-in demo model's (afdserve.model.demo.DEMO_CONFIG, checked by a test)


def checkpoint_dtype(model: str | None) -> str:
    """The dtype a checkpoint folder's config.json names ("dtype", or the older "torch_dtype"):
    float32, bfloat16 or float16; float32 where it names none or another (or cannot be read: the
    loader reports that); ``model`` None: the demo model's."""
    if model is None:
        return DEMO_DTYPE
    try:
        with open(Path(model).expanduser() / "config.json") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return "float32"
    name = raw.get("dtype") or raw.get("torch_dtype") if isinstance(raw, dict) else None
    return name if name in ("float32", "bfloat16", "float16") else "float32"


KV_CACHE_DTYPES = {"auto": "auto", "fp8_e4m3": "fp8_e4m3", "fp8": "fp8_e4m3"}  # the names and their aliases


@dataclass
class EngineConfig:
    model: str | None = None  # HF model folder; None = the built-in demo model
    # "auto": the checkpoint's own dtype (config.json's "dtype" or "torch_dtype"; float32 where it
    # names none), resolved when the config is made; the demo model's is bfloat16
    dtype: str = "auto"
    tokenizer: str | None = None  # defaults to the model folder
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's context length
    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb
    # the KV cache's storage: "auto" (the model's dtype) or "fp8_e4m3" ("fp8": e4m3 with a float32
    # scale per block and KV head, afdserve.kvcache.fp8; attention still computes in dtype)
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None  # torch threads of this process (None: leave as is)
    # automatic prefix caching (afdserve.kvcache.block_manager); the tiers are per attention worker
    enable_prefix_caching: bool = True
    prefix_cache_host_gb: float = 1.0  # host memory for blocks evicted from the KV cache (0: no host tier)
    prefix_cache_dir: str | None = None  # disk tier, kept across restarts (None: no disk tier)
    prefix_cache_disk_gb: float = 10.0  # bound of the disk tier
    # torch.compile the attention half of decode steps (AttentionModel.compile_decode); where the colocated
    # engine's decode steps are captured (below), the whole decode step instead, per padded batch size
    compile: bool = False
    # vLLM's: no captured decode steps. Otherwise the colocated engine captures its decode steps in CUDA
    # graphs, one per padded batch size (afdserve.engine.graphs), where the device is CUDA and the
    # backends allow it (triton attention, torch MoE: afdserve.backends.capture); on the CPU, only with
    # compile=True, which compiles the same function whole
    enforce_eager: bool = False
    # the hot path's backends (afdserve.backends.choose), chosen once per process from its device:
    # "auto" (the CPU kernels where they run, else PyTorch), "cpu" or "torch"; attention_backend and
    # moe_backend override ``backend`` for theirs
    backend: str = "auto"
    attention_backend: str | None = None
    moe_backend: str | None = None
    # where weights, KV cache and step tensors live: "cpu", "cuda" or "cuda:N" (colocated engine and
    # attention workers), or "auto": cuda where this process's torch sees a GPU, else cpu (resolved
    # when the config is made); expert workers use expert_device (None: the same as device)
    device: str = "auto"
    expert_device: str | None = None
    seed: int = 0
    # deployment (the runtime): expert_workers=0 is the colocated engine in this process
    attention_workers: int = 1
    expert_workers: int = 0
    # prefill/decode disaggregation (afdserve.cluster.pd): attention workers 0..P-1 prefill new prompts,
    # P..P+D-1 decode them after their first token, the KV moving layer by layer; 0 and 0: every
    # attention worker does both (attention_workers of them)
    prefill_workers: int = 0
    decode_workers: int = 0
    # context-parallel prefill (afdserve.cluster.cp): a prompt of at least cp_min_tokens tokens is split
    # over context_parallel_size attention workers (zigzag, afdserve.kvcache.cp_split), each computing
    # its share in one step while a ring passes the KV. Only where every share fits
    # max_num_batched_tokens; 1: off. cp_kv: where the prompt's KV stays after it: "gather" (the
    # first worker holds it all and decodes as usual), "shard" (every worker keeps its share; each
    # decode step attends over the shards and merges), "auto" (gathered where the request fits one
    # worker's cache, else sharded)
    context_parallel_size: int = 1
    cp_min_tokens: int = 4096
    cp_kv: str = "auto"
    micro_batches: int = 1
    gate: str = "attention"  # "attention" (MegaScale-Infer) or "expert" (JANUS)
    expert_split: list[int] | None = None  # experts per expert worker (default: as even as possible)
    comm_transport: str = "auto"  # M2N transport between workers: auto | shm | tcp | torch
    comm_timeout_ms: float = 2000.0  # deadline of a wait for a peer (per 256 tokens in flight)
    on_expert_loss: str = "wait"  # while a lost expert worker is replaced: "wait" for it, or "drop" its experts
    # the attention-side gate's dispatch (afdserve.runtime.dispatch): each expert worker's slot holds
    # capacity_factor x the tokens it gets under uniform routing (None: every token, outputs unchanged);
    # rows beyond it go in a "second-pass" round or "drop" their pairs on that worker (counted)
    expert_capacity_factor: float | None = None
    on_expert_overflow: str = "second-pass"
    # local cluster on the CPU: a worker that waits for its peers lends its cores to their kernels
    # (the cpu backend's hooks: afdserve.backends.host)
    lend_idle_cores: bool = True
    heartbeat_timeout_ms: float = 3000.0  # a worker silent this long (dead, stopped) is fenced and replaced
    startup_timeout_s: float = 300.0
    trace: str | None = None  # write a Chrome/Perfetto trace of the deployment here on shutdown
    load_window: int = 64  # engine steps of expert load kept for balancing and /metrics
    attention_cost: str | None = None  # planner profile (afdserve profile) used to balance attention workers
    # where the workers run: "local" (processes on this machine) or "ray" (Ray actors across nodes)
    cluster: str = "local"
    ray_address: str | None = None  # cluster="ray": ray.init address (None: RAY_ADDRESS, a local cluster, or a new one)
    deployment: str | None = None  # deployment spec file (TOML, afdserve.cluster.spec); its values override these
    # when the deployment is built (afdserve.cluster.resolve_deployment)

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ConfigError(f"invalid {name}={getattr(self, name)!r}: {why}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.dtype == "auto":
            self.dtype = checkpoint_dtype(self.model)
        check("dtype", self.dtype in ("float32", "bfloat16", "float16"), "use auto, float32, bfloat16 or float16")
        self.kv_cache_dtype = KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        check("kv_cache_dtype", self.kv_cache_dtype in ("auto", "fp8_e4m3"),
              "use auto (the model's dtype) or fp8_e4m3 (alias fp8)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "attention_workers", "micro_batches"):
            check(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "must be an integer >= 1")
        check("expert_workers", is_int(self.expert_workers) and self.expert_workers >= 0, "must be an integer >= 0")
        for name in ("prefill_workers", "decode_workers"):
            check(name, is_int(getattr(self, name)) and getattr(self, name) >= 0, "must be an integer >= 0")
        if self.prefill_workers or self.decode_workers:
            pd = self.prefill_workers + self.decode_workers
            check("prefill_workers", self.prefill_workers >= 1 and self.decode_workers >= 1,
                  f"prefill/decode disaggregation needs both pools (decode_workers={self.decode_workers})")
            check("attention_workers", self.attention_workers in (1, pd),
                  f"with prefill_workers={self.prefill_workers} and decode_workers={self.decode_workers} the "
                  f"attention workers are their sum ({pd}): leave attention_workers unset")
            check("expert_workers", self.expert_workers >= 1,
                  "prefill/decode disaggregation runs on a disaggregated deployment: needs expert_workers >= 1")
            self.attention_workers = pd
        check("context_parallel_size", is_int(self.context_parallel_size) and self.context_parallel_size >= 1,
              "must be an integer >= 1")
        check("context_parallel_size",
              self.context_parallel_size == 1 or not (self.prefill_workers or self.decode_workers),
              "context-parallel prefill does not run with prefill/decode disaggregation in this version: "
              "leave context_parallel_size at 1 or prefill_workers and decode_workers at 0")
        check("cp_min_tokens", is_int(self.cp_min_tokens) and self.cp_min_tokens >= 2, "must be an integer >= 2")
        check("cp_kv", self.cp_kv in ("auto", "gather", "shard"), "must be auto, gather or shard")
        check("max_model_len", self.max_model_len is None or (is_int(self.max_model_len) and self.max_model_len >= 2),
              "must be an integer >= 2")
        check("kv_cache_gb", isinstance(self.kv_cache_gb, (int, float)) and self.kv_cache_gb > 0, "must be > 0")
        check("num_kv_blocks", self.num_kv_blocks is None or (is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1),
              "must be an integer >= 1")
        check("enable_prefix_caching", isinstance(self.enable_prefix_caching, bool), "must be true or false")
        for name in ("prefix_cache_host_gb", "prefix_cache_disk_gb"):
            v = getattr(self, name)
            check(name, isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, "must be >= 0")
        check("prefix_cache_dir", self.prefix_cache_dir is None or (isinstance(self.prefix_cache_dir, str)
              and self.prefix_cache_dir != ""), "must be a non-empty path or None")
        check("num_threads", self.num_threads is None or (is_int(self.num_threads) and self.num_threads >= 1),
              "must be an integer >= 1")
        check("compile", isinstance(self.compile, bool), "must be true or false")
        check("enforce_eager", isinstance(self.enforce_eager, bool), "must be true or false")
        check("backend", self.backend in BACKENDS, f"use {', '.join(BACKENDS)}")
        for name in ("attention_backend", "moe_backend"):
            check(name, getattr(self, name) is None or getattr(self, name) in BACKENDS,
                  f"use {', '.join(BACKENDS)} (or leave it unset: as backend)")
        if self.device == "auto":
            import torch  # what this process's torch sees (NVML: no CUDA context is created)

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        check("device", is_device_name(self.device), "use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        check("expert_device", self.expert_device is None or is_device_name(self.expert_device),
              "use 'cpu', 'cuda' or 'cuda:N' (or leave it unset: the same as device)")
        check("gate", self.gate in ("attention", "expert"), "use 'attention' or 'expert'")
        check("comm_transport", self.comm_transport in ("auto", "shm", "tcp", "torch"), "use auto, shm, tcp or torch")
        check("comm_timeout_ms", isinstance(self.comm_timeout_ms, (int, float)) and self.comm_timeout_ms > 0,
              "must be > 0")
        check("on_expert_loss", self.on_expert_loss in ("wait", "drop"), "use 'wait' or 'drop'")
        f = self.expert_capacity_factor
        check("expert_capacity_factor", f is None or is_capacity_factor(f), "must be a number > 0 (or unset: no limit)")
        check("expert_capacity_factor", f is None or self.gate == "attention",
              "applies to the attention-side gate's dispatch; with gate='expert' every expert worker gets every token")
        check("on_expert_overflow", self.on_expert_overflow in OVERFLOW_POLICIES, "use 'drop' or 'second-pass'")
        check("lend_idle_cores", isinstance(self.lend_idle_cores, bool), "must be true or false")
        check("heartbeat_timeout_ms", isinstance(self.heartbeat_timeout_ms, (int, float))
              and self.heartbeat_timeout_ms >= 100, "must be >= 100")
        check("cluster", self.cluster in ("local", "ray"), "use 'local' or 'ray'")
        check("ray_address", self.ray_address is None or (isinstance(self.ray_address, str) and self.ray_address != ""),
              "must be a non-empty string or None")
        check("ray_address", not str(self.ray_address).startswith("ray://"),
              "Ray Client is not supported (workers connect back to the front end): give the cluster's GCS "
              "address (HEAD_IP:6379) and run on a machine the nodes can reach")
        if self.cluster != "ray" and self.ray_address is not None:
            check("ray_address", False, "only meaningful with cluster='ray'")
        check("expert_split", self.expert_split is None or (len(self.expert_split) == self.expert_workers
              and all(is_int(n) and n >= 1 for n in self.expert_split)),
              "one count >= 1 per expert worker")

        if self.deployment is None:  # else the spec file sets the workers (afdserve.cluster.resolve_deployment)
            self.check_workers()

    @property
    def kv_dtype(self) -> str:
        """The KV cache's storage dtype by name: ``dtype``, or "fp8_e4m3"."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def check_workers(self) -> None:
        if self.context_parallel_size > self.attention_workers:
            raise ConfigError(f"invalid context_parallel_size={self.context_parallel_size}: a prompt is split over "
                              f"that many attention workers: must be in 1..attention_workers "
                              f"({self.attention_workers})")
        if self.cluster == "ray" and self.expert_workers < 1:
            raise ConfigError(f"invalid expert_workers={self.expert_workers}: cluster='ray' runs attention and "
                              "expert workers as Ray actors: needs expert_workers >= 1")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)  # type: ignore[arg-type]
