"""Runs one scheduled batch through the model: attention here, routed experts through ``moe``."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from afdserve.balance.load import LoadTracker
from afdserve.kvcache.cache import KVCache
from afdserve.model.attention import AttnMetadata
from afdserve.model.model import AttentionModel, ExpertModel

# (layer, y [T, H], topk_ids [T, k], topk_weights [T, k]) -> routed experts' output [T, H]
MoEFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Runner(Protocol):
    vocab_size: int

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor,
                greedy: bool = False) -> torch.Tensor:
        """Returns float32 logits [len(rows), vocab] of the flat-batch token rows ``rows``; with
        ``greedy``, each row's argmax instead (int64 [len(rows)], ``afdserve.model.greedy``)."""
        ...


class LocalExperts:
    """The colocated deployment's MoE function: every routed expert is in this process. Counts the
    tokens routed to each expert and records the routing in a ``LoadTracker`` (the recent window,
    as the workers of a cluster do)."""

    def __init__(self, experts: ExpertModel, load_window: int):
        cfg = experts.cfg
        self.experts = experts
        device = experts.device
        self.counts = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.int64, device=device)
        self._count_rows = list(self.counts)  # per layer, a view of its row
        self.tracker = LoadTracker(cfg.num_layers, cfg.num_experts, load_window, device=device)

    def __call__(self, layer: int, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self.tracker.record(layer, ids)
        # the layer counts the routed ids as it runs them (``ExpertPart.forward``'s ``counts``)
        return self.experts.layers[layer](y, ids, w, counts=self._count_rows[layer])


class ModelRunner:
    def __init__(self, model: AttentionModel, kv: KVCache, moe: MoEFn, tracker: LoadTracker | None = None):
        self.model, self.kv, self.moe = model, kv, moe
        self.tracker = tracker  # advanced once per step (the MoE function records into it)
        self.vocab_size = model.cfg.vocab_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, rows: torch.Tensor,
                greedy: bool = False) -> torch.Tensor:
        m = self.model
        if self.tracker is not None:
            self.tracker.step()
        input_ids, meta, rows = m.step_inputs(input_ids, meta, rows)
        x = m.embed_tokens(input_ids)
        cos_sin = m.rotary.cos_sin(meta.positions, m.dtype)
        for layer in range(m.cfg.num_layers):
            h, y, ids, w = m.pre_moe(layer, x, cos_sin, meta, self.kv)
            # a dense layer (ids None) has its MLP here: nothing goes to the experts
            x = m.post_moe(layer, h, y, None if ids is None else self.moe(layer, y, ids, w))
        return m.greedy(x[rows]) if greedy else m.logits(x[rows])
