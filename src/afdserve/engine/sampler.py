"""Turns the logits of a batch into next tokens: one batched pass for all rows, each row with its own
sampling params (its row of a ``SamplingState``, on the logits' device), with vLLM's definitions and
order.

1. log-probabilities for the rows that ask for them, from the raw logits (vLLM's default);
2. the structured-output mask, then ``min_tokens`` (EOS and stop token ids masked), ``logit_bias``;
3. penalties: repetition (tokens of prompt or output: positive logits divided, negative multiplied),
   frequency (minus the count in the output times the penalty), presence (minus the penalty once);
4. greedy rows take the argmax; the others: temperature, ``min_p``, top-k, top-p, then one draw each
   (the exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)``: a row with a seed draws its noise
   from its own generator, so its tokens do not depend on the rest of the batch).

Each step is a few tensor operations over the batch, run only when some row of the state uses it;
which rows are greedy, seeded, short of ``min_tokens`` or asking for logprobs comes from the state's
host mirrors. The only reads from the device are the chosen tokens (and the logprobs asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from afdserve.engine.outputs import TokenLogprobs
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.sampling_state import FREQUENCY, MIN_P, PRESENCE, REPETITION, TEMPERATURE, TOP_K, TOP_P, \
    SamplingState
from afdserve.engine.sequence import Sequence

_TINY = torch.finfo(torch.float32).tiny
Mask = Callable[[torch.Tensor], object]  # sets the logits [S, V] of the tokens not allowed to -inf, in place


@dataclass
class SamplingInputs:
    """A batch sampled once, without a state kept across steps (``sample``)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]] = field(default_factory=list)  # per row; needed for the repetition penalty
    output_ids: list[list[int]] = field(default_factory=list)  # per row; penalties and min_tokens
    eos_token_ids: set[int] = field(default_factory=set)  # masked with the stop token ids before min_tokens
    allowed: torch.Tensor | None = None  # [S, V] bool: the structured-output mask (all True: no constraint)


def sample(logits: torch.Tensor, inp: SamplingInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [S, V] float32. ``sample_rows`` over a state holding these rows only."""
    state = SamplingState(logits.shape[1], logits.device, inp.eos_token_ids)
    for i, p in enumerate(inp.params):
        state.add(i, p, inp.prompt_ids[i] if inp.prompt_ids else [], inp.output_ids[i] if inp.output_ids else [],
                  inp.generators[i])
    allowed = inp.allowed
    mask = None if allowed is None else lambda x: x.masked_fill_(~allowed.to(x.device), float("-inf"))
    return sample_rows(logits, state, state.index(range(len(inp.params))), mask)


def sample_rows(logits: torch.Tensor, state: SamplingState, idx: np.ndarray,
                mask: Mask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [S, V] float32, row i of the state's row ``idx[i]``; ``mask``: the structured-output
    mask. Returns the next token of each row and, for the rows whose params ask for logprobs, their
    log-probabilities; the state's rows advance by the chosen tokens."""
    dev, uses = logits.device, state.uses
    rows = _on(idx, dev)
    ks = state.logprobs[idx]
    want = np.flatnonzero(ks >= 0) if uses["logprobs"] else np.zeros(0, dtype=np.int64)
    raw_lp = torch.log_softmax(logits[_on(want, dev)], dim=-1) if len(want) else None
    logits = _processed(logits, state, idx, rows, mask)
    rand = np.flatnonzero(~state.greedy[idx]) if uses["sampled"] else np.zeros(0, dtype=np.int64)
    if len(rand) == len(idx):
        tokens = _draw(logits, state, idx, rows)
    else:
        tokens = argmax_rows(logits)
        if len(rand):
            r = _on(rand, dev)
            tokens[r] = _draw(logits[r], state, idx[rand], rows[r])
    state.advance(idx, rows, tokens)
    out = tokens.tolist()
    lps: list[TokenLogprobs | None] = [None] * len(idx)
    if raw_lp is not None:
        for i, lp in zip(want.tolist(), rows_logprobs(raw_lp, tokens[_on(want, dev)], ks[want].tolist())):
            lps[i] = lp
    return out, lps


def argmax_rows(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of a [S, V] tensor, the same indices (the first maximum, NaN
    counting as the maximum), faster on a CPU for a vocabulary-sized V (its ``argmax`` over the last
    dimension runs scalar code, ``amax`` is vectorized): the row's best chunk of ``chunk`` columns by
    ``amax``, then the argmax within it."""
    s, v = x.shape
    n = v // chunk
    if n < 2:
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


def plain_greedy(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is the argmax of its raw logits: greedy, with nothing that reads
    or changes the logits first (logprobs, a grammar, penalties, a bias, a ``min_tokens`` not reached)."""
    return seq.plain and len(seq.output_token_ids) >= seq.params.min_tokens


def rows_logprobs(lp: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """``lp``: [R, V] log-probabilities; each row's entry of its ``tokens[r]`` (int64 [R], on lp's
    device), its rank, and its top ``ks[r]``: a few batched operations, read back once each."""
    value = lp.gather(1, tokens[:, None])[:, 0]
    rank = (lp > value[:, None]).sum(dim=1) + 1
    top: dict[int, tuple[list, list]] = {}
    for k in set(ks) - {0}:  # one topk per distinct k, over the rows asking for it
        rows = [r for r, kr in enumerate(ks) if kr == k]
        t = torch.topk(lp[rows], k, dim=-1)
        for r, ids, vals in zip(rows, t.indices.tolist(), t.values.tolist()):
            top[r] = (ids, vals)
    return [TokenLogprobs(tok, v, rk, *top.get(r, ([], [])))
            for r, (tok, v, rk) in enumerate(zip(tokens.tolist(), value.tolist(), rank.tolist()))]


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device, non_blocking=True)


def _processed(logits: torch.Tensor, state: SamplingState, idx: np.ndarray, rows: torch.Tensor,
               mask: Mask | None) -> torch.Tensor:
    """Steps 2 and 3, on a copy, when some row of the state needs them."""
    uses = state.uses
    if mask is None and not (uses["min_tokens"] or uses["bias"] or uses["penalty"]):
        return logits
    out = logits.clone()
    if mask is not None:
        mask(out)
    dev = state.on_device()
    if uses["min_tokens"]:
        short = np.flatnonzero(state.num_output[idx] < state.min_tokens[idx])
        if len(short):
            r = _on(short, out.device)
            out[r[:, None], dev["stop_ids"][rows[r]]] = float("-inf")  # (padded with a row's own first stop id)
    if uses["bias"]:
        out.scatter_add_(1, dev["bias_ids"][rows], dev["bias"][rows])  # (padded with bias 0)
    if uses["penalty"]:
        counts, scalars = state.counts[rows], dev["scalars"][:, rows, None]
        present = counts > 0
        if uses["repetition"]:  # (as vLLM: the penalty is 1 where the token was not seen)
            r = torch.where(state.prompt_seen[rows].logical_or_(present), scalars[REPETITION], 1.0)
            out = torch.where(out > 0, out / r, out * r)
        out.addcmul_(counts, -scalars[FREQUENCY]).addcmul_(present, -scalars[PRESENCE])
    return out


def _draw(logits: torch.Tensor, state: SamplingState, idx: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (state rows ``idx``, none of them greedy)."""
    uses, vocab = state.uses, logits.shape[1]
    scalars = state.on_device()["scalars"][:, rows, None]
    logits = logits / scalars[TEMPERATURE]
    if uses["min_p"]:
        probs = torch.softmax(logits, dim=-1)
        cut = probs.amax(dim=-1, keepdim=True) * scalars[MIN_P]
        logits = logits.masked_fill(probs < cut, float("-inf"))
    if uses["top"]:
        top_p = scalars[TOP_P]
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        pos = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(pos >= scalars[TOP_K], float("-inf"))
        sorted_p = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix reaching top_p (all of it where top_p is 1, whatever the rounding)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p) & (top_p < 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    seeded = np.flatnonzero(state.seeded[idx]) if uses["seeded"] else []
    if len(seeded) < len(idx):  # Exp(1) as -log(U), U uniform in [tiny, 1): never 0 nor inf, and on a CPU
        noise.uniform_(_TINY, 1).log_().neg_()  # a few times faster than exponential_
    if len(seeded):  # a request's generator lives on the CPU: its draws do not depend on the device or the batch
        on_cpu = noise.device.type == "cpu"
        host = noise if on_cpu else torch.empty(len(seeded), vocab, dtype=noise.dtype)
        for j, i in enumerate(seeded.tolist()):
            host[i if on_cpu else j].exponential_(generator=state.generators[idx[i]])
        if not on_cpu:
            noise[_on(seeded, noise.device)] = host.to(noise.device, non_blocking=True)
    return torch.argmax(probs.div_(noise), dim=-1)
