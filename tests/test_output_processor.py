"""The front end's output processing: token ids from the engine in, text, stop strings and
vLLM-shaped outputs out; a stop string finishes a request and asks the engine to abort it."""

import pytest

from afdserve.engine.outputs import TokenOutput
from afdserve.engine.output_processor import OutputProcessor
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.errors import RequestError
from tiny_models import write_tokenizer


def _processor(tmp_path):
    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    return OutputProcessor(tok), tok


def _ids(tok, text):
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_text_is_the_detokenized_ids_and_outputs_are_cumulative(tmp_path):
    proc, tok = _processor(tmp_path)
    ids = _ids(tok, "hello world, this is text")
    proc.add("a", "p", [1, 2], SamplingParams(max_tokens=64))
    text = ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs, stopped = proc.process([TokenOutput("a", [t], "length" if last else None)])
        assert stopped == [] and len(outs) == 1
        o = outs[0]
        assert o.outputs[0].token_ids == ids[: i + 1] and o.prompt_token_ids == [1, 2] and o.prompt == "p"
        assert o.outputs[0].text.startswith(text)
        text = o.outputs[0].text
    assert text == tok.tokenizer.decode(ids) and o.finished and o.outputs[0].finish_reason == "length"
    assert not proc.live


def test_stop_string_cuts_the_text_finishes_and_asks_for_an_abort(tmp_path):
    proc, tok = _processor(tmp_path)
    ids = _ids(tok, "one two three four")
    proc.add("a", None, [1], SamplingParams(max_tokens=64, stop=["three", "zzz"]))
    # several steps' tokens arrive at once (a cluster), the stop string straddles token boundaries
    outs, stopped = proc.process([TokenOutput("a", [t]) for t in ids])
    assert stopped == ["a"]
    (o,) = outs
    c = o.outputs[0]
    assert o.finished and c.finish_reason == "stop" and c.stop_reason == "three"
    assert c.text == "one two " and "three" not in c.text
    assert tok.tokenizer.decode(c.token_ids).startswith("one two three")
    assert len(c.token_ids) < len(ids)  # tokens after the stop are dropped
    # tokens the engine produced before the abort reached it are ignored
    assert proc.process([TokenOutput("a", [ids[-1]], "length")]) == ([], [])


def test_no_abort_when_the_engine_finished_on_the_same_token(tmp_path):
    proc, tok = _processor(tmp_path)
    ids = _ids(tok, "ab cd")
    proc.add("a", None, [1], SamplingParams(max_tokens=len(ids), stop=["cd"]))
    outs, stopped = proc.process([TokenOutput("a", ids, "length")])
    assert stopped == [] and outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].text == "ab "


def test_a_stop_token_wins_over_a_stop_string_in_its_text(tmp_path):
    proc, tok = _processor(tmp_path)
    ids = _ids(tok, "xy")
    proc.add("a", None, [1], SamplingParams(max_tokens=8, stop=["y"], stop_token_ids=[ids[-1]]))
    outs, stopped = proc.process([TokenOutput("a", ids, "stop", stop_reason=ids[-1])])
    c = outs[0].outputs[0]
    assert stopped == [] and c.finish_reason == "stop" and c.stop_reason == ids[-1] and c.token_ids == ids


def test_errors_and_dropped_requests(tmp_path):
    proc, _ = _processor(tmp_path)
    proc.add("a", None, [1], SamplingParams())
    proc.add("b", None, [1], SamplingParams())
    proc.drop("b")
    outs, stopped = proc.process([TokenOutput("a", [], "abort", error="boom"), TokenOutput("b", [5])])
    assert stopped == [] and [o.request_id for o in outs] == ["a"]
    assert outs[0].error == "boom" and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not proc.live


def test_final_only_gives_one_output_the_cumulative_ones_last(tmp_path):
    """``output_kind="final_only"`` (what ``LLM.generate`` asks for): nothing per step, then the
    same output that ``cumulative`` gives last; a stop string and an error still come out."""
    proc, tok = _processor(tmp_path)
    ids = _ids(tok, "hello world, this is text")
    proc.add("c", "p", [1, 2], SamplingParams(max_tokens=64))
    proc.add("f", "p", [1, 2], SamplingParams(max_tokens=64, output_kind="final_only"))
    got = {"c": [], "f": []}
    for i, t in enumerate(ids):
        fin = "length" if i == len(ids) - 1 else None
        outs, _ = proc.process([TokenOutput("c", [t], fin), TokenOutput("f", [t], fin)])
        for o in outs:
            got[o.request_id].append(o)
    assert len(got["c"]) == len(ids) and len(got["f"]) == 1
    c, f = got["c"][-1], got["f"][0]
    assert f.finished and f.outputs == c.outputs and f.outputs[0].text == tok.tokenizer.decode(ids)
    proc.add("s", None, [1], SamplingParams(max_tokens=64, stop=["three"], output_kind="final_only"))
    outs, stopped = proc.process([TokenOutput("s", [t]) for t in _ids(tok, "one two three four")])
    assert stopped == ["s"] and len(outs) == 1 and outs[0].outputs[0].text == "one two "
    proc.add("e", None, [1], SamplingParams(output_kind="final_only"))
    (o,), _ = proc.process([TokenOutput("e", [5], error="worker failure: boom")])
    assert o.error == "worker failure: boom"


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(RequestError, match="output_kind"):
        SamplingParams(output_kind="delta")
