"""Where a layer's tokens go: the attention side's dispatch plan, computed on the tokens' device.

For one layer of one micro-batch of ``T`` tokens routed top-k (attention-side gate), the plan gives
each expert worker ``j`` a slot of fixed capacity ``C_j`` rows: the tokens with at least one of
their k experts on ``j``, in token order, each row with its k ids (``num_experts`` for the pairs
that are not ``j``'s) and weights. Everything is tensor ops on the ids' device -- owners, per
destination membership, positions by a cumulative sum, the gather into the slots -- so nothing is
read back to the host and the shapes depend only on ``T`` (a layer's halves can be captured in
graphs). Padding rows carry no expert (all ids ``num_experts``) and scatter into a spare row.

Capacity (``Capacity``): with no factor every token fits (``C_j = T``: the outputs never change);
with a factor ``f``, ``C_j = min(T, ceil(f * p_j * T))`` where ``p_j`` is the share of tokens that
reach worker ``j`` when routing is uniform (``1 - C(E - E_j, k) / C(E, k)`` for ``E_j`` of ``E``
experts held). Rows beyond it either ``drop`` their pairs on that worker (the token's other weights
rescaled to the sum of all k, counted) or go in a ``second-pass`` round, which reads the overflow
counts on the host (the one read, and only when a capacity is below ``T``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from afdserve.config import OVERFLOW_POLICIES, is_capacity_factor
from afdserve.errors import ConfigError
from afdserve.runtime.expert_map import ExpertMap


@dataclass(frozen=True)
class Capacity:
    factor: float | None = None  # None: every token fits
    overflow: str = "second-pass"  # "drop" | "second-pass"

    def __post_init__(self) -> None:
        f = self.factor
        if f is not None and not is_capacity_factor(f):
            raise ConfigError(f"invalid expert_capacity_factor={f!r}: must be a number > 0 (or None: no limit)")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"invalid on_expert_overflow={self.overflow!r}: use 'drop' or 'second-pass'")


@dataclass
class Round:
    """One round of a layer's dispatch: per destination, a slot of ``rows`` [N, C] (token index;
    ``T`` for padding, which combines into a spare row), ``ids`` [N, C, k] int32 and ``weights``
    [N, C, k]; ``to`` the destinations that get a message (in the first round every worker holding
    experts of the layer)."""

    rows: torch.Tensor
    src: torch.Tensor  # [N, C]: the token each slot row is gathered from (any token for padding)
    ids: torch.Tensor
    weights: torch.Tensor
    to: list[int]


# counters (int64, on the device; read on the host only with the stats)
DROPPED_LOST, DROPPED_CAPACITY, SECOND_PASS_ROWS = 0, 1, 2


class Dispatcher:
    def __init__(self, expert_map: ExpertMap, num_experts: int, top_k: int, capacity: Capacity,
                 device: torch.device):
        self.num_experts, self.top_k, self.capacity, self.device = num_experts, top_k, capacity, device
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self.per_worker = torch.zeros(expert_map.num_workers, dtype=torch.int64, device=device)  # rows sent so far
        self.set_map(expert_map, None)

    def set_map(self, expert_map: ExpertMap, lost: torch.Tensor | None) -> None:
        """The map to route by; ``lost`` bool [L, E]: experts no live worker holds (their pairs are
        dropped, the tokens' other weights rescaled), or None."""
        n = expert_map.num_workers
        if n != self.per_worker.numel():  # the expert pool was resized: counted anew
            self.per_worker = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.map, self.n = expert_map, n
        self._workers = torch.arange(n, device=self.device).view(n, 1, 1)
        self.lost = None if lost is None else lost.to(self.device)
        # per layer: the first expert still held (lost pairs route as it, then are taken out), -1: none
        self._held = [] if lost is None else [int(r.nonzero()[0, 0]) if bool(r.any()) else -1 for r in ~lost]
        e, k = self.num_experts, self.top_k
        held = [expert_map.held_counts(layer) for layer in range(expert_map.num_layers)]
        self._share = [[1.0 - math.comb(e - h, k) / math.comb(e, k) for h in counts] for counts in held]
        # per layer, the workers that get a message: those holding some of its experts (not a missing one)
        self._to = [[j for j, h in enumerate(counts) if h > 0] for counts in held]
        self._caps: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}

    def whole(self, layer: int, t: int) -> bool:
        """Does one worker take the layer's ``t`` tokens as they are (it holds every expert, none is
        missing, no capacity binds)? Then no plan is needed (``sent_whole``)."""
        return self.n == 1 and self.lost is None and self.caps(layer, t)[1] is None

    def sent_whole(self, t: int) -> None:
        """Counts ``t`` rows sent to every worker without a plan (one worker, or the expert-side gate)."""
        self.per_worker += t

    def caps(self, layer: int, t: int) -> tuple[int, torch.Tensor | None]:
        """(the slot rows ``C`` = the largest capacity, per destination capacities [N, 1] or None:
        every token fits)."""
        f = self.capacity.factor
        if f is None:
            return t, None
        hit = self._caps.get((layer, t))
        if hit is None:
            caps = [min(t, math.ceil(f * p * t)) for p in self._share[layer]]
            if all(c >= t for c, p in zip(caps, self._share[layer]) if p > 0):  # (a worker holding none gets none)
                return t, None
            if len(self._caps) > 4096:
                self._caps.clear()
            hit = self._caps[(layer, t)] = (max(caps), torch.tensor(caps, device=self.device).view(-1, 1))
        return hit

    def plan(self, layer: int, ids: torch.Tensor, w: torch.Tensor) -> tuple[list[Round], torch.Tensor]:
        """The rounds of one layer's dispatch of top-k ``ids`` [T, k] and weights ``w`` [T, k]; and
        the weights as used (rescaled where pairs were dropped)."""
        t = ids.shape[0]
        owner = self._owner(layer, ids)
        if self.lost is not None:
            lost = owner < 0
            w = renormalized_weights(w, ~lost)
            self.counters[DROPPED_LOST] += lost.sum()
        mine = owner.unsqueeze(0) == self._workers  # [N, T, k]
        has = mine.any(2)  # [N, T]: the rows each destination gets
        c, cap = self.caps(layer, t)
        if cap is None:
            rounds = [self._round(has, c, ids, w, mine, self._to[layer], False)]
            self.per_worker += has.sum(1)
            return rounds, w
        pos = has.cumsum(1) - 1
        fits = has & (pos < cap)
        over = has & ~fits
        if self.capacity.overflow == "drop":
            dropped = (mine & over.unsqueeze(2)).any(0)  # [T, k]
            w = renormalized_weights(w, ~dropped)
            self.counters[DROPPED_CAPACITY] += dropped.sum()
            self.per_worker += fits.sum(1)
            return [self._round(fits, c, ids, w, mine, self._to[layer], True)], w
        rounds = [self._round(fits, c, ids, w, mine, self._to[layer], True)]
        spill = over.sum(1)
        self.per_worker += has.sum(1)
        self.counters[SECOND_PASS_ROWS] += spill.sum()
        counts = spill.tolist()  # second-pass: the one host read, of the overflow counts
        if max(counts) > 0:
            rounds.append(self._round(over, max(counts), ids, w, mine, [j for j, n in enumerate(counts) if n], True))
        return rounds, w

    def _owner(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        if self.lost is None:
            return self.map.route(layer, ids)
        lost = self.lost[layer][ids.long()]
        held = self._held[layer]
        if held < 0:  # no expert of this layer is held anywhere: nothing routed
            return torch.full(ids.shape, -1, dtype=torch.int64, device=ids.device)
        return torch.where(lost, -1, self.map.route(layer, torch.where(lost, held, ids)))

    def _round(self, take: torch.Tensor, c: int, ids: torch.Tensor, w: torch.Tensor, mine: torch.Tensor,
               to: list[int], masked: bool) -> Round:
        """The slots [N, c] of the rows ``take`` [N, T] (at most c each), in token order: a stable sort
        puts each destination's rows first. ``masked``: some rows not taken have pairs on the
        destination (over capacity), which the slot's padding must not carry."""
        n, t = take.shape
        skipped, src = torch.sort(~take, dim=1, stable=True)
        skipped, src = skipped[:, :c], src[:, :c]
        rows = torch.where(skipped, t, src)
        if masked:
            mine = mine & take.unsqueeze(2)
        k = ids.shape[1]
        sub = torch.where(mine, ids.to(torch.int32).unsqueeze(0), self.num_experts)
        sub = sub.gather(1, src.unsqueeze(2).expand(n, c, k))
        return Round(rows, src, sub, w.index_select(0, src.reshape(-1)).view(n, c, k), to)

    def read(self) -> tuple[list[int], list[int]]:
        """(rows sent to each expert worker so far, the counters: lost, over capacity, second-pass)."""
        return self.per_worker.tolist(), self.counters.tolist()


def renormalized_weights(w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Top-k weights [T, k] with the pairs not in ``keep`` zeroed and the kept ones scaled to the
    sum of all k (a token with none kept gets nothing routed)."""
    kept = torch.where(keep, w, torch.zeros_like(w))
    return kept * (w.sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny))
