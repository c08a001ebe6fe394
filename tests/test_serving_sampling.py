"""The sampling features through the OpenAI API with the official client, against a disaggregated
server (1 attention + 1 expert worker, 2 micro-batches: `afdserve serve`'s default): n with a seed,
logprobs against transformers (float32), penalties and logit_bias, json_schema at temperature 1."""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
from openai import OpenAI

from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}


@pytest.fixture(scope="module")
def client(tiny_mixtral):
    cfg = EngineConfig(model=str(tiny_mixtral), num_kv_blocks=512, expert_workers=1, micro_batches=2)
    with BackgroundServer(build_app(cfg, ServerOptions(served_model_name=MODEL))) as url:
        yield OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_mixtral):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()


def _tokenize(client, text):
    return client.post("/../tokenize", body={"model": MODEL, "prompt": text}, cast_to=object)["tokens"]


def test_n_choices_with_a_seed_are_reproducible(client):
    kw = dict(model=MODEL, prompt="hello there", n=3, max_tokens=8, temperature=1.0, seed=123)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, temperature=1.0, seed=5)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


def test_logprobs_equal_transformers(client, hf):
    r = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0,
                                  logprobs=5, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                          "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    prompt_ids = _tokenize(client, "the quick brown fox")
    out_ids = choice.model_extra["token_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids + out_ids])).logits[0].float(), -1)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(out_ids) == 6
    for i, tok in enumerate(out_ids):
        row = ref[len(prompt_ids) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(float(row[tok]), abs=1e-4)
        assert lp.tokens[i] == f"token_id:{tok}"
        top = torch.topk(row, 5)
        got = lp.top_logprobs[i]  # the top 5 and the chosen token
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert got[f"token_id:{t}"] == pytest.approx(v, abs=1e-4)
    # the chat shape, streamed: the same numbers per token
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                            temperature=0, logprobs=True, top_logprobs=5, stream=True,
                                            extra_body={"ignore_eos": True})
    content = [t for ch in stream if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(content) == 5 and all(len(t.top_logprobs) == 5 for t in content)
    for t in content:  # greedy: the chosen token is the most likely one; alternatives by rank
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)


def test_penalties_and_logit_bias_reach_the_sampler(client):
    kw = dict(model=MODEL, prompt="one two three", max_tokens=8, temperature=0)
    forced = client.completions.create(**kw, logit_bias={"42": 100}, extra_body={"return_token_ids": True,
                                                                                 "ignore_eos": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 8
    base = client.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    pen = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=2.0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "repetition_penalty": 2.0})
    ids, pids = base.choices[0].model_extra["token_ids"], pen.choices[0].model_extra["token_ids"]
    assert len(set(pids)) >= len(set(ids))


def test_json_schema_outputs_validate_20_of_20(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def one(i):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"person {i}"}],
                                           max_tokens=480, temperature=1.0, seed=i, response_format=fmt)
        return r.choices[0]

    with ThreadPoolExecutor(20) as pool:  # one batch on the server
        choices = list(pool.map(one, range(20)))
    for c in choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
