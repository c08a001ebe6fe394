"""Where a disaggregated decode's time goes, from a deployment trace (``--trace``).

The attention worker runs its lanes' steps interleaved (``runtime/lanes.py``), so steps overlap;
the breakdown is over the decode window instead: from the start of its first decode step (a step
of at most ``batch`` tokens) to the end of its last, per worker, the time in each kind of span,
normalized to one step of the whole batch (``batch`` generated tokens). The attention worker's
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


def _within(spans: list[dict], a: float, b: float) -> list[dict]:
    return [s for s in spans if a <= s["ts"] < b]


def breakdown(spans: dict[str, list[dict]], attention: str, expert: str, batch: int) -> StepBreakdown:
    """``spans``: ``trace_plot.load`` of a trace; the decode steps (at most ``batch`` tokens) of
    worker ``attention`` against expert worker ``expert`` (times in ms per ``batch`` tokens)."""
    steps = [s for s in spans[attention] if s["name"] == "step" and 0 < s.get("args", {}).get("tokens", 0) <= batch]
    if not steps:
        raise ValueError(f"no decode step of at most {batch} tokens in the trace of {attention}")
    a = min(s["ts"] for s in steps)
    b = max(s["ts"] + s["dur"] for s in steps)
    tokens = sum(s["args"]["tokens"] for s in steps)
    per_step = batch / tokens / 1e3  # us in the window -> ms per batch step
    att = _within([s for s in spans[attention] if s["name"] != "step"], a, b)
    exp = _within(spans[expert], a, b)

    def total(src: list[dict], name: str, phase: str | None = None) -> float:
        return sum(s["dur"] for s in src if s["name"] == name and s.get("args", {}).get("phase") == phase)

    layers, lm, combine = total(att, "attention"), total(att, "attention", "lm_head"), total(att, "attention", "combine")
    send = sum(s["dur"] for s in att if s["name"] == "send")
    engine = sum(s["dur"] for s in att if s["name"] == "engine")
    e_moe, e_lm = total(exp, "expert"), total(exp, "expert", "lm_head")
    e_send = sum(s["dur"] for s in exp if s["name"] == "send")
    window = b - a
    att_spans = layers + lm + combine + total(att, "attention", "dense_mlp") + send + engine
    return StepBreakdown(len(steps), window * per_step, layers * per_step, lm * per_step, combine * per_step,
                         send * per_step, engine * per_step, max(0.0, window - att_spans) * per_step,
                         e_moe * per_step, e_lm * per_step, e_send * per_step,
                         max(0.0, window - e_moe - e_lm - e_send) * per_step)
