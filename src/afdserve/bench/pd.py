"""Prefill/decode disaggregation measured (``afdserve bench pd``; docs/long_context.md).

* **Transfer tail**: one prompt of N tokens through 1 prefill + 1 decode attention worker: the
  decode worker's record of the transfer (``KVLanded``, one clock on one machine) gives the prefill's
  time (its first step's layer 0 to its last layer's end on the prefill worker) and the tail (its
  last layer's end there to every layer's KV held by the decode worker). The KV hides behind the
  prefill when the tail is a small share of the prefill (the issue's goal: <= 10%).
* **Decode gaps while long prompts arrive**: ``streams`` requests decode; once each has a token,
  ``long`` prompts of N tokens arrive; the gaps between the streams' tokens (output arrival time
  over tokens in the output) from then until every long prompt's first token, for 1 prefill + 1
  decode worker and for the single pool of 2 mixed attention workers. Two cores cannot isolate
  the pools physically: reported, not a goal.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from afdserve.engine.builder import resolve_model
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.llm import LLM

BLOCK = 16


@dataclass
class Transfer:
    tokens: int
    prefill_s: float
    tail_s: float

    @property
    def share(self) -> float:
        return self.tail_s / self.prefill_s


@dataclass
class Gaps:
    deployment: str
    gaps: int
    p50_ms: float
    p90_ms: float
    max_ms: float
    window_s: float


def with_context(model: str | None, tokens: int, root: Path) -> str:
    """The model (default: the demo model) with ``max_position_embeddings`` raised to ``tokens``
    where it is below (its RoPE extrapolates: rope_theta 1e6): a folder of links to its files with
    its config rewritten."""
    src = resolve_model(model)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= tokens:
        return str(src)
    dst = root / "long"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": tokens}))
    return str(dst)


def _prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]}


def _config(max_len: int, expert_workers: int, budget: int, threads: int | None) -> dict:
    return dict(expert_workers=expert_workers, max_model_len=max_len, max_num_batched_tokens=budget,
                block_size=BLOCK, num_kv_blocks=2 * (max_len // BLOCK) + 64, enable_prefix_caching=False,
                num_threads=threads)


def transfer_tail(model: str | None, lengths: list[int], rounds: int = 1, expert_workers: int = 1,
                  budget: int = 2048, threads: int | None = None, dtype: str = "float32") -> list[Transfer]:
    rng = random.Random(0)
    top = max(lengths) + 64
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = with_context(model, top, Path(tmp))
        with LLM(path, dtype=dtype, prefill_workers=1, decode_workers=1,
                 **_config(top, expert_workers, budget, threads)) as llm:
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            llm.generate([_prompt(rng, 64)], params)  # warm-up
            llm.engine.worker_stats()
            for n in lengths:
                for _ in range(rounds):
                    llm.generate([_prompt(rng, n)], params)
                    (rec,) = llm.engine.worker_stats()["attention1"].kv_landed
                    out.append(Transfer(n, (rec.last_layer_ns - rec.prefill_start_ns) / 1e9,
                                        (rec.landed_ns - rec.last_layer_ns) / 1e9))
    return out


def decode_gaps(model: str | None, long_tokens: int, n_long: int = 2, streams: int = 4, stream_tokens: int = 256,
                expert_workers: int = 1, budget: int = 2048, threads: int | None = None,
                dtype: str = "float32") -> list[Gaps]:
    out = []
    top = long_tokens + stream_tokens + 64
    with tempfile.TemporaryDirectory() as tmp:
        path = with_context(model, top, Path(tmp))
        for name, pools in (("single pool (2 mixed)", dict(attention_workers=2)),
                            ("P/D (1 prefill + 1 decode)", dict(prefill_workers=1, decode_workers=1))):
            rng = random.Random(1)
            with LLM(path, dtype=dtype, **pools, **_config(top, expert_workers, budget, threads)) as llm:
                out.append(_gaps(llm, name, rng, long_tokens, n_long, streams, stream_tokens))
    return out


def _gaps(llm: LLM, name: str, rng: random.Random, long_tokens: int, n_long: int, streams: int,
          stream_tokens: int) -> Gaps:
    eng = llm.engine
    decode = SamplingParams(max_tokens=stream_tokens, temperature=0, ignore_eos=True)
    ids = [eng.add_request(_prompt(rng, 16), decode) for _ in range(streams)]
    seen: dict[str, tuple[float, int]] = {}  # stream -> (time of its last output, tokens so far)
    gaps: list[float] = []
    longs: set[str] = set()
    start = end = 0.0
    deadline = time.monotonic() + 600
    while len(seen) < streams or longs or not start:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the benchmark did not finish within 600 s")
        for o in eng.get_outputs(timeout=0.5):
            if o.error:
                raise RuntimeError(f"{name}: {o.error}")
            t, n = time.perf_counter(), len(o.outputs[0].token_ids) if o.outputs else 0
            if o.request_id in longs and n:
                longs.discard(o.request_id)
                end = t if not longs else end
            elif o.request_id in ids and n:
                last = seen.get(o.request_id)
                if last is not None and start and not end and n > last[1]:
                    gaps += [(t - last[0]) / (n - last[1])] * (n - last[1])
                seen[o.request_id] = (t, n)
        if not start and len(seen) == streams:
            start = time.perf_counter()
            longs = {eng.add_request(_prompt(rng, long_tokens), SamplingParams(max_tokens=1, temperature=0))
                     for _ in range(n_long)}
    while eng.has_unfinished():
        eng.get_outputs(timeout=0.5)
    if not gaps:
        raise RuntimeError(f"{name}: no stream decoded while the long prompts prefilled (raise --stream-tokens)")
    q = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else [gaps[0]] * 9
    return Gaps(name, len(gaps), 1e3 * statistics.median(gaps), 1e3 * q[8], 1e3 * max(gaps), end - start)


def report(transfers: list[Transfer], gaps: list[Gaps]) -> str:
    lines = []
    if transfers:
        lines += ["| prompt tokens | prefill (s) | KV tail after the last layer (ms) | tail / prefill |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {t.tokens} | {t.prefill_s:.2f} | {1e3 * t.tail_s:.1f} | {100 * t.share:.3f}% |" for t in transfers]
    if gaps:
        lines += ["", "| deployment | gaps | p50 (ms) | p90 (ms) | max (ms) | window (s) |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {g.deployment} | {g.gaps} | {g.p50_ms:.1f} | {g.p90_ms:.1f} | {g.max_ms:.1f} | {g.window_s:.2f} |"
                  for g in gaps]
    return "\n".join(lines)
