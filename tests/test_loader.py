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


def test_dtype_auto_is_the_checkpoints(tiny_mixtral, tmp_path):
    """--dtype auto (the default) takes the checkpoint's dtype, "dtype" or the older "torch_dtype";
    float32 where the config names none; the demo model's is DEMO_CONFIG's."""
    import json
    import shutil

    from afdserve.config import DEMO_DTYPE, EngineConfig
    from afdserve.model.demo import DEMO_CONFIG

    assert EngineConfig(model=str(tiny_mixtral)).dtype == "float32"  # saved in float32 by transformers
    assert EngineConfig().dtype == DEMO_DTYPE == DEMO_CONFIG["torch_dtype"]
    assert EngineConfig(model=str(tiny_mixtral), dtype="bfloat16").dtype == "bfloat16"
    for key, value, want in (("torch_dtype", "bfloat16", "bfloat16"), ("dtype", "float16", "float16"),
                             ("dtype", None, "float32"), ("dtype", "int8", "float32")):
        path = tmp_path / f"{key}-{value}"
        shutil.copytree(tiny_mixtral, path)
        raw = {k: v for k, v in json.loads((path / "config.json").read_text()).items()
               if k not in ("dtype", "torch_dtype")}
        (path / "config.json").write_text(json.dumps(raw | ({key: value} if value else {})))
        assert EngineConfig(model=str(path)).dtype == want, (key, value)
