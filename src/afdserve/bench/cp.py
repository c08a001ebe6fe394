"""Context-parallel prefill measured (``afdserve bench cp``; docs/long_context.md).

One prompt of N tokens, its time to first token (``max_tokens=1``), on two deployments of the same
shape (2 attention workers + ``expert_workers``): CP = 1 (the prompt on one attention worker,
chunked by the token budget) and CP = 2 (split over both, zigzag, the ring), in paired rounds
that alternate which goes first; the ratio per round and its median.

Beside it, the ideal ratio from the CP = 1 run's measured split of the work: with ``A`` the
attention worker's attention time of the prefill and ``E`` the expert workers' time (their traced
spans), CP = 2 at best halves the attention and leaves the rest: ``(A / 2 + E) / (A + E)``. Both
deployments are traced (the same cost on both).

With ``decode`` D > 0 each request generates D more tokens and a third deployment runs CP = 2 with
the prompt's KV kept sharded (``cp_kv="shard"``; the second gathers it, ``cp_kv="gather"``): each
round also gives the three decodes' time per output token (from the first token's arrival to the
last's, over D) and the sharded prefill's time to first token.
"""

from __future__ import annotations

import contextlib
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
    shard_s: float | None = None  # CP = 2, its KV kept sharded: time to first token
    tpot1_s: float | None = None  # time per output token after it: CP = 1
    tpot2_s: float | None = None  # CP = 2 gathered
    tpot_shard_s: float | None = None  # CP = 2 sharded

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


def _config(tokens: int, expert_workers: int, cp: int, threads: int | None, trace: str | None, decode: int = 0,
            cp_kv: str = "gather") -> dict:
    shard = max(sum(b - a for a, b in pieces) for pieces in zigzag(tokens, 2, BLOCK))  # a rank's tokens
    return dict(attention_workers=2, expert_workers=expert_workers, max_model_len=tokens + 64 + decode,
                max_num_batched_tokens=max(2048, shard), block_size=BLOCK,
                num_kv_blocks=(tokens + decode) // BLOCK + 64, enable_prefix_caching=False, num_threads=threads,
                context_parallel_size=cp, cp_min_tokens=min(tokens, 4096), cp_kv=cp_kv, trace=trace)


def _ttft(llm: LLM, prompt: list[int]) -> float:
    return _run(llm, prompt, 0)[0]


def _run(llm: LLM, prompt: list[int], decode: int) -> tuple[float, float | None]:
    """(time to first token, time per output token over ``decode`` tokens after it, or None)."""
    eng = llm.engine
    t0 = time.perf_counter()
    rid = eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1 + decode, temperature=0,
                                                                       ignore_eos=True))
    first = None
    while True:
        for o in eng.get_outputs(timeout=0.5):
            if o.request_id != rid:
                continue
            now = time.perf_counter()
            if first is None and o.outputs[0].token_ids:
                first = now
            if o.finished:
                if o.outputs[0].finish_reason != "length":
                    raise RuntimeError(f"bench cp: the request ended {o.outputs[0].finish_reason!r}")
                return first - t0, (now - first) / decode if decode else None


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
            threads: int | None = None, decode: int = 0) -> CPResult:
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = with_context(model, tokens + 64 + decode, Path(tmp))
        prompts = [[rng.randrange(3, 250) for _ in range(tokens)] for _ in range(rounds + 1)]
        runs = {"one": (1, "gather"), "two": (2, "gather")} | ({"shard": (2, "shard")} if decode else {})
        llms = {k: stack.enter_context(LLM(path, **_config(tokens, expert_workers, cp, threads,
                                                            str(Path(tmp) / f"{k}.json"), decode, kv)))
                for k, (cp, kv) in runs.items()}
        att, exp = _split(llms["one"], prompts[-1])  # also warms them up
        for k in runs:
            if k != "one":
                _ttft(llms[k], prompts[-1])
        out = []
        for i in range(rounds):  # each round's prompt is new to all (no cache), the order alternates
            got = {k: _run(llms[k], prompts[i], decode) for k in (runs if i % 2 == 0 else reversed(runs))}
            sh = got.get("shard", (None, None))
            out.append(CPRound(got["one"][0], got["two"][0], sh[0], got["one"][1], got["two"][1], sh[1]))
    return CPResult(tokens, out, att, exp)


def report(res: CPResult) -> str:
    lines = [f"context-parallel prefill of {res.tokens:,} tokens (2 attention workers; time to first token)",
             f"{'round':>5} {'CP=1 s':>8} {'CP=2 s':>8} {'ratio':>6}"]
    for i, r in enumerate(res.rounds):
        lines.append(f"{i:>5} {r.cp1_s:>8.2f} {r.cp2_s:>8.2f} {r.ratio:>6.3f}")
    lines.append(f"median ratio CP=2/CP=1: {res.ratio:.3f}; ideal from the CP=1 split "
                 f"(attention {res.attention_s:.2f} s, experts {res.expert_s:.2f} s): {res.ideal:.3f}")
    if res.rounds[0].tpot1_s is not None:
        lines += ["decode after it (time per output token, ms), and CP=2 with the KV kept sharded:",
                  f"{'round':>5} {'CP=1':>8} {'CP=2':>8} {'sharded':>8} {'sharded TTFT s':>15}"]
        for i, r in enumerate(res.rounds):
            lines.append(f"{i:>5} {r.tpot1_s * 1e3:>8.1f} {r.tpot2_s * 1e3:>8.1f} {r.tpot_shard_s * 1e3:>8.1f} "
                         f"{r.shard_s:>15.2f}")
        med = {k: statistics.median(getattr(r, k) for r in res.rounds) for k in ("tpot1_s", "tpot2_s", "tpot_shard_s")}
        lines.append(f"median sharded/gathered time per output token: {med['tpot_shard_s'] / med['tpot2_s']:.3f} "
                     f"(CP=1 {med['tpot1_s'] * 1e3:.1f} ms, CP=2 {med['tpot2_s'] * 1e3:.1f} ms, sharded "
                     f"{med['tpot_shard_s'] * 1e3:.1f} ms)")
    return "\n".join(lines)
