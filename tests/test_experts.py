"""The MoE backends' experts: the torch backend's grouped GEMM equals running each expert alone
(empty experts included; bit for bit where its rows need no padding), pairs routed elsewhere give
nothing, and every backend counts each routed pair."""

import pytest
import torch
import torch.nn.functional as F

from afdserve.backends import choose
from afdserve.backends.base import Activation
from afdserve.backends.pytorch.moe import GroupedExperts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 4)])  # aligned rows; rows padded once when packed
def test_grouped_experts_equal_one_expert_at_a_time(dtype, hidden, inter):
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
    experts = GroupedExperts(w1, w2, None, None, Activation())
    got = experts._swiglu(F.pad(x, (0, experts.pad_h)), counts)[:, :hidden]
    if experts.pad_h == 0 and experts.w13 is w1:
        assert torch.equal(got, torch.cat(want))
    else:
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 4)])
def test_grouped_path_with_pairs_routed_elsewhere(monkeypatch, bias, hidden, inter):
    """The torch MoE backend (CUDA's, and the CPU's without the kernels): every (token, slot) pair
    goes through the GEMMs sorted by held expert, those routed to experts held elsewhere last and
    zeroed, nothing read back to the host; equals the experts one token at a time."""
    from afdserve.model import experts
    from afdserve.model.config import ModelConfig

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
    part.prepare(choose("cpu", torch.float32, "torch"))
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


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_expert_part_counts_each_pair_on_every_backend(backend):
    """``counts`` gets each (token, slot) pair's id, those routed elsewhere (id num_experts)
    included, whichever backend computes the layer (the fused kernel counts as it sorts)."""
    from afdserve.backends import cpu
    from afdserve.model import experts
    from afdserve.model.config import ModelConfig

    if backend == "cpu" and not cpu.supports("fused_moe", torch.bfloat16):
        pytest.skip("no fused MoE kernel on this machine")
    cfg = ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=64, hidden_size=64, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                     num_local_experts=6, num_experts_per_tok=2))
    part = experts.ExpertPart(cfg, [4, 1, 3], torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for t in (part.w_gate_up, part.w_down):
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    part.prepare(choose("cpu", torch.bfloat16, backend))
    assert type(part.experts).__name__ == ("FusedExperts" if backend == "cpu" else "GroupedExperts")
    y = torch.randn(9, 64, generator=g).bfloat16()
    ids = torch.tensor([[4, 0], [1, 3], [6, 5], [3, 4], [2, 6], [1, 1], [5, 4], [6, 6], [0, 3]], dtype=torch.int32)
    w = torch.rand(9, 2, generator=g)
    counts = torch.zeros(7, dtype=torch.int64)
    out = part(y, ids, w, counts=counts)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1).long(), minlength=7))
    torch.testing.assert_close(out, part(y, ids.long(), w), rtol=0, atol=0)  # the counts change nothing else
    part(y, ids, w, counts=counts)
    assert torch.equal(counts, 2 * torch.bincount(ids.reshape(-1).long(), minlength=7))
