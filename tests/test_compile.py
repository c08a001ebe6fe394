"""The ``compile`` switch: the decode step's attention half through torch.compile."""

import warnings

import pytest
import torch

from afdserve import LLM, SamplingParams
from tiny_models import hf_greedy

PROMPTS = [[5, 17, 99], [7] * 9, list(range(3, 20)), [42, 43] * 15]
# different lengths: sequences finish at different steps, so decode batches of 4, 3, 2 and 1
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 6, 12, 18)]


def generate(path, **kwargs) -> list[list[int]]:
    with LLM(str(path), num_kv_blocks=64, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.torch_backend
def test_compiled_decode_matches_transformers_without_recompiling(tiny_model):
    """float32 greedy tokens as transformers'; one compilation serves every batch size but 1
    (which dynamo specializes) and every layer; no graph breaks."""
    from torch._dynamo.utils import counters

    _, path = tiny_model
    ref = [r[:p.max_tokens] for r, p in zip(hf_greedy(path, PROMPTS, 24), PARAMS)]
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compilation warns and runs eager
        assert generate(path, compile=True) == ref
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_failed_compile_warns_and_runs_eager(tiny_mixtral, monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    ref = generate(tiny_mixtral)
    with pytest.warns(RuntimeWarning, match="running eager: RuntimeError: no compiler here"):
        assert generate(tiny_mixtral, compile=True) == ref


def test_compiled_decode_in_the_disaggregated_deployment(tiny_mixtral):
    """The attention worker compiles its micro-batches' decode steps: float32 greedy tokens as
    transformers'."""
    ref = [r[:p.max_tokens] for r, p in zip(hf_greedy(tiny_mixtral, PROMPTS, 24), PARAMS)]
    assert generate(tiny_mixtral, compile=True, expert_workers=1, micro_batches=2) == ref
