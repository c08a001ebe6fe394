"""Splits a scheduled batch into micro-batches of about equal token counts.

A sequence's new tokens may be split across micro-batches (long prefills): micro-batch i+1
attends to the keys and values that micro-batch i wrote in the same layer, because the pipeline
runs the micro-batches of a layer in order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from afdserve.config import micro_batch_sizes
from afdserve.model.attention import AttnMetadata


@dataclass
class MicroBatch:
    rows: slice  # token rows of the flat batch
    meta: AttnMetadata


def split(meta: AttnMetadata, m: int) -> list[MicroBatch]:
    sizes = micro_batch_sizes(meta.num_tokens, m)
    bounds = [0, *itertools.accumulate(sizes)]
    out: list[MicroBatch] = []
    seq, used = 0, 0  # current sequence, and how many of its new tokens earlier micro-batches took
    for i in range(len(sizes)):
        want = bounds[i + 1] - bounds[i]
        seqs, qlens, kv_lens = [], [], []
        while want > 0:
            q, kv = meta.query_lens[seq], meta.kv_lens[seq]
            take = min(q - used, want)
            done_before = kv - q + used  # context already in the cache before this piece
            seqs.append(seq)
            qlens.append(take)
            kv_lens.append(done_before + take)
            used += take
            want -= take
            if used == q:
                seq, used = seq + 1, 0
        out.append(MicroBatch(slice(bounds[i], bounds[i + 1]), meta.select(seqs, qlens, kv_lens)))
    return out


def rows_in(mbs: list[MicroBatch], rows: torch.Tensor) -> list[torch.Tensor]:
    """For each micro-batch, the requested flat rows it contains, as local indices."""
    return [rows[(rows >= mb.rows.start) & (rows < mb.rows.stop)] - mb.rows.start for mb in mbs]
