"""The decode breakdown of a trace (``runtime.trace_steps``) on a hand-made timeline of two lanes."""

import pytest

from afdserve.runtime.trace_steps import breakdown


def _span(name, ts, dur, **args):
    return {"name": name, "ph": "X", "ts": ts * 1e3, "dur": dur * 1e3, "args": args}  # ms -> us


def test_breakdown_over_the_decode_window_of_overlapping_lane_steps():
    att = [_span("step", 0, 30, tokens=64)]  # a prefill step (more tokens than the batch): not counted
    exp = []
    for k in range(4):  # lane steps of 4 tokens (batch 8, two lanes), 10 ms each, overlapping by 5 ms
        t = 30 + k * 5.0
        att += [_span("step", t, 10, tokens=4, lane=k % 2),
                _span("attention", t, 1, layer=0), _span("send", t + 1, 0.5),
                _span("attention", t + 2, 0.5, phase="combine"), _span("attention", t + 3, 1, phase="lm_head"),
                _span("engine", t + 4, 0.5, phase="finish")]
        exp += [_span("expert", t + 1.5, 2), _span("expert", t + 3, 0.5, phase="lm_head"), _span("send", t + 3.5, 0.25)]
    b = breakdown({"attention0": att, "expert0": exp}, "attention0", "expert0", batch=8)
    # window 30..55 ms = 25 ms for 16 tokens: 12.5 ms per batch step of 8; every span halves likewise
    assert b.steps == 4 and b.step_ms == pytest.approx(12.5)
    assert b.attention_layers_ms == pytest.approx(2) and b.lm_head_ms == pytest.approx(2)
    assert b.combine_ms == pytest.approx(1) and b.send_ms == pytest.approx(1) and b.engine_ms == pytest.approx(1)
    assert b.other_ms == pytest.approx(12.5 - 7)
    assert b.expert_busy_ms == pytest.approx(4) and b.expert_lm_head_ms == pytest.approx(1)
    assert b.expert_send_ms == pytest.approx(0.5) and b.expert_idle_ms == pytest.approx(12.5 - 5.5)


def test_no_decode_step_is_an_error():
    with pytest.raises(ValueError, match="no decode step"):
        breakdown({"a": [_span("step", 0, 1, tokens=20)], "e": []}, "a", "e", 5)
