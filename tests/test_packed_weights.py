"""Prepacked weights (``model.linear``) and the expert layer's three paths (dense over all held
experts, per-expert packed, grouped GEMM) against a plain per-token reference."""

import pickle

import pytest
import torch
import torch.nn.functional as F

from afdserve.model import experts as experts_mod
from afdserve.model import linear
from afdserve.model.config import ModelConfig
from afdserve.model.experts import ExpertPart
from afdserve.model.linear import Linear, PackedWeight

needs_packing = pytest.mark.skipif(not linear.packing_available(), reason="no oneDNN bf16 GEMM on this CPU")


@pytest.fixture
def packing_off(monkeypatch):
    def off():
        monkeypatch.setenv("AFDSERVE_PACKED_WEIGHTS", "0")
        linear.packing_available.cache_clear()
    yield off
    linear.packing_available.cache_clear()


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 64, 700])
def test_packed_linear_gives_the_bits_of_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 160, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 96, generator=g))
        lin.bias.copy_(torch.randn(160, generator=g))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        assert lin.packed._packed is not None  # it did go through the packed weight


@needs_packing
def test_packed_weight_follows_changes_of_the_weight():
    w = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    p = PackedWeight()
    with torch.inference_mode():
        first = p(x, w)
        w.copy_(torch.randn(32, 16))  # in place: the version counter moves
        assert torch.equal(p(x, w), F.linear(x, w))
        assert not torch.equal(p(x, w), first)
        other = torch.randn(32, 16).to(torch.bfloat16)  # another tensor altogether
        assert torch.equal(p(x, other), F.linear(x, other))


def test_float32_and_the_switch_stay_on_f_linear(packing_off):
    p = PackedWeight()
    x, w = torch.randn(4, 16), torch.randn(32, 16)
    assert torch.equal(p(x, w), F.linear(x, w)) and p._packed is None  # float32: never packed
    off = Linear(16, 8, bias=False, dtype=torch.bfloat16)
    packing_off()
    off(torch.randn(2, 16).to(torch.bfloat16))
    assert off.packed._packed is None
    assert pickle.loads(pickle.dumps(off)).packed._packed is None  # a copy starts unpacked


def _part(bias: bool, held: list[int], num_experts: int = 8) -> ExpertPart:
    cfg = ModelConfig(family="mixtral", vocab_size=100, hidden_size=64, moe_intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=num_experts, top_k=2,
                      norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                      expert_bias=bias, expert_activation="swiglu_oai" if bias else "silu")
    part = ExpertPart(cfg, held, torch.bfloat16)
    g = torch.Generator().manual_seed(len(held))
    with torch.no_grad():
        for t in part.parameters():
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return part


def _reference(part: ExpertPart, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float32."""
    out = torch.zeros(y.shape, dtype=torch.float32)
    for t in range(y.shape[0]):
        for e, wt in zip(ids[t].tolist(), w[t].tolist()):
            if e not in part.expert_ids:
                continue
            tensors = [x.float() for x in part.weights(part.expert_ids.index(e))]
            gu = F.linear(y[t].float(), tensors[0], tensors[2] if len(tensors) > 2 else None)
            d = F.linear(part.act(gu), tensors[1], tensors[3] if len(tensors) > 2 else None)
            out[t] += wt * d
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 24, 80])  # dense below DENSE_TOKENS_PER_THREAD * threads, else sparse
@pytest.mark.parametrize("held", [list(range(8)), [1, 4, 6]])
def test_every_expert_path_matches_the_reference(monkeypatch, bias, tokens, held):
    part = _part(bias, held)
    g = torch.Generator().manual_seed(tokens)
    y = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 2, generator=g), -1)
    want = _reference(part, y, ids, w)
    scale = want.abs().max()
    seen = []
    for dense_limit, packing in ((1 << 20, "1"), (0, "1"), (0, "0")):  # dense, per-expert packed, grouped
        monkeypatch.setattr(experts_mod, "DENSE_TOKENS_PER_THREAD", dense_limit)
        monkeypatch.setenv("AFDSERVE_PACKED_WEIGHTS", packing)
        linear.packing_available.cache_clear()
        with torch.inference_mode():
            got = part(y, ids, w).float()
        assert (got - want).abs().max() <= 0.03 * scale, (dense_limit, packing)
        seen.append(got)
    linear.packing_available.cache_clear()
    if linear.packing_available() and (1 - (1 - 2 / 8) ** tokens) >= 0.5:
        assert part.packed_all[0]._packed is not None  # the dense path did run
