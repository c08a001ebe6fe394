"""Rotary position embedding and its scaling types, read from a Hugging Face config.

The inverse frequencies follow transformers' ``modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS``) for
the types these families configure: ``default``, ``linear``, ``dynamic``, ``yarn`` and ``llama3``.
Parameters come from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs; it
wins when both are present, as in transformers), with ``rope_theta`` from the dict or the config.

Dynamic NTK: transformers rescales the frequencies with the length of the sequence at hand (and so
rotates the keys already in a cache with other frequencies than the new ones). A paged cache needs
one set of frequencies, so afdserve follows vLLM: the frequencies are those transformers computes
for a sequence of ``max_position`` tokens, the longest context served (``ModelConfig`` serves a
dynamic model up to ``factor * max_position_embeddings``, as vLLM does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from afdserve.errors import ModelError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_parameters(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of a raw HF config as one flat dict with ``rope_type`` and ``rope_theta``
    (``layer_type`` picks one entry of parameters nested by layer type)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelError(f"rope parameters must be a JSON object, got {params!r}")
    nested = [k for k in params if isinstance(params[k], dict)]
    if nested:
        key = layer_type if layer_type in params else nested[0]
        if layer_type is None and any(params[k] != params[key] for k in nested):
            raise ModelError(f"rope parameters differ by layer type ({', '.join(nested)}); name a layer type")
        params = params[key]
    p = dict(params)
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    if p.get("rope_theta") is None:
        p["rope_theta"] = raw.get("rope_theta", 10000.0)
    if raw.get("original_max_position_embeddings") is not None:  # Phi-3 style: wins, as in transformers
        p["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return p


def served_context(raw: dict[str, Any]) -> int:
    """Longest context a model is served for: ``max_position_embeddings``, times ``factor`` for
    dynamic NTK scaling (vLLM's rule; the other types configure the extended length directly)."""
    n = int(raw.get("max_position_embeddings", 4096))
    p = rope_parameters(raw)
    if p["rope_type"] == "dynamic":
        n = int(n * float(p["factor"]))
    return n


def _need(p: dict[str, Any], key: str) -> Any:
    if p.get(key) is None:
        raise ModelError(f"rope_type {p['rope_type']!r} needs {key!r} in rope_scaling / rope_parameters")
    return p[key]


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(p: dict[str, Any], dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = int(p.get("original_max_position_embeddings") or max_pos)
    if factor is None:
        factor = max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _llama3(p: dict[str, Any], dim: int, base: float) -> torch.Tensor:
    inv = _base_inv_freq(base, dim)
    factor = float(_need(p, "factor"))
    low_f, high_f = float(_need(p, "low_freq_factor")), float(_need(p, "high_freq_factor"))
    old = float(_need(p, "original_max_position_embeddings"))
    low_wl, high_wl = old / low_f, old / high_f
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


@dataclass
class Rope:
    """Inverse frequencies of ``rotary_dim`` rotated dimensions and the factor folded into cos/sin
    (YaRN's attention factor; 1 for the other types)."""

    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    attention_factor: float
    rope_type: str
    # cos/sin of positions [0, n) per (dtype, device), built by ``cos_sin`` when it is given a bound
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    @classmethod
    def from_config(cls, raw: dict[str, Any], rotary_dim: int, max_position: int,
                    layer_type: str | None = None) -> "Rope":
        """``raw``: the HF config dict; ``max_position``: the longest context served (the length
        dynamic NTK scaling is computed for)."""
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ModelError(f"rotary dimension must be a positive even number, got {rotary_dim}")
        p = rope_parameters(raw, layer_type)
        kind, base = p["rope_type"], float(p["rope_theta"])
        attn = 1.0
        if kind == "default":
            inv = _base_inv_freq(base, rotary_dim)
        elif kind == "linear":
            inv = _base_inv_freq(base, rotary_dim) / float(_need(p, "factor"))
        elif kind == "dynamic":
            factor, orig = float(_need(p, "factor")), int(raw.get("max_position_embeddings", max_position))
            seq = max(max_position, orig)
            base = base * ((factor * seq / orig) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
            inv = _base_inv_freq(base, rotary_dim)
        elif kind == "yarn":
            inv, attn = _yarn(p, rotary_dim, base, int(raw.get("max_position_embeddings", max_position)))
        elif kind == "llama3":
            inv = _llama3(p, rotary_dim, base)
        else:
            raise ModelError(f"unsupported RoPE scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
        return cls(inv.float(), attn, kind)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] of ``positions`` (the attention factor folded in). With
        ``max_position`` (at least the largest position): rows of a table on the positions' device
        built once (grown by doubling), one gather per step instead of computing them."""
        if max_position is not None:
            cos, sin = self._table(max_position + 1, dtype, positions.device)
            return cos.index_select(0, positions), sin.index_select(0, positions)
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # moved once: a host-to-device copy a step waits on
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _table(self, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._tables
        have = tables.get((dtype, device))
        if have is None or have[0].shape[0] < n:
            size = max(n, 2 * have[0].shape[0]) if have is not None else max(n, 4096)
            have = self._compute(torch.arange(size, device=device), dtype)
            tables[(dtype, device)] = have
        return have
