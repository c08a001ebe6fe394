"""Greedy decoding's argmax over the vocabulary, whole or in pieces: ``argmax_rows`` over logits
that exist, ``Best`` to merge the (value, index) of pieces computed anywhere (this process's LM
head, an expert worker's share of it) in any order, with ``torch.argmax``'s choice: the first
maximum, a NaN counting as the largest (the first NaN)."""

from __future__ import annotations

import torch


def argmax_rows(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of a [S, V] tensor, the same indices (the first maximum, NaN
    counting as the maximum), faster on CPU for a vocabulary-sized V: ``argmax`` over the last
    dimension runs scalar code there, ``amax`` is vectorized. The row's best chunk of ``chunk``
    columns is found by ``amax``, then the argmax within it."""
    s, v = x.shape
    n = v // chunk
    if n < 2 or x.device.type != "cpu":
        return torch.argmax(x, dim=-1)
    rows = torch.arange(s, device=x.device)
    head = x[:, : n * chunk].reshape(s, n, chunk)
    best = torch.argmax(head.amax(dim=-1), dim=-1)  # the first chunk holding the maximum (or a NaN)
    idx = best * chunk + torch.argmax(head[rows, best], dim=-1)
    if n * chunk < v:  # the columns after the last whole chunk win only with a larger value (or a NaN)
        tail_val, tail_idx = x[:, n * chunk :].max(dim=-1)
        head_val = x[rows, idx]
        later = (tail_val > head_val) | (tail_val.isnan() & ~head_val.isnan())
        idx = torch.where(later, tail_idx + n * chunk, idx)
    return idx


class Best:
    """The running (value, index) of each of ``rows`` rows over the pieces merged so far (updated
    in place: the LM head kernel merges its pieces straight into them)."""

    def __init__(self, rows: int, device: torch.device | str = "cpu"):
        self.val = torch.zeros(rows, dtype=torch.float32, device=device)
        self.idx = torch.full((rows,), -1, dtype=torch.int64, device=device)

    def merge(self, val: torch.Tensor, idx: torch.Tensor) -> None:
        """Takes a piece's (value, index) per row (index -1: none) where it is the better choice."""
        val, idx = val.to(self.val.device), idx.to(self.idx.device)
        vn, bn = val.isnan(), self.val.isnan()
        lower = idx < self.idx
        take = torch.where(vn | bn, vn & (~bn | lower), (val > self.val) | ((val == self.val) & lower))
        take = (idx >= 0) & (take | (self.idx < 0))
        self.val.copy_(torch.where(take, val, self.val))
        self.idx.copy_(torch.where(take, idx, self.idx))
