"""``afdserve plan kv`` (afdserve.planner.kv_capacity): bytes per token, blocks per worker and the
blocks a sequence holds, checked against the engine's own allocation and its start-up check;
context-parallel ranks; the presets and the design note's figure; the command."""

import json

import pytest
import torch

from afdserve.cli.plan import main as plan_main
from afdserve.config import EngineConfig
from afdserve.engine.builder import kv_blocks, kv_storage_dtype
from afdserve.errors import ConfigError
from afdserve.kvcache import KVCache
from afdserve.model.config import ModelConfig
from afdserve.planner import load_model_spec
from afdserve.planner.kv_capacity import KVShape, kv_capacity
from tiny_models import make_checkpoint, make_deepseek_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    return {"mixtral": make_checkpoint(root / "mixtral", "mixtral"),
            "windowed": make_checkpoint(root / "windowed", "mixtral", sliding_window=8),
            "deepseek": make_deepseek_checkpoint(root / "deepseek", 3)}


@pytest.mark.parametrize("name", ["mixtral", "windowed", "deepseek"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_the_report_is_the_engines_allocation(models, name, dtype):
    path = models[name]
    cfg = ModelConfig.from_pretrained(path)
    fp8 = dtype == "fp8_e4m3"
    kw = dict(model=str(path), dtype="bfloat16" if fp8 else dtype, kv_cache_dtype="fp8" if fp8 else "auto",
              max_num_batched_tokens=64)
    eng = EngineConfig(kv_cache_gb=0.002, **kw)
    cap = kv_capacity(cfg, dtype, eng.block_size, eng.kv_cache_gb, None, eng.max_num_batched_tokens)
    n = kv_blocks(eng, cfg, 32)  # what the engine allocates
    assert cap.num_blocks == n and cap.tokens_per_worker == n * eng.block_size
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, n, eng.block_size, kv_storage_dtype(eng),
                 cfg.kv_latent_dim)
    assert kv.allocated_bytes() == n * cap.bytes_per_block  # fp8: the scales included
    assert cap.bytes_per_token == kv.bytes_per_token_per_layer() * cfg.num_layers
    if fp8:  # half of bfloat16's bytes, plus a float32 scale per block and head (per block for the latent)
        bf16 = kv_capacity(cfg, "bfloat16", eng.block_size, eng.kv_cache_gb)
        heads = 1 if cfg.kv_latent_dim else 2 * cfg.num_kv_heads
        assert cap.scale_bytes_per_token == cfg.num_layers * heads * 4 / eng.block_size
        assert cap.bytes_per_token == bf16.bytes_per_token / 2 + cap.scale_bytes_per_token
    # the blocks one sequence holds: the engine starts with exactly that many, refuses one fewer
    longest = cfg.max_position_embeddings
    need = cap.blocks_for(longest)
    assert kv_blocks(EngineConfig(num_kv_blocks=need, **kw), cfg, longest) == need
    with pytest.raises(ConfigError, match="needs"):
        kv_blocks(EngineConfig(num_kv_blocks=need - 1, **kw), cfg, longest)
    if name == "windowed":
        assert need < -(-longest // eng.block_size)  # blocks out of every layer's window went back


def test_cp_ranks_and_fp8():
    shape = KVShape("gqa", num_layers=80, num_kv_heads=8, head_dim=128)  # the design note's 70B model
    bf16 = kv_capacity(shape, "bfloat16", 16, 80.0)
    assert bf16.bytes_per_token == 320 * 1024  # 320 KiB per token
    fp8 = kv_capacity(shape, "fp8_e4m3", 16, 80.0)
    assert fp8.bytes_per_token == 160 * 1024 + 80 * 2 * 8 * 4 / 16  # half, plus a scale per block and head
    assert 1.99 * bf16.num_blocks < fp8.num_blocks < 2 * bf16.num_blocks  # the scales take a little
    for cap in (bf16, fp8):
        one = cap.tokens_per_worker
        assert cap.cp_ranks(one) == 1 and cap.cp_ranks(one + 1) == 2 and cap.cp_ranks(3 * one) == 3
    assert bf16.cp_ranks(1_000_000) == 4 and fp8.cp_ranks(1_000_000) == 2  # 305 GiB / 80, 152 GiB / 80
    latent = KVShape.of(load_model_spec("deepseek-v3"))
    assert latent.latent_dim == 576 and kv_capacity(latent, "bfloat16").bytes_per_token == 61 * 576 * 2
    with pytest.raises(ConfigError, match="dtype"):
        kv_capacity(shape, "int4")


def test_the_command(models, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert plan_main(["plan", "kv", "--model", str(models["mixtral"]), "--num-kv-blocks", "64",
                      "--prompt-tokens", "1024,1025,4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bytes/token" in text and "fp8_e4m3*" in text and "are scales" in text
    rows = {r["dtype"]: r for r in json.loads(out.read_text())["kv"]}
    assert rows["float32"]["tokens_per_worker"] == 1024
    assert rows["float32"]["cp_ranks"] == {"1024": 1, "1025": 2, "4096": 4}
    assert plan_main(["plan", "kv", "--model", "mixtral-8x22b"]) == 0
    assert "56 layers" in capsys.readouterr().out
    assert plan_main(["plan", "kv", "--model", str(tmp_path / "missing")]) == 2
