"""Prefill pieces of a flat batch attended in a few padded calls instead of one call per sequence.

A batch's prefill pieces (sequences with more than one new token: whole prompts, chunks after a
cached prefix) are grouped by how many keys they read; each group is one attention call over a
padded [pieces, new tokens, keys] block with a mask. A piece joins the current group while the
padded area stays within ``MAX_PADDING`` times the area its pieces really attend, so a long prompt
beside short ones does not blow the short ones up to its length. Built on the host, once per step
and window, from the block tables; moved to the device with the rest of the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_PADDING = 2.0  # padded area / attended area a group may reach
SMALL_AREA = 1 << 14  # a group this small is padded freely (one call beats two)


@dataclass
class PrefillGroup:
    """Pieces attended in one call. Padding repeats a piece's last query row and last key slot, so
    every padded query row has keys to attend (no NaN) and every slot is a live one; the padded
    rows' outputs are dropped (only ``src`` is read back)."""

    rows: torch.Tensor  # [P, Lq] int64: each piece's query rows in the flat batch
    slots: torch.Tensor  # [P, Lk] int64: cache slots of the keys each piece reads, from its first one
    mask: torch.Tensor | None  # [P, 1, Lq, Lk] bool, True where attended; None: all plain causal, Lq == Lk
    src: torch.Tensor  # [n] int64: the real queries' indices in the flattened [P * Lq] output
    dst: torch.Tensor  # [n] int64: their rows in the flat batch

    def to(self, device: torch.device) -> "PrefillGroup":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return PrefillGroup(move(self.rows), move(self.slots), move(self.mask), move(self.src), move(self.dst))


def plan(query_lens: np.ndarray, kv_lens: np.ndarray, tables: np.ndarray, block_size: int,
         window: int) -> list[PrefillGroup]:
    """The groups of the pieces with ``query_lens[i]`` > 1 (their last ``query_lens[i]`` of
    ``kv_lens[i]`` tokens are new, in the blocks of ``tables[i]``), attending through ``window``
    (0: all keys)."""
    q_all = np.asarray(query_lens, dtype=np.int64)
    kv_all = np.asarray(kv_lens, dtype=np.int64)
    start_all = np.cumsum(q_all) - q_all
    idx = np.flatnonzero(q_all > 1)
    if idx.size == 0:
        return []
    q, kv = q_all[idx], kv_all[idx]
    _, nk = _keys(q, kv, window)
    order = np.argsort(-nk, kind="stable")  # most keys first: a group's key length is its first's
    groups, cur, area, lq, lk = [], [], 0, 0, 0
    for j in order.tolist():
        qj, kj = int(q[j]), int(nk[j])
        padded = (len(cur) + 1) * max(lq, qj) * (lk or kj)
        if cur and padded > MAX_PADDING * (area + qj * kj) and padded > SMALL_AREA:
            groups.append(cur)
            cur, area, lq, lk = [], 0, 0, 0
        cur.append(int(idx[j]))
        area, lq, lk = area + qj * kj, max(lq, qj), lk or kj
    groups.append(cur)
    return [_group(np.asarray(g), q_all, kv_all, start_all, tables, block_size, window) for g in groups]


def _keys(q: np.ndarray, kv: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's first key position (its ``q`` new tokens the last of ``kv``, through
    ``window``; 0: all keys) and how many keys it reads from there."""
    first = np.maximum(0, kv - q - window + 1) if window else np.zeros_like(q)
    return first, kv - first


def _group(ids: np.ndarray, q_all: np.ndarray, kv_all: np.ndarray, start_all: np.ndarray, tables: np.ndarray,
           block_size: int, window: int) -> PrefillGroup:
    q, kv, start = q_all[ids], kv_all[ids], start_all[ids]
    first, nk = _keys(q, kv, window)
    lq, lk = int(q.max()), int(nk.max())
    j = np.minimum(np.arange(lq)[None, :], q[:, None] - 1)  # [P, Lq]: padded rows repeat the last query
    rows = start[:, None] + j
    qpos = (kv - q)[:, None] + j
    kpos = first[:, None] + np.minimum(np.arange(lk)[None, :], nk[:, None] - 1)  # [P, Lk]
    slots = tables[ids[:, None], kpos // block_size].astype(np.int64) * block_size + kpos % block_size
    causal = bool(np.all(q == kv) and np.all(q == lq)) and (not window or window >= lq)
    mask = None
    if not causal:
        m = (np.arange(lk)[None, None, :] < nk[:, None, None]) & (kpos[:, None, :] <= qpos[:, :, None])
        if window:
            m &= kpos[:, None, :] > qpos[:, :, None] - window
        mask = torch.from_numpy(m[:, None])
    real = np.arange(lq)[None, :] < q[:, None]
    src = np.flatnonzero(real)
    return PrefillGroup(torch.from_numpy(rows), torch.from_numpy(slots), mask, torch.from_numpy(src),
                        torch.from_numpy(rows.reshape(-1)[src]))
