"""The expert part of a MoE layer: routed SwiGLU experts (grouped) and the shared expert.

An expert is ``down(act(gate_up(y)))`` with gate and up stacked in one [2I, H] matrix; gpt-oss's
experts add biases to both projections and use its clamped SwiGLU (``Activation``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afdserve import kernels
from afdserve.kernels.moe import fused_moe, pack_down, pack_gate_up
from afdserve.model.config import ModelConfig
from afdserve.model.layers import swiglu
from afdserve.model.linear import SIDE_BY_SIDE, STACKED, forget, linear, packs


@dataclass(frozen=True)
class Activation:
    """``silu``: SwiGLU ``silu(gate) * up``; ``swiglu_oai``: gpt-oss's ``(up + 1) * gate *
    sigmoid(alpha * gate)`` with gate clamped above at ``limit`` and up to ``[-limit, limit]``."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Activation":
        return cls(cfg.expert_activation, cfg.swiglu_alpha, cfg.swiglu_limit)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = Activation()

# the most tokens per thread for which ``ExpertPart`` runs every held expert densely (without the
# fused kernel)
DENSE_TOKENS_PER_THREAD = 16
# the fused MoE kernel runs wherever it is built (False: the PyTorch paths)
USE_FUSED_KERNEL = True


def grouped_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   counts: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                   b_down: torch.Tensor | None = None, act: Activation = SILU) -> torch.Tensor:
    """Gated MLPs of rows grouped by expert: rows ``[sum(counts[:j]), sum(counts[:j+1]))`` of ``x``
    go through expert j (``w_gate_up[j]`` [2I, H], ``w_down[j]`` [H, I], optional biases
    ``b_gate_up[j]`` [2I], ``b_down[j]`` [H]). One grouped GEMM per projection for all experts
    (``torch._grouped_mm``), no Python loop over experts. Rows past ``sum(counts)`` go through no
    expert: what they come out as is unspecified."""
    if any(d * x.element_size() % 16 for d in (x.shape[1], w_down.shape[2], w_gate_up.shape[1])):
        # the grouped GEMM needs 16-byte aligned rows: a loop for such (tiny) shapes
        sizes = counts.tolist()
        parts = []
        for j, rows in enumerate(x[: sum(sizes)].split(sizes)):
            gu = rows @ w_gate_up[j].T
            gu = gu if b_gate_up is None else gu + b_gate_up[j]
            out = act(gu) @ w_down[j].T
            parts.append(out if b_down is None else out + b_down[j])
        parts.append(x.new_zeros(x.shape[0] - sum(sizes), w_down.shape[1]))  # the rows past the groups
        return torch.cat(parts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    # each row's bias; the rows past sum(counts), if any, get zeros (all worked out on the device)
    rest = (x.shape[0] - offs[-1:]).to(counts.dtype)
    per_row = lambda b: torch.repeat_interleave(torch.cat([b, b.new_zeros(1, b.shape[1])]),  # noqa: E731
                                                torch.cat([counts, rest]), dim=0, output_size=x.shape[0])
    gu = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs)
    if b_gate_up is not None:
        gu = gu + per_row(b_gate_up)
    out = torch._grouped_mm(act(gu).contiguous(), w_down.transpose(1, 2), offs=offs)
    if b_down is not None:
        out = out + per_row(b_down)
    return out


class ExpertPart(nn.Module):
    """Holds the routed experts ``expert_ids`` (logical ids) of one layer.

    ``forward`` runs each held expert once over all the tokens routed to it (one grouped GEMM per
    projection) and returns the router-weighted sum of their outputs; tokens routed to experts held
    elsewhere get zero.
    """

    def __init__(self, cfg: ModelConfig, expert_ids: Sequence[int], dtype: torch.dtype):
        super().__init__()
        self.expert_ids = list(expert_ids)
        n, h, i = len(self.expert_ids), cfg.hidden_size, cfg.moe_intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(n, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(n, h, i, dtype=dtype), requires_grad=False)
        self.b_gate_up = nn.Parameter(torch.empty(n, 2 * i, dtype=dtype), requires_grad=False) \
            if cfg.expert_bias else None
        self.b_down = nn.Parameter(torch.empty(n, h, dtype=dtype), requires_grad=False) if cfg.expert_bias else None
        self.act = Activation.of(cfg)
        # logical id -> index in this part; id num_experts marks "routed to another worker"
        local = torch.full((cfg.num_experts + 1,), -1, dtype=torch.int64)
        for j, e in enumerate(self.expert_ids):
            local[e] = j
        self.register_buffer("local_index", local, persistent=False)
        self._kernel: tuple | None = None  # (weights' key, packed weights) of the fused MoE kernel

    def forward(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                counts: torch.Tensor | None = None) -> torch.Tensor:
        """``counts`` (int64 [num_experts + 1], on y's device): each (token, slot) pair's id is counted
        into it (an expert worker's load statistics; by the fused kernel as it sorts the pairs)."""
        if USE_FUSED_KERNEL and self.expert_ids and y.shape[1] % 2 == 0 and kernels.supports("fused_moe", y):
            w13, w2, b13, b2 = self._kernel_weights()
            a = self.act
            return fused_moe(y.contiguous(), w13, w2, topk_ids.contiguous(), topk_weights.float().contiguous(),
                             self.local_index, self.w_down.shape[2], b13, b2, a.kind, a.alpha, a.limit, counts)
        topk_ids = topk_ids.long()
        if counts is not None:  # on the device: nothing is read back to the host (bincount would)
            flat = topk_ids.reshape(-1)
            counts.index_add_(0, flat, torch.ones_like(flat))
        if self.expert_ids and packs(y, self.w_gate_up) and self._dense_pays(y.shape[0], topk_ids.shape[1]):
            return self._dense(y, topk_ids, topk_weights)
        out = torch.zeros_like(y)
        k = topk_ids.shape[1]
        local = self.local_index[topk_ids.reshape(-1)]
        if not self.expert_ids:
            return out
        if not packs(y, self.w_gate_up[0]):
            return out.index_add_(0, *self._grouped(y, local, k, topk_weights))
        hit = (local >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return out
        order = torch.argsort(local[hit], stable=True)
        pairs = hit[order]  # flat (token, slot) pairs grouped by expert, experts in held order
        counts = torch.bincount(local[pairs], minlength=len(self.expert_ids))
        tokens = pairs // k
        res = self._packed_swiglu(y[tokens], counts) * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, res.to(y.dtype))
        return out

    def _grouped(self, y: torch.Tensor, local: torch.Tensor, k: int,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grouped_swiglu`` over every (token, slot) pair, sorted by held expert with the pairs
        routed elsewhere last (through no expert, their rows zeroed): nothing is read back to the
        host, so a CUDA step keeps its kernels queued. (token rows, weighted outputs) for
        ``index_add_``."""
        n = len(self.expert_ids)
        key = torch.where(local >= 0, local, n)
        pairs = torch.argsort(key, stable=True)
        # index_add_, not bincount: CUDA's bincount reads the largest id back to the host
        counts = torch.zeros(n + 1, dtype=torch.int64, device=y.device).index_add_(
            0, key, torch.ones_like(key))[:n]
        tokens = pairs // k
        res = grouped_swiglu(y[tokens], self.w_gate_up, self.w_down, counts, self.b_gate_up, self.b_down, self.act)
        res = torch.where((key[pairs] < n)[:, None], res * topk_weights.reshape(-1)[pairs, None], 0)
        return tokens, res.to(y.dtype)

    def _kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The held experts packed for the fused MoE kernel (made on first use, again after the
        weights changed: ``set_weights``, a move), with float32 biases."""
        key = (self.w_gate_up.data_ptr(), self.w_down.data_ptr(), self.w_gate_up.dtype)
        if self._kernel is None or self._kernel[0] != key:
            biases = (None, None) if self.b_gate_up is None else (self.b_gate_up.float().contiguous(),
                                                                 self.b_down.float().contiguous())
            self._kernel = (key, (pack_gate_up(self.w_gate_up), pack_down(self.w_down), *biases))
        return self._kernel[1]

    def _dense_pays(self, tokens: int, k: int) -> bool:
        """Whether to run every held expert over every token (``_dense``). Few tokens make the
        experts' GEMMs memory-bound: computing all held experts then costs about what reading their
        weights costs, in two GEMM calls instead of two per expert, with no sorting, gathering or
        scattering of tokens. Pays while the rows stay within what the cores compute in the time
        the weights stream in (``DENSE_TOKENS_PER_THREAD`` per thread, measured on the demo
        model's expert layers) and the batch is expected to touch at least half of the
        experts (uniform routing), so that little of the weight read is wasted."""
        if tokens > DENSE_TOKENS_PER_THREAD * torch.get_num_threads():
            return False
        num_experts = self.local_index.numel() - 1
        return 1.0 - (1.0 - k / num_experts) ** tokens >= 0.5

    def _dense(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Every held expert over every token: one packed GEMM for all gate/up projections (the
        experts stacked [n*2I, H]), the activation scaled by each token's routing weight of each
        expert (0 where not routed to it), one packed GEMM for all down projections (side by side
        [H, n*I]), which also sums over the experts."""
        t, n = y.shape[0], len(self.expert_ids)
        local = self.local_index[topk_ids]  # [T, k]; -1 for experts held elsewhere: column n, dropped
        weights = torch.zeros(t, n + 1, dtype=torch.float32, device=y.device)
        weights.scatter_add_(1, torch.where(local >= 0, local, n), topk_weights.float())
        weights = weights[:, :n]
        b_gu = None if self.b_gate_up is None else self.b_gate_up.reshape(-1)
        gu = linear(y, self.w_gate_up, b_gu, STACKED).view(t, n, -1)
        act = (self.act(gu) * weights[:, :, None]).to(y.dtype).reshape(t, -1)
        out = linear(act, self.w_down, None, SIDE_BY_SIDE)
        if self.b_down is not None:
            out = out + (weights @ self.b_down.float()).to(y.dtype)
        return out

    def _packed_swiglu(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``grouped_swiglu`` through each expert's packed weights (CPU, bf16: see ``model.linear``):
        one call per projection of each expert that has rows. On this path oneDNN's packed GEMM
        beats ``torch._grouped_mm`` by more than the loop costs (measured on the demo model's expert
        layers)."""
        parts = []
        for j, rows in enumerate(x.split(counts.tolist())):
            if rows.shape[0] == 0:
                continue
            bias = self.b_gate_up is not None
            gu = linear(rows, self.w_gate_up[j], self.b_gate_up[j] if bias else None)
            parts.append(linear(self.act(gu), self.w_down[j], self.b_down[j] if bias else None))
        return torch.cat(parts)

    def weights(self, j: int) -> tuple[torch.Tensor, ...]:
        """Held expert j's tensors: (gate_up [2I, H], down [H, I]) and, with biases, (b_gate_up, b_down)."""
        if self.b_gate_up is None:
            return self.w_gate_up[j], self.w_down[j]
        return self.w_gate_up[j], self.w_down[j], self.b_gate_up[j], self.b_down[j]

    def set_weights(self, j: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copies one expert's tensors (as ``weights`` returns them) into held slot j."""
        mine = self.weights(j)
        if len(tensors) != len(mine):
            raise ValueError(f"expert weights: {len(tensors)} tensors given, {len(mine)} held")
        for dst, src in zip(mine, tensors):
            dst.copy_(src)
        self._kernel = None
        for t in (self.w_gate_up, self.w_down, self.b_gate_up, self.b_down):
            if t is not None and t.is_inference():  # no version counter tells the packed copies
                forget(t)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: ``sigmoid(gate(y)) * mlp(y)``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(h, i, dtype=dtype), requires_grad=False)
        self.gate = nn.Parameter(torch.empty(1, h, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(y, self.gate)) * swiglu(y, self.w_gate_up, self.w_down)
