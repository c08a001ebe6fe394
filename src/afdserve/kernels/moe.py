"""The fused MoE kernel's weight layout and call (``csrc/moe.cpp``).

``pack_gate_up`` / ``pack_down`` turn an expert layer's stacked weights ([E, 2I, H] gate+up, [E, H, I]
down) into the kernel's column blocks of 32 outputs; ``fused_moe`` runs every routed (token, expert)
pair of the layer and returns the routing-weighted sum per token.
"""

from __future__ import annotations

import torch

from afdserve.kernels import ops
from afdserve.kernels.packing import BLOCK, blocks
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}


def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] gate rows then up rows -> blocks holding 16 gate and the matching 16 up rows."""
    e, two_i, h = w.shape
    i = two_i // 2
    ipad = -(-i // 16) * 16
    gate = torch.zeros(e, ipad, h, dtype=w.dtype, device=w.device)
    up = torch.zeros_like(gate)
    gate[:, :i], up[:, :i] = w[:, :i], w[:, i:]
    rows = torch.cat([gate.view(e, ipad // 16, 16, h), up.view(e, ipad // 16, 16, h)], dim=2)
    return blocks(rows.reshape(e, 2 * ipad, h))


def pack_down(w: torch.Tensor) -> torch.Tensor:
    """[E, H, I] -> blocks of 32 hidden outputs over I rounded up to 16 (zeros past I)."""
    e, h, i = w.shape
    hpad, ipad = -(-h // BLOCK) * BLOCK, -(-i // 16) * 16
    padded = torch.zeros(e, hpad, ipad, dtype=w.dtype, device=w.device)
    padded[:, :h, :i] = w
    return blocks(padded)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              local: torch.Tensor, inter: int, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              counts: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` over the pairs whose expert this part holds
    (``local[id]`` >= 0: its index in the packed weights; ids past ``local`` or mapped to -1 give 0).

    x [T, H] (bf16 or float32, H even); w13, w2 from ``pack_gate_up`` / ``pack_down``; ids [T, k]
    int32/int64; weights [T, k] float32; biases (gpt-oss) [E, 2I] / [E, H] float32. ``counts``
    (int64 [n]): each pair's id in ``[0, n)`` is counted into it (``bincount``'s counts, added)."""
    return ops().fused_moe(x, w13, w2, b13, b2, ids, weights, local, inter, ACTIVATIONS[activation], alpha, limit,
                           counts)
