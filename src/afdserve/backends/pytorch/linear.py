"""Linear projections in PyTorch (``F.linear``), and the LM head's greedy argmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLinearOp:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self(x, torch.float32)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self(x, torch.float32), dim=-1)


class TorchLinear:
    name = "torch"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> TorchLinearOp:
        return TorchLinearOp(weight, bias)
