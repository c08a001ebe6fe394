"""Routed experts in PyTorch: every (token, expert) pair sorted by held expert, one grouped GEMM per
projection for all experts (``torch._grouped_mm``), nothing read back to the host (a CUDA step keeps
its kernels queued). Shapes whose rows the grouped GEMM cannot take (not 16-byte aligned: tiny test
models) are padded with zeros once, when the experts are packed. Compiled, the grouped GEMM is a custom op
(``grouped_mm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afdserve.backends.base import Activation

ALIGN_BYTES = 16  # the grouped GEMM's row alignment


def _padded(n: int, elem: int) -> int:
    step = max(1, ALIGN_BYTES // elem)
    return -(-n // step) * step


class GroupedExperts:
    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
                 b_down: torch.Tensor | None, act: Activation):
        n, two_i, h = w_gate_up.shape
        i, elem = two_i // 2, w_gate_up.element_size()
        hp, ip = _padded(h, elem), _padded(i, elem)
        self.n, self.h, self.pad_h, self.act = n, h, hp - h, act
        if (hp, ip) == (h, i):
            self.w13, self.w2, self.b13, self.b2 = w_gate_up, w_down, b_gate_up, b_down
            return
        self.w13 = w_gate_up.new_zeros(n, 2 * ip, hp)  # gate rows [0, I), up rows [Ip, Ip + I)
        self.w13[:, :i, :h], self.w13[:, ip:ip + i, :h] = w_gate_up[:, :i], w_gate_up[:, i:]
        self.w2 = w_down.new_zeros(n, hp, ip)
        self.w2[:, :h, :i] = w_down
        self.b13 = self.b2 = None
        if b_gate_up is not None:
            self.b13 = b_gate_up.new_zeros(n, 2 * ip)
            self.b13[:, :i], self.b13[:, ip:ip + i] = b_gate_up[:, :i], b_gate_up[:, i:]
            self.b2 = b_down.new_zeros(n, hp)
            self.b2[:, :h] = b_down

    def __call__(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        ids = ids.long()
        flat = ids.reshape(-1)
        if counts is not None:  # on the device (bincount would read the largest id back)
            counts.index_add_(0, flat, torch.ones_like(flat))
        out = torch.zeros_like(y)
        if self.n == 0:
            return out
        n, k = self.n, ids.shape[1]
        held = local[flat]
        key = torch.where(held >= 0, held, n)  # pairs routed elsewhere sort last and go through no expert
        pairs = torch.argsort(key, stable=True)
        sizes = torch.zeros(n + 1, dtype=torch.int64, device=y.device).index_add_(0, key, torch.ones_like(key))[:n]
        tokens = pairs // k
        x = y[tokens]
        if self.pad_h:
            x = F.pad(x, (0, self.pad_h))
        res = self._swiglu(x, sizes)[:, : self.h]
        res = torch.where((key[pairs] < n)[:, None], res * weights.reshape(-1)[pairs, None], 0)
        return out.index_add_(0, tokens, res.to(y.dtype))

    def _swiglu(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Rows ``[sum(sizes[:j]), sum(sizes[:j+1]))`` of x through expert j; the rows past
        ``sum(sizes)`` through none (their values unspecified)."""
        offs = torch.cumsum(sizes, 0).to(torch.int32)
        mm = grouped_mm if torch.compiler.is_compiling() else torch._grouped_mm
        gu = mm(x, self.w13.transpose(1, 2), offs=offs)
        if self.b13 is not None:
            gu = gu + self._per_row(self.b13, sizes, x.shape[0])
        out = mm(self.act(gu).contiguous(), self.w2.transpose(1, 2), offs=offs)
        if self.b2 is not None:
            out = out + self._per_row(self.b2, sizes, x.shape[0])
        return out

    @staticmethod
    def _per_row(b: torch.Tensor, sizes: torch.Tensor, rows: int) -> torch.Tensor:
        """Each row's bias (zeros past the groups), worked out on the device."""
        rest = (rows - sizes.sum()).reshape(1)
        return torch.repeat_interleave(torch.cat([b, b.new_zeros(1, b.shape[1])]), torch.cat([sizes, rest]), dim=0,
                                       output_size=rows)


@torch.library.custom_op("afdserve::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` (x [M, K], w [G, K, N]: [M, N]) as an op of its own for
    ``torch.compile``, whose fake of the grouped GEMM takes bfloat16 only (the tests compile float32)."""
    return torch._grouped_mm(x, w, offs=offs)


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


class TorchMoE:
    name = "torch"

    def pack(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
             b_down: torch.Tensor | None, act: Activation) -> GroupedExperts:
        return GroupedExperts(w_gate_up, w_down, b_gate_up, b_down, act)
