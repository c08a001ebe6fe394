"""``afdserve bench gpu`` (afdserve.bench.gpu) without a GPU: the profiler-trace arithmetic on a
made-up trace, the bound's bytes against a checkpoint, and the whole benchmark at ``--scale tiny`` on
the CPU through the CLI -- its JSON, its bound arithmetic, and afdserve's greedy tokens identical to
transformers' in float32 for both shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
from safetensors import safe_open

from afdserve.bench.gpu import TINY, build_model, hf_config, make_plan, new_tokens, save_checkpoint
from afdserve.bench.gpu_trace import STEP_MARK, analyze
from afdserve.bench.peer_bound import kv_token_bytes, step_bytes
from afdserve.model.config import ModelConfig
from afdserve.runtime.trace_plot import union_length


def test_union_of_intervals():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # overlaps counted once
    assert union_length([(3, 4), (0, 1)]) == 2


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_trace_per_step_figures():
    events = [  # two steps: kernels on two streams overlapping, one graph launch, a D2H copy and its sync
        _x("user_annotation", STEP_MARK, 0, 399), _x("user_annotation", STEP_MARK, 400, 20),
        _x("gpu_user_annotation", STEP_MARK, 0, 999),  # the mark's GPU-side twin: neither step nor busy time
        _x("cuda_runtime", "cudaLaunchKernel", 0, 5), _x("kernel", "gemm", 10, 100),
        _x("cuda_runtime", "cudaLaunchKernelExC", 6, 5), _x("kernel", "attn", 50, 100),  # busy 10..150
        _x("cuda_runtime", "cudaGraphLaunch", 12, 5), _x("kernel", "g1", 200, 50), _x("kernel", "g2", 250, 50),
        _x("cuda_runtime", "cudaMemcpyAsync", 20, 3), _x("gpu_memcpy", "Memcpy DtoH", 300, 10),
        _x("cuda_runtime", "cudaStreamSynchronize", 23, 290), _x("cuda_driver", "cuLaunchKernel", 400, 2),
        _x("kernel", "argmax", 405, 5), _x("cuda_runtime", "cudaDeviceSynchronize", 402, 10),
        _x("cuda_runtime", "cudaDeviceSynchronize", 430, 5),  # after the steps (the profiler's stop)
        _x("cpu_op", "aten::mm", 0, 400), {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1},
    ]
    t = analyze(events, steps=2)
    assert t.gpu_busy_ms == pytest.approx((140 + 100 + 10 + 5) / 1e3 / 2)
    assert t.kernels == 5 / 2  # the graph's two kernels included
    assert t.launches == 4 / 2  # 2 runtime kernel launches, 1 graph launch, 1 driver launch
    assert t.launch_calls == {"cudaLaunchKernel": 1, "cudaLaunchKernelExC": 1, "cudaGraphLaunch": 1,
                              "cuLaunchKernel": 1}
    assert t.syncs == 2 / 2 and t.sync_calls == {"cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 1}
    assert set(t.as_dict()) == {"steps", "gpu_busy_ms_per_step", "kernels_per_step", "launches_per_step",
                                "host_syncs_per_step", "launch_calls", "sync_calls"}
    unmarked = analyze([e for e in events if e["name"] != STEP_MARK], steps=2)  # no marks: every host call
    assert unmarked.syncs == 3 / 2 and unmarked.gpu_busy_ms == t.gpu_busy_ms
    assert analyze([_x("cpu_op", "aten::mm", 0, 5)], steps=2) is None  # a CPU run: nothing on a GPU


def test_step_bytes_add_up_to_the_checkpoint(tmp_path):
    """With every expert touched, a decode step reads every weight once but the embedding, of which
    it reads the batch's rows; the KV read is every position of every sequence."""
    plan = make_plan(tiny=True, device="cpu")
    save_checkpoint(build_model(TINY["qwen3"], plan, 128), TINY["qwen3"], tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    total = embed = 0
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = st.get_tensor(k).numel() * 4
                total += n
                embed += n if "embed_tokens" in k else 0
    weights, kv = step_bytes(cfg, 3, 40.5, cfg.num_experts, 4)
    assert weights == total - embed + 3 * cfg.hidden_size * 4
    assert kv == 3 * 40.5 * kv_token_bytes(cfg, 4) == 3 * 40.5 * 4 * 2 * 1 * 16 * 4  # layers x K,V x heads x dim
    fewer, _ = step_bytes(cfg, 3, 40.5, 5, 4)
    assert weights - fewer == (cfg.num_experts - 5) * cfg.num_layers * 3 * 64 * 32 * 4


def test_tiny_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "afdserve.cli.main", "bench", "gpu", "--device", "cpu",
                           "--scale", "tiny", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    plan = res["plan"]
    assert res["device"] == "cpu" and res["copy_gbps"] > 0 and set(res["shapes"]) == {"qwen3", "mixtral"}
    assert "of bound" in proc.stdout and "Mixtral-8x7B tiny" in proc.stdout
    for key, shape in res["shapes"].items():
        cfg = ModelConfig.from_dict(hf_config(TINY[key], 128, 0.1).to_dict())
        assert shape["shape"] == asdict(TINY[key]) and shape["layers"] == cfg.num_layers == 4
        assert [(p["context"], p["batch"]) for p in shape["points"]] == [(c, b) for c in plan["contexts"]
                                                                         for b in plan["batches"]]
        for p in shape["points"]:
            hf, afd, bound = p["transformers"], p["afdserve"], p["bound"]
            assert p["afdserve graphs"] == {"skipped": "CUDA graphs need a CUDA device"}
            assert p["afdserve triton"] == {"skipped": "the graphs variant's eager twin: runs where graphs do (CUDA)"}
            assert afd["captured"] is False  # the eager variant (enforce_eager=True)
            # greedy, float32, random weights: afdserve's tokens are transformers'
            assert afd["identical"] == p["batch"], (key, p["context"], p["batch"])
            assert len(afd["step_ms_each"]) == len(hf["step_ms_each"]) == plan["steps"]
            assert afd["later_steps_whole_batch"] and afd["trace"] is None and afd["busy_fraction"] is None
            assert afd["prefill_s"] > 0 and hf["prefill_s"] > 0 and afd["profiled_step_ms"] > 0
            # transformers prefills 3 x 40 tokens in chunks of 64 // 3 positions (identical tokens all the same)
            assert hf.get("prefill_chunk_size") == (21 if p["batch"] * p["context"] > 64 else None)
            for r in (hf, afd):
                assert r["tok_s"] == pytest.approx(p["batch"] / (r["step_ms"] / 1e3))
                assert r["of_bound"] == pytest.approx(bound["step_ms"] / r["step_ms"])
            assert afd["vs_transformers"] == pytest.approx(afd["tok_s"] / hf["tok_s"])
            # the bound: the experts afdserve's routing steps touched, the KV of the timed steps' mean length
            touched = afd["experts_touched_per_layer"]
            assert len(touched) == 4 and all(cfg.top_k <= t <= min(cfg.num_experts, p["batch"] * cfg.top_k)
                                             for t in touched)
            assert bound["experts_touched"] == pytest.approx(sum(touched) / 4)
            assert bound["kv_len"] == p["context"] + (plan["steps"] + 1) / 2
            w, kv = step_bytes(cfg, p["batch"], bound["kv_len"], bound["experts_touched"], 4)
            assert (bound["weight_bytes"], bound["kv_bytes"]) == pytest.approx((w, kv))
            assert bound["step_ms"] == pytest.approx((w + kv) / (res["copy_gbps"] * 1e9) * 1e3)


def test_every_sequence_runs_through_the_measured_steps():
    """A sequence whose prefill ends first decodes one token a step while the others prefill: its
    max_tokens leaves it running through the timed, profiled and routing steps."""
    plan = make_plan(device="cuda")
    n = new_tokens(plan, 2048, 256)
    prefill_steps = -(-256 * 2048 // (plan.prefill_tokens - 256))  # each step also decodes the early ones
    assert n >= 1 + prefill_steps + plan.steps + plan.profile_steps + plan.routing_steps
    assert make_plan(quick=True).shapes == ("qwen3",) and make_plan(steps=3).steps == 3
