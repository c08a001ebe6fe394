"""A dense SwiGLU MLP on the attention side: the MLP of a layer without experts (DeepSeek's first
``first_k_dense_replace`` layers, Qwen-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``) and
DeepSeek's ungated shared experts."""

from __future__ import annotations

import torch

from afdserve.model.layers import GatedMLP
from afdserve.model.loader import CheckpointReader


class DenseMLP(GatedMLP):
    """``down(silu(gate(y)) * up(y))``."""

    def load(self, r: CheckpointReader, prefix: str, dtype: torch.dtype) -> None:
        """Reads ``{prefix}.gate_proj`` / ``up_proj`` / ``down_proj``."""
        i2, h = self.w_gate_up.shape
        i = i2 // 2
        self.w_gate_up.copy_(torch.cat([r.get(f"{prefix}.gate_proj.weight", (i, h), dtype),
                                        r.get(f"{prefix}.up_proj.weight", (i, h), dtype)]))
        self.w_down.copy_(r.get(f"{prefix}.down_proj.weight", (h, i), dtype))
