"""Builds an engine from an ``EngineConfig``: model, tokenizer, KV cache, scheduler, runner."""

from __future__ import annotations

from pathlib import Path

import torch

from afdserve.config import EngineConfig
from afdserve.engine.engine import Engine
from afdserve.engine.runner import MoEFn, ModelRunner, local_experts
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.errors import ConfigError, ModelError
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.cache import KVCache
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_dtype
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


def kv_blocks(cfg: EngineConfig, model_cfg: ModelConfig, max_len: int) -> int:
    per_block = KVCache.bytes_per_block(model_cfg, cfg.block_size, parse_dtype(cfg.dtype))
    n = cfg.num_kv_blocks or int(cfg.kv_cache_gb * 2**30 // per_block)
    need = -(-max_len // cfg.block_size)
    if n < need:
        field = "num_kv_blocks" if cfg.num_kv_blocks else "kv_cache_gb"
        raise ConfigError(
            f"invalid {field}: the KV cache holds {n} blocks of {cfg.block_size} tokens, "
            f"but one sequence of max_model_len={max_len} needs {need}; raise {field} or lower max_model_len"
        )
    return n


def build_attention_engine(cfg: EngineConfig, path: Path, model_cfg: ModelConfig,
                           moe: MoEFn | None = None, reader: CheckpointReader | None = None) -> Engine:
    """An engine over this process's attention model; ``moe`` runs the routed experts
    (None: load every expert here, the colocated deployment)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    reader = reader or CheckpointReader(path)
    dtype = parse_dtype(cfg.dtype)
    model = AttentionModel.load(path, dtype, model_cfg, reader)
    if moe is None:
        moe = local_experts(ExpertModel.load(path, None, dtype, model_cfg, reader))
    max_len = context_len(cfg, model_cfg)
    n_blocks = kv_blocks(cfg, model_cfg, max_len)
    kv = KVCache(model_cfg, n_blocks, cfg.block_size, dtype)
    tok = load_tokenizer(Path(cfg.tokenizer) if cfg.tokenizer else path, model_cfg.eos_token_ids)
    sched = SchedulerConfig(cfg.max_num_seqs, max(cfg.max_num_batched_tokens, 1))
    return Engine(ModelRunner(model, kv, moe), BlockManager(n_blocks, cfg.block_size), tok, sched, max_len,
                  tok.eos_token_ids)


def build_colocated_engine(cfg: EngineConfig) -> Engine:
    path = resolve_model(cfg.model)
    return build_attention_engine(cfg, path, ModelConfig.from_pretrained(path))


def build_engine(cfg: EngineConfig):
    """The deployment ``cfg`` describes: the colocated engine in this process (``expert_workers=0``
    and one attention worker) or a cluster of worker processes (local, or Ray actors)."""
    if cfg.expert_workers > 0 or cfg.attention_workers > 1:
        from afdserve.runtime.cluster import LocalCluster

        return LocalCluster(cfg)
    return build_colocated_engine(cfg)
