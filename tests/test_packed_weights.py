"""Prepacked weights (``model.linear``) and the expert layer's three paths (dense over all held
experts, per-expert packed, grouped GEMM) against a plain per-token reference."""

import pytest
import torch
import torch.nn.functional as F

from afdserve import kernels
from afdserve.model import experts as experts_mod
from afdserve.model import linear
from afdserve.model.config import ModelConfig
from afdserve.model.experts import ExpertPart
from afdserve.model.linear import STACKED, Linear, linear as packed_linear

needs_packing = pytest.mark.skipif(not linear.packing_available(), reason="no oneDNN bf16 GEMM on this CPU")


@pytest.fixture
def packing_off(monkeypatch):
    def off():
        monkeypatch.setenv("AFDSERVE_PACKED_WEIGHTS", "0")
        linear.reset_packing()
    yield off
    linear.reset_packing()


def _entries(w: torch.Tensor) -> int:
    return sum(1 for k in linear._packed if k[0] == w.data_ptr())


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
    assert _entries(lin.weight) == 1  # it did go through a packed copy


@needs_packing
def test_packed_copies_follow_the_weight():
    w = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    with torch.inference_mode():
        first = packed_linear(x, w)
        w.copy_(torch.randn(32, 16))  # in place: the version counter moves
        assert torch.equal(packed_linear(x, w), F.linear(x, w))
        assert not torch.equal(packed_linear(x, w), first)
        frozen = torch.randn(3, 32, 16).to(torch.bfloat16)  # an inference tensor: no version counter
        packed_linear(x, frozen[0]), packed_linear(x, frozen[2])  # views into it are packed too
        frozen.copy_(torch.randn(3, 32, 16))
        linear.forget(frozen)  # so whoever changes it says so
        assert torch.equal(packed_linear(x, frozen[0]), F.linear(x, frozen[0]))
        assert torch.equal(packed_linear(x, frozen[2]), F.linear(x, frozen[2]))
        stacked = torch.randn(3, 8, 16).to(torch.bfloat16)
        assert torch.equal(packed_linear(x, stacked, None, STACKED), F.linear(x, stacked.reshape(24, 16)))
    ptr = w.data_ptr()
    del w  # the packed copies go with the weight
    assert not any(k[0] == ptr for k in linear._packed)


@needs_packing
def test_packed_linear_inside_torch_compile():
    lin = Linear(64, 48, bias=False, dtype=torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    compiled = torch.compile(lin, fullgraph=True, backend="eager")  # the op traces without a graph break
    with torch.inference_mode():
        assert torch.equal(compiled(x), F.linear(x, lin.weight))


def test_float32_packs_only_for_the_kernel_and_the_switch_turns_packing_off(packing_off):
    """float32: oneDNN's packed linear rounds differently, so only afdserve's kernel packs it."""
    x, w = torch.randn(4, 16), torch.randn(32, 16)
    if kernels.supports("linear", x):
        assert torch.allclose(packed_linear(x, w), F.linear(x, w), atol=1e-5) and _entries(w) == 1
    else:
        assert torch.equal(packed_linear(x, w), F.linear(x, w)) and _entries(w) == 0
    packing_off()
    assert torch.equal(packed_linear(x, w + 1), F.linear(x, w + 1))
    off = Linear(16, 8, bias=False, dtype=torch.bfloat16)
    off(torch.randn(2, 16).to(torch.bfloat16))
    assert _entries(off.weight) == 0


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
    for dense_limit, packing in ((1 << 20, "1"), (0, "1"), (0, "0")):  # dense, per-expert packed, grouped
        monkeypatch.setattr(experts_mod, "DENSE_TOKENS_PER_THREAD", dense_limit)
        monkeypatch.setenv("AFDSERVE_PACKED_WEIGHTS", packing)
        linear.reset_packing()
        with torch.inference_mode():
            got = part(y, ids, w).float()
        assert (got - want).abs().max() <= 0.03 * scale, (dense_limit, packing)
    linear.reset_packing()
    if linear.packing_available() and (1 - (1 - 2 / 8) ** tokens) >= 0.5:
        assert any(k[0] == part.w_gate_up.data_ptr() and k[3] == STACKED for k in linear._packed)  # dense ran
