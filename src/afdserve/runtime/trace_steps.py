"""Where a disaggregated decode's time goes, from a deployment trace (``--trace``).

The attention worker runs its lanes' steps interleaved (``runtime/lanes.py``), so steps overlap;
the breakdown is over the decode windows instead (``decode_windows``: the stretches covered by its
decode steps, steps of at most ``batch`` tokens, leaving out any that overlaps a prefill of another
lane), per worker, the time in each kind of span, normalized to one step of the whole batch
(``batch`` generated tokens). The attention worker's
time outside any span (waiting for replies, the lanes' bookkeeping) is ``other``; the expert
worker's outside its compute and sends is ``idle``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepBreakdown:
    steps: int  # decode steps of the lanes in the window
    step_ms: float  # the window per ``batch`` generated tokens
    attention_layers_ms: float
    lm_head_ms: float  # the attention worker's part of the LM head
    combine_ms: float
    send_ms: float
    engine_ms: float  # scheduling, sampling, outputs (the engine spans)
    other_ms: float  # the attention worker outside any span: waiting for replies, lane switches
    expert_busy_ms: float  # MoE layers
    expert_lm_head_ms: float  # the expert worker's share of the LM head
    expert_send_ms: float
    expert_idle_ms: float

    def to_json(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def decode_steps(spans: dict[str, list[dict]], batch: int, m: int | None = None) -> list[dict]:
    """The decode steps in ``spans`` (``trace_plot.load`` of a trace): steps of at most ``batch``
    tokens, run with ``m`` micro-batches if given, and none that a larger step (a prefill, which
    another lane can run meanwhile) overlaps."""
    steps = [e for evs in spans.values() for e in evs if e["name"] == "step" and (m is None or e["args"].get("m") == m)]
    prefill = [(e["ts"], e["ts"] + e["dur"]) for e in steps if e["args"].get("tokens", 0) > batch]
    return [e for e in steps if 0 < e["args"].get("tokens", 0) <= batch
            and not any(lo < e["ts"] + e["dur"] and e["ts"] < hi for lo, hi in prefill)]


def decode_windows(spans: dict[str, list[dict]], batch: int, m: int | None = None) -> list[tuple[float, float]]:
    """The stretches covered by ``decode_steps`` (overlapping lanes' steps merged), in trace time."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted((e["ts"], e["ts"] + e["dur"]) for e in decode_steps(spans, batch, m)):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def within(spans: list[dict], windows: list[tuple[float, float]]) -> list[dict]:
    """The spans of ``spans`` that start inside one of ``windows``."""
    return [s for s in spans if any(a <= s["ts"] < b for a, b in windows)]


def breakdown(spans: dict[str, list[dict]], attention: str, expert: str, batch: int) -> StepBreakdown:
    """``spans``: ``trace_plot.load`` of a trace; the decode steps (at most ``batch`` tokens) of
    worker ``attention`` against expert worker ``expert`` (times in ms per ``batch`` tokens)."""
    mine = {attention: spans[attention]}
    steps = decode_steps(mine, batch)
    if not steps:
        raise ValueError(f"no decode step of at most {batch} tokens in the trace of {attention}")
    windows = decode_windows(mine, batch)
    tokens = sum(s["args"]["tokens"] for s in steps)
    per_step = batch / tokens / 1e3  # us in the windows -> ms per batch step
    att = within([s for s in spans[attention] if s["name"] != "step"], windows)
    exp = within(spans[expert], windows)

    def total(src: list[dict], name: str, phase: str | None = None) -> float:
        return sum(s["dur"] for s in src if s["name"] == name and s.get("args", {}).get("phase") == phase)

    layers, lm, combine = total(att, "attention"), total(att, "attention", "lm_head"), total(att, "attention", "combine")
    send = sum(s["dur"] for s in att if s["name"] == "send")
    engine = sum(s["dur"] for s in att if s["name"] == "engine")
    e_moe, e_lm = total(exp, "expert"), total(exp, "expert", "lm_head")
    e_send = sum(s["dur"] for s in exp if s["name"] == "send")
    window = sum(b - a for a, b in windows)
    att_spans = layers + lm + combine + total(att, "attention", "dense_mlp") + send + engine
    return StepBreakdown(len(steps), window * per_step, layers * per_step, lm * per_step, combine * per_step,
                         send * per_step, engine * per_step, max(0.0, window - att_spans) * per_step,
                         e_moe * per_step, e_lm * per_step, e_send * per_step,
                         max(0.0, window - e_moe - e_lm - e_send) * per_step)
