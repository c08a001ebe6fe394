"""The block manager's persistent block-table rows (``batch_table``) always equal the per-sequence
tables (``block_table``) padded with -1, whatever happened to the sequences: blocks taken a few at a
time, prefix hits shared by reference, blocks given back early (sliding windows), frees, evictions
of cached blocks, more sequences and longer tables than the array first had room for; and the blocks
each sequence holds (``held``) are what ``blocks_needed`` counts."""

import random

import numpy as np
import pytest

from afdserve.kvcache.block_manager import BlockManager, BlockRows
from afdserve.kvcache.prefix import PrefixCacheConfig, block_hashes


def _padded(bm: BlockManager, ids: list[int]) -> np.ndarray:
    tables = [bm.block_table(i) for i in ids]
    out = np.full((len(ids), max(2, max(len(t) for t in tables))), -1, dtype=np.int32)
    for row, t in enumerate(tables):
        out[row, : len(t)] = t
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batch_table_equals_the_padded_block_tables_after_random_operations(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    bm = BlockManager(rng.randrange(16, 300), bs, PrefixCacheConfig(b"salt") if seed % 2 else None)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 90))] for _ in range(6)]  # shared prefixes
    live: dict[int, tuple[list[int], int]] = {}  # seq -> (tokens, tokens held)
    next_id = 0
    for _ in range(400):
        c = rng.random()
        if c < 0.25:  # admit, as the scheduler does: prefix hit, then the rest
            tokens = rng.choice(prompts)[: rng.randrange(1, 90)] + [rng.randrange(50)]
            keys = block_hashes(tokens, bs, b"salt")
            hit = bm.lookup(keys, (len(tokens) - 1) // bs)
            if bm.can_admit(hit, len(tokens)):
                bm.acquire(next_id, hit, len(tokens))
                bm.reserve(next_id, len(tokens))
                bm.commit(next_id, keys, len(tokens))
                live[next_id] = (tokens, len(tokens))
                next_id += 1
        elif c < 0.55 and live:  # grow
            s = rng.choice(list(live))
            tokens, held = live[s]
            n = held + rng.randrange(0, 3 * bs + 1)
            if bm.can_hold(s, n):
                bm.reserve(s, n)
                live[s] = (tokens, n)
        elif c < 0.7 and live:  # a window moves on
            s = rng.choice(list(live))
            bm.release_before(s, rng.randrange(0, live[s][1] + 1))
        elif c < 0.85 and live:
            s = rng.choice(list(live))
            bm.free(s)
            del live[s]
        if live:
            ids = rng.sample(list(live), rng.randrange(1, len(live) + 1))
            got = bm.batch_table(ids)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, _padded(bm, ids))
            for s, h in zip(ids, bm.held(ids)):  # the scheduler's count: blocks_needed's
                assert h == len(bm.block_table(s))  # given back ones included
                n = live[s][1] + rng.randrange(0, 2 * bs + 1)
                assert bm.blocks_needed(s, n) == max(0, -(-n // bs) - h)
    assert next_id > 20  # the run admitted, and so freed and reused, many sequences


def test_rows_grow_and_a_reused_row_starts_clean():
    rows = BlockRows(rows=1, cols=2)
    rows.write(7, 0, [3, 4, 5])  # wider than the array
    rows.write(8, 0, [9])  # a second row: the array doubles
    np.testing.assert_array_equal(rows.gather([7, 8]), [[3, 4, 5], [9, -1, -1]])
    rows.drop(7)
    rows.write(10, 0, [1])  # takes 7's row
    np.testing.assert_array_equal(rows.gather([10]), [[1, -1]])
    with pytest.raises(KeyError, match=r"\[7\]"):
        rows.gather([7])
    with pytest.raises(ValueError):
        BlockRows(rows=1, cols=1)
