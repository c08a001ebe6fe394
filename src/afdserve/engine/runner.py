"""Runs one scheduled batch through the model: attention here, routed experts through ``moe``."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from afdserve.kvcache.cache import KVCache
from afdserve.model.attention import AttnMetadata
from afdserve.model.model import AttentionModel, ExpertModel

# (layer, y [T, H], topk_ids [T, k], topk_weights [T, k]) -> routed experts' output [T, H]
MoEFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Runner(Protocol):
    vocab_size: int

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits [len(rows), vocab] of the flat-batch token rows ``rows``."""
        ...


def local_experts(experts: ExpertModel) -> MoEFn:
    """The colocated deployment: every routed expert is in this process."""
    return lambda layer, y, ids, w: experts.layers[layer](y, ids, w)


class ModelRunner:
    def __init__(self, model: AttentionModel, kv: KVCache, moe: MoEFn):
        self.model, self.kv, self.moe = model, kv, moe
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(input_ids)
        cos_sin = m.rotary.cos_sin(meta.positions, m.dtype)
        for layer in range(m.cfg.num_layers):
            h, y, ids, w = m.pre_moe(layer, x, cos_sin, meta, self.kv)
            x = m.post_moe(layer, h, y, self.moe(layer, y, ids, w))
        return m.logits(x[rows])
