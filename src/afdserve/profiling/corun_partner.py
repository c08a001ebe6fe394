"""``python -m afdserve.profiling.corun_partner ROLE MODEL DTYPE SECONDS``: the partner process of
the co-running measurement (:mod:`afdserve.profiling.corun`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from afdserve.profiling.corun import attention_work, expert_work
from afdserve.profiling.parts import Checkpoint

__all__ = ["run_partner"]


@torch.inference_mode()
def run_partner(role: str, model_path: Path, dtype: str, seconds: float) -> None:
    """One worker role's work in a loop for ``seconds``, printing ``ready`` once its weights are
    loaded (the partner process of :func:`~afdserve.profiling.corun.measure_corun`)."""
    torch.set_num_threads(1)
    ckpt = Checkpoint(model_path, dtype)
    cfg = ckpt.cfg
    end = time.monotonic() + seconds
    if role == "expert":  # rounds of 8 pairs per expert
        expert_layer = expert_work(ckpt, 8)
        print("ready", flush=True)
        layer = 0
        while time.monotonic() < end:
            expert_layer(layer % cfg.num_layers)
            layer += 1
    else:  # every layer, then the LM head
        attention_layer, lm_head = attention_work(ckpt)
        print("ready", flush=True)
        while time.monotonic() < end:
            for lyr in range(cfg.num_layers):
                attention_layer(lyr)
            lm_head()


if __name__ == "__main__":
    run_partner(sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
