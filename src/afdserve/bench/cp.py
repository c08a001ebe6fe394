"""Context-parallel prefill measured (``afdserve bench cp``; docs/long_context.md).

One prompt of N tokens, its time to first token (``max_tokens=1``), on two deployments of the same
shape (2 attention workers + ``expert_workers``): CP = 1 (the prompt on one attention worker,
chunked by the token budget) and CP = 2 (split over both, zigzag, the ring), in paired rounds
that alternate which goes first; the ratio per round and its median.

Beside it, the ideal ratio from the CP = 1 run's measured split of the work: with ``A`` the
attention worker's attention time of the prefill and ``E`` the expert workers' time (their traced
spans), CP = 2 at best halves the attention and leaves the rest: ``(A / 2 + E) / (A + E)``. Both
deployments are traced (the same cost on both).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from afdserve.bench.pd import with_context
from afdserve.engine.sampling_params import SamplingParams
from afdserve.kvcache.cp_split import zigzag
from afdserve.serving.llm import LLM

BLOCK = 16


@dataclass
class CPRound:
    cp1_s: float
    cp2_s: float

    @property
    def ratio(self) -> float:
        return self.cp2_s / self.cp1_s


@dataclass
class CPResult:
    tokens: int
    rounds: list[CPRound]
    attention_s: float  # the CP = 1 prefill's attention time (traced)
    expert_s: float  # ... its expert workers' time

    @property
    def ratio(self) -> float:
        return statistics.median(r.ratio for r in self.rounds)

    @property
    def ideal(self) -> float:
        a, e = self.attention_s, self.expert_s
        return (a / 2 + e) / (a + e)


def _config(tokens: int, expert_workers: int, cp: int, threads: int | None, trace: str | None) -> dict:
    shard = max(sum(b - a for a, b in pieces) for pieces in zigzag(tokens, 2, BLOCK))  # a rank's tokens
    return dict(attention_workers=2, expert_workers=expert_workers, max_model_len=tokens + 64,
                max_num_batched_tokens=max(2048, shard), block_size=BLOCK, num_kv_blocks=tokens // BLOCK + 64,
                enable_prefix_caching=False, num_threads=threads, context_parallel_size=cp,
                cp_min_tokens=min(tokens, 4096), trace=trace)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


def _split(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(attention s, expert s) of one traced prefill of ``prompt``."""
    llm.engine.traces()  # drops what came before
    _ttft(llm, prompt)
    spans = llm.engine.traces()
    att = sum(e["dur"] for n, evs in spans.items() if n.startswith("attention") for e in evs
              if e.get("name") == "attention") / 1e6
    exp = sum(e["dur"] for n, evs in spans.items() if n.startswith("expert") for e in evs
              if e.get("name") == "expert") / 1e6
    return att, exp


def measure(model: str | None, tokens: int, rounds: int, expert_workers: int = 1,
            threads: int | None = None) -> CPResult:
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp:
        path = with_context(model, tokens + 64, Path(tmp))
        prompts = [[rng.randrange(3, 250) for _ in range(tokens)] for _ in range(rounds + 1)]
        with LLM(path, **_config(tokens, expert_workers, 1, threads, str(Path(tmp) / "cp1.json"))) as one, \
                LLM(path, **_config(tokens, expert_workers, 2, threads, str(Path(tmp) / "cp2.json"))) as two:
            att, exp = _split(one, prompts[-1])  # also warms both up
            _ttft(two, prompts[-1])
            out = []
            for i in range(rounds):  # each round's prompt is new to both (no cache), the order alternates
                if i % 2 == 0:
                    a = _ttft(one, prompts[i])
                    b = _ttft(two, prompts[i])
                else:
                    b = _ttft(two, prompts[i])
                    a = _ttft(one, prompts[i])
                out.append(CPRound(a, b))
    return CPResult(tokens, out, att, exp)


def report(res: CPResult) -> str:
    lines = [f"context-parallel prefill of {res.tokens:,} tokens (2 attention workers; time to first token)",
             f"{'round':>5} {'CP=1 s':>8} {'CP=2 s':>8} {'ratio':>6}"]
    for i, r in enumerate(res.rounds):
        lines.append(f"{i:>5} {r.cp1_s:>8.2f} {r.cp2_s:>8.2f} {r.ratio:>6.3f}")
    lines.append(f"median ratio CP=2/CP=1: {res.ratio:.3f}; ideal from the CP=1 split "
                 f"(attention {res.attention_s:.2f} s, experts {res.expert_s:.2f} s): {res.ideal:.3f}")
    return "\n".join(lines)
