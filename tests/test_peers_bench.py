"""The peer benchmark (benchmarks/peers.py) without vLLM: the driver protocol, the memory-bandwidth
bound's byte accounting (against real checkpoints), the round bookkeeping, and afdserve colocated and
transformers driven in their own processes on a tiny model."""

from __future__ import annotations

import io
import json

import pytest
from safetensors import safe_open

from afdserve.bench import peer_driver
from afdserve.bench.peer_bound import WeightBytes, expected_experts, memcpy_bytes_per_s, run_bound
from afdserve.bench.peer_driver import Failed, Generate, Load
from afdserve.bench.peers import Peers, PeerError, afdserve_specs, agreement, summarize, transformers_spec, vllm_spec
from afdserve.bench.peers_report import plot, points, table
from afdserve.model.config import ModelConfig
from tiny_models import ARCHS, make_checkpoint


def test_messages_round_trip_and_bad_lines_fail():
    msg = Generate([[5, 6, 7]], 4, routing=True)
    assert peer_driver.decode(peer_driver.encode(msg)) == msg
    with pytest.raises(ValueError):
        peer_driver.decode(json.dumps({"type": "Generate", "prompts": [], "new_tokens": 1, "bogus": 1}))
    with pytest.raises(ValueError):
        peer_driver.decode(json.dumps({"type": "Exec"}))


def test_driver_answers_misuse_with_failed():
    out = io.StringIO()
    peer_driver.serve(io.StringIO(peer_driver.encode(Generate([[3]], 1)) + peer_driver.encode(Load("nope", "x"))), out)
    replies = [peer_driver.decode(line) for line in out.getvalue().splitlines()]
    assert [type(r) for r in replies] == [Failed, Failed]
    assert "before Load" in replies[0].error and "unknown engine 'nope'" in replies[1].error


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_bytes_add_up_to_the_checkpoint(tmp_path, arch):
    path = make_checkpoint(tmp_path / arch, arch)
    cfg = ModelConfig.from_pretrained(path)
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).numel() * 4 for k in st.keys())  # saved in float32
    w = WeightBytes.of(cfg, 4)
    whole = cfg.num_layers * (w.attention_layer + cfg.num_experts * w.expert) + w.head + cfg.vocab_size * w.embedding_row
    assert whole == total


def test_bound_counts_the_bytes_of_a_run(tmp_path):
    cfg = ModelConfig.from_pretrained(make_checkpoint(tmp_path / "m", "mixtral"))
    e, k = cfg.num_experts, cfg.top_k
    assert expected_experts(e, k, 1) == pytest.approx(k)
    assert expected_experts(e, k, 10_000) == pytest.approx(e)
    small = run_bound(cfg, 1, 8, 4, bandwidth=1e9)
    big = run_bound(cfg, 512, 8, 4, bandwidth=1e9)
    assert small.basis == "expected" and small.experts_touched == pytest.approx(k)
    assert big.basis == "all" and big.experts_touched == pytest.approx(e)
    assert small.tok_s == pytest.approx(1 * 4 * 1e9 / small.run_bytes)
    # a measured routing replaces the expectation; fewer experts touched -> fewer bytes -> higher bound
    routed = run_bound(cfg, 512, 8, 4, bandwidth=1e9, touched=3.0)
    assert routed.basis == "routed" and routed.decode_step_bytes < big.decode_step_bytes and routed.tok_s > big.tok_s
    # KV reads grow with the context: mean decode context = prompt + new_tokens / 2
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert big.kv_step_bytes == pytest.approx(512 * (8 + 4 / 2) * kv_token)
    assert memcpy_bytes_per_s(1 << 20, reps=3) > 0
    with pytest.raises(ValueError):
        run_bound(cfg, 0, 8, 4, bandwidth=1e9)


def test_summary_medians_spread_and_ratios():
    runs = {"vllm": {8: [100.0, 120.0, 110.0]}, "afdserve": {8: [50.0, 70.0, 60.0], 64: [5.0]}}
    s = summarize(runs)
    assert s["afdserve"][8] == {"runs_tok_s": [50.0, 70.0, 60.0], "median": 60.0, "min": 50.0, "max": 70.0,
                                "vs_vllm": pytest.approx(60 / 110)}
    assert "vs_vllm" not in s["afdserve"][64]  # vLLM did not run batch 64
    assert agreement({"transformers": {2: [[1, 2, 3, 4]]}, "x": {2: [[1, 2, 9, 4]]}})["x"][2] == 0.5


def test_vllm_is_skipped_when_not_installed(tmp_path):
    assert vllm_spec("m", 2, 8, 96, tmp_path / "no-venv") is None


def test_engines_in_their_own_processes(tmp_path, capsys):
    """afdserve colocated and transformers loaded once each in a driver process, two rounds over two
    batch sizes: float32 greedy tokens agree, every round is recorded, the routing is measured."""
    path = make_checkpoint(tmp_path / "m", "mixtral")
    cfg = ModelConfig.from_pretrained(path)
    specs = afdserve_specs(str(path), 1, 3, 12, dtype="float32", disaggregated=False)
    specs.append(transformers_spec(str(path), 1, 3, 12, dtype="float32"))
    batches, new = [2, 3], {2: 4, 3: 4}
    peers = Peers.start(specs, tmp_path / "logs", timeout=300)
    try:
        assert set(peers.load_seconds) == {"afdserve", "transformers"}
        assert set(peers.measure_idle(0.2)) == {"afdserve", "transformers"}
        peers.warm_up(batches, 8, new, cfg.vocab_size, timeout=120)
        peers.run_rounds(2, batches, 8, new, cfg.vocab_size, timeout=120)
        with pytest.raises(PeerError, match="afdserve: .*token"):  # the engine's error, and it serves on
            peers.generate("afdserve", [[cfg.vocab_size + 5] * 8], 2, timeout=60)
        assert len(peers.generate("afdserve", [[5] * 8], 2, timeout=60).token_ids[0]) == 2
    finally:
        peers.close()
    assert all(p.proc.returncode is not None for p in peers.procs.values())
    assert {n: {b: len(v) for b, v in r.items()} for n, r in peers.runs.items()} == \
        {"afdserve": {2: 2, 3: 2}, "transformers": {2: 2, 3: 2}}
    assert agreement(peers.outputs)["afdserve"] == {2: 1.0, 3: 1.0}
    for b in batches:
        touched = peers.experts_touched[b]
        assert len(touched) == cfg.num_layers and all(cfg.top_k <= t <= min(cfg.num_experts, b * cfg.top_k)
                                                      for t in touched)
    bounds = {b: run_bound(cfg, b, 8, new[b], 1e9, touched=sum(peers.experts_touched[b]) / cfg.num_layers, dtype_bytes=4)
              for b in batches}
    rows = points(summarize(peers.runs), bounds)
    assert [r["batch"] for r in rows] == batches
    assert all(e["of_bound"] == pytest.approx(e["median"] / r["bound"]["tok_s"]) for r in rows for e in r["engines"].values())
    text = table(rows, new, 1e9)
    assert "afdserve" in text and "routed" in text
    plot(rows, str(tmp_path / "peers.png"), "tiny")
    assert (tmp_path / "peers.png").stat().st_size > 10_000
    assert peers.info["transformers"]["threads"] == 1
