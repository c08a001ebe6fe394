"""The backends, chosen once (``afdserve.backends.choose``): what each choice gives for a device,
dtype and model; weights packed at load for the linear and MoE backends, both against a plain
reference; a packed linear inside ``torch.compile``."""

import pytest
import torch
import torch.nn.functional as F

from afdserve.backends import choose, cpu
from afdserve.errors import ConfigError
from afdserve.model.config import ModelConfig
from afdserve.model.experts import ExpertPart
from afdserve.model.linear import Linear

BACKENDS = ["cpu", "torch"]


def needs_cpu(kernel: str, dtype: torch.dtype) -> None:
    if not cpu.supports(kernel, dtype):
        pytest.skip(f"no {kernel} kernel for {dtype} on this CPU")


def test_auto_takes_the_kernels_where_they_run_and_torch_elsewhere():
    names = choose("cpu", torch.float32).names()
    if cpu.available():
        assert names == dict.fromkeys(("attention", "moe", "linear", "norm"), "cpu")
    else:
        assert set(names.values()) == {"torch"}
    assert set(choose("cpu", torch.float32, "torch").names().values()) == {"torch"}
    assert set(choose("meta", torch.float32).names().values()) == {"torch"}  # not the CPU: PyTorch
    assert choose("cpu", torch.float32, latent=True).attention.name == "torch"  # MLA: the torch attention
    mixed = choose("cpu", torch.float32, attention="torch")
    assert mixed.attention.name == "torch" and mixed.linear.name == names["linear"]


def test_an_explicit_choice_that_cannot_run_is_refused_saying_why():
    with pytest.raises(ConfigError, match="invalid linear backend 'cpu': .*not the CPU"):
        choose("meta", torch.float32, "cpu")
    with pytest.raises(ConfigError, match="invalid attention backend 'cpu': .*MLA"):
        choose("cpu", torch.float32, attention="cpu", latent=True)
    with pytest.raises(ConfigError, match="needs the cpu linear backend"):
        choose("cpu", torch.float32, "torch", attention="cpu")
    with pytest.raises(ConfigError, match="invalid moe backend 'gpu'"):
        choose("cpu", torch.float32, moe="gpu")
    if not cpu.supports("linear", torch.float16):  # no float16 kernels: auto takes torch, cpu is refused
        assert choose("cpu", torch.float16).linear.name == "torch"
        with pytest.raises(ConfigError, match="float16"):
            choose("cpu", torch.float16, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64, 700])
def test_a_linear_layer_packed_at_load_computes_f_linear(backend, dtype, rows):
    if backend == "cpu":
        needs_cpu("linear", dtype)
    g = torch.Generator().manual_seed(rows)
    lin = Linear(96, 160, bias=True, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(160, 96, generator=g))
        lin.bias.copy_(torch.randn(160, generator=g))
    lin.prepare(choose("cpu", dtype, backend))
    assert type(lin.op).__name__ == ("KernelLinearOp" if backend == "cpu" else "TorchLinearOp")
    x = torch.randn(rows, 96, generator=g).to(dtype)
    want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    with torch.inference_mode():
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(lin(x).float(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lin(x, torch.float32), want, rtol=tol, atol=tol)
        assert torch.equal(lin.op.argmax(x), torch.argmax(lin(x, torch.float32), dim=-1))


def test_an_odd_inner_dimension_in_bfloat16_packs_for_pytorch():
    """The kernel multiplies bfloat16 pairs: a weight with an odd inner dimension is packed for
    PyTorch when the layer is prepared, not refused later."""
    lin = Linear(7, 32, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    lin.prepare(choose("cpu", torch.bfloat16))
    assert type(lin.op).__name__ == "TorchLinearOp"
    x = torch.randn(3, 7).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, lin.weight))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_linear_compiles_without_a_graph_break(backend):
    if backend == "cpu":
        needs_cpu("linear", torch.bfloat16)
    lin = Linear(64, 48, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    lin.prepare(choose("cpu", torch.bfloat16, backend))
    x = torch.randn(5, 64).to(torch.bfloat16)
    compiled = torch.compile(lin, fullgraph=True, backend="eager")  # the op traces without a graph break
    with torch.inference_mode():
        assert torch.equal(compiled(x), lin(x))


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 24, 80])
@pytest.mark.parametrize("held", [list(range(8)), [1, 4, 6], []])
def test_every_moe_backend_matches_the_reference(backend, bias, tokens, held):
    if backend == "cpu":
        needs_cpu("fused_moe", torch.bfloat16)
    part = _part(bias, held)
    part.prepare(choose("cpu", torch.bfloat16, moe=backend))
    g = torch.Generator().manual_seed(tokens)
    y = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 2, generator=g), -1)
    want = _reference(part, y, ids, w)
    scale = want.abs().max().clamp_min(1)
    with torch.inference_mode():
        got = part(y, ids, w).float()
    assert (got - want).abs().max() <= 0.03 * scale


def test_experts_set_again_are_packed_again():
    """``set_weights`` drops the packed experts; ``prepare`` packs the new weights (no cache keyed by
    where the old ones lived)."""
    part = _part(False, [0, 1])
    backends = choose("cpu", torch.bfloat16)
    part.prepare(backends)
    y = torch.randn(4, 64).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    before = part(y, ids, w)
    part.set_weights(0, [t * 2 for t in part.weights(1)])
    assert part.experts is None
    part.prepare(backends)
    assert not torch.equal(part(y, ids, w), before)
    want = _reference(part, y, ids, w)
    assert (part(y, ids, w).float() - want).abs().max() <= 0.03 * want.abs().max()
