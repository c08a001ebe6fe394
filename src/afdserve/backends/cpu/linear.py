"""The linear kernel over weights packed once (bfloat16 and float32): one call per product, little
fixed cost for the few-row products of decoding, float32 outputs on request (the LM head's logits),
and the greedy argmax of the LM head without writing its logits."""

from __future__ import annotations

import torch

from afdserve.backends.cpu import ops, supports
from afdserve.backends.pytorch.linear import TorchLinearOp


class KernelLinearOp:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.packed = ops.pack(weight)
        self.bias = None if bias is None else bias.float().contiguous()  # the kernel adds float32 biases
        k = ops.ops()
        self._linear, self._argmax = k.linear, k.linear_argmax

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self._linear(x.reshape(-1, self.in_features).contiguous(), self.packed, self.bias, self.out_features,
                         out_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x.contiguous(), self.packed, self.bias, self.out_features, torch.float32, True)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        val = torch.empty(x.shape[0], dtype=torch.float32)
        idx = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x, self.packed, self.bias, self.out_features, 0, val, idx, False)
        return idx


class CpuLinear:
    name = "cpu"

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> KernelLinearOp | TorchLinearOp:
        """The kernel's op where it multiplies this weight (its dtype on this CPU; an even inner
        dimension for bfloat16), else PyTorch's."""
        fits = weight.device.type == "cpu" and supports("linear", weight.dtype) and (
            weight.dtype == torch.float32 or weight.shape[1] % 2 == 0)
        return KernelLinearOp(weight, bias) if fits else TorchLinearOp(weight, bias)
