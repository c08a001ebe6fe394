"""Builds the pieces of an engine from an ``EngineConfig``: the attention side (model, KV cache,
blocks, scheduler limits) that the colocated engine and every attention worker share, and the
colocated client. The runner is chosen by the caller and passed in; it is never swapped later."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from afdserve.backends import Backends, choose
from afdserve.backends.capture import Capture, choose_capture
from afdserve.config import EngineConfig
from afdserve.engine.colocated import ColocatedClient
from afdserve.engine.engine import Engine, Grammars
from afdserve.engine.graphs import CapturedDecode
from afdserve.engine.host_memory import keep_freed_memory
from afdserve.engine.padded import PaddedDecode, batch_sizes
from afdserve.engine.runner import LocalExperts, ModelRunner, Runner
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.engine.structured_output import XGrammars
from afdserve.engine.tokenizer import TokenizerInfo, load_tokenizer
from afdserve.errors import ConfigError, ModelError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.prefix import PrefixCacheConfig, model_salt
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_device, parse_dtype
from afdserve.model.model import AttentionModel, ExpertModel


def resolve_model(model: str | None) -> Path:
    """The model folder; ``None`` is the built-in demo model (built on first use)."""
    if model is None:
        from afdserve.model.demo import demo_model_path

        return demo_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model folder {str(path)!r} does not exist (models are loaded from a local folder)")
    return path


def context_len(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    n = cfg.max_model_len or model_cfg.max_position_embeddings
    if n > model_cfg.max_position_embeddings:
        raise ConfigError(f"invalid max_model_len={n}: the model's context is {model_cfg.max_position_embeddings}")
    return n


def kv_storage_dtype(cfg: EngineConfig) -> torch.dtype:
    """What the KV cache stores: the model's dtype, or e4m3 (``kv_cache_dtype="fp8_e4m3"``)."""
    return torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8_e4m3" else parse_dtype(cfg.dtype)


def kv_block_bytes(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    return KVCache.bytes_per_block(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, cfg.block_size,
                                   kv_storage_dtype(cfg), model_cfg.kv_latent_dim)


def kv_blocks(cfg: EngineConfig, model_cfg: ModelConfig, max_len: int) -> int:
    per_block = kv_block_bytes(cfg, model_cfg)
    n = cfg.num_kv_blocks or int(cfg.kv_cache_gb * 2**30 // per_block)
    cp = cfg.context_parallel_size
    if cp > 1 and cfg.cp_kv != "gather":  # a sequence's KV may stay sharded: a worker holds a share of it
        max_len = min(max_len, -(-max_len // cp) + 2 * cfg.block_size)
    need = KVCache.sequence_blocks(max_len, cfg.block_size, model_cfg.kv_window, cfg.max_num_batched_tokens)
    if n < need:
        field = "num_kv_blocks" if cfg.num_kv_blocks else "kv_cache_gb"
        raise ConfigError(
            f"invalid {field}: the KV cache holds {n} blocks of {cfg.block_size} tokens, "
            f"but one sequence of max_model_len={max_len} needs {need}; raise {field} or lower max_model_len"
        )
    return n


def front_end_tokenizer(cfg: EngineConfig, path: Path, model_cfg: ModelConfig) -> TokenizerInfo:
    return load_tokenizer(Path(cfg.tokenizer) if cfg.tokenizer else path, model_cfg.eos_token_ids)


@dataclass
class AttentionSide:
    """What an engine over attention holds: the attention model (embeddings, attention parts,
    routers, LM head), the paged KV cache and its block manager."""

    model: AttentionModel
    kv: KVCache
    blocks: BlockManager
    max_model_len: int
    backends: Backends
    capture: Capture | None = None  # how decode steps are captured (``captures``; None: eager)


def load_attention_side(cfg: EngineConfig, path: Path, model_cfg: ModelConfig, reader: CheckpointReader,
                        captures: bool = False) -> AttentionSide:
    """``captures``: the caller captures its decode steps where the device and backends allow it
    (``choose_capture``; the KV cache then has a scratch block for their padded rows)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    keep_freed_memory()
    torch.manual_seed(cfg.seed)
    dtype = parse_dtype(cfg.dtype)
    device = parse_device(cfg.device)
    backends = engine_backends(cfg, device, dtype, model_cfg)
    fp8 = cfg.kv_cache_dtype == "fp8_e4m3"
    capture = choose_capture(device, backends, eager=cfg.enforce_eager, compile=cfg.compile, fp8_kv=fp8,
                             dtype=dtype, functions=2 * len(batch_sizes(cfg.max_num_seqs))) if captures else None
    model = AttentionModel.load(path, dtype, model_cfg, reader).to(device).prepare(backends)
    if cfg.compile and capture is None:  # a capture compiles the whole step where compile is asked
        model.compile_decode()
    max_len = context_len(cfg, model_cfg)
    n_blocks = kv_blocks(cfg, model_cfg, max_len)
    kv = KVCache(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, n_blocks, cfg.block_size,
                 kv_storage_dtype(cfg), model_cfg.kv_latent_dim, device, scratch=capture is not None)
    return AttentionSide(model, kv, BlockManager(n_blocks, cfg.block_size, prefix_config(cfg, path), kv), max_len,
                         backends, capture)


def engine_backends(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, model_cfg: ModelConfig) -> Backends:
    """The backends of a process computing on ``device``, chosen once from the device, what this
    machine runs, the config's ``backend`` / ``attention_backend`` / ``moe_backend`` and its KV dtype."""
    return choose(device, dtype, cfg.backend, attention=cfg.attention_backend, moe=cfg.moe_backend,
                  latent=model_cfg.mla is not None, fp8_kv=cfg.kv_cache_dtype == "fp8_e4m3")


def prefix_config(cfg: EngineConfig, path: Path) -> PrefixCacheConfig | None:
    """The prefix cache of an engine over the model at ``path`` (None: disabled). Keys are salted with
    the model's identity, dtype, KV dtype and block size, so a disk tier of another model or dtype is
    never used."""
    if not cfg.enable_prefix_caching:
        return None
    return PrefixCacheConfig(model_salt(path, cfg.dtype, cfg.kv_dtype, cfg.block_size),
                             host_bytes=int(cfg.prefix_cache_host_gb * 2**30), disk_dir=cfg.prefix_cache_dir,
                             disk_bytes=int(cfg.prefix_cache_disk_gb * 2**30))


def build_engine(cfg: EngineConfig, side: AttentionSide, runner: Runner, eos_token_ids: set[int],
                 grammars: Grammars | None = None) -> Engine:
    """The engine core over ``side``, running batches through ``runner``; ``grammars`` enforce
    structured outputs (``afdserve.engine.structured_output.XGrammars``)."""
    sched = SchedulerConfig(cfg.max_num_seqs, max(cfg.max_num_batched_tokens, 1))
    return Engine(runner, side.blocks, sched, side.max_model_len, eos_token_ids, grammars,
                  kv_window=side.model.cfg.kv_window)


def build_colocated(cfg: EngineConfig) -> ColocatedClient:
    """The colocated deployment: attention and every expert in this process."""
    if cfg.expert_device not in (None, cfg.device):
        raise ConfigError(f"expert_device={cfg.expert_device!r}: the colocated engine runs its experts on "
                          f"device={cfg.device!r} (expert_device is for expert workers)")
    path = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_pretrained(path)
    reader = CheckpointReader(path)
    side = load_attention_side(cfg, path, model_cfg, reader, captures=True)
    experts = LocalExperts(ExpertModel.load(path, None, side.model.dtype, model_cfg, reader).to(cfg.device)
                           .prepare(side.backends), cfg.load_window)
    tok = front_end_tokenizer(cfg, path, model_cfg)
    grammars = XGrammars(tok.tokenizer, model_cfg.vocab_size, tok.eos_token_ids)  # xgrammar loads on first use
    runner = ModelRunner(side.model, side.kv, experts, experts.tracker)
    if side.capture is not None:
        padded = PaddedDecode(side.model, side.kv, experts, cfg.max_num_seqs, side.max_model_len)
        runner.captured = CapturedDecode.start(padded, side.capture, runner.eager)
    engine = build_engine(cfg, side, runner, tok.eos_token_ids, grammars)
    return ColocatedClient(cfg, engine, tok, experts)
