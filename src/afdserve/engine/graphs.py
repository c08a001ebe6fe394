"""The colocated engine's captured decode steps: ``PaddedDecode.forward`` captured once per padded
batch size, greedy (token ids) and sampled (logits), at start-up (``CapturedDecode.start``), by the
mechanism the backends chose once (``afdserve.backends.capture``: CUDA graphs on a GPU; on the CPU,
with ``compile=True``, the same function compiled whole).

Each capture is checked before it serves: its function runs on a second batch, different from the
one it was captured with (other tokens, lengths and padded rows), and its outputs must be the eager
runner's on the same inputs (logits within the rounding of a changed order of sums; greedy tokens
the eager logits' largest). A capture that fails or differs warns, and every decode step runs eager.
Prefill and mixed steps, and any step ``PaddedDecode.size_of`` refuses, run eager.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import torch

from afdserve.backends.capture import Capture
from afdserve.engine.padded import PaddedDecode
from afdserve.engine.runner import ModelInput, ModelOutput


class CaptureMismatch(RuntimeError):
    pass


class CapturedDecode:
    def __init__(self, padded: PaddedDecode, capture: Capture):
        self.padded, self.capture = padded, capture
        self.runs: dict[tuple[int, bool], Callable[[], torch.Tensor]] = {}

    @classmethod
    @torch.inference_mode()
    def start(cls, padded: PaddedDecode, capture: Capture,
              eager: Callable[[ModelInput], ModelOutput]) -> "CapturedDecode | None":
        """Every padded size's two functions captured (the largest first: smaller graphs reuse its
        memory) and checked against ``eager``; None (after a warning) where one fails. The routings
        counted meanwhile are cleared: the engine's load statistics start empty."""
        self = cls(padded, capture)
        try:
            for b in reversed(padded.sizes):
                for greedy in (True, False):
                    padded.write(padded.dummy(b, seed=2 * b), b)
                    run = capture.capture(functools.partial(padded.forward, b, greedy))
                    run()  # a compiled function compiles on its first call
                    self.runs[(b, greedy)] = run
                self._check(b, eager)
        except Exception as e:  # noqa: BLE001 - any failure of a capture: the steps run eager
            warnings.warn(f"{capture.name} capture of the decode step failed, running eager: "
                          f"{type(e).__name__}: {str(e)[:500]}", RuntimeWarning, stacklevel=2)
            self = None
        ex = padded.experts
        ex.tracker.reset()
        ex.counts.zero_()
        return self

    def _check(self, b: int, eager: Callable[[ModelInput], ModelOutput]) -> None:
        """Size b's captures on a batch they were not captured with, against ``eager``."""
        p = self.padded
        inp = p.dummy(b, seed=2 * b + 1)
        n = inp.layout.num_seqs
        ref = eager(inp).logits
        p.write(inp, b)
        logits = self.runs[(b, False)]()[:n]
        scale = ref.abs().max().clamp_min(1.0)
        tol = (1e-3 if p.model.dtype == torch.float32 else 5e-2) * scale
        if logits.shape != ref.shape or not bool(((logits - ref).abs() <= tol).all()):
            raise CaptureMismatch(f"batch size {b}: the captured logits differ from the eager step's by up to "
                                  f"{(logits - ref).abs().max().item():.3g} (tolerance {tol.item():.3g})")
        p.write(inp, b)
        ids = self.runs[(b, True)]()[:n]
        chosen = ref.gather(1, ids[:, None])[:, 0]
        if not bool((chosen >= ref.max(1).values - tol).all()):
            want = eager(dataclasses.replace(inp, greedy=True)).token_ids
            raise CaptureMismatch(f"batch size {b}: the captured greedy tokens {ids.tolist()} are not the eager "
                                  f"step's {want.tolist()}")

    def __call__(self, inp: ModelInput) -> ModelOutput | None:
        """``inp`` through its padded size's capture (the outputs are valid until the next step's);
        None where it runs eager."""
        p = self.padded
        b = p.size_of(inp)
        if b is None:
            return None
        p.write(inp, b)
        out = self.runs[(b, inp.greedy)]()[:inp.layout.num_seqs]
        p.fold()
        return ModelOutput(token_ids=out) if inp.greedy else ModelOutput(logits=out)
