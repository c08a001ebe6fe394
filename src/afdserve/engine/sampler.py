"""Turns the logits of a batch into next tokens: one batched pass for all rows, each row with its own
sampling params, with vLLM's definitions and order.

1. log-probabilities for the rows that ask for them, from the raw logits (vLLM's default);
2. the structured-output mask, then ``min_tokens`` (EOS and stop token ids masked), ``logit_bias``;
3. penalties: repetition (tokens of prompt or output: positive logits divided, negative multiplied),
   frequency (minus the count in the output times the penalty), presence (minus the penalty once);
4. greedy rows take the argmax; the others: temperature, ``min_p``, top-k, top-p, then one draw each
   (the exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)``: a row with a seed draws its noise
   from its own generator, so its tokens do not depend on the rest of the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afdserve.engine.outputs import TokenLogprobs
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.sequence import Sequence


@dataclass
class SamplingInputs:
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]] = field(default_factory=list)  # per row; needed for the repetition penalty
    output_ids: list[list[int]] = field(default_factory=list)  # per row; penalties and min_tokens
    eos_token_ids: set[int] = field(default_factory=set)  # masked with the stop token ids before min_tokens
    allowed: torch.Tensor | None = None  # [S, V] bool: the structured-output mask (all True: no constraint)


def sample(logits: torch.Tensor, inp: SamplingInputs) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [S, V] float32. Returns the next token of each row and, for the rows whose params
    ask for logprobs, their log-probabilities. What to do is read from the params on the host: the
    only reads from the device are the chosen tokens (and the logprobs asked for), one each."""
    params = inp.params
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw_lp = torch.log_softmax(logits[want], dim=-1) if want else None
    logits = _processed(logits, inp)
    tokens = argmax_rows(logits)
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if rand:
        tokens[rand] = _draw(logits[rand], [params[i] for i in rand], [inp.generators[i] for i in rand])
    out = tokens.tolist()
    lps: list[TokenLogprobs | None] = [None] * len(params)
    if raw_lp is not None:
        for i, lp in zip(want, rows_logprobs(raw_lp, tokens[want], [params[i].logprobs or 0 for i in want])):
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


def _processed(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """Steps 2 and 3 (on a copy, only when a row needs them): each a few tensor operations over the
    whole batch, the rows and tokens they touch gathered from the params on the host."""
    params, (num_rows, vocab) = inp.params, logits.shape
    out = logits
    dev = out.device
    if inp.allowed is not None:
        out = out.masked_fill(~inp.allowed.to(dev), float("-inf"))
    stop_rows, stop_ids, bias_rows, bias_ids, bias = [], [], [], [], []
    for i, p in enumerate(params):
        # a grammar decides when a constrained row may end (its mask then allows only EOS)
        if p.min_tokens and len(inp.output_ids[i]) < p.min_tokens and p.structured_outputs is None:
            stops = [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else inp.eos_token_ids) if t < vocab]
            stop_rows += [i] * len(stops)
            stop_ids += stops
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias += list(p.logit_bias.values())
    if stop_rows or bias_rows:
        out = out.clone() if out is logits else out
        idx = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        if stop_rows:
            out[idx(stop_rows), idx(stop_ids)] = float("-inf")
        if bias_rows:
            out.index_put_((idx(bias_rows), idx(bias_ids)), torch.tensor(bias, dtype=out.dtype, device=dev),
                           accumulate=True)
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(r != 1.0 for r in rep) or any(freq) or any(pres):
        counts = _counts(inp.output_ids, num_rows, vocab, dev)
        out = out.clone() if out is logits else out
        if any(r != 1.0 for r in rep):
            seen = (counts > 0) | _counts(inp.prompt_ids, num_rows, vocab, dev).bool()
            r = torch.tensor(rep, dtype=out.dtype, device=dev)[:, None].expand_as(out)
            penalized = torch.where(out > 0, out / r, out * r)
            out = torch.where(seen, penalized, out)
        out -= torch.tensor(freq, dtype=out.dtype, device=dev)[:, None] * counts
        out -= torch.tensor(pres, dtype=out.dtype, device=dev)[:, None] * (counts > 0)
    return out


def _counts(ids: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's ids."""
    counts = torch.zeros(rows, vocab, dtype=torch.float32)
    lens = [len(x) for x in ids]
    if sum(lens):
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(rows), torch.tensor(lens))
        counts.index_put_((row, flat), torch.ones(len(flat)), accumulate=True)
    return counts.to(device)


def _draw(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (none of them greedy); which filters run is read from
    the params, not from the device."""
    dev, vocab = logits.device, logits.shape[1]
    logits = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)[:, None]
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev)
        probs = torch.softmax(logits, dim=-1)
        cut = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < cut, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab or any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        pos = torch.arange(vocab, device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill(pos >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
        sorted_p = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p[:, None]  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, idx, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(gens) if g is not None]
    if len(seeded) < len(gens):
        noise.exponential_()
    if seeded:  # a request's generator lives on the CPU: its draws do not depend on the device or the batch
        host = noise if dev.type == "cpu" else torch.empty(len(seeded), vocab, dtype=noise.dtype)
        for j, i in enumerate(seeded):
            host[i if host is noise else j].exponential_(generator=gens[i])
        if host is not noise:
            noise[torch.tensor(seeded, device=dev)] = host.to(dev)
    return torch.argmax(probs / noise, dim=-1)
