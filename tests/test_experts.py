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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 4)])
def test_grouped_path_with_pairs_routed_elsewhere(monkeypatch, bias, hidden, inter):
    """``ExpertPart``'s grouped path (CUDA's, and the CPU's without packed weights): every (token,
    slot) pair goes through the GEMMs sorted by held expert, those routed to experts held elsewhere
    last and zeroed, nothing read back to the host; equals the experts one token at a time."""
    from afdserve.model import experts
    from afdserve.model.config import ModelConfig

    monkeypatch.setattr(experts, "packs", lambda *a: False)
    monkeypatch.setattr(experts, "USE_FUSED_KERNEL", False)
    cfg = ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     num_local_experts=6, num_experts_per_tok=2))
    part = experts.ExpertPart(cfg, [4, 1, 3], torch.float32)
    g = torch.Generator().manual_seed(hidden)
    for t in (part.w_gate_up, part.w_down):
        t.copy_(torch.randn(t.shape, generator=g))
    if bias:
        part.b_gate_up = torch.nn.Parameter(torch.randn(3, 2 * inter, generator=g), requires_grad=False)
        part.b_down = torch.nn.Parameter(torch.randn(3, hidden, generator=g), requires_grad=False)
    y = torch.randn(7, hidden, generator=g)
    ids = torch.tensor([[4, 0], [1, 3], [0, 5], [3, 4], [2, 5], [1, 1], [5, 4]])
    w = torch.rand(7, 2, generator=g)
    want = torch.zeros(7, hidden)
    for t in range(7):
        for s in range(2):
            e = int(ids[t, s])
            if e not in part.expert_ids:
                continue
            j = part.expert_ids.index(e)
            gu = part.w_gate_up[j] @ y[t] + (part.b_gate_up[j] if bias else 0)
            gate, up = gu.chunk(2)
            want[t] += w[t, s] * (part.w_down[j] @ (F.silu(gate) * up) + (part.b_down[j] if bias else 0))
    torch.testing.assert_close(part(y, ids, w), want, rtol=1e-5, atol=1e-4)
