"""The prefix cache over the other cache layouts: MLA's latent cache (DeepSeek) and a model whose
every layer has a sliding window (its out-of-window blocks go back early, cached ones stay cached).
Outputs equal caching disabled, through device hits and host/disk restores."""

import random

import pytest

from afdserve import LLM, SamplingParams
from tiny_models import make_checkpoint, make_deepseek_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v3", "mixtral_window"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v3":
        return make_deepseek_checkpoint(path, 3)
    return make_checkpoint(path, "mixtral", sliding_window=8)


@pytest.mark.torch_backend
def test_cached_prefixes_give_the_uncached_outputs(model, tmp_path):
    rng = random.Random(5)
    bases = [[rng.randrange(3, 256) for _ in range(33)] for _ in range(3)]
    ps = [b + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 7))] for b in bases for _ in range(2)]
    base = dict(num_kv_blocks=24, block_size=8, max_model_len=64, max_num_batched_tokens=16)
    with LLM(str(model), enable_prefix_caching=False, **base) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    opts = base | dict(prefix_cache_host_gb=2 ** -20, prefix_cache_dir=str(tmp_path), prefix_cache_disk_gb=2 ** -14)
    with LLM(str(model), **opts) as llm:
        got = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in ps]
        blocks = llm.engine.engine.blocks
        stats = llm.engine.engine.prefix_stats()
        assert blocks.num_free == blocks.num_blocks and not blocks.tables
    assert got == ref
    assert stats.hit_tokens > 0
    with LLM(str(model), **opts) as llm:  # a restart: prefixes come back from the disk tier
        again = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in ps]
        assert llm.engine.engine.prefix_stats().disk_hit_tokens > 0
    assert again == ref
