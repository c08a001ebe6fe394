"""Runs one scheduled batch through the model: attention here, routed experts through ``moe``.

A runner gets a step as host arrays (``ModelInput``), stages them once into its persistent buffers
(``StepBuffers``: the step's context, token ids and sampled rows on the model's device), and returns
``ModelOutput``: the logits of the sampled rows, or for a greedy step the token ids they choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from afdserve.backends.base import Ring, ShardPeers
from afdserve.backends.step import AttnContext, StepBuffers, StepLayout
from afdserve.balance.load import LoadTracker
from afdserve.engine.cp import CPStep, ShardedDecode
from afdserve.kvcache.cache import KVCache
from afdserve.model.model import AttentionModel, ExpertModel

# (layer, y [T, H], topk_ids [T, k], topk_weights [T, k]) -> routed experts' output [T, H]
MoEFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelInput:
    """A step's batch on the host: the flat token ids [T] of its ``layout``, and the rows [R]
    (ascending) whose next-token distribution is needed; ``greedy``: each of them takes the plain
    argmax (the runner returns token ids, not logits)."""

    input_ids: np.ndarray  # int64 [T]
    layout: StepLayout
    rows: np.ndarray  # int64 [R]
    greedy: bool = False
    cp: "CPStep | None" = None  # a context-parallel prefill step's part (``afdserve.engine.cp``)
    sharded: "ShardedDecode | None" = None  # a decode step over sharded KV (``afdserve.engine.cp``)


@dataclass(frozen=True)
class ModelOutput:
    """What a runner computed for a step's rows: float32 ``logits`` [R, vocab], or for a greedy step
    the ``token_ids`` [R] (int64) they choose."""

    logits: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


class Runner(Protocol):
    vocab_size: int

    def forward(self, inp: ModelInput) -> ModelOutput: ...


def stage(model: AttentionModel, inp: ModelInput, buffers: StepBuffers, ring: Ring | None = None,
          peers: ShardPeers | None = None) -> tuple[AttnContext, torch.Tensor, torch.Tensor]:
    """The step's context, token ids and rows on the model's device, staged through ``buffers`` (a
    context-parallel step's with its ``ring``: ``AttentionModel.cp_context``; a sharded decode
    step's with the ``peers`` holding the other shards: ``AttentionModel.sharded_context``)."""
    buffers.begin()
    if inp.cp is not None:
        sh = inp.cp.shard
        ctx = model.cp_context(inp.layout, buffers, ring, sh.owner, inp.cp.rank_slots, sh.pieces, sh.rank, sh.keep)
    elif inp.sharded is not None:
        ctx = model.sharded_context(inp.layout, buffers, peers, inp.sharded.slots, inp.sharded.positions)
    else:
        ctx = model.context(inp.layout, buffers)
    ids, rows = buffers.stage("input_ids", inp.input_ids), buffers.stage("rows", inp.rows)
    buffers.end()
    return ctx, ids, rows


def head(model: AttentionModel, x: torch.Tensor, rows: torch.Tensor, greedy: bool) -> ModelOutput:
    """The LM head over the final hidden states ``x`` of the step's ``rows`` (ascending, distinct:
    all of them are every row, as in a decode step, and x is taken as it is), in one call."""
    x = x if rows.shape[0] == x.shape[0] else x[rows]
    return ModelOutput(token_ids=model.greedy(x)) if greedy else ModelOutput(logits=model.logits(x))


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
        self.buffers = StepBuffers(model.device)
        # the plain decode steps' captured forward (``afdserve.engine.graphs.CapturedDecode``), set once
        # at start-up; None: every step runs eager
        self.captured: Callable[[ModelInput], ModelOutput | None] | None = None

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> ModelOutput:
        if self.tracker is not None:
            self.tracker.step()
        if self.captured is not None and (out := self.captured(inp)) is not None:
            return out
        return self.eager(inp)

    @torch.inference_mode()
    def eager(self, inp: ModelInput) -> ModelOutput:
        """The step layer by layer (the load tracker is not advanced: ``forward`` does)."""
        m = self.model
        ctx, ids, rows = stage(m, inp, self.buffers)
        x = m.embed_tokens(ids)
        for layer in range(m.cfg.num_layers):
            h, y, ids, w = m.pre_moe(layer, x, ctx, self.kv)
            # a dense layer (ids None) has its MLP here: nothing goes to the experts
            x = m.post_moe(layer, h, y, None if ids is None else self.moe(layer, y, ids, w))
        return head(m, x, rows, inp.greedy)
