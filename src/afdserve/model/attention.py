"""The attention part of a MoE layer: norms, QKV, RoPE, paged GQA attention, output projection."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from afdserve import kernels
from afdserve.kernels.attention import attention_half, paged_attention
from afdserve.kernels.layers import rope_cache
from afdserve.kvcache.block_manager import block_slots
from afdserve.model.config import ModelConfig
from afdserve.model.layers import RMSNorm, sdpa
from afdserve.model.linear import Linear, kernel_weight
from afdserve.model.prefill_groups import PrefillGroup, SlotSource, plan
from afdserve.model.rope import apply_rotary


@dataclass
class AttnMetadata:
    """Where the tokens of a flat batch go in the paged KV cache and what they attend to.

    The batch is the concatenation of each sequence's new tokens (``query_lens``); after this
    step sequence ``i`` has ``kv_lens[i]`` tokens in the cache. The engine describes the cache by
    block tables (``from_table``, or ``from_blocks`` from per-sequence lists: ``block_tables``
    [S, max_blocks] int32, -1 for blocks given back because no layer's window reaches them), which
    the paged attention kernel reads in place; a per-position slot list per sequence (``kv_slots``,
    -1 where released) is derived from them when a PyTorch path needs it, or given directly
    (``build``).
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_lens: list[int]
    kv_lens: list[int]
    block_size: int = 0  # of ``block_tables`` (0: none)
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    decode_rows: torch.Tensor | None = None  # token rows of the query_len == 1 sequences
    decode_seqs: torch.Tensor | None = None  # their sequence indices
    _kv_slots: list[torch.Tensor] | None = field(default=None, repr=False)
    _decode_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _lens: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _prefill: dict[int, list[PrefillGroup]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def build(query_lens: list[int], kv_slots: list[torch.Tensor]) -> "AttnMetadata":
        """``kv_slots[i]``: cache slots of all tokens of sequence i after this step; its last
        ``query_lens[i]`` tokens are the new ones."""
        kv_lens = [int(s.shape[0]) for s in kv_slots]
        q = torch.tensor(query_lens, dtype=torch.int64)
        kv = torch.tensor(kv_lens, dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(len(query_lens)), q)  # sequence of each token
        first = torch.cumsum(q, 0) - q  # first token row of each sequence
        positions = (kv - q)[seq_of] + torch.arange(int(q.sum())) - first[seq_of]
        slot_mapping = torch.cat([s[s.shape[0] - n:] for s, n in zip(kv_slots, query_lens)])
        dec = (q == 1).nonzero().squeeze(1)
        rows = first[dec] if dec.numel() else None
        return AttnMetadata(positions, slot_mapping, list(query_lens), kv_lens, decode_rows=rows,
                            decode_seqs=dec if dec.numel() else None, _kv_slots=list(kv_slots))

    @staticmethod
    def from_blocks(query_lens: list[int], kv_lens: list[int], tables: list[list[int]],
                    block_size: int) -> "AttnMetadata":
        """``tables[i]``: the blocks of sequence i's positions ``[j * block_size, (j + 1) * block_size)``
        (-1: given back), covering its ``kv_lens[i]`` tokens; its last ``query_lens[i]`` are new."""
        # at least 2 columns: a width of 1 would make torch.compile specialize (and recompile)
        arr = np.full((len(tables), max(2, max(len(t) for t in tables))), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            arr[i, : len(t)] = t
        return AttnMetadata._from_array(query_lens, kv_lens, arr, block_size)

    @staticmethod
    def from_table(query_lens: list[int], kv_lens: list[int], table: np.ndarray, block_size: int) -> "AttnMetadata":
        """As ``from_blocks``, from the tables already as one int32 array [S, max_blocks] (-1 padded;
        ``BlockManager.batch_table``), which the metadata takes over."""
        if table.dtype != np.int32 or table.ndim != 2 or table.shape[0] != len(query_lens):
            raise ValueError(f"block table: int32 [{len(query_lens)}, blocks] expected, "
                             f"got {table.dtype} {table.shape}")
        return AttnMetadata._from_array(query_lens, kv_lens, table, block_size)

    def select(self, seqs: list[int], query_lens: list[int], kv_lens: list[int]) -> "AttnMetadata":
        """A piece of this batch (a micro-batch): its sequences ``seqs`` with ``query_lens`` new tokens
        and ``kv_lens`` tokens after them (a prefill split across pieces has fewer in the first)."""
        if self.block_tables is None:
            return AttnMetadata.build(query_lens, [self.kv_slots[s][:n] for s, n in zip(seqs, kv_lens)])
        return AttnMetadata._from_array(query_lens, kv_lens, self.block_tables.numpy()[seqs], self.block_size)

    @staticmethod
    def _from_array(query_lens: list[int], kv_lens: list[int], arr: np.ndarray, bs: int) -> "AttnMetadata":
        s = len(query_lens)
        q, kv = np.asarray(query_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
        if int(q.sum()) == s:  # a pure decode step: one token per sequence, at its last position
            seq_of, positions = np.arange(s), kv - 1
            first = seq_of
        else:
            seq_of = np.repeat(np.arange(s), q)
            first = np.cumsum(q) - q
            positions = (kv - q)[seq_of] + np.arange(int(q.sum())) - first[seq_of]
        slots = arr[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        dec = np.flatnonzero(q == 1)
        return AttnMetadata(torch.from_numpy(positions), torch.from_numpy(slots), list(query_lens), list(kv_lens),
                            bs, torch.from_numpy(arr), torch.from_numpy(first[dec]) if dec.size else None,
                            torch.from_numpy(dec) if dec.size else None)

    @property
    def kv_slots(self) -> list[torch.Tensor]:
        """Per sequence: [kv_len] cache slots of its whole context (-1 where released)."""
        if self._kv_slots is None:
            slots = block_slots(self.block_tables, self.block_size)
            self._kv_slots = [slots[i, :n] for i, n in enumerate(self.kv_lens)]
        return self._kv_slots

    def lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_lens [S], cu_q [S + 1]) as int32 tensors: the paged attention kernel's view."""
        if self._lens is None:
            cu = np.zeros(len(self.query_lens) + 1, dtype=np.int32)
            np.cumsum(self.query_lens, out=cu[1:])
            dev = self.positions.device
            self._lens = (torch.tensor(self.kv_lens, dtype=torch.int32, device=dev), torch.from_numpy(cu).to(dev))
        return self._lens

    def decode_kv(self, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of the decode sequences through a ``window`` (0: all): padded slots [S, L] and
        the mask [S, 1, 1, L] (True where attended). Computed once per window and step, from the
        block tables in a few whole-batch operations where there are tables."""
        if window not in self._decode_kv:
            seqs = self.decode_seqs
            lens = torch.tensor(self.kv_lens, dtype=torch.int64, device=seqs.device)[seqs]
            starts = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
            kept = lens - starts
            cols = torch.arange(int(kept.max()), device=seqs.device)[None, :]
            # padded with each sequence's own last position (masked): never a slot of a block it gave back
            pos = starts[:, None] + torch.minimum(cols, kept[:, None] - 1)
            if self.block_tables is not None:
                table = block_slots(self.block_tables[seqs], self.block_size)
            else:
                width = max(len(s) for s in self.kv_slots)
                table = torch.stack([F.pad(self.kv_slots[i], (0, width - len(self.kv_slots[i])), value=-1)
                                     for i in seqs.tolist()])
            slots = table.gather(1, pos)
            mask = (cols < kept[:, None])[:, None, None, :]
            self._decode_kv[window] = (slots, mask)
        return self._decode_kv[window]

    def prefill_groups(self, window: int = 0) -> list[PrefillGroup]:
        """The prefill pieces (sequences with more than one new token) through a ``window`` (0: all
        keys), grouped into padded attention calls (``afdserve.model.prefill_groups``); built on
        the host once per window and step."""
        if window not in self._prefill:
            if self.block_tables is not None:
                src = SlotSource(self.block_tables.cpu().numpy(), self.block_size)
            else:
                src = SlotSource(per_seq=self.kv_slots)
            groups = plan(self.query_lens, self.kv_lens, src, window)
            dev = self.positions.device
            self._prefill[window] = [g.to(dev) for g in groups] if dev.type != "cpu" else groups
        return self._prefill[window]

    def to(self, device: torch.device, windows: tuple[int, ...] = (0,)) -> "AttnMetadata":
        """This metadata with its tensors on ``device`` (itself on the CPU). The decode keys and
        prefill groups of ``windows`` are prepared here first, so no step reads anything back from
        the device."""
        if device.type == "cpu":
            return self
        for w in windows:
            if self.decode_seqs is not None:
                self.decode_kv(w)
            if not self.is_decode:
                self.prefill_groups(w)
        self.lens()
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return AttnMetadata(move(self.positions), move(self.slot_mapping), self.query_lens, self.kv_lens,
                            self.block_size, move(self.block_tables), move(self.decode_rows), move(self.decode_seqs),
                            # decodes read their keys through decode_kv, prefills through their groups;
                            # kv_slots are derived on the device from the tables if ever asked for
                            None if self.block_tables is not None else [move(s) for s in self.kv_slots],
                            {w: (move(a), move(b)) for w, (a, b) in self._decode_kv.items()},
                            (move(self._lens[0]), move(self._lens[1])),
                            {w: [g.to(device) for g in gs] for w, gs in self._prefill.items()})

    @property
    def is_decode(self) -> bool:
        """Every sequence of the batch has one new token."""
        return self.decode_rows is not None and self.decode_rows.shape[0] == self.num_tokens

    @property
    def decode_slots(self) -> torch.Tensor:
        return self.decode_kv(0)[0]

    @property
    def decode_mask(self) -> torch.Tensor:
        return self.decode_kv(0)[1]


class AttentionPart(nn.Module):
    """``x -> (h, y)`` with ``h = x + attn(norm(x))`` and ``y = post_norm(h)`` (the MoE input).

    ``window``: keys attended (0: all). With ``cfg.attention_sinks`` (gpt-oss) every head's softmax
    also has a learned logit ``sinks[head]`` that takes weight and adds no value."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, window: int = 0):
        super().__init__()
        self.cfg, self.window = cfg, window
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.qkv = Linear(h, (nh + 2 * nkv) * hd, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(nh * hd, h, bias=cfg.o_proj_bias, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(nh, dtype=dtype)) if cfg.attention_sinks else None
        self.scale = hd**-0.5
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.block_tables is not None and kernels.supports("paged_attention", x):
            return self.paged(x, *cos_sin, meta.slot_mapping, meta.block_tables, *meta.lens(), meta.block_size,
                              k_cache, v_cache)
        q = self._project(x, cos_sin, meta.slot_mapping, k_cache, v_cache)
        if meta.is_decode:
            return self._output(x, self._decode(q, k_cache, v_cache, *meta.decode_kv(self.window)))
        return self._output(x, self._attend(q, k_cache, v_cache, meta))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
               slots: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of a batch of decodes, on tensors only (``slots``, ``mask``: ``decode_kv``):
        what ``AttentionModel.compile_decode`` compiles."""
        q = self._project(x, (cos, sin), slot_mapping, k_cache, v_cache)
        return self._output(x, self._decode(q, k_cache, v_cache, slots, mask))

    def _project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The queries [T, nh, hd] of ``x``; its keys and values go into the caches ([num_slots, nkv,
        hd] views of the paged blocks) at ``slot_mapping``."""
        cfg = self.cfg
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.qkv(self.input_norm(x))
        cos, sin = cos_sin
        if kernels.supports("rope_cache", qkv) and k_cache.is_contiguous() and v_cache.is_contiguous():
            norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            return rope_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, nh, nkv, *norms, cfg.rms_norm_eps)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache[slot_mapping] = k
        v_cache[slot_mapping] = v
        return q

    def _output(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.post_norm.add_forward(self.o_proj(out.reshape(x.shape[0], -1)), x)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None,
              gqa: bool = True) -> torch.Tensor:
        """q [B, Hq, Lq, hd], keys/vals [B, Hk, L, hd] (Hq a multiple of Hk: query head h reads
        key head h // (Hq / Hk)), mask bool broadcastable to [B, Hq, Lq, L] (None: causal with
        Lq == L). A decode call passes each key head's query heads as its queries (Hq == Hk,
        Lq = heads per key head, ``gqa`` False): the same attention, and several times faster on
        CPU than ``enable_gqa``."""
        if self.sinks is None:
            return sdpa(q, keys, vals, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa)
        b, hq, lq, _ = q.shape
        if mask is None:
            mask = torch.ones(lq, keys.shape[2], dtype=torch.bool, device=q.device).tril()
        # the sink: one more key (zero, so its logit is the bias sinks[head]) with a zero value
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = torch.cat([bias.expand(b, hq, lq, -1),
                          self.sinks.to(q.dtype).view(1, hq, -1, 1).expand(b, hq, lq, 1)], dim=-1)
        zero = keys.new_zeros(b, keys.shape[1], 1, keys.shape[3])
        return sdpa(q, torch.cat([keys, zero], 2), torch.cat([vals, zero], 2),
                    attn_mask=bias, scale=self.scale, enable_gqa=gqa)

    def paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
              tables: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor, block_size: int, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` over the paged attention kernel: every sequence of the batch, decodes and
        prefills, in one call that reads the cache in place through the block tables (see
        ``AttnMetadata.lens``); on tensors only, so ``compile_decode`` compiles it too."""
        q = self._project(x, (cos, sin), slot_mapping, k_cache, v_cache)
        sinks = None if self.sinks is None else self.sinks.float()
        out = paged_attention(q.contiguous(), k_cache, v_cache, tables, kv_lens, cu_q, block_size, self.window,
                              self.scale, sinks)
        return self._output(x, out)

    def fused(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
              k_cache: torch.Tensor, v_cache: torch.Tensor,
              router_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``forward`` in one kernel call (``kernels.attention.attention_half``), with the logits of a
        router of weight ``router_w`` (float32, ``Router.route``'s input; empty without one); None
        where that kernel does not run (no block tables, a dtype or device it lacks, weights the
        linear kernel does not multiply)."""
        if meta.block_tables is None or x.dim() != 2 or not kernels.supports("attention_half", x):
            return None
        if not (x.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        qkv_w, o_w = kernel_weight(x, self.qkv.weight), kernel_weight(x, self.o_proj.weight)
        r_w = None if router_w is None else kernel_weight(x, router_w)
        if qkv_w is None or o_w is None or (router_w is not None and r_w is None):
            return None
        cfg = self.cfg
        qkv_b, o_b = self.qkv.bias, self.o_proj.bias
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        return attention_half(x, self.input_norm.weight, qkv_w, None if qkv_b is None else qkv_b.float(), *cos_sin,
                              k_cache, v_cache, meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads, *norms,
                              meta.block_tables, *meta.lens(), meta.block_size, self.window, self.scale,
                              None if self.sinks is None else self.sinks.float(), o_w,
                              None if o_b is None else o_b.float(), self.post_norm.weight, r_w,
                              0 if router_w is None else router_w.shape[0], cfg.rms_norm_eps)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttnMetadata) -> torch.Tensor:
        """The PyTorch path: the decode rows in one SDPA call, the prefill pieces in one call per
        group of similar lengths (``AttnMetadata.prefill_groups``)."""
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, *meta.decode_kv(self.window))
        for g in meta.prefill_groups(self.window):
            qs = q[g.rows].transpose(1, 2)  # [P, nh, Lq, hd]
            keys = k_cache[g.slots].transpose(1, 2)  # [P, nkv, Lk, hd]
            vals = v_cache[g.slots].transpose(1, 2)
            o = self._sdpa(qs, keys, vals, g.mask)
            out[g.dst] = o.transpose(1, 2).reshape(-1, *q.shape[1:])[g.src]
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """q [S, nh, hd] of decode sequences over their keys at ``slots`` [S, L] (``mask`` [S, 1, 1, L])."""
        keys = k_cache[slots].transpose(1, 2)  # [S, nkv, L, hd]
        vals = v_cache[slots].transpose(1, 2)
        grouped = q.view(q.shape[0], self.cfg.num_kv_heads, -1, q.shape[-1])  # [S, nkv, heads per kv head, hd]
        return self._sdpa(grouped, keys, vals, mask, gqa=False).reshape(q.shape)
