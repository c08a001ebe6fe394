"""Turns the logits of a batch into next tokens, each row with its own sampling params."""

from __future__ import annotations

import torch

from afdserve.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [S, V] float32. Greedy rows take the argmax; others sample with temperature, top-k, top-p."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
