"""``afdserve profile`` on a tiny checkpoint: every measurement runs the real code (attention and
expert parts, PipelinedRunner, Engine, the M2N library between two processes) on a tiny grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afdserve.cli.profile import main
from afdserve.planner import load_model_spec, load_profile, predict_local, profile_summary
from afdserve.profiling import CacheFlusher, ProfileGrid, measure_attention, measure_corun, run_profile

from tiny_models import make_checkpoint

TINY_GRID = ProfileGrid(batches=(1, 4), seq_lens=(8, 48), pairs_per_expert=(1, 4), experts_per_node=(3, 6),
                        msg_tokens=(1, 16), step_batches=(1, 4), dispatch_workers=(1, 2), repeats=2,
                        passes=1, transport_repeats=3, corun=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("profiler_tiny"), "mixtral")


def test_profile_of_tiny_model(tiny: Path, tmp_path: Path) -> None:
    prof = run_profile(tiny, TINY_GRID, evict=False)
    assert prof.model == tiny.name and not prof.estimate and "cores" in prof.device
    (att,) = prof.attention
    assert att.gpu == "cpu" and att.n_samples == 4 and att.seq_len_range == (8, 48)
    assert att.k1_tok >= 0 and att.k1_ctx >= 0 and att.k2 > 0
    assert att.time(4, 48) > 0
    assert sorted(e.experts_per_node for e in prof.expert) == [3, 6]
    assert all(e.k3 >= 0 and e.k3 * 4 + e.k4 > 0 and e.n_samples == 2 for e in prof.expert)
    net = prof.network
    assert net is not None and net.latency_s >= 0 and net.bandwidth_Bps > 0
    assert prof.wire.act_bytes == 4 and prof.wire.meta_bytes_per_token == 2 * 8 and prof.wire.dispatch == "routed"
    assert prof.step_fixed_s + prof.step_per_token_s > 0
    rt = prof.runtime
    assert rt is not None and rt.cores >= 1 and rt.send_s + rt.send_per_byte_s > 0 and rt.take_s > 0
    s = prof.samples or {}
    assert len(s["attention_workers"]) == 2 * 2 + 2 and len(s["expert"]) == 4 and len(s["step"]) == 2
    assert len(s["lm_head"]) == 2 and len(rt.lm_head_points) == 2 and rt.lm_head_time(4) > 0
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
    assert data["format"] == "afdserve-planner-profile" and data["runtime"]["cores"] >= 1
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


def test_corun_factors(tiny: Path) -> None:
    fa, fe = measure_corun(tiny, 2, CacheFlusher(enabled=False))
    assert fa >= 1.0 and fe >= 1.0
