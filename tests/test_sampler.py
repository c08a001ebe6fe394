import torch

from afdserve.engine.sampler import sample
from afdserve.engine.sampling_params import SamplingParams


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    seen_k, seen_p = set(), set()
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        a, b = sample(logits, [SamplingParams(top_k=2), SamplingParams(top_p=0.8)], [g, g])
        seen_k.add(a)
        seen_p.add(b)
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.8


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)], [None, None]) == [1, 0]
