"""One engine of the peer benchmark (``benchmarks/peers.py``), kept loaded in its own process.

The benchmark starts this file once per engine -- in afdserve's environment for ``afdserve`` and
``transformers``, in vLLM's own virtual environment for ``vllm`` -- and drives it over stdin/stdout,
one JSON line per message: ``Load`` once, then ``Generate`` whenever the benchmark says, then
``Shutdown``. Every reply is a ``Loaded``, a ``Generated`` or a ``Failed``. The engine's own prints
go to stderr (fd 1 is moved there before anything is imported), so only messages use stdout.

Only the standard library is imported at the top: vLLM's environment has no afdserve, so the
benchmark runs this file by path (``runpy``), and each engine's imports happen in its adapter.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

ENGINES = ("afdserve", "transformers", "vllm")


@dataclass(frozen=True)
class Load:
    """Load ``engine`` with the checkpoint ``model``. ``expert_workers``/``micro_batches`` select an
    afdserve deployment (0: colocated); ``threads`` is the torch/OpenMP thread count of each compute
    process; ``max_batch``/``max_len`` size the engine (sequences, tokens per sequence)."""

    engine: str
    model: str
    dtype: str = "bfloat16"
    threads: int = 1
    max_batch: int = 8
    max_len: int = 128
    expert_workers: int = 0
    micro_batches: int = 1
    compile: bool = False  # afdserve: torch.compile of the decode step (EngineConfig.compile)


@dataclass(frozen=True)
class Generate:
    """Greedy decoding, ``new_tokens`` per prompt with EOS ignored; ``routing``: also count the
    distinct experts each MoE layer routes the batch's tokens to in every decode step
    (transformers only, untimed runs)."""

    prompts: list[list[int]]
    new_tokens: int
    routing: bool = False


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Loaded:
    seconds: float  # wall time of the load, including the engine's start-up
    info: dict[str, Any] = field(default_factory=dict)  # versions, settings the engine reports


@dataclass(frozen=True)
class Generated:
    seconds: float  # wall time of the generate call
    token_ids: list[list[int]]  # generated tokens, one list per prompt
    experts_touched: list[float] | None = None  # Generate.routing: per layer, mean distinct experts per decode step


@dataclass(frozen=True)
class Failed:
    error: str


MESSAGES = {c.__name__: c for c in (Load, Generate, Shutdown, Loaded, Generated, Failed)}


def encode(msg: Any) -> str:
    """One JSON line: the message's type name and its fields."""
    if type(msg).__name__ not in MESSAGES:
        raise TypeError(f"not a peer message: {msg!r}")
    return json.dumps({"type": type(msg).__name__, **asdict(msg)}) + "\n"


def decode(line: str) -> Any:
    raw = json.loads(line)
    cls = MESSAGES.get(raw.pop("type", None))
    if cls is None or set(raw) - {f.name for f in fields(cls)}:
        raise ValueError(f"not a peer message: {line.strip()[:200]!r}")
    return cls(**raw)


# ---------------------------------------------------------------------------------------------
# engines: load(Load) -> (generate(prompts, new_tokens, routing) -> (token ids, experts touched), info)
# ---------------------------------------------------------------------------------------------

Runner = Callable[[list[list[int]], int, bool], tuple[list[list[int]], list[float] | None]]


def _afdserve(cfg: Load) -> tuple[Runner, dict[str, Any]]:
    from afdserve import LLM, SamplingParams  # first, as a user's script does: its OpenMP defaults apply

    import torch

    if cfg.expert_workers:  # the front end only detokenizes; the workers compute
        torch.set_num_threads(1)
    llm = LLM(cfg.model, dtype=cfg.dtype, num_threads=cfg.threads, max_num_seqs=cfg.max_batch,
              max_num_batched_tokens=max(2048, cfg.max_batch * cfg.max_len), max_model_len=cfg.max_len,
              expert_workers=cfg.expert_workers, micro_batches=cfg.micro_batches, compile=cfg.compile)

    def run(prompts: list[list[int]], n: int, routing: bool) -> tuple[list[list[int]], list[float] | None]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs], None

    import afdserve

    return run, {"torch": torch.__version__, "afdserve": afdserve.__version__, "path": afdserve.__file__}


def _router_hooks(model: Any, batch: int) -> tuple[list[list[int]], Callable[[], None]]:
    """Hooks on each MoE layer's router (transformers' ``*TopKRouter``, which returns
    ``(logits, weights, indices)``) that record the distinct experts of every decode step (a call
    with ``batch`` tokens). Returns the per-layer counts (none without such routers: the benchmark
    then assumes uniform routing) and a function that removes the hooks."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    counts: list[list[int]] = [[] for _ in routers]

    def hook(i: int) -> Callable[..., None]:
        def record(_mod: Any, _inp: Any, out: Any) -> None:
            ids = out[-1]
            if ids.shape[0] == batch:
                counts[i].append(int(ids.unique().numel()))
        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]

    def remove() -> None:
        for h in handles:
            h.remove()

    return counts, remove


def _transformers(cfg: Load) -> tuple[Runner, dict[str, Any]]:
    import torch
    import transformers

    torch.set_num_threads(cfg.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype)).eval()
    model.generation_config.eos_token_id = None  # exactly new_tokens tokens (ignore_eos)

    def run(prompts: list[list[int]], n: int, routing: bool) -> tuple[list[list[int]], list[float] | None]:
        ids = torch.tensor(prompts)
        counts, remove = _router_hooks(model, len(prompts)) if routing else (None, None)
        try:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
        finally:
            if remove is not None:
                remove()
        touched = [sum(c) / len(c) for c in counts] if counts and all(counts) else None
        return out[:, ids.shape[1]:].tolist(), touched

    return run, {"torch": torch.__version__, "transformers": transformers.__version__,
                 "threads": torch.get_num_threads()}


def _vllm(cfg: Load) -> tuple[Runner, dict[str, Any]]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's own default step budget (chunked prefill); prompts are fresh every round, and prefix
    # caching is off, so no run reuses another's KV
    llm = LLM(model=cfg.model, dtype=cfg.dtype, max_num_seqs=cfg.max_batch, max_model_len=cfg.max_len, seed=0,
              enable_prefix_caching=False)

    def run(prompts: list[list[int]], n: int, routing: bool) -> tuple[list[list[int]], list[float] | None]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], None

    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU", "LD_PRELOAD", "OMP_"))}
    return run, {"torch": torch.__version__, "vllm": vllm.__version__, "env": env}


ADAPTERS: dict[str, Callable[[Load], tuple[Runner, dict[str, Any]]]] = {
    "afdserve": _afdserve, "transformers": _transformers, "vllm": _vllm}


def serve(inp: Any, out: Any) -> None:
    """The driver loop: messages from ``inp``, replies to ``out`` (text streams)."""
    run: Runner | None = None
    for line in inp:
        if not line.strip():
            continue
        try:
            msg = decode(line)
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Load):
                if run is not None:
                    raise RuntimeError("already loaded")
                if msg.engine not in ADAPTERS:
                    raise ValueError(f"unknown engine {msg.engine!r}; known: {', '.join(ENGINES)}")
                t0 = time.perf_counter()
                run, info = ADAPTERS[msg.engine](msg)
                reply: Any = Loaded(time.perf_counter() - t0, info)
            elif isinstance(msg, Generate):
                if run is None:
                    raise RuntimeError("Generate before Load")
                t0 = time.perf_counter()
                ids, touched = run(msg.prompts, msg.new_tokens, msg.routing)
                reply = Generated(time.perf_counter() - t0, ids, touched)
            else:
                raise ValueError(f"a driver does not take {type(msg).__name__}")
        except Exception as e:  # the benchmark reports it and stops this engine
            import traceback

            traceback.print_exc()
            reply = Failed(f"{type(e).__name__}: {e}")
        out.write(encode(reply))
        out.flush()


def main() -> None:
    proto = os.fdopen(os.dup(1), "w")  # messages only
    os.dup2(2, 1)  # whatever the engines print goes to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, proto)


if __name__ == "__main__":  # also vLLM's worker processes re-import this file: start nothing there
    main()
