"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``): e4m3 storage with a float32 scale per block and
KV head (per block for MLA's latent), read back in the model's dtype.

A stored value ``q`` of block ``b`` and head ``h`` stands for ``q * scale[b, h]``. The scale is the
block's largest magnitude so far over 448 (e4m3's largest finite value), so nothing written ever
saturates:

* a block's scale starts afresh (0) when its first slot is written (a block freed and reused);
* a write raises the scale of each block it touches to its tokens' largest magnitude / 448, and the
  entries the block held already are re-quantized to the new scale (``q * old / new``: their
  magnitudes only shrink, so they stay in range; each costs one more rounding);
* only the block of each sequence's first new token can hold earlier entries (the tokens after it
  are contiguous, and a block they enter is entered at its first slot), so a step re-quantizes one
  block per sequence, whatever its length.

Every operation has a fixed shape (no host read-back), so a step stays capturable in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}


@dataclass(frozen=True)
class Fp8Pages:
    """One layer's FP8 keys, values or latents: ``data`` [slots, kv_heads, D] (or [slots, D], MLA's
    latent) in e4m3 and ``scale`` [num_blocks, kv_heads] (or [num_blocks, 1]) float32."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # indexing e4m3 tensors through their bytes (every torch op supports uint8)


def dequantize(pages: Fp8Pages, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values at ``slots`` (any shape) in ``dtype``: ``[*slots.shape, *pages.shape[1:]]``."""
    q = _bytes(pages.data)[slots].view(FP8).float()
    s = pages.scale[torch.div(slots, pages.block_size, rounding_mode="floor")]  # [*slots, heads]
    if pages.data.dim() == 3:
        s = s.unsqueeze(-1)
    return (q * s).to(dtype)


def quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``x * inv_scale`` in e4m3 (the clamp only guards the last bit of float rounding)."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write(pages: Fp8Pages, slots: torch.Tensor, x: torch.Tensor, first_rows: torch.Tensor) -> None:
    """Stores ``x`` [T, kv_heads, D] (or [T, D]) at cache ``slots`` [T], raising the touched blocks'
    scales (and re-quantizing what they held) as the module docstring says. ``first_rows`` [S]:
    each sequence's first row of ``x`` (its earlier tokens' block is the only one re-quantized)."""
    bs, scale = pages.block_size, pages.scale
    data = pages.data if pages.data.dim() == 3 else pages.data.unsqueeze(1)  # [slots, heads, D]
    x = x if x.dim() == 3 else x.unsqueeze(1)
    heads = scale.shape[1]
    slots = slots.long()
    blk = torch.div(slots, bs, rounding_mode="floor")
    idx = blk[:, None].expand(-1, heads)
    # a block whose first slot is written now starts afresh (a freed block reused)
    first = (slots % bs == 0)[:, None].expand(-1, heads)
    scale.scatter_reduce_(0, idx, torch.where(first, 0.0, float("inf")), "amin")
    lead = blk[first_rows.long()]  # the block of each sequence's first new token
    old = scale[lead]  # [S, heads]
    scale.scatter_reduce_(0, idx, x.abs().amax(-1).float() / FP8_MAX, "amax")
    new = scale[lead]
    ratio = torch.where(new > 0, old / new, 0.0)
    rows = lead[:, None] * bs + torch.arange(bs, device=slots.device)  # [S, bs]: the lead blocks' slots
    raw = _bytes(data)
    held = raw[rows].view(FP8).float()  # [S, bs, heads, D]
    raw[rows] = _bytes(quantize(held, ratio[:, None, :, None]))
    s = scale[blk]  # [T, heads]: every token's block's final scale
    inv = torch.where(s > 0, 1.0 / s.clamp_min(torch.finfo(SCALE_DTYPE).tiny), 0.0)
    raw[slots] = _bytes(quantize(x, inv[..., None]))
