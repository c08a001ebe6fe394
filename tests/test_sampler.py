"""The batched sampler against reference implementations of vLLM's definitions, row by row."""

import math

import pytest
import torch

from afdserve.engine.sampler import SamplingInputs, argmax_rows, sample
from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import RequestError


def _sample(logits, params, gens=None, prompts=None, outputs=None, eos=(), allowed=None):
    n = len(params)
    return sample(logits, SamplingInputs(params, gens or [None] * n, prompts or [[] for _ in range(n)],
                                         outputs or [[] for _ in range(n)], set(eos), allowed))


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    seen_k, seen_p = set(), set()
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for _ in range(300):
        (a, b), _ = _sample(logits, [SamplingParams(top_k=2), SamplingParams(top_p=0.8)], [g1, g2])
        seen_k.add(a)
        seen_p.add(b)
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.8


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        (t,), _ = _sample(torch.log(probs)[None], [SamplingParams(temperature=1.0)], [g])
        counts[t] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {_sample(logits, [SamplingParams(min_p=0.5)], [g])[0][0] for _ in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert _sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)])[0] == [1, 0]


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=5)
    alone = [_sample(logits[i:i + 1], [p], [torch.Generator().manual_seed(5)])[0][0] for i in range(4)]
    together = _sample(logits, [p] * 4, [torch.Generator().manual_seed(5) for _ in range(4)])[0]
    assert together == alone


def _vllm_reference(logits, p, prompt, output, eos):
    """vLLM's definitions, one row at a time and literally."""
    row = logits.clone()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            row[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in range(row.shape[0]):
        if t in prompt or t in output:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        count = output.count(t)
        row[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return int(torch.argmax(row))


@pytest.mark.parametrize("seed", range(20))
def test_penalties_bias_and_min_tokens_match_vllm_definitions(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, rows = 12, 5
    logits = torch.randn(rows, vocab, generator=g) * 2
    params, prompts, outputs = [], [], []
    for _ in range(rows):
        r = torch.rand(6, generator=g).tolist()
        params.append(SamplingParams(
            temperature=0, max_tokens=8, min_tokens=int(r[0] * 4), presence_penalty=(r[1] - 0.5) * 4,
            frequency_penalty=(r[2] - 0.5) * 4, repetition_penalty=0.5 + r[3] * 1.5,
            logit_bias={int(r[4] * vocab): (r[5] - 0.5) * 20}, stop_token_ids=[3]))
        prompts.append(torch.randint(0, vocab, (4,), generator=g).tolist())
        outputs.append(torch.randint(0, vocab, (int(r[0] * 6),), generator=g).tolist())
    got, _ = _sample(logits, params, prompts=prompts, outputs=outputs, eos=[1])
    want = [_vllm_reference(logits[i], params[i], prompts[i], outputs[i], [1]) for i in range(rows)]
    assert got == want


def test_allowed_mask_and_logprobs_of_the_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    allowed = torch.tensor([[True, True, False, True]])
    (tok,), (lp,) = _sample(logits, [SamplingParams(temperature=0, logprobs=2)], allowed=allowed)
    raw = torch.log_softmax(logits[0], -1)
    assert tok == 1  # token 2 is masked
    assert lp.token_id == 1 and lp.logprob == pytest.approx(float(raw[1])) and lp.rank == 2
    assert lp.top_ids == [2, 1] and lp.top_logprobs == pytest.approx(raw[[2, 1]].tolist())


def test_bad_sampling_params_are_refused():
    for kw in ({"min_p": 1.5}, {"presence_penalty": 3}, {"repetition_penalty": 0}, {"logprobs": 21},
               {"min_tokens": 20, "max_tokens": 10}, {"n": 0}, {"logit_bias": {-1: 1.0}},
               {"logit_bias": {1: float("nan")}}, {"stop_token_ids": [-2]}):
        with pytest.raises(RequestError):
            SamplingParams(**kw)
    assert SamplingParams(logit_bias={3: 500}).logit_bias == {3: 100.0}


@pytest.mark.parametrize("vocab", [7, 512, 1000, 32000])
def test_argmax_rows_is_torch_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1, :] = 0.5  # all tied: the first column
    x[2, vocab // 3] = x[2, vocab - 1] = 1e9  # tie between a chunk and the tail
    x[3, vocab - 1] = 1e9  # the tail wins
    x[4, 5] = float("nan")  # NaN counts as the maximum
    x[5, vocab - 1] = float("nan")
    x[6, :] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        assert torch.equal(argmax_rows(y), torch.argmax(y, dim=-1))


def test_plain_greedy_is_only_a_bare_argmax():
    from afdserve.engine.sampler import plain_greedy
    from afdserve.engine.sequence import Sequence

    def seq(out=(), **kw):
        return Sequence("r", [1, 2], SamplingParams(max_tokens=8, **kw), output_token_ids=list(out))

    assert plain_greedy(seq(temperature=0)) and plain_greedy(seq(top_k=1))
    assert plain_greedy(seq(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[4], out=[7, 8]))
    for kw in ({}, {"temperature": 0, "logprobs": 0}, {"temperature": 0, "logit_bias": {3: 1.0}},
               {"temperature": 0, "repetition_penalty": 1.1}, {"temperature": 0, "frequency_penalty": 0.5},
               {"temperature": 0, "presence_penalty": 0.5}, {"temperature": 0, "min_tokens": 2}):
        assert not plain_greedy(seq(**kw)), kw
