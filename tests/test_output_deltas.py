"""Worker -> front end output deltas rebuild exactly the outputs the engine produced."""

from afdserve.engine.outputs import CompletionOutput, RequestOutput
from afdserve.runtime.deltas import DeltaDecoder, DeltaEncoder


def _out(rid, ids, text, finish=None, stop=None, error=None):
    return RequestOutput(rid, "p", [5, 6], [CompletionOutput(0, text, list(ids), finish, stop)],
                         finished=finish is not None, error=error)


def test_deltas_roundtrip_with_stop_string_cutting_sent_text():
    steps = [
        [_out("a", [1], "he"), _out("b", [7], "x")],
        [_out("a", [1, 2], "hel"), _out("b", [7, 8], "xy")],
        # a stop string "lo" straddled the previous text: the text shrinks below what was sent
        [_out("a", [1, 2, 3], "he", "stop", "lo"), _out("b", [7, 8, 9], "xyz")],
        [_out("b", [7, 8, 9, 4], "xyz!", "length")],
        [_out("c", [], "", "abort", error="boom")],  # failed before it ran
    ]
    enc, dec = DeltaEncoder(), DeltaDecoder()
    for rid in "abc":
        dec.add(rid, "p", [5, 6])
    for outs in steps:
        deltas = enc.encode(outs)
        assert sum(len(d[1]) for d in deltas) <= len(outs)  # at most one new token per request per step
        assert [dec.decode(d) for d in deltas] == outs
    assert not enc._sent and not dec._live  # finished requests leave no state
