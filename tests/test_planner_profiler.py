"""``afdserve profile`` on a tiny checkpoint: every measurement runs the real code (attention and
expert parts, PipelinedRunner, Engine, the M2N library between two processes) on a tiny grid."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import afdserve.profiling.corun as corun
from afdserve.cli.profile import main
from afdserve.planner import load_model_spec, load_profile, predict_local, profile_summary
from afdserve.profiling import CacheFlusher, ProfileGrid, measure_attention, measure_corun, run_profile

from tiny_models import make_checkpoint

TINY_GRID = ProfileGrid(batches=(1, 4), seq_lens=(8, 48), pairs_per_expert=(1, 4), experts_per_node=(3, 6),
                        msg_tokens=(1, 16), step_batches=(1, 4), dispatch_workers=(1, 2), repeats=2,
                        passes=1, transport_repeats=3, corun=False)


CORES = len(os.sched_getaffinity(0))  # the cores this process may run on (asked of the OS, not of afdserve)


def _solves_nnls(columns: list[list[float]], y: list[float], coef: list[float]) -> bool:
    """Whether ``coef`` minimises the relative squared error ``sum(((A c - y) / y) ** 2)`` over
    ``c >= 0``, as the profile's fits claim: the optimality (KKT) conditions, checked independently of
    how the fit found its answer. The gradient vanishes along every positive coefficient and points
    into ``c >= 0`` along every zero one (to a millionth of its scale: rounding, not a wrong fit)."""
    a = np.column_stack([np.asarray(col, dtype=float) for col in columns]) / np.asarray(y, dtype=float)[:, None]
    c = np.asarray(coef, dtype=float)
    grad = a.T @ (a @ c - 1.0)
    tol = 1e-6 * np.abs(a).sum(axis=0)
    return bool(np.all(c >= 0) and np.all(np.where(c > 0, np.abs(grad) <= tol, grad >= -tol)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("profiler_tiny"), "mixtral")


def test_profile_of_tiny_model(tiny: Path, tmp_path: Path) -> None:
    prof = run_profile(tiny, TINY_GRID, evict=False)
    assert prof.model == tiny.name and not prof.estimate and "cores" in prof.device
    (att,) = prof.attention
    assert att.gpu == "cpu" and att.n_samples == 4 and att.seq_len_range == (8, 48)
    s = prof.samples or {}
    # every fit is the best non-negative fit of its own samples: Ta = (k1_tok + k1_ctx * s) * b + k2 ...
    b, sl, t = (list(c) for c in zip(*s["attention"]))
    assert len(t) == 4 and _solves_nnls([b, [x * y for x, y in zip(b, sl)], [1.0] * 4], t,
                                        [att.k1_tok, att.k1_ctx, att.k2])
    assert att.time(4, 48) > 0
    assert sorted(e.experts_per_node for e in prof.expert) == [3, 6]
    for e in prof.expert:  # ... Te = k3 * pairs + k4 per number of experts a worker holds ...
        rows = [r[1:] for r in s["expert"] if r[0] == e.experts_per_node]
        assert e.n_samples == len(rows) == 2 and e.k3 * 4 + e.k4 > 0
        assert _solves_nnls([[r[0] for r in rows], [1.0] * 2], [r[1] for r in rows], [e.k3, e.k4])
    # ... one-way time = latency + bytes / bandwidth, unless the time does not grow with these sizes
    # (the best fit has no bandwidth term): then the latency is the median one-way time
    net = prof.network
    size, t = (list(c) for c in zip(*s["network"]))
    assert net is not None and net.bandwidth_Bps > 0
    flat = sum(1 / x for x in t) / sum(1 / x ** 2 for x in t)  # the best fit of the latency alone
    if _solves_nnls([[1.0] * len(t), size], t, [flat, 0.0]):
        assert net.latency_s == pytest.approx(float(np.median(t)))
    else:
        assert _solves_nnls([[1.0] * len(t), size], t, [net.latency_s, 1 / net.bandwidth_Bps])
    assert prof.wire.act_bytes == 4 and prof.wire.meta_bytes_per_token == 2 * 8 and prof.wire.dispatch == "routed"
    b, t = (list(c) for c in zip(*s["step"]))  # ... step overhead = fixed + per token * batch
    assert prof.step_fixed_s + prof.step_per_token_s > 0
    assert _solves_nnls([[1.0] * len(b), b], t, [prof.step_fixed_s, prof.step_per_token_s])
    rt = prof.runtime
    assert rt is not None and rt.cores == CORES and rt.send_s + rt.send_per_byte_s > 0 and rt.take_s > 0
    assert len(s["attention_workers"]) == 2 * 2 + 2 and len(s["expert"]) == 4 and len(s["step"]) == 2
    assert len(s["lm_head"]) == 2 and len(rt.lm_head_points) == 2 and rt.lm_head_time(4) > 0
    b, sl, t = (list(c) for c in zip(*s["colocated_attention"]))  # the colocated layer outside its experts
    assert len(t) == 4 and _solves_nnls([b, [x * y for x, y in zip(b, sl)], [1.0] * 4], t,
                                        [rt.colocated_k1_tok, rt.colocated_k1_ctx, rt.colocated_k2])
    b, t = (list(c) for c in zip(*s["begin"]))  # the part before the first layer: within the overhead
    assert len(b) == 2 and _solves_nnls([[1.0] * 2, b], t, [rt.begin_s, rt.begin_per_token_s])
    assert all(0 < x < o for (_, x), (_, o) in zip(s["begin"], s["step"]))
    if CORES > 1:  # lent cores: speed-ups on every core, never below 1, one per measured size
        assert [p[0] for p in rt.lend_lm_head_points] == [1.0, 4.0] and len(rt.lend_expert_points) == 2
        assert all(x >= 1.0 for _, x in rt.lend_lm_head_points + rt.lend_expert_points)
    else:
        assert rt.lend_lm_head_points == rt.lend_expert_points == ()
    assert {"transport_oneway", "transport_send", "transport_take", "transport_wake"} <= set(s)
    # usable by the local model, with both methods
    spec = load_model_spec(str(tiny))
    for method in ("runtime", "analytic"):
        p = predict_local(prof, 1, 2, 2, 4, 20, spec, method=method)
        assert p.iteration_s > p.pipeline_s > 0 and p.method == method
    assert "k1_tok" in profile_summary(prof)


def test_cli_writes_profile(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "profile.json"
    rc = main(["profile", "--out", str(out), "--model", str(tiny), "--warm", "--quiet", "--batches", "1,2",
               "--seq-lens", "4,16", "--pairs-per-expert", "1,2", "--experts-per-node", "6", "--msg-tokens", "1,4",
               "--step-batches", "1,2", "--repeats", "1", "--passes", "1", "--no-corun"])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "step overhead" in text
    data = json.loads(out.read_text())
    assert data["format"] == "afdserve-planner-profile" and data["runtime"]["cores"] == CORES
    back = load_profile(out)
    assert back.runtime is not None and back.expert[0].experts_per_node == 6
    assert back.runtime.corun_attention == back.runtime.corun_expert == 1.0
    assert len(back.runtime.lm_head_points) == 2 and "least of 1 passes" in back.notes


def test_attention_rows_and_cache_eviction(tiny: Path) -> None:
    calls = []
    flush = CacheFlusher(enabled=False)
    rows = measure_attention(tiny, [(2, 8, 1), (2, 8, 3)], 2, lambda: (calls.append(1), flush())[1])
    assert [r[:3] for r in rows] == [[2.0, 8.0, 1.0], [2.0, 8.0, 3.0]] and all(r[3] > 0 for r in rows)
    assert len(calls) == 4  # evicted before every timed call
    big = CacheFlusher(enabled=True, factor=0.01)
    big()
    assert big._buf.numel() > 1


def test_corun_factors(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each factor is the mean over a role's work of ``with the partner / mean(alone before, alone
    after)``, floored at 1 (a partner cannot speed a worker up): the real work and partner
    processes run, the timer answers with set figures, so the arithmetic and the floor can be checked."""
    if CORES < 2:
        pytest.skip("co-running needs two cores")
    # per call: the attention worker's layer and LM head alone, with the partner, alone again; then
    # the expert worker's layer the same way
    figures = iter([1.0, 1.0, 4.0, 0.5, 3.0, 1.0,  # attention: 4 / 2 and 0.5 / 1: 1.25
                    2.0, 1.0, 4.0])  # expert: 1 / 3, floored: 1
    calls = []

    def timer(fn, repeats, before=None):
        if before is not None:
            before()
        fn()  # the real work, once
        calls.append(fn)
        return next(figures)

    monkeypatch.setattr(corun, "median_time", timer)
    fa, fe = measure_corun(tiny, 2, CacheFlusher(enabled=False))
    assert len(calls) == 9 and calls[0:2] == calls[2:4] == calls[4:6] and calls[6] is calls[7] is calls[8]
    assert fa == pytest.approx(1.25) and fe == 1.0  # not 2.25 (alone after ignored), 1.5 (floored per call)
