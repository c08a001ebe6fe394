"""Sliding-window attention: token-identical to transformers past the window (prefill, chunked
prefill, decode), blocks out of every layer's window go back to the pool and are never read."""

import random

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kvcache.block_manager import BlockManager
from afdserve.model.config import ModelConfig
from tiny_models import hf_greedy, make_checkpoint, prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
WINDOWED = {  # each family's way of asking for a window (window 8 << prompt + output)
    "mixtral": dict(sliding_window=8),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 0 only
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=8),
}



@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(f"{arch}_window"), arch, **WINDOWED[arch])
    ps = prompts()
    return arch, path, ps, hf_greedy(path, ps, 32)


def _poison_released(llm):
    """Fills every block given back early with NaN: a read of one (even masked) spoils the output."""
    engine = llm.engine.engine
    blocks, kv = engine.blocks, engine.runner.kv
    release = blocks.release_before
    freed = []

    def poisoning(seq_id, position):
        table = list(blocks.tables.get(seq_id, ()))
        n = release(seq_id, position)
        for b in table[:n]:
            rows = slice(b * blocks.block_size, (b + 1) * blocks.block_size)
            kv.k[:, rows] = float("nan")
            kv.v[:, rows] = float("nan")
        freed.extend(table[:n])
        return n

    blocks.release_before = poisoning
    return freed


def test_config_windows():
    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=8, hidden_size=8, num_attention_heads=2,
                num_hidden_layers=4, moe_intermediate_size=4, num_experts=2, num_experts_per_tok=1,
                max_position_embeddings=64, sliding_window=16)
    assert ModelConfig.from_dict(base).sliding_windows == ()  # use_sliding_window is false
    on = ModelConfig.from_dict(base | {"use_sliding_window": True, "max_window_layers": 3})
    assert on.sliding_windows == (16, 0, 16, 0) and on.kv_window == 0  # transformers' rule
    assert on.max_position_embeddings == 64  # served past the window
    typed = ModelConfig.from_dict(base | {"use_sliding_window": True, "layer_types": ["sliding_attention"] * 4})
    assert typed.sliding_windows == (16,) * 4 and typed.kv_window == 16


@pytest.mark.torch_backend
@pytest.mark.parametrize("budget,block_size", [(2048, 16), (7, 4)])  # whole prefills; chunked, many frees
def test_windowed_matches_transformers(windowed, budget, block_size):
    arch, path, ps, ref = windowed
    with LLM(str(path), num_kv_blocks=96, block_size=block_size, max_num_batched_tokens=budget,
             max_model_len=256) as llm:
        freed = _poison_released(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
        engine = llm.engine.engine
        assert engine.blocks.num_free == engine.blocks.num_blocks
    assert [o.outputs[0].token_ids for o in outs] == ref
    # only a model whose every layer has a window gives blocks back early
    assert bool(freed) == (arch != "qwen2_moe")


def test_out_of_window_blocks_return_to_pool(windowed):
    """A pool too small for the sequences' whole contexts serves them (with preemptions) because
    out-of-window blocks go back as they advance; the accounting ends with every block free."""
    arch, path, ps, ref = windowed
    if arch == "qwen2_moe":
        pytest.skip("a full-attention layer keeps every block")
    # window 8 + budget 8 at block size 4 needs at most 5 blocks per sequence; 62 tokens need 16
    with LLM(str(path), num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_model_len=128) as llm:
        engine = llm.engine.engine
        blocks = engine.blocks
        _poison_released(llm)
        peak = []
        step = engine.step

        def watched():
            out = step()
            peak.append(max((len(t) for t in blocks.tables.values()), default=0))
            return out

        engine.step = watched
        preempted = []
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, batch: (preempted.append(seq.request_id), preempt(seq, batch))
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
        assert blocks.num_free == blocks.num_blocks and not blocks.tables
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(peak) <= 5 < -(-(30 + 32) // 4)
    assert preempted  # 4 sequences x 5 blocks > 12: a preempted sequence comes back and is right


def test_release_accounting():
    bm = BlockManager(8, 4)
    bm.reserve(1, 10)  # 3 blocks
    assert bm.release_before(1, 3) == 0  # block 0 still holds position 3
    assert bm.release_before(1, 9) == 2
    assert bm.num_free == 7 and bm.num_released(1) == 2
    slots = bm.slots(1, 10)
    assert (slots[:8] == -1).all() and (slots[8:] >= 0).all()
    assert bm.blocks_needed(1, 12) == 0 and bm.blocks_needed(1, 13) == 1
    bm.reserve(1, 13)
    assert bm.num_free == 6
    assert bm.release_before(1, 9) == 0  # nothing twice
    bm.free(1)  # preemption or finish: only the live blocks go back, once
    assert bm.num_free == 8 and bm.num_released(1) == 0
    bm.reserve(1, 4)  # recomputed from the start
    assert bm.slots(1, 4).min() >= 0 and bm.num_free == 7
    assert torch.equal(bm.slots(1, 4) // 4, bm.slots(1, 4)[:1] // 4 * torch.ones(4, dtype=torch.int64))


@pytest.fixture(scope="module")
def windowed_mixtral(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("mixtral_window_disagg"), "mixtral", sliding_window=8)
    ps = prompts()
    return path, ps, hf_greedy(path, ps, 32)


@pytest.mark.parametrize("gate", [pytest.param("attention", marks=pytest.mark.torch_backend), "expert"])
def test_windowed_disaggregated(windowed_mixtral, gate):
    """Every attention worker gives back its sequences' old blocks; chunked prefills split across
    micro-batches attend through the window too."""
    path, ps, ref = windowed_mixtral
    with LLM(str(path), num_kv_blocks=12, block_size=4, max_model_len=128, attention_workers=2, expert_workers=2,
             micro_batches=2, gate=gate, max_num_batched_tokens=8) as llm:  # 62 tokens would need 16 blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_decode_and_prefill_keys_stay_in_the_window():
    """Decode rows gather only the window's slots of their own sequence (padding included) and
    prefill masks equal the brute-force window mask."""
    from afdserve.backends.pytorch.attention import _decode_keys
    from afdserve.backends.pytorch.prefill_groups import plan
    from afdserve.backends.step import StepLayout

    rng, bs = random.Random(3), 4
    for _ in range(50):
        window = rng.randrange(1, 12)
        seqs, qlens, tables = [], [], []
        for s in range(rng.randrange(1, 5)):
            n = rng.randrange(1, 40)
            q = 1 if rng.random() < 0.6 or n == 1 else rng.randrange(1, n + 1)
            released = max(0, n - q - window + 1) // bs  # the blocks wholly before every query's window
            table = [-1 if j < released else 250 * (s + 1) + j for j in range(-(-n // bs))]
            slots = torch.tensor([table[p // bs] * bs + p % bs if table[p // bs] >= 0 else -1 for p in range(n)])
            seqs.append(slots)
            qlens.append(q)
            tables.append(table)
        layout = StepLayout.from_blocks(qlens, [int(x.shape[0]) for x in seqs], tables, bs)
        if layout.num_decode:
            slots, mask = (torch.from_numpy(a) for a in _decode_keys(layout, layout.decode_seqs, window))
            for row, i in enumerate(layout.decode_seqs.tolist()):
                n = seqs[i].shape[0]
                own = set(seqs[i][max(0, n - window):].tolist())
                assert set(slots[row].tolist()) <= own and -1 not in own
                assert int(mask[row].sum()) == min(n, window)
        starts = torch.tensor([0, *qlens]).cumsum(0).tolist()
        for g in plan(layout.query_lens, layout.kv_lens, layout.block_table, bs, window):
            for row, i in enumerate(starts.index(int(r)) for r in g.rows[:, 0]):
                n, q = seqs[i].shape[0], qlens[i]
                qpos, kpos = torch.arange(n - q, n)[:, None], torch.arange(n)[None, :]
                want = (kpos <= qpos) & (kpos > qpos - window)  # what each new token attends
                got = torch.zeros(q, n, dtype=torch.bool)  # what the group's row attends, by position
                m = torch.ones(q, q, dtype=torch.bool).tril() if g.mask is None else g.mask[row, 0, :q]
                key_pos = {int(s): j for j, s in enumerate(seqs[i].tolist()) if s >= 0}
                for c in range(g.slots.shape[1]):
                    got[:, key_pos[int(g.slots[row, c])]] |= m[:, c]  # never a released (-1) slot
                assert torch.equal(got, want)
