"""Where a disaggregated decode step's time goes, from a deployment trace (``--trace``).

For every pure decode step of one attention worker (its ``step`` spans with ``tokens`` equal to the
batch), the attention worker's time is split into the layers' attention, the LM head, combines,
sends, waits on the experts and the rest of the step (scheduling, metadata, sampling, outputs: no
span), and the expert worker's into compute, sends and idle; the expert's idle time at the step
boundary (from its last expert span of the step to its first of the next) is reported apart.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass


@dataclass
class StepBreakdown:
    steps: int  # decode steps measured
    step_ms: float
    attention_layers_ms: float
    lm_head_ms: float
    combine_ms: float
    send_ms: float
    wait_ms: float
    engine_ms: float  # the attention worker's step time outside any span
    between_steps_ms: float  # from a step's end to the next one's start (control, outputs)
    expert_busy_ms: float
    expert_idle_ms: float
    expert_boundary_idle_ms: float  # of which at the step boundary

    def to_json(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def _clip(span: dict, start: float, end: float) -> float:
    return max(0.0, min(span["ts"] + span["dur"], end) - max(span["ts"], start))


def breakdown(spans: dict[str, list[dict]], attention: str, expert: str, tokens: int) -> StepBreakdown:
    """``spans``: ``trace_plot.load`` of a trace; the steps of worker ``attention`` with ``tokens``
    tokens, against expert worker ``expert`` (times in ms, medians over the steps)."""
    att = sorted(spans[attention], key=lambda s: s["ts"])
    exp = sorted((s for s in spans[expert] if s["name"] == "expert"), key=lambda s: s["ts"])
    exp_send = [s for s in spans[expert] if s["name"] == "send"]
    steps = [s for s in att if s["name"] == "step"]
    rows: list[dict[str, float]] = []
    for i, st in enumerate(steps[:-1]):
        if st.get("args", {}).get("tokens") != tokens:
            continue
        nxt = steps[i + 1]
        a, e = st["ts"], st["ts"] + st["dur"]
        inside = [s for s in att if s["name"] != "step" and a <= s["ts"] < e]

        def total(name: str, phase: str | None = None, match_phase: bool = True) -> float:
            return sum(s["dur"] for s in inside if s["name"] == name
                       and (not match_phase or s.get("args", {}).get("phase") == phase))

        mine = [s for s in exp if a <= s["ts"] < e]
        later = [s for s in exp if s["ts"] >= e]
        busy = sum(_clip(s, a, e) for s in exp)
        sent = sum(_clip(s, a, e) for s in exp_send)
        spans_ms = sum(s["dur"] for s in inside)
        rows.append({
            "step": st["dur"], "layers": total("attention"), "lm_head": total("attention", "lm_head"),
            "combine": total("attention", "combine") + total("attention", "dense_mlp"),
            "send": total("send", match_phase=False), "wait": total("wait", match_phase=False),
            "engine": st["dur"] - spans_ms, "between": nxt["ts"] - e, "busy": busy, "idle": st["dur"] - busy - sent,
            "boundary": (later[0]["ts"] - (mine[-1]["ts"] + mine[-1]["dur"])) if mine and later else 0.0,
        })
    if not rows:
        raise ValueError(f"no decode step of {tokens} tokens in the trace of {attention}")
    med = {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0]}
    return StepBreakdown(len(rows), med["step"], med["layers"], med["lm_head"], med["combine"], med["send"],
                         med["wait"], med["engine"], med["between"], med["busy"], med["idle"], med["boundary"])
