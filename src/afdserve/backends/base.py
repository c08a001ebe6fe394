"""The backend interfaces: what the model's layers call, chosen once when the engine is built.

A layer holds the backend it was prepared with (``AttentionModel.prepare`` / ``ExpertModel.prepare``)
and never asks which device it runs on. Four small interfaces:

* ``AttentionBackend``: builds a step's attention context once (``prepare``: positions, cache slots,
  whatever its kernels read), then runs the attention half of a layer over the paged KV cache for
  prefills and decodes alike (``forward``), and, for MLA, the latent attention (``latent``).
* ``MoEBackend``: packs a layer's held experts once (``pack``) into an ``Experts`` callable.
* ``LinearBackend``: packs a weight once (``pack``) into a ``LinearOp`` (projections, the router,
  the LM head with its greedy argmax).
* ``NormBackend``: RMS norm (with the residual add) and RoPE with the KV-cache write.

``Ring`` is what a context-parallel prefill step exchanges with the other ranks (its KV per layer),
read by the CP attention halves (``afdserve.backends.pytorch.cp_half``).

Implementations: ``pytorch`` (device-agnostic PyTorch: CUDA and any CPU) and ``cpu`` (afdserve's C++
kernels). ``afdserve.backends.choose`` picks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from afdserve.backends.step import AttnContext, StepBuffers, StepLayout


@dataclass(frozen=True)
class Activation:
    """An expert's activation of its stacked gate/up output: ``silu`` is SwiGLU ``silu(gate) * up``;
    ``swiglu_oai`` is gpt-oss's ``(up + 1) * gate * sigmoid(alpha * gate)`` with gate clamped above
    at ``limit`` and up to ``[-limit, limit]``."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "silu":
            return torch.nn.functional.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class LinearOp(Protocol):
    """A weight [N, K] (and bias) packed once for a backend."""

    out_features: int

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` ([..., N], in ``out_dtype``: x's by default; float32 computed as such)."""
        ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 ``x @ W.T`` [M, N] (x [M, K]): logits read once, later (a kernel may
        write them past the caches)."""
        ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (int64 [M]) of ``logits(x)``: the first maximum, a NaN counting as the
        largest, as ``torch.argmax``; no logits are kept."""
        ...


class LinearBackend(Protocol):
    name: str

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearOp: ...


class NormBackend(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension, computed in float32, the weight applied in x's dtype."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, rms_norm(h)) with h = x + residual; x [T, D]."""
        ...

    def rope_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The queries [T, heads, D] of ``qkv`` [T, (heads + 2 kv_heads) * D]; its keys and values
        written into the caches [slots, kv_heads, D] at ``slots``: q and k RMS-normalized per head
        where norms are given (Qwen3) and rotated half-split over the first ``cos.shape[1]`` dims."""
        ...


class Experts(Protocol):
    """A layer's held experts packed for a backend."""

    def __call__(self, y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(y[t])`` over the pairs whose expert is held
        (``local[id]`` >= 0: its index among the packed experts; -1 or an id past ``local``: none).
        y [T, H]; ids [T, k] int32/int64; weights [T, k] float32. ``counts`` (int64 [n]): every
        pair's id is counted into it (ids in [0, n)). Nothing is read back to the host."""
        ...


class MoEBackend(Protocol):
    name: str

    def pack(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
             b_down: torch.Tensor | None, act: Activation) -> Experts:
        """Experts from stacked weights: gate rows then up rows [n, 2I, H], down [n, H, I], optional
        biases [n, 2I] / [n, H] (gpt-oss); ``n`` may be 0 (an expert part holding none)."""
        ...


class AttentionHalf(Protocol):
    """One layer's attention half bound to a backend (``AttentionBackend.bind``)."""

    def __call__(self, x: torch.Tensor, ctx: AttnContext, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The attention half of the layer (norm, QKV, RoPE and the cache write, paged attention,
        output projection, residual, post-attention norm) for the step's tokens x [T, H]: (h, y, the
        float32 logits of the router it was bound with for y, or None). Prefills and decodes in one
        call; capturable in a graph (it reads tensors of ``ctx`` only, nothing from the host)."""
        ...


class AttentionBackend(Protocol):
    name: str
    latent: bool  # runs MLA's latent attention (``latent_attention``)

    def prepare(self, layout: StepLayout, windows: tuple[int, ...], buffers: StepBuffers) -> AttnContext:
        """The step's context, built once on the host and staged through ``buffers`` onto their device
        (nothing is read back later): what every layer of the step reads, for the key windows
        ``windows`` (0: all keys) its layers use."""
        ...

    def bind(self, layer: torch.nn.Module, router: LinearOp | None) -> AttentionHalf:
        """``layer`` (an ``AttentionPart`` whose weights are packed already) bound to this backend, with
        the router whose logits it computes too (a plain one: ``Router.plain_logits``; None: none)."""
        ...


class ShardPeers(Protocol):
    """A sharded decode step's exchange with the ranks holding the other shards of its sequence's KV
    (implemented by ``afdserve.runtime.cp``)."""

    def ask(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        """The step's queries of ``layer`` ([T, heads, D]; MLA's absorbed ones) at ``positions``
        (int64 [T]), to every peer; it does not wait."""
        ...

    def answers(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every peer's attention of those queries over its shard: (o float32 [T, heads, Dv], lse
        float32 [T, heads]), in rank order."""
        ...


class Ring(Protocol):
    """A context-parallel prefill step's exchange with the other ranks (implemented by
    ``afdserve.runtime.cp``): every rank's KV of a layer reaches every other rank of the ring."""

    def send(self, layer: int, parts: list[torch.Tensor], positions: torch.Tensor) -> None:
        """This rank's KV of ``layer`` (``[k, v]`` [T, kv_heads, D], or MLA's ``[latent]`` [T, latent_dim]),
        with its positions (int64 [T]), to the next rank of the ring; it does not wait for the
        receiver (the tensors are not written afterwards)."""
        ...

    def receive(self, layer: int) -> Iterator[tuple[int, list[torch.Tensor], torch.Tensor]]:
        """The other ranks' KV of ``layer``, one rank at a time as it comes: (its rank, parts as
        ``send`` has them, positions). The caller takes all of them (the ring forwards each on to
        the next rank itself)."""
        ...
