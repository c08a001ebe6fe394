"""A decode step of the colocated engine as one function of fixed buffers: what a CUDA graph captures
(``afdserve.engine.graphs``).

A step of n sequences runs at the padded batch size b >= n of ``batch_sizes`` (1, 2, 4, 8, ... up
to ``max_num_seqs``). Its inputs (token ids, positions, cache slots, block tables as wide as the
longest sequence can need, context lengths) live in buffers allocated once for the largest size
and written in place each step, b rows of them (``write``); ``forward(b, greedy)`` reads the first
b rows and nothing from the host: embeddings, every layer, the final norm and the head (greedy:
token ids; else float32 logits).

A padded row is token 0 at position 0 of a one-token sequence in the KV cache's scratch block
(``KVCache(scratch=True)``, outside the block manager's pool): it writes its key and value there
and attends over that block only. Its (token, expert) pairs go to expert id ``E`` (the experts'
"held nowhere"): through no expert. The step counts every layer's routings into fixed buffers
(tokens per expert, pairs of experts), the padded rows into a column ``E`` that is dropped; ``fold``
adds them to the engine's counts and load tracker, outside the captured function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from afdserve.backends.step import PagedContext, StepLayout
from afdserve.engine.runner import LocalExperts, ModelInput
from afdserve.kvcache.cache import KVCache
from afdserve.model.model import AttentionModel


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes: powers of two below ``max_num_seqs``, then ``max_num_seqs``."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


@dataclass(frozen=True)
class _Rows:
    """The first b rows of every buffer (views, fixed for the life of the engine)."""

    ids: torch.Tensor  # int64 [b]
    positions: torch.Tensor  # int64 [b]
    slots: torch.Tensor  # int64 [b]
    kv_lens: torch.Tensor  # int32 [b]
    valid: torch.Tensor  # int32 [b]: 1 for a sequence's row, 0 for a padded one
    tables: torch.Tensor  # int32 [b, width]
    cu_q: torch.Tensor  # int32 [b + 1]: 0, 1, ..., b
    first_rows: torch.Tensor  # int64 [b]: 0, 1, ..., b - 1


class PaddedDecode:
    def __init__(self, model: AttentionModel, kv: KVCache, experts: LocalExperts, max_num_seqs: int,
                 max_model_len: int):
        if kv.scratch_block is None:
            raise ValueError("a padded decode step needs a KV cache with a scratch block (KVCache(scratch=True))")
        self.model, self.kv, self.experts = model, kv, experts
        self.sizes = batch_sizes(max_num_seqs)
        m, dev, bs = self.sizes[-1], model.device, kv.block_size
        self.width = max(2, -(-max_model_len // bs) + 1)  # block-table columns: as many as a sequence can need
        self.scratch_slot = kv.scratch_block * bs
        # the step's inputs in three blocks (int64: ids, positions, slots; int32: lengths, valid; int32:
        # tables), on the host and (a device other than the CPU) copied to the device each step
        pin = dev.type == "cuda"
        self._host64 = torch.zeros(3 * m, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(2 * m, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(m, self.width, dtype=torch.int32, pin_memory=pin)
        self._np64, self._np32, self._np_tables = self._host64.numpy(), self._host32.numpy(), self._host_tables.numpy()
        on_host = dev.type == "cpu"
        self._dev64 = self._host64 if on_host else self._host64.to(dev)
        self._dev32 = self._host32 if on_host else self._host32.to(dev)
        self._dev_tables = self._host_tables if on_host else self._host_tables.to(dev)
        self._copied: torch.cuda.Event | None = None
        ar = torch.arange(m + 1, device=dev)
        self._cu_q, self._first_rows = ar.to(torch.int32), ar[:m].clone()
        # the rotary tables of every position a sequence reaches, built once
        self.cos, self.sin = model.rotary.cos_sin(torch.arange(max_model_len, device=dev), model.dtype,
                                                  max_model_len)
        cfg = model.cfg
        self.num_experts = e = cfg.num_experts
        self.tokens = torch.zeros(cfg.num_layers, e + 1, dtype=torch.int64, device=dev)  # the step's routings
        self.pairs = torch.zeros(cfg.num_layers, (e + 1) ** 2, dtype=torch.int32, device=dev)  # (first, second)
        iu = torch.triu_indices(cfg.top_k, cfg.top_k, 1, device=dev)
        self._first, self._second = iu[0], iu[1]
        self.rows = {b: self._rows(b) for b in self.sizes}

    def _rows(self, b: int) -> _Rows:
        m, d64, d32 = self.sizes[-1], self._dev64, self._dev32
        return _Rows(d64[:b], d64[m:m + b], d64[2 * m:2 * m + b], d32[:b], d32[m:m + b], self._dev_tables[:b],
                     self._cu_q[:b + 1], self._first_rows[:b])

    def size_of(self, inp: ModelInput) -> int | None:
        """The padded batch size ``inp`` runs at; None where it is not a plain decode step this can
        run (a prefill or mixed step, a context-parallel or sharded one, too many sequences, a block
        table wider than the buffers)."""
        lay = inp.layout
        n = lay.num_seqs
        if inp.cp is not None or inp.sharded is not None or not lay.is_decode or n > self.sizes[-1] \
                or inp.rows.shape[0] != n or lay.block_table.shape[1] > self.width:
            return None
        return next(b for b in self.sizes if b >= n)

    def write(self, inp: ModelInput, b: int) -> None:
        """``inp``'s n rows and b - n padded rows into the buffers (and their device copies). A row's
        table columns past its step's table width keep older values: the attention reads a sequence's
        columns up to its length only (a padded row's first)."""
        if self._copied is not None:  # the previous step's copies out of the host buffers are done
            self._copied.synchronize()
            self._copied = None
        lay, m = inp.layout, self.sizes[-1]
        n = lay.num_seqs
        i64, i32 = self._np64, self._np32
        i64[:n], i64[n:b] = inp.input_ids, 0
        i64[m:m + n], i64[m + n:m + b] = lay.positions, 0
        i64[2 * m:2 * m + n], i64[2 * m + n:2 * m + b] = lay.slot_mapping, self.scratch_slot
        i32[:n], i32[n:b] = lay.kv_lens, 1
        i32[m:m + n], i32[m + n:m + b] = 1, 0
        have = lay.block_table.shape[1]
        self._np_tables[:n, :have] = lay.block_table
        self._np_tables[n:b, 0] = self.kv.scratch_block
        if self._dev64 is not self._host64:
            self._dev64.copy_(self._host64, non_blocking=True)
            self._dev32.copy_(self._host32, non_blocking=True)
            # whole rows: one contiguous copy from the pinned buffer (a column slice would be staged
            # through a pageable temporary, a synchronous copy)
            self._dev_tables[:b].copy_(self._host_tables[:b], non_blocking=True)
            self._copied = torch.cuda.Event()  # on the copies' stream (the model's device, not the current one)
            self._copied.record(torch.cuda.current_stream(self._dev64.device))

    def forward(self, b: int, greedy: bool) -> torch.Tensor:
        """The decode step over the buffers' first b rows: token ids [b] (int64) with ``greedy``, else
        float32 logits [b, vocab]; the step's routings counted into ``tokens`` and ``pairs``."""
        m, kv, r, e = self.model, self.kv, self.rows[b], self.num_experts
        self.tokens.zero_()
        self.pairs.zero_()
        ctx = PagedContext(None, r.positions, r.slots, b, True, self.cos.index_select(0, r.positions),
                           self.sin.index_select(0, r.positions), r.first_rows, r.tables, r.kv_lens, r.cu_q,
                           kv.block_size)
        padded = (r.valid == 0)[:, None]
        x = m.embed_tokens(r.ids)
        for layer in range(m.cfg.num_layers):
            h, y, ids, w = m.pre_moe(layer, x, ctx, kv)
            routed = None
            if ids is not None:
                ids = ids.masked_fill(padded, e)  # through no expert, counted in the dropped column
                routed = self._experts(layer, y, ids, w)
            x = m.post_moe(layer, h, y, routed)
        return m.greedy(x) if greedy else m.logits(x)

    def _experts(self, layer: int, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``LocalExperts`` over fixed buffers: the pairs (first, second by top-k position) counted as
        ``LoadTracker.record`` counts them, the tokens by the experts as they run them."""
        if ids.shape[1] > 1:
            flat = (ids[:, self._first] * (self.num_experts + 1) + ids[:, self._second]).reshape(-1)
            self.pairs[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return self.experts.experts.layers[layer](y, ids, w, counts=self.tokens[layer])

    def fold(self) -> None:
        """The step's routings (padded rows dropped) into the experts' counts and load tracker."""
        e, layers = self.num_experts, self.tokens.shape[0]
        tokens = self.tokens[:, :e]
        self.experts.counts += tokens
        self.experts.tracker.add(tokens, self.pairs.view(layers, e + 1, e + 1)[:, :e, :e].reshape(layers, e * e))

    def dummy(self, b: int, seed: int) -> ModelInput:
        """A decode batch to capture and check with: n of b rows (b, or b - 1 with ``seed`` odd: padded
        rows too) of random tokens, each a sequence of up to a block in a block of the pool (what the
        KV cache holds there is no sequence's yet: this runs at start-up)."""
        rng = np.random.default_rng(seed)
        n = max(1, min(b - seed % 2, self.kv.num_blocks))
        bs = self.kv.block_size
        kv_lens = rng.integers(1, bs + 1, n)
        lay = StepLayout.from_blocks(np.ones(n, dtype=np.int64), kv_lens, [[i] for i in range(n)], bs)
        return ModelInput(rng.integers(0, self.model.cfg.vocab_size, n), lay, np.arange(n, dtype=np.int64))
