"""The decode-step breakdown of a trace (``runtime.trace_steps``) on a hand-made timeline."""

import pytest

from afdserve.runtime.trace_steps import breakdown


def _span(name, ts, dur, **args):
    return {"name": name, "ph": "X", "ts": ts * 1e3, "dur": dur * 1e3, "args": args}  # ms -> us


def test_breakdown_splits_a_step_and_finds_the_boundary_bubble():
    att, exp = [], []
    for k in range(3):  # three decode steps of 20 ms, 1 ms apart
        t = k * 21.0
        att += [_span("step", t, 20, tokens=8),
                _span("attention", t + 1, 2, layer=0), _span("send", t + 3, 0.5), _span("wait", t + 3.5, 3.5),
                _span("attention", t + 7, 0.5, phase="combine"), _span("attention", t + 8, 6, phase="lm_head")]
        exp += [_span("expert", t + 3.5, 3.5), _span("send", t + 7, 0.25)]
    att.append(_span("step", 63, 5, tokens=3))  # a prefill step: not counted
    b = breakdown({"attention0": att, "expert0": exp}, "attention0", "expert0", tokens=8)
    assert b.steps == 3  # every decode step followed by another step (the prefill one at the end too)
    assert b.step_ms == pytest.approx(20) and b.attention_layers_ms == pytest.approx(2)
    assert b.lm_head_ms == pytest.approx(6) and b.combine_ms == pytest.approx(0.5)
    assert b.send_ms == pytest.approx(0.5) and b.wait_ms == pytest.approx(3.5)
    assert b.engine_ms == pytest.approx(20 - 12.5) and b.between_steps_ms == pytest.approx(1)
    assert b.expert_busy_ms == pytest.approx(3.5) and b.expert_idle_ms == pytest.approx(20 - 3.75)
    assert b.expert_boundary_idle_ms == pytest.approx(17.5)  # from 7 ms to the next step's 24.5 ms


def test_no_matching_step_is_an_error():
    with pytest.raises(ValueError, match="no decode step"):
        breakdown({"a": [_span("step", 0, 1, tokens=2), _span("step", 2, 1, tokens=2)], "e": []}, "a", "e", 5)
