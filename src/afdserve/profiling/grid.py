"""What ``afdserve profile`` measures: the grid of sizes and the repeats (:class:`ProfileGrid`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProfileGrid", "DEFAULT_GRID", "QUICK_GRID", "attention_points"]


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure.  Sizes are clipped to what the model allows."""

    batches: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256)  # b_a: sequences in one decode micro-batch
    seq_lens: tuple[int, ...] = (16, 256, 1024)  # s: context tokens of every sequence
    pairs_per_expert: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # b_e / experts held
    experts_per_node: tuple[int, ...] | None = None  # default: every divisor of E
    msg_tokens: tuple[int, ...] = (1, 16, 64, 256, 1024)  # tokens per M2N message
    step_batches: tuple[int, ...] = (1, 4, 8, 16, 24, 32, 48, 64, 128, 256)  # sequences per engine step
    dispatch_workers: tuple[int, ...] = (1, 2, 4)  # expert workers a micro-batch is dispatched to
    repeats: int = 9  # timed calls per point and pass (median)
    passes: int = 3  # passes over the grid; a point's time is the least of its passes' medians
    transport_repeats: int = 100
    corun: bool = True  # measure how much two workers computing at once slow each other
    lend: bool = True  # measure what the fused MoE and the LM head gain from lent cores
    max_context_tokens: int = 1 << 16  # attention points with b * s above this are skipped (memory)


DEFAULT_GRID = ProfileGrid()
QUICK_GRID = ProfileGrid(
    batches=(1, 8, 32, 128),
    seq_lens=(16, 512),
    pairs_per_expert=(2, 8, 32),
    experts_per_node=None,
    msg_tokens=(1, 64, 512),
    step_batches=(1, 16, 64, 256),
    dispatch_workers=(1, 2),
    repeats=5,
    passes=2,
    transport_repeats=40,
)


def attention_points(grid: ProfileGrid, num_experts: int) -> list[tuple[int, int, int]]:
    """The (b, s, n_e) grid: every b x s with one expert worker, and every b at the shortest s with
    each other worker count (the per-worker cost of the dispatch)."""
    pts = [(b, s, 1) for s in grid.seq_lens for b in grid.batches if b * s <= grid.max_context_tokens]
    s0 = min(grid.seq_lens)
    pts += [(b, s0, n) for n in grid.dispatch_workers if 1 < n <= num_experts for b in grid.batches]
    return pts
