"""Prefix-cache tiers: device blocks spill to host memory then disk, are restored bit-exact, the disk
tier survives a restart and never serves a truncated, corrupt or foreign file; all tiers stay bounded."""

import random

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.cache import KVCache
from afdserve.kvcache.disk import DiskTier
from afdserve.kvcache.prefix import PrefixCacheConfig, block_hashes

BS, SALT = 4, b"salt-a"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _manager(n, host_blocks=0, disk=None, disk_blocks=0, salt=SALT, dtype=torch.float32):
    kv = KVCache(2, 1, 8, n, BS, dtype)
    b = kv.block_bytes
    cfg = PrefixCacheConfig(salt, host_bytes=host_blocks * b, disk_dir=str(disk) if disk else None,
                            disk_bytes=disk_blocks * int(b * 1.5))  # a file holds some metadata too
    return BlockManager(n, BS, cfg, kv), kv


def _compute(bm, kv, sid, tokens):
    """Admits a sequence and writes recognisable values into its new blocks ("computing" them)."""
    keys = block_hashes(tokens, BS, SALT if bm.salt == SALT else bm.salt)
    hit = bm.lookup(keys, (len(tokens) - 1) // BS)
    cached = bm.acquire(sid, hit, len(tokens))
    bm.reserve(sid, len(tokens))
    for j, b in enumerate(bm.tables[sid][cached // BS:], start=cached // BS):
        k, v = kv.read_block(b)
        k.fill_(float(tokens[j * BS])), v.fill_(-float(tokens[j * BS]))
    bm.commit(sid, keys, len(tokens))
    return cached


def _check_values(bm, kv, sid, tokens):
    for j, b in enumerate(bm.tables[sid][: len(tokens) // BS]):
        k, v = kv.read_block(b)
        assert torch.all(k == tokens[j * BS]) and torch.all(v == -tokens[j * BS])


def test_spill_to_host_then_restore_exactly(tmp_path):
    bm, kv = _manager(4, host_blocks=8)
    a = list(range(10, 23))  # 3 full blocks + 1
    _compute(bm, kv, 1, a)
    bm.free(1)
    _compute(bm, kv, 2, list(range(100, 116)))  # takes all 4 blocks: a's blocks spill to host
    bm.free(2)
    s = bm.stats()
    assert s.device_evictions == 3 and s.host_bytes == 3 * kv.block_bytes
    assert _compute(bm, kv, 3, a) == 12  # all 3 restored from host
    _check_values(bm, kv, 3, a)
    s = bm.stats()
    assert s.host_hit_tokens == 12 and s.restored_blocks == 3 and s.host_restore_bytes_per_s > 0


def test_host_overflow_goes_to_disk_and_survives_a_restart(tmp_path):
    bm, kv = _manager(4, host_blocks=1, disk=tmp_path, disk_blocks=16)
    a = list(range(10, 23))
    _compute(bm, kv, 1, a)
    bm.free(1)
    _compute(bm, kv, 2, list(range(100, 116)))
    bm.free(2)
    assert bm.stats().host_evictions == 2 and bm.stats().disk_bytes > 0
    bm.persist()  # shutdown: every cached block to disk
    bm2, kv2 = _manager(4, host_blocks=1, disk=tmp_path, disk_blocks=16)  # a restart
    assert _compute(bm2, kv2, 1, a) == 12
    _check_values(bm2, kv2, 1, a)
    assert bm2.stats().disk_hit_tokens == 12


def _disk_with(tmp_path, salt=SALT, dtype=torch.float32):
    bm, kv = _manager(4, disk=tmp_path, disk_blocks=16, salt=salt, dtype=dtype)
    _compute(bm, kv, 1, list(range(10, 23)))
    bm.free(1)
    bm.persist()
    return bm


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign_salt_file", "wrong_name"])
def test_disk_files_are_validated(tmp_path, damage):
    bm = _disk_with(tmp_path)
    tier = bm.tiers.disk
    files = sorted(tier.dir.glob("*.kv"))
    assert len(files) == 3
    victim = tier.path(block_hashes(list(range(10, 23)), BS, SALT)[0])
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) - 17])
    elif damage == "flip":
        victim.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    elif damage == "foreign_salt_file":  # a file another model wrote, copied into this model's folder
        other = _disk_with(tmp_path / "other", salt=b"salt-b")
        src = sorted(other.tiers.disk.dir.glob("*.kv"))[0]
        victim.write_bytes(src.read_bytes())
    else:  # a valid file of another key under this key's name
        victim.write_bytes(tier.path(block_hashes(list(range(10, 23)), BS, SALT)[1]).read_bytes())
    bm2, kv2 = _manager(4, disk=tmp_path, disk_blocks=16)
    assert _compute(bm2, kv2, 1, list(range(10, 23))) == 0  # the first block is invalid: nothing served
    assert bm2.stats().invalid_disk_files == 1 and not victim.exists()


def test_another_model_or_dtype_never_sees_the_files(tmp_path):
    _disk_with(tmp_path)
    for salt, dtype in ((b"salt-b", torch.float32), (SALT, torch.bfloat16)):
        bm, kv = _manager(4, disk=tmp_path, disk_blocks=16, salt=salt, dtype=dtype)
        assert _compute(bm, kv, 1, list(range(10, 23))) == 0
        assert bm.stats().disk_hit_tokens == 0


def test_disk_tier_bound_evicts_lru(tmp_path):
    bm = _disk_with(tmp_path)
    size = next(iter(bm.tiers.disk.files.values()))
    tier = DiskTier(tmp_path, SALT, 2 * size, bm.tiers.disk.shapes, (torch.float32,) * 2)  # reopened, smaller
    assert len(tier) == 2 and tier.bytes <= 2 * size and tier.evictions == 1
    assert len(list(tier.dir.glob("*.kv"))) == 2


def test_recompute_when_restoring_is_measured_slower():
    bm, kv = _manager(4, host_blocks=8)
    a = list(range(10, 23))
    _compute(bm, kv, 1, a)
    bm.free(1)
    _compute(bm, kv, 2, list(range(100, 116)))
    bm.free(2)
    bm.tiers.rates["host"].observe(1, 1.0)  # measured: 1 byte/s restores
    bm.observe_prefill(10**6, 1.0)  # and a million tokens/s prefill
    assert _compute(bm, kv, 3, a) == 0
    assert bm.stats().recomputed_blocks == 3 and bm.stats().restored_blocks == 0


def test_engine_tiers_outputs_identical_and_bounded(tiny_mixtral, tmp_path):
    rng = random.Random(3)
    bases = [[rng.randrange(3, 256) for _ in range(40)] for _ in range(4)]
    ps = [b + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 9))] for b in bases for _ in range(2)]
    with LLM(str(tiny_mixtral), num_kv_blocks=16, block_size=8, max_model_len=64, enable_prefix_caching=False) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    opts = dict(num_kv_blocks=16, block_size=8, max_model_len=64, prefix_cache_host_gb=4 * 2 ** -20,
                prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=64 * 2 ** -20)
    with LLM(str(tiny_mixtral), **opts) as llm:
        eng = llm.engine.engine
        got = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in ps]
        s = eng.prefix_stats()
        assert got == ref
        assert s.device_evictions > 0 and s.host_evictions > 0 and s.disk_bytes > 0
        assert s.host_bytes <= s.host_bytes_limit and s.disk_bytes <= s.disk_bytes_limit
        assert eng.blocks.num_free == 16
    with LLM(str(tiny_mixtral), **opts) as llm:  # a restart: the prompts come back from disk
        got = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in ps]
        s = llm.engine.engine.prefix_stats()
    assert got == ref and s.disk_hit_tokens > 0


def test_cli_flags_and_config_checks(tmp_path):
    from afdserve.cli.deployment import engine_config
    from afdserve.cli.main import build_parser
    from afdserve.config import EngineConfig
    from afdserve.errors import ConfigError

    args = build_parser().parse_args(["generate", "--no-prefix-cache", "--prefix-cache-dir", str(tmp_path),
                                      "--prefix-cache-disk-gb", "0.5", "--prefix-cache-host-gb", "0", "--prompt", "x"])
    cfg = engine_config(args)
    assert (cfg.enable_prefix_caching, cfg.prefix_cache_dir, cfg.prefix_cache_disk_gb, cfg.prefix_cache_host_gb) == \
        (False, str(tmp_path), 0.5, 0)
    assert EngineConfig().enable_prefix_caching
    for bad in (dict(prefix_cache_host_gb=-1), dict(prefix_cache_disk_gb="x"), dict(prefix_cache_dir=""),
                dict(enable_prefix_caching=1)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineConfig(**bad)
