"""Expert load tracking: tokens per expert and co-activation counts over a sliding window.

A :class:`LoadTracker` lives next to the router (wherever ``topk_ids`` are produced) and is fed the
logical top-k ids of every micro-batch and layer. It keeps a ring of ``slots`` count buffers on the
ids' device, so ``record`` is a handful of asynchronous tensor ops (an ``index_add_`` for tokens,
one for co-activation) and never synchronises with the host. ``snapshot`` sums the ring and
copies it to the host as a :class:`LoadSnapshot`, which serialises to JSON and merges by summation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from afdserve.errors import ConfigError

SNAPSHOT_FORMAT = "afdserve.expert-load/1"


@dataclass(frozen=True)
class LoadSnapshot:
    """Expert load of every layer over a window of engine steps.

    ``tokens[l, e]``: number of (token, expert) routings of layer ``l`` to logical expert ``e``.
    ``coactivation[l, i, j]``: number of tokens of layer ``l`` that chose both ``i`` and ``j``
    (symmetric, zero diagonal); ``None`` when the tracker did not collect it.
    ``steps``: engine steps the window covers (to turn counts into per-step rates).
    """

    tokens: np.ndarray  # int64 [L, E]
    coactivation: np.ndarray | None  # int64 [L, E, E]
    steps: int

    def __post_init__(self) -> None:
        tokens = np.asarray(self.tokens, dtype=np.int64)
        if tokens.ndim != 2:
            raise ConfigError(f"LoadSnapshot.tokens must be [layers, experts], got shape {tokens.shape}")
        object.__setattr__(self, "tokens", tokens)
        if self.coactivation is not None:
            co = np.asarray(self.coactivation, dtype=np.int64)
            num_layers, num_experts = tokens.shape
            if co.shape != (num_layers, num_experts, num_experts):
                raise ConfigError(
                    f"LoadSnapshot.coactivation must be [{num_layers}, {num_experts}, {num_experts}], got {co.shape}"
                )
            object.__setattr__(self, "coactivation", co)
        if self.steps < 0:
            raise ConfigError(f"LoadSnapshot.steps must be >= 0, got {self.steps}")

    @property
    def num_layers(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[1])

    def tokens_per_step(self) -> np.ndarray:
        """float64 [L, E]: mean routings per engine step (the counts when ``steps`` is 0)."""
        return self.tokens / max(self.steps, 1)

    def coactivation_per_step(self) -> np.ndarray:
        """float64 [L, E, E]: mean co-activations per step (zeros when not collected)."""
        if self.coactivation is None:
            return np.zeros((self.num_layers, self.num_experts, self.num_experts))
        return self.coactivation / max(self.steps, 1)

    @staticmethod
    def merge(snapshots: Iterable["LoadSnapshot"]) -> "LoadSnapshot":
        """Sum of snapshots taken by workers that ran side by side over the same window.

        Counts add up; ``steps`` is the largest of them (the workers' steps ran concurrently).
        Co-activation is kept only if every snapshot has it.
        """
        snaps = list(snapshots)
        if not snaps:
            raise ConfigError("LoadSnapshot.merge needs at least one snapshot")
        shape = snaps[0].tokens.shape
        for s in snaps:
            if s.tokens.shape != shape:
                raise ConfigError(f"cannot merge snapshots of shapes {shape} and {s.tokens.shape}")
        tokens = np.sum([s.tokens for s in snaps], axis=0)
        co = None
        if all(s.coactivation is not None for s in snaps):
            co = np.sum([s.coactivation for s in snaps], axis=0)
        return LoadSnapshot(tokens=tokens, coactivation=co, steps=max(s.steps for s in snaps))

    def __add__(self, other: "LoadSnapshot") -> "LoadSnapshot":
        return LoadSnapshot.merge([self, other])

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "steps": self.steps,
            "tokens": self.tokens.tolist(),
            "coactivation": None if self.coactivation is None else self.coactivation.tolist(),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "LoadSnapshot":
        if d.get("format") != SNAPSHOT_FORMAT:
            raise ConfigError(f"not an expert-load snapshot (format={d.get('format')!r}, expected {SNAPSHOT_FORMAT!r})")
        num_layers, num_experts = int(d["num_layers"]), int(d["num_experts"])
        tokens = np.asarray(d["tokens"], dtype=np.int64).reshape(num_layers, num_experts)
        co = d.get("coactivation")
        coactivation = None if co is None else np.asarray(co, dtype=np.int64).reshape(num_layers, num_experts, num_experts)
        return LoadSnapshot(tokens=tokens, coactivation=coactivation, steps=int(d["steps"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "LoadSnapshot":
        return LoadSnapshot.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> "LoadSnapshot":
        return LoadSnapshot.from_json(Path(path).read_text())


class LoadTracker:
    """Per-layer expert load over the last ``window`` engine steps.

    Call :meth:`record` for every (micro-batch, layer) with the router's logical ``topk_ids`` and
    :meth:`step` once per engine step. The window is a ring of ``slots`` buffers, each holding
    ``window // slots`` consecutive steps, the step in progress included; with ``slots == window``
    (the default) a snapshot covers exactly the last ``window`` steps (the one in progress and the
    ``window - 1`` before it). Fewer slots trade window
    precision for memory: the co-activation ring takes ``4 * slots * L * E * E`` bytes on ``device``.

    Co-activation (``k * (k-1) / 2`` pairs per token) is sampled: recorded in one step of every
    ``coactivation_every`` and scaled up to the window's steps in the snapshot, so that tracking costs
    one small update per layer in most steps.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window: int = 64,
        *,
        slots: int | None = None,
        coactivation: bool = True,
        coactivation_every: int = 8,
        device: torch.device | str = "cpu",
    ) -> None:
        slots = window if slots is None else slots
        if num_layers < 1 or num_experts < 1:
            raise ConfigError(f"LoadTracker needs num_layers >= 1 and num_experts >= 1, got {num_layers}, {num_experts}")
        if window < 1 or slots < 1 or window % slots:
            raise ConfigError(f"LoadTracker window ({window}) must be a positive multiple of slots ({slots})")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self.slots = slots
        self.steps_per_slot = window // slots
        self.device = torch.device(device)
        self._tokens = torch.zeros(slots, num_layers, num_experts, dtype=torch.int64, device=self.device)
        self._coact: torch.Tensor | None = None
        if coactivation:
            # Ordered pairs (first, second by top-k position) accumulate into one cell; the snapshot
            # symmetrises, so each token adds k*(k-1)/2 entries instead of k*(k-1).
            self._coact = torch.zeros(slots, num_layers, num_experts * num_experts, dtype=torch.int32, device=self.device)
        self._slot_steps = [0] * slots
        self._coact_steps = [0] * slots  # of them, steps whose co-activation was recorded
        self.coactivation_every = max(1, int(coactivation_every))
        self._step_no = 0
        self._cur = 0
        self._pending = False  # something was recorded in the step in progress
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ones: dict[torch.dtype, torch.Tensor] = {}

    def _pair_index(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k not in self._pairs:
            iu = torch.triu_indices(k, k, 1, device=self.device)
            self._pairs[k] = (iu[0], iu[1])
        return self._pairs[k]

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Adds one batch of routings of ``layer``: ``topk_ids`` [T, k] logical expert ids."""
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer} out of range [0, {self.num_layers})")
        ids = topk_ids.to(device=self.device, dtype=torch.int64)
        if ids.dim() == 1:
            ids = ids.unsqueeze(1)
        if ids.numel() == 0:
            return
        e = self.num_experts
        self._pending = True
        # index_add_ rather than bincount: CUDA bincount reads the max id back to the host
        flat_ids = ids.reshape(-1)
        self._tokens[self._cur, layer].index_add_(0, flat_ids, self._ones_like(flat_ids.numel(), torch.int64))
        if self._coact is not None and ids.shape[1] > 1 and self._step_no % self.coactivation_every == 0:
            first, second = self._pair_index(ids.shape[1])
            flat = (ids[:, first] * e + ids[:, second]).reshape(-1)
            self._coact[self._cur, layer].index_add_(0, flat, self._ones_like(flat.numel(), torch.int32))

    def add(self, tokens: torch.Tensor, ordered_pairs: torch.Tensor) -> None:
        """Adds a step's routings of every layer counted elsewhere, as ``record`` counts them: ``tokens``
        [L, E] (routings per expert) and ``ordered_pairs`` [L, E * E] (tokens per (first, second)
        expert by top-k position), on the tracker's device (a captured decode step's fixed buffers,
        ``afdserve.engine.padded``); the pairs count in the steps whose co-activation is sampled."""
        self._pending = True
        self._tokens[self._cur] += tokens
        if self._coact is not None and self._step_no % self.coactivation_every == 0:
            self._coact[self._cur] += ordered_pairs

    def _ones_like(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        ones = self._ones.get(dtype)
        if ones is None or ones.numel() < n:
            ones = torch.ones(max(n, 1024), dtype=dtype, device=self.device)
            self._ones[dtype] = ones
        return ones[:n]

    def step(self) -> None:
        """Marks the end of one engine step; every ``window // slots`` steps the ring advances."""
        self._pending = False
        self._slot_steps[self._cur] += 1
        self._coact_steps[self._cur] += self._step_no % self.coactivation_every == 0
        self._step_no += 1
        if self._slot_steps[self._cur] >= self.steps_per_slot:
            self._cur = (self._cur + 1) % self.slots
            self._slot_steps[self._cur] = 0
            self._coact_steps[self._cur] = 0
            self._tokens[self._cur].zero_()
            if self._coact is not None:
                self._coact[self._cur].zero_()

    def reset(self) -> None:
        self._tokens.zero_()
        if self._coact is not None:
            self._coact.zero_()
        self._slot_steps = [0] * self.slots
        self._coact_steps = [0] * self.slots
        self._step_no = 0
        self._cur = 0
        self._pending = False

    def snapshot(self) -> LoadSnapshot:
        """The window's counts on the host (one device-to-host copy)."""
        tokens = self._tokens.sum(0).cpu().numpy()
        co = None
        if self._coact is not None:
            e = self.num_experts
            ordered = self._coact.sum(0, dtype=torch.int64).view(self.num_layers, e, e)
            sym = ordered + ordered.transpose(1, 2)
            sym.diagonal(dim1=1, dim2=2).zero_()  # a token never picks an expert twice
            co = sym.cpu().numpy()
        steps = sum(self._slot_steps) + (1 if self._pending else 0)
        sampled = sum(self._coact_steps) + (1 if self._pending and self._step_no % self.coactivation_every == 0 else 0)
        if co is not None and sampled and sampled != steps:  # the sampled steps, scaled up to the window
            co = np.rint(co * (steps / sampled)).astype(np.int64)
        return LoadSnapshot(tokens=tokens, coactivation=co, steps=steps)
