"""Disaggregated deployments give exactly the colocated engine's (and transformers') greedy tokens."""

import random

import pytest

from afdserve import LLM, SamplingParams
from tiny_models import hf_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

# (attention workers, expert workers, micro-batches, gate, expert split): every value of each
# dimension appears, with uneven splits
CONFIGS = [
    (1, 1, 1, "attention", None),
    (1, 2, 2, "attention", [1, 5]),
    (2, 3, 3, "expert", None),
    (2, 2, 1, "expert", [4, 2]),
    (1, 3, 2, "attention", [3, 2, 1]),
    (2, 1, 3, "attention", None),
]
# run on the torch backends too (scripts/test.sh): both gates, one and two attention workers
TORCH_BACKEND = {(1, 2, 2, "attention", (1, 5)), (2, 2, 1, "expert", (4, 2))}


def _prompts(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 9, 17, 30, 5)]


@pytest.fixture(scope="module")
def references(tiny_model):
    arch, path = tiny_model
    ps = _prompts()
    with LLM(str(path), num_kv_blocks=64) as llm:
        colocated = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert colocated == hf_greedy(path, ps, 16)
    return path, ps, colocated


@pytest.mark.parametrize("n_a,n_e,m,gate,split", [
    pytest.param(*c, marks=[pytest.mark.torch_backend] if (*c[:4], tuple(c[4] or ())) in TORCH_BACKEND else [],
                 id=f"a{c[0]}-e{c[1]}-m{c[2]}-{c[3]}" + ("-" + "_".join(map(str, c[4])) if c[4] else "")) for c in CONFIGS])
def test_disaggregated_matches_colocated(references, n_a, n_e, m, gate, split):
    path, ps, colocated = references
    with LLM(str(path), num_kv_blocks=64, attention_workers=n_a, expert_workers=n_e, micro_batches=m, gate=gate,
             expert_split=split, max_num_batched_tokens=24) as llm:  # small budget: chunked prefills too
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated


def test_micro_batches_changed_while_running(references):
    """One deployment switched between m = 1, 3, 2 between generations gives the same tokens;
    beyond what its links were sized for it refuses, naming the limit."""
    path, ps, colocated = references
    with LLM(str(path), num_kv_blocks=64, expert_workers=1, micro_batches=1) as llm:
        cluster = llm.engine
        for m in (3, 2, 1):
            cluster.set_micro_batches(m)
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == colocated
        with pytest.raises(ValueError, match=r"1\.\.3"):
            cluster.set_micro_batches(4)
        assert cluster.micro_batches == 1


def test_a_generate_batch_reaches_the_lanes_whole(tiny_mixtral, tmp_path):
    """``generate`` sends its prompts to the attention worker in one message, so its two lanes' first
    steps split the batch by the token budget (sent one by one, the first lane would start with the
    first few prompts and the second take the rest: a prefill with nothing to overlap)."""
    from afdserve.runtime.trace_plot import load

    trace = tmp_path / "trace.json"
    prompts = [{"prompt_token_ids": [3 + i % 200, 4, 5, 6]} for i in range(96)]
    with LLM(str(tiny_mixtral), num_kv_blocks=64, expert_workers=1, micro_batches=2, max_num_batched_tokens=128,
             trace=str(trace)) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    steps = sorted((s for s in load(str(trace))["attention0"] if s["name"] == "step"), key=lambda s: s["ts"])
    assert [s["args"]["tokens"] for s in steps[:2]] == [64, 64]


def test_a_batch_split_over_several_messages_gives_the_same_tokens(references, monkeypatch):
    """A batch larger than one AddRequests message holds goes in several; nothing changes."""
    from afdserve.runtime import messages

    monkeypatch.setattr(messages, "ADDS_PER_MESSAGE", 2)
    path, ps, colocated = references
    with LLM(str(path), num_kv_blocks=64, expert_workers=1, micro_batches=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == colocated


def test_waits_spin_long_only_where_each_worker_thread_has_a_core(monkeypatch):
    from types import SimpleNamespace

    from afdserve.config import EngineConfig
    from afdserve.runtime import links

    monkeypatch.setattr(links, "cpu_cores", lambda: 2)  # a 2-core machine
    spin = lambda **kw: links.spin_options(SimpleNamespace(config=EngineConfig(model="m", **kw)))  # noqa: E731
    assert spin(expert_workers=1) == {"spin_s": links.OWN_CORES_SPIN_S}  # 1 + 1, a thread each
    assert spin(expert_workers=1, num_threads=2) == {}  # 4 threads on 2 cores
    assert spin(expert_workers=2, attention_workers=2) == {}
    assert spin(expert_workers=1, cluster="ray") == {}  # workers on other machines: their cores unknown here
