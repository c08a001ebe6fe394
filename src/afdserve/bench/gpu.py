"""Decode on real MoE layer shapes against transformers and the memory-bandwidth bound (``afdserve bench gpu``).

Random-weight checkpoints of 4 layers with the layer shapes of Qwen3-30B-A3B (hidden 2048, 32 / 4
heads x 128, 128 experts x 768, top-8, vocab 151,936) and Mixtral-8x7B (hidden 4096, 32 / 8 heads x
128, 8 experts x 14,336, top-2, vocab 32,000) are built on the device (transformers' own init, in the
benchmark's dtype) and saved as safetensors; afdserve loads that folder, transformers decodes with the
model that wrote it. For each context (prompt length) and batch:

* transformers: one greedy ``generate`` of 1 + ``steps`` tokens; a streamer stamps the time each
  step's tokens reach the host (transformers syncs there every step anyway);
* afdserve colocated, each variant (eager; on a CUDA device the triton attention backend eager and in
  CUDA graphs, ``captured`` saying whether its decode steps were; ``compile=True`` on request): the
  engine stepped one ``get_outputs`` at a time, ``steps`` decode steps of the whole batch timed,
  ``profile_steps`` more under ``torch.profiler`` (GPU busy time, kernels, launches and host syncs
  per step: ``afdserve.bench.gpu_trace``), ``routing_steps`` more reading which experts each layer ran;
* the bound: the bytes a decode step reads -- attention, norms and router weights, the experts it
  touches (measured: the distinct experts afdserve's routing steps ran per layer; else the
  expectation under uniform routing), final norm and LM head, embedding rows, and the KV of every
  sequence -- over a device-to-device copy rate measured in the same run (``afdserve.bench.peer_bound``).

Step times are medians over the timed steps; decode tok/s = batch / step time.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from afdserve.bench.gpu_trace import STEP_MARK, analyze_profile
from afdserve.bench.peer_bound import expected_experts, memcpy_bytes_per_s, step_bytes
from afdserve.model.config import ModelConfig

LAYERS = 4


@dataclass(frozen=True)
class Shape:
    title: str
    arch: str  # "qwen3_moe" or "mixtral"
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    expert_intermediate: int
    top_k: int
    vocab: int


SHAPES = {"qwen3": Shape("Qwen3-30B-A3B", "qwen3_moe", 2048, 32, 4, 128, 128, 768, 8, 151936),
          "mixtral": Shape("Mixtral-8x7B", "mixtral", 4096, 32, 8, 128, 8, 14336, 2, 32000)}
# the same structure shrunk for a CPU run: grouped KV heads, more experts than top-k, a vocabulary wider than hidden
TINY = {"qwen3": Shape("Qwen3-30B-A3B tiny", "qwen3_moe", 64, 8, 1, 16, 16, 32, 4, 512),
        "mixtral": Shape("Mixtral-8x7B tiny", "mixtral", 64, 4, 1, 16, 8, 96, 2, 512)}


@dataclass(frozen=True)
class Plan:
    shapes: tuple[str, ...]
    contexts: tuple[int, ...]  # prompt lengths
    batches: tuple[int, ...]
    steps: int  # timed decode steps per point (and transformers' new tokens - 1)
    profile_steps: int
    routing_steps: int
    prefill_tokens: int  # afdserve's max_num_batched_tokens
    hf_prefill_tokens: int  # transformers prefills larger prompt batches in chunks of about this many tokens
    tiny: bool
    device: str
    dtype: str
    compile: bool = False
    budget_s: float | None = None  # engine runs that would start later than this are skipped


def make_plan(quick: bool = False, tiny: bool = False, device: str = "cuda", **over: Any) -> Plan:
    """The full run (both shapes, contexts 512 and 2,048, batches 1, 64, 256), ``quick`` (Qwen3
    shapes, context 512, batches 64 and 256, fewer steps) or ``tiny`` (both shapes shrunk, float32,
    for a CPU); ``over`` replaces any field (None: keep)."""
    if tiny:
        base = Plan(("qwen3", "mixtral"), (16, 40), (1, 3), 4, 2, 1, 64, 64, True, device, "float32")
    elif quick:
        base = Plan(("qwen3",), (512,), (64, 256), 12, 3, 2, 32768, 65536, False, device, "bfloat16", budget_s=150.0)
    else:
        base = Plan(("qwen3", "mixtral"), (512, 2048), (1, 64, 256), 16, 4, 2, 32768, 65536, False, device, "bfloat16",
                    budget_s=420.0)
    return replace(base, **{k: v for k, v in over.items() if v is not None})


def new_tokens(plan: Plan, context: int, batch: int) -> int:
    """afdserve's max_tokens at a point: a sequence whose prefill ends early decodes while the others
    still prefill (one token a step), and must still run through every measured step."""
    early = math.ceil(batch * context / max(1, plan.prefill_tokens - batch)) + 1
    return 1 + early + plan.steps + plan.profile_steps + plan.routing_steps


def hf_config(shape: Shape, max_positions: int, init_std: float) -> Any:
    import transformers as tf

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=LAYERS,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  num_experts_per_tok=shape.top_k, max_position_embeddings=max_positions, initializer_range=init_std,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if shape.arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=shape.experts, intermediate_size=shape.expert_intermediate, **common)
    return tf.Qwen3MoeConfig(num_experts=shape.experts, moe_intermediate_size=shape.expert_intermediate,
                             norm_topk_prob=True, **common)


def write_id_tokenizer(path: Path, vocab: int) -> None:
    """A tokenizer whose every id is a word ("<17>"): the engines take token ids; afdserve's front end
    only needs to detokenize them."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<1>", "eos_token": "<2>"}))


def build_model(shape: Shape, plan: Plan, max_positions: int) -> Any:
    """The random-weight transformers model, initialized on the device in the plan's dtype (its EOS off)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = hf_config(shape, max_positions, 0.1 if plan.tiny else 0.02)  # 0.1: no near ties at float32 tiny
    with torch.device(plan.device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, plan.dtype)).eval()
    model.generation_config.eos_token_id = None  # exactly the new tokens asked for
    return model


def save_checkpoint(model: Any, shape: Shape, path: Path) -> None:
    model.save_pretrained(path)
    write_id_tokenizer(path, shape.vocab)


def scratch_dir(need: int) -> Path:
    """A temporary folder for a checkpoint of ``need`` bytes: in /dev/shm (memory: saving and loading
    skip the disk) where it has room, else in the default temporary folder."""
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need else None
    return Path(tempfile.mkdtemp(prefix="afdserve-bench-gpu-", dir=base))


def prompts_of(shape: Shape, context: int, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(context * 1000 + batch)
    return torch.randint(3, shape.vocab, (batch, context), generator=gen).tolist()


def hf_point(model: Any, prompts: list[list[int]], steps: int, chunk_tokens: int) -> dict:
    """transformers: 1 + ``steps`` new tokens, each decode step timed by when its tokens reach the host."""
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:  # the prompt, then each step's tokens (copied to the host)
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor(prompts, device=model.device)
    kw = {}
    if ids.numel() > chunk_tokens and hasattr(GenerationConfig(), "prefill_chunk_size"):
        kw["prefill_chunk_size"] = max(1, chunk_tokens // len(prompts))
    clock = Clock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + steps,
                             min_new_tokens=1 + steps, do_sample=False, pad_token_id=0, streamer=clock, **kw)
    t = clock.times
    each = [b - a for a, b in zip(t[1:], t[2:])]
    step = statistics.median(each)
    return {"prefill_s": t[1] - t[0], "step_ms": step * 1e3, "step_ms_each": [x * 1e3 for x in each],
            "tok_s": len(prompts) / step, "_tokens": out[:, ids.shape[1]:].tolist(), **kw}


def afd_point(llm: Any, prompts: list[list[int]], plan: Plan, scratch: Path) -> dict:
    """afdserve colocated: the engine stepped one ``get_outputs`` (one step) at a time; the first
    ``plan.steps`` steps that decode the whole batch timed, then the profiled and the routing steps."""
    from afdserve import SamplingParams

    client, batch = llm.engine, len(prompts)
    params = SamplingParams(max_tokens=new_tokens(plan, len(prompts[0]), batch), temperature=0.0, ignore_eos=True,
                            output_kind="final_only")  # as LLM.generate: no output built per step
    ids = client.add_requests([({"prompt_token_ids": p}, params) for p in prompts])
    final: dict[str, list[int]] = {}

    def step() -> tuple[float, bool]:
        t0 = time.perf_counter()
        for o in client.get_outputs():  # one engine step; the sampled tokens reach the host in it
            if o.finished:
                final[o.request_id] = list(o.outputs[0].token_ids)
        dt = time.perf_counter() - t0
        st = client.engine.last_step
        return dt, st.num_decode == batch and st.num_tokens == batch

    try:
        prefill, times, pure, touched, trace, profiled = _measure(client, step, plan, scratch)
    except BaseException:  # the point failed: its requests leave the engine for the next point
        for i in ids:
            if i not in final:
                client.abort(i)
        while client.has_unfinished():
            client.get_outputs()
        raise
    median = statistics.median(times)
    trace_error, trace = (trace, None) if isinstance(trace, str) else (None, trace)
    row = {"prefill_s": prefill, "step_ms": median * 1e3, "step_ms_each": [x * 1e3 for x in times],
           "tok_s": batch / median, "profiled_step_ms": profiled / max(1, plan.profile_steps) * 1e3,
           "later_steps_whole_batch": all(pure), "trace": trace.as_dict() if trace else trace_error,
           # GPU busy time of a profiled step over an unprofiled step's time (and over a profiled one's)
           "busy_fraction": trace.gpu_busy_ms / (median * 1e3) if trace else None,
           "busy_fraction_profiled": trace.gpu_busy_ms * plan.profile_steps / (profiled * 1e3) if trace else None,
           "experts_touched_per_layer": ([statistics.mean(c) for c in zip(*touched)] if touched else None),
           "_tokens": [final[i] for i in ids]}
    return row


def _measure(client: Any, step: Callable[[], tuple[float, bool]], plan: Plan, scratch: Path) -> tuple:
    """Steps until the timed decode steps are done (the steps before them: the prefill), then the
    profiled ones, the routing ones, and the rest (sequences that ran ahead finish)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    prefill, times = 0.0, []
    while len(times) < plan.steps:
        if not client.has_unfinished():
            raise RuntimeError("the requests finished before their decode steps were measured")
        dt, decode = step()
        if decode:
            times.append(dt)
        elif times:
            raise RuntimeError("a step amid the decode steps did not decode the whole batch")
        else:
            prefill += dt
    cuda = plan.device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        pure = []
        for _ in range(plan.profile_steps):
            with record_function(STEP_MARK):
                pure.append(step()[1])
        profiled = time.perf_counter() - t0
    try:
        trace = analyze_profile(prof, plan.profile_steps, scratch) if plan.profile_steps else None
    except (OSError, ValueError) as e:  # a trace that cannot be read back: the timings still count
        trace = f"{type(e).__name__}: {e}"[:300]
    counts = client.experts.counts  # tokens each layer routed to each expert, so far
    touched = []
    for _ in range(plan.routing_steps):
        before = counts.clone()
        pure.append(step()[1])
        touched.append(((counts - before) > 0).sum(1).tolist())
    while client.has_unfinished():
        step()
    return prefill, times, pure, touched, trace, profiled


def afd_variants(plan: Plan) -> dict[str, dict | str]:
    """afdserve's engine options per variant; a string: why the variant does not run. Decode steps
    are captured in CUDA graphs with the triton attention backend only (``afdserve.backends.capture``):
    the graphs variant asks for it, the eager one keeps the default backends, and "afdserve triton" is
    the graphs variant run eager (so that graphs against eager changes one thing)."""
    out: dict[str, dict | str] = {"afdserve": {"enforce_eager": True}}
    cuda = plan.device.startswith("cuda")
    out["afdserve triton"] = ({"enforce_eager": True, "attention_backend": "triton"} if cuda
                              else "the graphs variant's eager twin: runs where graphs do (CUDA)")
    out["afdserve graphs"] = ({"enforce_eager": False, "attention_backend": "triton"} if cuda
                              else "CUDA graphs need a CUDA device")
    if plan.compile:
        out["afdserve compile"] = {"compile": True, **out["afdserve"]}  # type: ignore[dict-item]
    return out


def engine_options(plan: Plan, max_len: int) -> dict:
    batch = max(plan.batches)
    return dict(device=plan.device, dtype=plan.dtype, max_num_seqs=batch, max_model_len=max_len,
                max_num_batched_tokens=max(plan.prefill_tokens, batch), num_kv_blocks=batch * -(-max_len // 16) + 8,
                enable_prefix_caching=False, prefix_cache_host_gb=0.0, startup_timeout_s=600.0,
                num_threads=None if plan.device.startswith("cuda") else 2)


def finish_row(row: dict, cfg: ModelConfig, plan: Plan, bandwidth: float) -> None:
    """Adds the bound, each engine's fraction of it, and afdserve against transformers (speed, tokens)."""
    batch, context = row["batch"], row["context"]
    afd = row.get("afdserve", {})
    per_layer = afd.get("experts_touched_per_layer")
    if per_layer:
        touched, basis = statistics.mean(per_layer), "routed: afdserve's routing steps"
    else:
        touched, basis = expected_experts(cfg.num_experts, cfg.top_k, batch), "expected under uniform routing"
    kv_len = context + (plan.steps + 1) / 2  # the timed decode step j attends over context + j positions
    weights, kv = step_bytes(cfg, batch, kv_len, touched, 2 if plan.dtype in ("bfloat16", "float16") else 4)
    bound_ms = (weights + kv) / bandwidth * 1e3
    row["bound"] = {"step_ms": bound_ms, "weight_bytes": weights, "kv_bytes": kv, "kv_len": kv_len,
                    "experts_touched": touched, "experts_basis": basis}
    hf = row.get("transformers", {})
    want = hf.pop("_tokens", None)
    for name, r in row.items():
        if isinstance(r, dict) and "step_ms" in r and name != "bound":
            r["of_bound"] = bound_ms / r["step_ms"]
        if name.startswith("afdserve") and isinstance(r, dict) and "_tokens" in r:
            got = r.pop("_tokens")
            if want is not None:
                n = 1 + plan.steps
                r["identical"] = sum(g[:n] == w[:n] for g, w in zip(got, want))
                r["vs_transformers"] = r["tok_s"] / hf["tok_s"]


def run_shape(key: str, plan: Plan, bandwidth: float, deadline: float | None, log: Callable[[str], None]) -> dict:
    from afdserve import LLM, SamplingParams

    shape = (TINY if plan.tiny else SHAPES)[key]
    points = [(c, b) for c in plan.contexts for b in plan.batches]
    max_len = max(c + new_tokens(plan, c, b) for c, b in points) + 16
    rows = [{"context": c, "batch": b} for c, b in points]
    late = lambda: deadline is not None and time.perf_counter() > deadline  # noqa: E731
    t0 = time.perf_counter()
    model = build_model(shape, plan, max_len)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    root = scratch_dir(size)
    try:
        save_checkpoint(model, shape, root / "model")
        log(f"{shape.title}: checkpoint of {size / 1e9:.2f} GB built and saved to {root} in "
            f"{time.perf_counter() - t0:.1f} s")
        cfg = ModelConfig.from_dict(json.loads((root / "model" / "config.json").read_text()))
        warm = prompts_of(shape, 16, 2)  # each engine's first generate pays for its lazy set-ups
        _guarded(hf_point, model, warm, 2, plan.hf_prefill_tokens)
        for row in rows:
            t0 = time.perf_counter()
            prompts = prompts_of(shape, row["context"], row["batch"])
            row["transformers"] = ({"skipped": "time budget"} if late() else
                                   _guarded(hf_point, model, prompts, plan.steps, plan.hf_prefill_tokens))
            log(f"  transformers ctx {row['context']} batch {row['batch']}: {time.perf_counter() - t0:.1f} s")
        del model
        gc.collect()  # the model's reference cycles: its memory is back before afdserve loads
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()
        for name, options in afd_variants(plan).items():
            if isinstance(options, str) or late():
                for row in rows:
                    row[name] = {"skipped": options if isinstance(options, str) else "time budget"}
                continue
            t0 = time.perf_counter()
            try:
                llm = LLM(str(root / "model"), **engine_options(plan, max_len), **options)
            except Exception as e:  # noqa: BLE001 -- reported; the other variants still run
                for row in rows:
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            captured = llm.engine.engine.runner.captured is not None  # else its capture failed: eager (warned)
            log(f"  {name}: loaded in {time.perf_counter() - t0:.1f} s{', decode steps captured' if captured else ''}")
            try:
                llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=4, temperature=0.0,
                                                                                     ignore_eos=True))
                for row in rows:
                    t0 = time.perf_counter()
                    row[name] = ({"skipped": "time budget"} if late() else
                                 _guarded(afd_point, llm, prompts_of(shape, row["context"], row["batch"]), plan, root))
                    if "skipped" not in row[name]:
                        row[name]["captured"] = captured
                    log(f"  {name} ctx {row['context']} batch {row['batch']}: {time.perf_counter() - t0:.1f} s")
            finally:
                llm.shutdown()
        for row in rows:
            finish_row(row, cfg, plan, bandwidth)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"title": shape.title, "shape": asdict(shape), "layers": LAYERS, "points": rows}


def _guarded(fn: Callable[..., dict], *args: Any) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- one point's failure (out of memory, say) is reported, the rest run
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def run(plan: Plan, log: Callable[[str], None] = print, partial: Callable[[dict], None] | None = None) -> dict:
    """Every shape of ``plan``; ``partial`` gets the result so far after each shape."""
    import transformers

    t_start = time.perf_counter()
    cuda = plan.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(2)
    bandwidth = memcpy_bytes_per_s(2 << 30 if cuda else 64 << 20, reps=9 if cuda else 5, device=plan.device)
    result: dict = {"plan": asdict(plan), "torch": torch.__version__, "transformers": transformers.__version__,
                    "device": torch.cuda.get_device_name(plan.device) if cuda else "cpu",
                    "copy_gbps": bandwidth / 1e9, "shapes": {}}
    log(f"device {result['device']}: copy {bandwidth / 1e9:,.0f} GB/s (read + written)")
    deadline = t_start + plan.budget_s if plan.budget_s else None
    for key in plan.shapes:
        t0 = time.perf_counter()
        result["shapes"][key] = run_shape(key, plan, bandwidth, deadline, log)
        log(f"{key}: {time.perf_counter() - t0:.0f} s (total {time.perf_counter() - t_start:.0f} s)")
        result["elapsed_s"] = time.perf_counter() - t_start
        if partial is not None:
            partial(result)
    return result
