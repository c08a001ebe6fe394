"""Where a disaggregated decode's time goes, from a deployment trace (``--trace``).

The attention worker runs its lanes' steps interleaved (``runtime/lanes.py``), so steps overlap;
the breakdown is over the decode windows instead (``decode_windows``: the stretches covered by its
decode steps, steps of at most ``batch`` tokens, leaving out any that overlaps a prefill of another
lane), per worker, the time in each kind of span, normalized to one step of the whole batch
(``batch`` generated tokens). The attention worker's
time blocked on expert replies (its ``wait`` spans) is ``wait``, the rest outside any span (the
lanes' bookkeeping and Python between spans, and whatever preempted it) ``other``; the expert
worker's outside its compute and sends is ``idle``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass


@dataclass
class StepBreakdown:
    steps: int  # decode steps of the lanes in the window
    step_ms: float  # the window per ``batch`` generated tokens
    attention_layers_ms: float
    lm_head_ms: float
    combine_ms: float
    send_ms: float
    engine_ms: float  # scheduling, sampling, outputs (the engine spans)
    wait_ms: float  # the attention worker blocked on expert replies (its wait spans)
    other_ms: float  # the attention worker outside any span, not waiting: lane switches, Python between spans
    expert_busy_ms: float  # MoE layers
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
    wait = sum(s["dur"] for s in att if s["name"] == "wait")
    e_moe = total(exp, "expert")
    e_send = sum(s["dur"] for s in exp if s["name"] == "send")
    window = sum(b - a for a, b in windows)
    att_spans = layers + lm + combine + total(att, "attention", "dense_mlp") + send + engine
    return StepBreakdown(len(steps), window * per_step, layers * per_step, lm * per_step, combine * per_step,
                         send * per_step, engine * per_step, wait * per_step,
                         max(0.0, window - att_spans - wait) * per_step,
                         e_moe * per_step, e_send * per_step, max(0.0, window - e_moe - e_send) * per_step)


def _kind(span: dict) -> str:
    """A span's kind for ``idle_beside``: its name, with the phase or engine part where it has one."""
    a = span.get("args", {})
    if span["name"] == "engine":
        return f"engine {a.get('phase', '')}".strip()
    if span["name"] in ("attention", "expert"):
        return {"attention": "layers", "expert": "moe"}[span["name"]] if "phase" not in a else a["phase"]
    return span["name"]


class _Spans:
    """Spans sorted by start, with the running maximum of their ends, so that the spans that overlap
    a stretch are found by bisection instead of a pass over all of them."""

    def __init__(self, spans: list[dict]):
        self.spans = sorted(spans, key=lambda s: s["ts"])
        self.reach = list(itertools.accumulate((s["ts"] + s["dur"] for s in self.spans), max))

    def overlapping(self, lo: float, hi: float) -> Iterator[tuple[dict, float, float]]:
        """(span, start, end) of each span that overlaps ``[lo, hi)``, clipped to it."""
        for k in range(bisect.bisect_right(self.reach, lo), len(self.spans)):
            s = self.spans[k]
            if s["ts"] >= hi:
                return
            a, b = max(s["ts"], lo), min(s["ts"] + s["dur"], hi)
            if b > a:
                yield s, a, b


def _gaps(busy: _Spans, windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The stretches of ``windows`` that no span of ``busy`` covers."""
    out = []
    for lo, hi in windows:
        t = lo
        for _, a, b in busy.overlapping(lo, hi):
            if a > t:
                out.append((t, a))
            t = max(t, b)
        if hi > t:
            out.append((t, hi))
    return out


def idle_beside(spans: dict[str, list[dict]], attention: str, expert: str, batch: int) -> dict[str, dict[str, float]]:
    """Who waits on whom in the decode windows of ``breakdown``: for each of the two workers, its
    time outside any compute, send or engine span (blocked or not), split by what the other worker
    did meanwhile (its span kinds; ``idle`` where it was idle too), in ms per ``batch`` tokens."""
    mine = {attention: spans[attention]}
    steps, windows = decode_steps(mine, batch), decode_windows(mine, batch)
    if not steps:
        raise ValueError(f"no decode step of at most {batch} tokens in the trace of {attention}")
    per_step = batch / sum(s["args"]["tokens"] for s in steps) / 1e3
    busy = {w: _Spans([s for s in spans[w] if s["name"] not in ("step", "idle", "wait")])
            for w in (attention, expert)}
    out = {}
    for me, other in ((attention, expert), (expert, attention)):
        split: dict[str, float] = {}
        for lo, hi in _gaps(busy[me], windows):
            covered = 0.0
            for s, a, b in busy[other].overlapping(lo, hi):
                split[_kind(s)] = split.get(_kind(s), 0.0) + (b - a)
                covered += b - a
            split["idle"] = split.get("idle", 0.0) + max(0.0, hi - lo - covered)
        out[me] = {k: round(v * per_step, 3) for k, v in sorted(split.items(), key=lambda kv: -kv[1])}
    return out
