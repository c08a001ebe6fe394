"""n, logprobs, prompt logprobs, penalties and min_tokens through the Python API, colocated and
disaggregated, against transformers (float32)."""

import random

import pytest
import torch

from afdserve import LLM, SamplingParams

DEPLOYMENTS = {"colocated": {}, "disaggregated": dict(attention_workers=2, expert_workers=2, micro_batches=2)}


def _prompts(n=3, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 20))] for _ in range(n)]


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def llm(request, tiny_mixtral):
    with LLM(str(tiny_mixtral), num_kv_blocks=128, max_num_batched_tokens=24, **DEPLOYMENTS[request.param]) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf(tiny_mixtral):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.torch_backend
def test_logprobs_and_prompt_logprobs_equal_transformers(llm, hf):
    ps = _prompts()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    for p, out in zip(ps, llm.generate([{"prompt_token_ids": p} for p in ps], params)):
        c = out.outputs[0]
        ref = _hf_logprobs(hf, p + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 6
        for i, (tok, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + i]
            assert pos[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
            top = torch.topk(row, 5)
            assert {t for t, v in pos.items() if v.rank <= 5} == set(top.indices.tolist())
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert pos[t].logprob == pytest.approx(v, abs=1e-4)
        assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)))
        pl = out.prompt_logprobs
        assert pl[0] is None and len(pl) == len(p)
        for j in range(1, len(p)):
            assert pl[j][p[j]].logprob == pytest.approx(float(ref[j - 1][p[j]]), abs=1e-4)
            assert pl[j][p[j]].rank == int((ref[j - 1] > ref[j - 1][p[j]]).sum()) + 1


def test_n_sequences_with_a_seed_are_reproducible(llm):
    p = {"prompt_token_ids": _prompts(1, seed=4)[0]}
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    a = llm.generate(p, params)[0]
    b = llm.generate(p, params)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # different seeds per sequence
    # sequence i is the request with seed + i, as vLLM does
    one = llm.generate(p, SamplingParams(max_tokens=8, temperature=1.0, seed=12, ignore_eos=True))[0]
    assert one.outputs[0].token_ids == a.outputs[1].token_ids


def test_penalties_change_greedy_output_and_min_tokens_hold_eos_back(llm, tiny_mixtral):
    p = {"prompt_token_ids": _prompts(1, seed=7)[0]}
    base = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    rep = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                         frequency_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(rep)) >= len(set(base))
    first = base[0]
    # the first greedy token as a stop token: without min_tokens it ends at once, with it not before 5
    stopped = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first]))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(p, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first],
                                          min_tokens=5))[0].outputs[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:4]
    # a large logit bias forces a token
    forced = llm.generate(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                            logit_bias={42: 100.0}))[0].outputs[0].token_ids
    assert forced == [42] * 4
