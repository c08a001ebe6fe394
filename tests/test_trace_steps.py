"""The decode breakdown of a trace (``runtime.trace_steps``) on a hand-made timeline of two lanes."""

import pytest

from afdserve.runtime.trace_steps import breakdown, decode_windows, idle_beside


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
                _span("engine", t + 4, 0.5, phase="finish"), _span("wait", t + 4.5, 1)]
        exp += [_span("expert", t + 1.5, 2), _span("send", t + 3.5, 0.25)]
    b = breakdown({"attention0": att, "expert0": exp}, "attention0", "expert0", batch=8)
    # window 30..55 ms = 25 ms for 16 tokens: 12.5 ms per batch step of 8; every span halves likewise
    assert b.steps == 4 and b.step_ms == pytest.approx(12.5)
    assert b.attention_layers_ms == pytest.approx(2) and b.lm_head_ms == pytest.approx(2)
    assert b.combine_ms == pytest.approx(1) and b.send_ms == pytest.approx(1) and b.engine_ms == pytest.approx(1)
    assert b.wait_ms == pytest.approx(2) and b.other_ms == pytest.approx(12.5 - 7 - 2)
    assert b.expert_busy_ms == pytest.approx(4) and b.expert_send_ms == pytest.approx(0.5)
    assert b.expert_idle_ms == pytest.approx(12.5 - 4.5)


def test_no_decode_step_is_an_error():
    with pytest.raises(ValueError, match="no decode step"):
        breakdown({"a": [_span("step", 0, 1, tokens=20)], "e": []}, "a", "e", 5)


def test_a_decode_step_that_overlaps_another_lanes_prefill_is_left_out():
    """Lane 0 decodes while lane 1 still prefills: that stretch is neither decode time nor tokens."""
    att = [_span("step", 0, 20, tokens=64, lane=0), _span("step", 5, 40, tokens=64, lane=1),  # prefills
           _span("step", 20, 10, tokens=4, lane=0),  # overlaps lane 1's prefill (until 45): left out
           _span("step", 45, 10, tokens=4, lane=1), _span("step", 50, 10, tokens=4, lane=0),
           _span("attention", 25, 2, layer=0), _span("attention", 46, 2, layer=0), _span("attention", 51, 2, layer=0)]
    assert decode_windows({"a": att}, batch=8) == [(45e3, 60e3)]
    b = breakdown({"a": att, "e": []}, "a", "e", batch=8)
    # 15 ms for 8 tokens; only the two attention spans inside it
    assert b.steps == 2 and b.step_ms == pytest.approx(15) and b.attention_layers_ms == pytest.approx(4)
    assert b.expert_idle_ms == pytest.approx(15)


def test_who_waits_on_whom():
    """One decode step of 8 tokens over 0..10 ms. Attention: layer 0..2, send 2..3, finish 8..10;
    expert: idle span 0..3 (not work), MoE 3..7, send 7..7.5."""
    att = [_span("step", 0, 10, tokens=8), _span("attention", 0, 2, layer=0), _span("send", 2, 1),
           _span("engine", 8, 2, phase="finish")]
    exp = [_span("idle", 0, 3), _span("expert", 3, 4, layer=0), _span("send", 7, 0.5)]
    got = idle_beside({"attention0": att, "expert0": exp}, "attention0", "expert0", batch=8)
    # the attention worker waits 3..8: the expert computes 3..7, sends 7..7.5, and both idle 7.5..8
    assert got["attention0"] == pytest.approx({"moe": 4, "send": 0.5, "idle": 0.5})
    # the expert waits 0..3 and 7.5..10: the attention layer, its send, both idle 7.5..8, the finish
    assert got["expert0"] == pytest.approx({"layers": 2, "send": 1, "idle": 0.5, "engine finish": 2})


def test_a_traced_deployment_records_the_attention_workers_waits(tiny_mixtral, tmp_path):
    """A traced 1 + 1 run (m = 2): the attention worker's blocking waits for expert replies are
    recorded as 'wait' spans, inside its steps, and the breakdown reads them."""
    from afdserve import LLM, SamplingParams
    from afdserve.runtime.trace_plot import load

    path = tmp_path / "trace.json"
    with LLM(str(tiny_mixtral), num_kv_blocks=64, expert_workers=1, micro_batches=2, trace=str(path)) as llm:
        llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    spans = load(str(path))
    steps = [s for s in spans["attention0"] if s["name"] == "step"]
    lo, hi = min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)
    waits = [s for s in spans["attention0"] if s["name"] == "wait"]
    assert waits and all(s["dur"] >= 0 and lo <= s["ts"] <= hi for s in waits)
    assert breakdown(spans, "attention0", "expert0", batch=4).wait_ms >= 0  # how many fall in decode steps is timing
