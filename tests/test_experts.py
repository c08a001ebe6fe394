"""The grouped expert GEMM equals running each expert alone, bit for bit (empty experts included)."""

import pytest
import torch
import torch.nn.functional as F

from afdserve.model.experts import grouped_swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 4)])  # aligned rows: grouped GEMM; else the loop
def test_grouped_swiglu_equals_one_expert_at_a_time(dtype, hidden, inter):
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(5, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(5, hidden, inter, generator=g).to(dtype)
    counts = torch.tensor([3, 0, 1, 0, 4])
    x = torch.randn(int(counts.sum()), hidden, generator=g).to(dtype)
    want, start = [], 0
    for j, c in enumerate(counts.tolist()):
        gate, up = F.linear(x[start:start + c], w1[j]).chunk(2, dim=-1)
        want.append(F.linear(F.silu(gate) * up, w2[j]))
        start += c
    assert torch.equal(grouped_swiglu(x, w1, w2, counts), torch.cat(want))
