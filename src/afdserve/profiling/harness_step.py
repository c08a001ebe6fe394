"""The attention worker's per-step work outside its layers, and the LM head of a micro-batch (the
profile's ``step`` overhead and ``runtime.lm_head_*``)."""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from afdserve.engine import SamplingParams
from afdserve.runtime import AttentionStats, ControlChannel, StepOutputs
from afdserve.profiling.loopback import LoopbackLinks
from afdserve.profiling.parts import Checkpoint, attention_engine
from afdserve.profiling.timers import CpuTracer, cpu_time

__all__ = ["measure_step"]


class _PipeSink:
    """The worker's control channel to the front end: a real pipe whose far end a thread drains."""

    def __init__(self) -> None:
        r, w = os.pipe()
        self.ctl = ControlChannel(Connection(w, readable=False))
        self._r = r
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        while os.read(self._r, 1 << 20):
            pass

    def close(self) -> None:
        self.ctl.close()
        self._t.join(5)
        os.close(self._r)


def measure_step(
    model_path: Path,
    batches: Sequence[int],
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    prompt_len: int = 8,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """``([b, overhead_s], [b, lm_head_s], [b, begin_s])``: the per-step work of an attention worker
    outside its layers -- scheduling, metadata, micro-batch split, embedding, sampling, and shipping
    the new tokens over a pipe as the worker does --, the LM head of a micro-batch (timed apart
    because the runtime runs it per lane step), and the part of the overhead before the first layer
    (``Engine.begin``).  Timed in CPU time with the real ``Engine`` driving the
    attention worker's ``PipelinedRunner`` (loop-back links, one expert worker, ``m = 1``): a decode
    step minus the span from its first layer's attention to its last span, the LM head spans from
    the runner's own trace."""
    ckpt = Checkpoint(model_path, dtype)
    cfg = ckpt.cfg
    over, head, begins = [], [], []
    sink = _PipeSink()
    try:
        for b in batches:
            steps = repeats + 2
            max_len = min(cfg.max_position_embeddings, prompt_len + steps + 8)
            tracer = CpuTracer()
            links = LoopbackLinks(cfg.hidden_size, ckpt.dtype, on_recv=flush)
            eng = attention_engine(ckpt, b, max_len, links, tracer)
            gen = torch.Generator().manual_seed(3)
            params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            for i in range(b):
                eng.add_request(f"p{i}", torch.randint(3, cfg.vocab_size, (prompt_len,), generator=gen).tolist(),
                                params)
            eng.step()  # prefill
            sink.ctl.send(_step_outputs(eng, eng.step()))  # the first decode step
            ts, hs, bs = [], [], []
            for _ in range(repeats):
                flush()
                tracer.spans.clear()
                t0 = cpu_time()
                step = eng.begin()
                bs.append(cpu_time() - t0)
                assert step is not None
                sink.ctl.send(_step_outputs(eng, eng.finish(step, eng.runner.forward(step.model_input))))
                total = cpu_time() - t0
                first = min(sp[2] for sp in tracer.spans)
                last = max(sp[3] for sp in tracer.spans)
                ts.append(total - (last - first))
                hs.append(sum(sp[3] - sp[2] for sp in tracer.spans if sp[1] == "lm_head"))
            t, h = float(statistics.median(ts)), float(statistics.median(hs))
            over.append([float(b), t])
            head.append([float(b), h])
            begins.append([float(b), float(statistics.median(bs))])
            log(f"  step overhead b={b:<4} {t * 1e3:8.3f} ms   LM head {h * 1e3:8.3f} ms")
            del eng
    finally:
        sink.close()
    return over, head, begins


def _step_outputs(eng, outs) -> StepOutputs:
    """What an attention worker sends after a step that produced tokens."""
    runner = eng.runner
    return StepOutputs("attention0", outs, AttentionStats(
        len(eng.scheduler.running), len(eng.scheduler.waiting), eng.blocks.usage, eng.last_step.seconds,
        eng.last_step.num_tokens, runner.counts()[0]))
