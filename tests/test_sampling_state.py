"""The persistent sampling state (rows kept across steps, counts advanced on the device) against the
from-scratch computation, and the packed structured-output mask against the bool mask. Preempted
sequences with penalties in a running engine: tests/test_scheduling.py."""

import random

import numpy as np
import pytest
import torch

from afdserve import SamplingParams
from afdserve.engine.sampler import SamplingInputs, sample, sample_rows
from afdserve.engine.sampling_state import SamplingState
from afdserve.engine.structured_output import TokenBitmask, XGrammars

EOS = 2


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    greedy = rng.random() < 0.4
    kw = dict(max_tokens=64, temperature=0 if greedy else rng.choice([0.5, 1.0, 1.5]), stop_token_ids=[3])
    if rng.random() < 0.6:
        kw.update(frequency_penalty=rng.uniform(-2, 2), presence_penalty=rng.uniform(-2, 2))
    if rng.random() < 0.5:
        kw.update(repetition_penalty=rng.uniform(0.5, 2))
    if rng.random() < 0.3:
        kw.update(logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(rng.randrange(1, 4))})
    if rng.random() < 0.3:
        kw.update(min_tokens=rng.randrange(1, 6))
    if rng.random() < 0.3:
        kw.update(logprobs=rng.randrange(0, 4))
    if not greedy:
        kw.update(seed=rng.randrange(1 << 30), top_k=rng.choice([-1, 5, 20]), top_p=rng.choice([1.0, 0.9]),
                  min_p=rng.choice([0.0, 0.05]))
    return SamplingParams(**kw)


class _Seq:
    def __init__(self, rng: random.Random, vocab: int):
        self.params = _params(rng, vocab)
        self.prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        self.output: list[int] = []
        seed = self.params.seed
        # the same noise on both sides: one generator each, advanced by the same draws
        self.gens = [None if seed is None else torch.Generator().manual_seed(seed) for _ in range(2)]


@pytest.mark.parametrize("vocab", [37, 300])
def test_rows_kept_across_steps_equal_the_from_scratch_computation(vocab):
    """Sequences join, leave and are preempted (leave, then join again with their tokens) over many
    steps; each step samples a part of the state's rows: tokens and logprobs equal those of a batch
    built from scratch from the sequences' token lists."""
    rng, g = random.Random(vocab), torch.Generator().manual_seed(vocab)
    state = SamplingState(vocab, "cpu", {EOS})
    live: list[_Seq] = []
    preempted: list[_Seq] = []
    for step in range(60):
        for _ in range(rng.randrange(0, 3)):
            live.append(_Seq(rng, vocab))
        if preempted and rng.random() < 0.5:
            live.append(preempted.pop(0))
        for s in [s for s in live if rng.random() < 0.08]:  # finished or preempted
            live.remove(s)
            state.remove(s)
            if rng.random() < 0.5:
                preempted.append(s)
        batch = [s for s in live if rng.random() < 0.8]  # (the others are in another step, say)
        if not batch:
            continue
        for s in batch:
            if s not in state:
                state.add(s, s.params, s.prompt, s.output, s.gens[0])
        logits = torch.randn(len(batch), vocab, generator=g) * 3
        got, got_lp = sample_rows(logits, state, state.index(batch))
        want, want_lp = sample(logits, SamplingInputs([s.params for s in batch], [s.gens[1] for s in batch],
                                                      [s.prompt for s in batch], [s.output for s in batch], {EOS}))
        assert got == want, step
        assert got_lp == want_lp, step
        for s, t in zip(batch, got):
            s.output.append(t)
    assert state.counts is not None and state.prompt_seen is not None
    for s in live:  # the counts advanced on the device are the histograms of the outputs
        if s in state and s.params.frequency_penalty:
            row = state.rows[s]
            assert torch.equal(state.counts[row], torch.bincount(torch.tensor(s.output, dtype=torch.int64),
                                                                 minlength=vocab).float())


def test_unseeded_draws_follow_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    tokens, _ = sample(torch.log(probs).expand(6000, 4), SamplingInputs([SamplingParams()] * 6000, [None] * 6000))
    freq = torch.bincount(torch.tensor(tokens), minlength=4) / 6000
    assert torch.allclose(freq, probs, atol=0.02)


def test_state_allocates_counts_only_for_penalties_and_frees_its_rows():
    state = SamplingState(50, "cpu")
    for i in range(20):
        state.add(i, SamplingParams(temperature=0.7, top_k=5, seed=i), [1, 2], [], torch.Generator().manual_seed(i))
    assert state.counts is None and state.prompt_seen is None  # nothing that needs them
    assert state.uses["top"] == state.uses["seeded"] == 20 and state.uses["penalty"] == 0
    state.add("p", SamplingParams(repetition_penalty=1.2), [4], [5, 5])
    assert state.counts.shape == (32, 50) and state.counts[state.rows["p"], 5] == 2
    assert state.prompt_seen[state.rows["p"]].nonzero().flatten().tolist() == [4]
    for key in [*range(20), "p"]:
        state.remove(key)
    assert len(state) == 0 and not +state.uses  # no feature used by any row
    state.add("q", SamplingParams(), [1], [])
    assert state.rows["q"] < 32  # a freed row, not a new one


def _bool_of(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask read one bit at a time (bit t % 32 of word t // 32)."""
    words = bits.numpy().astype(np.uint32)
    return torch.tensor([[bool((int(w[t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for w in words])


@pytest.mark.parametrize("grammar_vocab,logits_vocab", [(77, 77), (77, 100), (64, 64), (1000, 1003)])
def test_packed_mask_equals_the_bool_mask(grammar_vocab, logits_vocab):
    g = torch.Generator().manual_seed(grammar_vocab + logits_vocab)
    rows, words = 6, -(-grammar_vocab // 32)
    bits = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int64, generator=g).to(torch.int32)
    constrained = [0, 2, 3]
    allowed = torch.ones(rows, logits_vocab, dtype=torch.bool)
    allowed[constrained] = False
    allowed[constrained, :grammar_vocab] = _bool_of(bits, grammar_vocab)[constrained]
    logits = torch.randn(rows, logits_vocab, generator=g)
    packed = logits.clone()
    TokenBitmask(bits, constrained, grammar_vocab)(packed)
    assert torch.equal(packed, logits.masked_fill(~allowed, float("-inf")))
    # and through the sampler: the same tokens as with the bool mask
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0, seed=3)] * 3
    state = SamplingState(logits_vocab, "cpu")
    for i, p in enumerate(params):
        state.add(i, p, [], [], torch.Generator().manual_seed(i))
    got = sample_rows(logits, state, state.index(range(rows)), TokenBitmask(bits, constrained, grammar_vocab))
    want = sample(logits, SamplingInputs(params, [torch.Generator().manual_seed(i) for i in range(rows)],
                                         allowed=allowed))
    assert got == want


def test_packed_mask_with_a_tokenizer_smaller_than_the_model(tiny_mixtral):
    """The tokenizer has 259 tokens, the model 300 (not a multiple of 32): ids past the tokenizer's
    are never allowed; the packed mask applied equals its bits read one at a time."""
    from afdserve.engine.sampling_params import StructuredOutputsParams
    from afdserve.engine.sequence import Sequence

    grammars = XGrammars(tiny_mixtral, 300, {EOS})
    seqs = [Sequence(f"r{i}", [5], SamplingParams(structured_outputs=so)) for i, so in
            enumerate([None, StructuredOutputsParams(regex="[a-z]+"), StructuredOutputsParams(json_object=True)])]
    for s in seqs[1:]:
        grammars.add(s)
    mask = grammars.mask(seqs)
    assert mask.rows == [1, 2] and mask.bits.shape == (3, 10)
    logits = torch.randn(3, 300)
    masked = logits.clone()
    mask(masked)
    allowed = _bool_of(mask.bits, 300)
    allowed[0] = True
    assert torch.equal(masked, logits.masked_fill(~allowed, float("-inf")))
    assert not allowed[1:, 259:].any() and allowed[1].sum() > 20

