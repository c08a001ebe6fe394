"""The loader reads only the tensors a role needs (counted in bytes)."""

import torch

from afdserve.backends import choose
from safetensors import safe_open

from afdserve.model.config import ModelConfig
from afdserve.model.loader import CheckpointReader
from afdserve.model.model import AttentionModel, ExpertModel


def _sizes(path):
    sizes = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                sizes[k] = t.numel() * t.element_size()
    return sizes


def test_role_loads_read_only_their_tensors(tiny_mixtral):
    sizes = _sizes(tiny_mixtral)
    cfg = ModelConfig.from_pretrained(tiny_mixtral)
    expert_bytes = {k: v for k, v in sizes.items() if ".experts." in k}
    assert len(list(tiny_mixtral.glob("*.safetensors"))) > 1  # sharded, with an index

    r = CheckpointReader(tiny_mixtral)
    AttentionModel.load(tiny_mixtral, "float32", cfg, r)
    assert r.bytes_read == sum(sizes.values()) - sum(expert_bytes.values())

    r = CheckpointReader(tiny_mixtral)
    ExpertModel.load(tiny_mixtral, [2, 3, 4], "float32", cfg, r)
    wanted = sum(v for k, v in expert_bytes.items() if any(f".experts.{e}." in k for e in (2, 3, 4)))
    assert r.bytes_read == wanted


def test_expert_parts_partition_reproduces_all_experts(tiny_model):
    arch, path = tiny_model
    cfg = ModelConfig.from_pretrained(path)
    backends = choose("cpu", torch.float32)
    full = ExpertModel.load(path).prepare(backends)
    a = ExpertModel.load(path, [0, 1]).prepare(backends)
    b = ExpertModel.load(path, list(range(2, cfg.num_experts))).prepare(backends)
    torch.manual_seed(0)
    y = torch.randn(10, cfg.hidden_size)
    ids = torch.stack([torch.randperm(cfg.num_experts)[: cfg.top_k] for _ in range(10)])
    w = torch.rand(10, cfg.top_k)
    torch.testing.assert_close(full.layers[1](y, ids, w), a.layers[1](y, ids, w) + b.layers[1](y, ids, w))


def test_bfloat16_load(tiny_model):
    arch, path = tiny_model
    m = AttentionModel.load(path, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
