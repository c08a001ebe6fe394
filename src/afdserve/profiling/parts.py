"""The runtime's parts, built as its workers build them, from the public API of the model, KV-cache,
engine and runtime packages.  Every harness builds what it times here: the one place to adapt when
those APIs change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from afdserve.backends import Backends, choose
from afdserve.backends.step import AttnContext, StepBuffers, StepLayout
from afdserve.balance.load import LoadTracker
from afdserve.config import EngineConfig
from afdserve.engine.engine import Engine
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.kvcache import BlockManager, KVCache
from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader, parse_dtype
from afdserve.model.model import AttentionModel, ExpertModel
from afdserve.runtime import ExpertCompute, ExpertMap, PipelinedRunner

__all__ = ["Checkpoint", "kv_cache", "decode_layout", "step_context", "attention_runner", "expert_compute",
           "attention_engine"]

BLOCK_SIZE = EngineConfig().block_size


class Checkpoint:
    """A model folder opened once: its config, tensor reader and the dtype to run in."""

    def __init__(self, path: Path, dtype: str = "float32") -> None:
        self.path = Path(path)
        self.cfg = ModelConfig.from_pretrained(self.path)
        self.reader = CheckpointReader(self.path)
        self.dtype = parse_dtype(dtype)
        # the backends a worker on this machine's CPU chooses (engine.builder.engine_backends)
        self.backends: Backends = choose("cpu", self.dtype, latent=self.cfg.mla is not None)

    def attention_model(self) -> AttentionModel:
        return AttentionModel.load(self.path, self.dtype, self.cfg, self.reader).prepare(self.backends)

    def experts(self, held: list[int] | None = None) -> ExpertModel:
        """The routed experts ``held`` (None: all) of every layer."""
        return ExpertModel.load(self.path, held, self.dtype, self.cfg, self.reader).prepare(self.backends)


def kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> KVCache:
    return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, dtype, cfg.kv_latent_dim)


def decode_layout(b: int, s: int, block_size: int = BLOCK_SIZE) -> tuple[StepLayout, int]:
    """``(layout, blocks)`` of ``b`` decode sequences with ``s`` tokens each (the last one new),
    blocks laid out one sequence after the other."""
    nb = -(-s // block_size)
    table = np.arange(b * nb, dtype=np.int32).reshape(b, nb)
    if nb < 2:
        table = np.concatenate([table, np.full((b, 1), -1, dtype=np.int32)], axis=1)
    return StepLayout.of([1] * b, [s] * b, table, block_size), b * nb


def step_context(model: AttentionModel, layout: StepLayout) -> AttnContext:
    """The context a runner builds for a step of ``layout`` (its own buffers)."""
    return model.context(layout, StepBuffers(model.device))


def attention_runner(model: AttentionModel, kv: KVCache, links: Any, expert_map: ExpertMap,
                     tracer: Any) -> PipelinedRunner:
    """A ``PipelinedRunner`` as the attention worker builds it: one micro-batch, the attention-side
    gate and its expert-load tracker."""
    cfg = model.cfg
    tracker = LoadTracker(cfg.num_layers, cfg.num_experts, EngineConfig().load_window)
    return PipelinedRunner(model, kv, links, expert_map, 1, "attention", tracer, timeout_s=1.0, tracker=tracker)


def expert_compute(experts: ExpertModel, held: int) -> ExpertCompute:
    """An ``ExpertCompute`` as the expert worker builds it, for worker 0 holding experts
    ``0 .. held-1`` (attention-side gate: no routers)."""
    cfg = experts.cfg
    sizes = [held] if held == cfg.num_experts else [held, cfg.num_experts - held]
    expert_map = ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, len(sizes), sizes)
    return ExpertCompute(experts, None, 0, {0: expert_map})


def attention_engine(ckpt: Checkpoint, max_num_seqs: int, max_len: int, links: Any, tracer: Any) -> Engine:
    """An attention worker's engine: the attention model, a paged KV cache for ``max_num_seqs``
    sequences of ``max_len`` tokens, and a :func:`attention_runner` over ``links`` dispatching to one
    expert worker."""
    cfg = ckpt.cfg
    blocks = max_num_seqs * -(-max_len // BLOCK_SIZE) + 1
    model = ckpt.attention_model()
    kv = kv_cache(cfg, blocks, BLOCK_SIZE, ckpt.dtype)
    runner = attention_runner(model, kv, links, ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, 1), tracer)
    sched = SchedulerConfig(max_num_seqs, EngineConfig().max_num_batched_tokens)
    return Engine(runner, BlockManager(blocks, BLOCK_SIZE), sched, max_len, set(cfg.eos_token_ids))
