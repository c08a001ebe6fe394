"""Expert placement: which logical expert every physical expert slot of every worker holds.

A worker ``w`` has ``capacities[w]`` expert slots per layer (its memory budget for expert weights).
``LayerPlacement.slots[w][s]`` is the logical expert loaded into slot ``s`` of worker ``w`` for
that layer, or :data:`EMPTY`. An expert may have several replicas, on distinct workers; every
logical expert has at least one. Physical expert ids number the slots worker by worker:
``physical = offsets[w] + s``. Optionally ``shares[w][s]`` is the fraction of the expert's tokens
that slot should serve (a MegaScale-Infer plan's ``x_ig``); ``None`` means an even split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from afdserve.errors import ConfigError

EMPTY = -1


def capacities_of(num_workers: int, slots_per_worker: int | Sequence[int]) -> tuple[int, ...]:
    """Per-worker slot counts from an int (same for all) or a sequence of ``num_workers`` ints."""
    if num_workers < 1:
        raise ConfigError(f"num_workers must be >= 1, got {num_workers}")
    if isinstance(slots_per_worker, (int, np.integer)):
        caps = (int(slots_per_worker),) * num_workers
    else:
        caps = tuple(int(c) for c in slots_per_worker)
        if len(caps) != num_workers:
            raise ConfigError(f"slots_per_worker has {len(caps)} entries for {num_workers} workers")
    if any(c < 0 for c in caps):
        raise ConfigError(f"slots_per_worker must be >= 0, got {caps}")
    return caps


def slots_from_memory(free_bytes: Sequence[int], expert_bytes: int, num_layers: int) -> list[int]:
    """Expert slots per layer that fit in each worker's free memory (every layer gets the same count)."""
    if expert_bytes <= 0 or num_layers <= 0:
        raise ConfigError(f"expert_bytes and num_layers must be > 0, got {expert_bytes}, {num_layers}")
    return [int(b) // (expert_bytes * num_layers) for b in free_bytes]


@dataclass(frozen=True)
class LayerPlacement:
    """Placement of one layer: ``slots[worker][slot]`` = logical expert id or ``EMPTY``;
    ``shares[worker][slot]`` (optional) = fraction of that expert's tokens the slot serves."""

    num_experts: int
    slots: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...] | None = None
    _replicas: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _cache: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        slots = tuple(tuple(int(e) for e in worker) for worker in self.slots)
        object.__setattr__(self, "slots", slots)
        if self.shares is not None:
            shares = tuple(tuple(float(x) for x in worker) for worker in self.shares)
            if tuple(len(w) for w in shares) != tuple(len(w) for w in slots):
                raise ConfigError("LayerPlacement.shares must have the shape of slots")
            object.__setattr__(self, "shares", shares)
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for w, worker in enumerate(slots):
            for e in worker:
                if 0 <= e < self.num_experts and (not replicas[e] or replicas[e][-1] != w):
                    replicas[e].append(w)
        object.__setattr__(self, "_replicas", tuple(tuple(r) for r in replicas))
        offsets = [0]
        for worker in slots:
            offsets.append(offsets[-1] + len(worker))
        object.__setattr__(self, "_offsets", tuple(offsets))

    @property
    def num_workers(self) -> int:
        return len(self.slots)

    @property
    def capacities(self) -> tuple[int, ...]:
        return tuple(len(w) for w in self.slots)

    @property
    def num_slots(self) -> int:
        return self._offsets[-1]

    def experts_on(self, worker: int) -> tuple[int, ...]:
        """Logical experts held by ``worker``, in slot order (empty slots skipped)."""
        return tuple(e for e in self.slots[worker] if e != EMPTY)

    def replicas_of(self, expert: int) -> tuple[int, ...]:
        """Workers holding ``expert``, ascending."""
        return self._replicas[expert]

    def replica_counts(self) -> np.ndarray:
        """int64 [E]: number of replicas of each logical expert."""
        return np.array([len(r) for r in self._replicas], dtype=np.int64)

    def share(self, worker: int, expert: int) -> float:
        """Fraction of ``expert``'s tokens ``worker`` serves (even split when no shares are set)."""
        if self.shares is None:
            return 1.0 / len(self._replicas[expert]) if worker in self._replicas[expert] else 0.0
        try:
            return self.shares[worker][self.slot_of(worker, expert)]
        except KeyError:
            return 0.0

    def slot_of(self, worker: int, expert: int) -> int:
        """The slot of ``worker`` holding ``expert``; ``KeyError`` if it holds none."""
        try:
            return self.slots[worker].index(expert)
        except ValueError:
            raise KeyError(f"worker {worker} does not hold expert {expert}") from None

    def physical_id(self, worker: int, slot: int) -> int:
        return self._offsets[worker] + slot

    def physical_to_logical(self) -> list[int]:
        """Flat list over physical slots (worker-major): logical expert or ``EMPTY``."""
        return [e for worker in self.slots for e in worker]

    def logical_to_physical(self) -> list[list[int]]:
        """For each logical expert, the physical ids of its replicas (ascending worker)."""
        return [[self.physical_id(w, self.slot_of(w, e)) for w in self._replicas[e]] for e in range(self.num_experts)]

    def validate(self, capacities: Sequence[int] | None = None) -> None:
        """Raises ``ConfigError`` unless every expert is placed, ids are in range, no worker holds an
        expert twice and (if given) each worker has exactly ``capacities[w]`` slots."""
        if capacities is not None and tuple(capacities) != self.capacities:
            raise ConfigError(f"placement has slots {self.capacities}, expected {tuple(capacities)}")
        for w, worker in enumerate(self.slots):
            held = [e for e in worker if e != EMPTY]
            bad = [e for e in held if not 0 <= e < self.num_experts]
            if bad:
                raise ConfigError(f"worker {w} holds unknown experts {bad} (num_experts={self.num_experts})")
            if len(set(held)) != len(held):
                raise ConfigError(f"worker {w} holds an expert twice: {worker}")
        missing = [e for e in range(self.num_experts) if not self._replicas[e]]
        if missing:
            raise ConfigError(f"experts {missing[:8]}{'...' if len(missing) > 8 else ''} have no replica")
        if self.shares is not None:
            total = np.zeros(self.num_experts)
            for worker, fractions in zip(self.slots, self.shares):
                for e, x in zip(worker, fractions):
                    if x < 0 or (e == EMPTY and x != 0):
                        raise ConfigError(f"invalid share {x} for slot holding {e}")
                    if e != EMPTY:
                        total[e] += x
            bad = np.flatnonzero(np.abs(total - 1.0) > 1e-6)
            if bad.size:
                raise ConfigError(f"shares of experts {bad[:8].tolist()} do not sum to 1")


@dataclass(frozen=True)
class Placement:
    """Placement of every layer; all layers share the worker count and per-worker slot counts."""

    layers: tuple[LayerPlacement, ...]

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise ConfigError("a Placement needs at least one layer")
        object.__setattr__(self, "layers", layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def num_workers(self) -> int:
        return self.layers[0].num_workers

    @property
    def capacities(self) -> tuple[int, ...]:
        return self.layers[0].capacities

    def replicas_of(self, layer: int, expert: int) -> list[int]:
        """Workers holding ``expert`` in ``layer``, ascending."""
        return list(self.layers[layer].replicas_of(expert))

    def experts_on(self, layer: int, worker: int) -> list[int]:
        return list(self.layers[layer].experts_on(worker))

    def validate(self) -> None:
        caps = self.capacities
        for i, lp in enumerate(self.layers):
            if lp.num_experts != self.num_experts:
                raise ConfigError(f"layer {i} has {lp.num_experts} experts, layer 0 has {self.num_experts}")
            try:
                lp.validate(caps)
            except ConfigError as e:
                raise ConfigError(f"layer {i}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "layers": [[list(w) for w in lp.slots] for lp in self.layers],
            "shares": [None if lp.shares is None else [list(w) for w in lp.shares] for lp in self.layers],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Placement":
        e = int(d["num_experts"])
        shares = d.get("shares") or [None] * len(d["layers"])
        return Placement(
            tuple(
                LayerPlacement(e, tuple(tuple(w) for w in layer), None if sh is None else tuple(tuple(w) for w in sh))
                for layer, sh in zip(d["layers"], shares)
            )
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Placement":
        return Placement.from_dict(json.loads(text))


def round_robin_layer(num_experts: int, num_workers: int, slots_per_worker: int | Sequence[int]) -> LayerPlacement:
    """One copy per expert, contiguous blocks: worker 0 gets experts 0..n0-1, worker 1 the next n1...

    Block sizes are as even as the capacities allow (the first ``E mod N`` workers get one more when
    all capacities suffice); unused slots stay ``EMPTY``.
    """
    caps = capacities_of(num_workers, slots_per_worker)
    if sum(caps) < num_experts:
        raise ConfigError(f"{num_experts} experts do not fit in {sum(caps)} slots ({caps})")
    sizes = [0] * num_workers
    left = num_experts
    while left:  # water-filling: one more expert to every worker that still has room, in order
        for w in range(num_workers):
            if left and sizes[w] < caps[w]:
                sizes[w] += 1
                left -= 1
    slots = []
    start = 0
    for w in range(num_workers):
        block = list(range(start, start + sizes[w]))
        start += sizes[w]
        slots.append(tuple(block + [EMPTY] * (caps[w] - sizes[w])))
    return LayerPlacement(num_experts, tuple(slots))


def round_robin(
    num_experts: int, num_workers: int, slots_per_worker: int | Sequence[int], num_layers: int = 1
) -> Placement:
    """The static expert-parallel baseline: :func:`round_robin_layer` for every layer."""
    lp = round_robin_layer(num_experts, num_workers, slots_per_worker)
    return Placement((lp,) * num_layers)


def align_slots(new: Placement, old: Placement) -> Placement:
    """``new`` with each worker's experts permuted so that experts it already held in ``old`` keep
    their slot; the placement (who holds what, and shares) is unchanged, only fewer weights need
    reloading."""
    if new.capacities != old.capacities or new.num_layers != old.num_layers:
        raise ConfigError("align_slots needs placements of the same shape")
    layers = []
    for lp_new, lp_old in zip(new.layers, old.layers):
        slots, shares = [], []
        for w, (ws_new, ws_old) in enumerate(zip(lp_new.slots, lp_old.slots)):
            want = [e for e in ws_new if e != EMPTY]
            keep = set(want)
            row: list[int] = [e if (e != EMPTY and e in keep) else EMPTY for e in ws_old]
            placed = set(row)
            rest = [e for e in want if e not in placed]
            for s in range(len(row)):
                if row[s] == EMPTY and rest:
                    row[s] = rest.pop(0)
            slots.append(tuple(row))
            shares.append(tuple(0.0 if e == EMPTY else lp_new.share(w, e) for e in row))
        layers.append(LayerPlacement(lp_new.num_experts, tuple(slots), None if lp_new.shares is None else tuple(shares)))
    return Placement(tuple(layers))


@dataclass(frozen=True)
class SlotChange:
    """Slot ``slot`` of ``worker`` in ``layer`` must switch from ``old`` to ``new`` (``EMPTY`` = unload)."""

    layer: int
    worker: int
    slot: int
    old: int
    new: int


def slot_changes(old: Placement, new: Placement) -> list[SlotChange]:
    """The slots whose logical expert differs between two placements of the same shape."""
    if new.capacities != old.capacities or new.num_layers != old.num_layers:
        raise ConfigError("slot_changes needs placements of the same shape")
    out = []
    for l, (a, b) in enumerate(zip(old.layers, new.layers)):
        for w, (sa, sb) in enumerate(zip(a.slots, b.slots)):
            for s, (ea, eb) in enumerate(zip(sa, sb)):
                if ea != eb:
                    out.append(SlotChange(l, w, s, ea, eb))
    return out
