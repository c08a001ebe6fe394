"""The paged KV cache tensors: fixed-size blocks of key/value slots for every layer."""

from __future__ import annotations

import torch

from afdserve.kvcache.fp8 import FP8, SCALE_DTYPE, Fp8Pages

Pages = torch.Tensor | Fp8Pages  # one layer's keys, values or latents, as the attention backend reads them


class KVCache:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    ``keys(layer)``/``values(layer)`` are ``[num_blocks * block_size, kv_heads, head_dim]`` views:
    slot ``b * block_size + o`` holds offset ``o`` of block ``b``.

    With ``latent_dim > 0`` the cache has MLA's latent layout instead: ``latent(layer)`` is a
    ``[num_blocks * block_size, latent_dim]`` view (the compressed latent and the decoupled RoPE key
    of each token) and there are no per-head keys or values.

    With ``dtype`` ``torch.float8_e4m3fn`` (``kv_cache_dtype="fp8_e4m3"``) every tensor has a float32
    scale per block and KV head beside it (per block for the latent; ``afdserve.kvcache.fp8``), and
    the views are ``Fp8Pages`` (the e4m3 slots and their layer's scales).

    With ``scratch`` the tensors hold one block more, ``scratch_block`` (= ``num_blocks``), outside
    the ``num_blocks`` a block manager hands out: what the padded rows of a captured decode step
    write and read (``afdserve.engine.padded``).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, latent_dim: int = 0, device: torch.device | str = "cpu", scratch: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block: int | None = num_blocks if scratch else None
        num_blocks += scratch
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.lat: torch.Tensor | None = None
        if latent_dim:
            self.lat = torch.zeros((num_layers, num_blocks * block_size, latent_dim), dtype=dtype, device=device)
        else:
            shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scales: list[torch.Tensor] = []  # fp8: [num_layers, num_blocks, heads] per tensor
        if dtype == FP8:
            heads = 1 if latent_dim else num_kv_heads
            self.scales = [torch.zeros((num_layers, num_blocks, heads), dtype=SCALE_DTYPE, device=device)
                           for _ in self.tensors()]

    @property
    def is_latent(self) -> bool:
        return self.lat is not None

    def _pages(self, i: int, layer: int) -> Pages:
        data = self.tensors()[i][layer]
        return Fp8Pages(data, self.scales[i][layer], self.block_size) if self.scales else data

    def keys(self, layer: int) -> Pages:
        if self.k is None:
            raise ValueError("a latent (MLA) cache has no per-head keys; use latent(layer)")
        return self._pages(0, layer)

    def values(self, layer: int) -> Pages:
        if self.v is None:
            raise ValueError("a latent (MLA) cache has no per-head values; use latent(layer)")
        return self._pages(1, layer)

    def latent(self, layer: int) -> Pages:
        if self.lat is None:
            raise ValueError("a K/V cache has no latent layout; use keys(layer) / values(layer)")
        return self._pages(0, layer)

    def tensors(self) -> list[torch.Tensor]:
        """The allocated tensors ([K, V], or [latent]), each ``[num_layers, num_slots, ...]``."""
        return [t for t in (self.k, self.v, self.lat) if t is not None]

    def allocated_bytes(self) -> int:
        """Bytes of every allocated tensor (fp8: with the scales)."""
        return sum(t.numel() * t.element_size() for t in self.tensors() + self.scales)

    def bytes_per_token_per_layer(self) -> float:
        """Bytes the allocated tensors hold for one token of one layer (fp8: with its share of the
        block's scales)."""
        return sum(t[0, 0].numel() * t.element_size() for t in self.tensors()) + sum(
            s[0, 0].numel() * s.element_size() for s in self.scales) / self.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors()[0].dtype

    def read_block(self, block: int) -> tuple[torch.Tensor, ...]:
        """Views of one block of every allocated tensor (keys and values, or the latent), each
        ``[num_layers, block_size, ...]``, then (fp8) their scales, each ``[num_layers, heads]``:
        what the prefix cache's lower tiers keep of a block, as stored."""
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        return tuple(t[:, s] for t in self.tensors()) + tuple(t[:, block] for t in self.scales)

    def write_block(self, block: int, parts: tuple[torch.Tensor, ...]) -> None:
        for dst, src in zip(self.read_block(block), parts, strict=True):
            dst.copy_(src, non_blocking=True)

    def layer_blocks(self, layer: int) -> list[torch.Tensor]:
        """One layer's storage by block: each tensor ``[num_blocks, block_size, ...]`` (keys and values,
        or the latent), then (fp8) their scales ``[num_blocks, heads]``: what a prefill/decode
        transfer moves of a layer's blocks, as stored (e4m3 as its bytes)."""
        n, bs = self.num_blocks, self.block_size
        raw = [t.view(torch.uint8) if t.dtype == FP8 else t for t in self.tensors()]  # (bytes: copied as they are)
        return [t[layer, : n * bs].view(n, bs, *t.shape[2:]) for t in raw] + [s[layer, :n] for s in self.scales]

    def read_layer_blocks(self, layer: int, blocks: torch.Tensor) -> list[torch.Tensor]:
        return [t.index_select(0, blocks) for t in self.layer_blocks(layer)]

    def write_layer_blocks(self, layer: int, blocks: torch.Tensor, parts: list[torch.Tensor]) -> None:
        for dst, src in zip(self.layer_blocks(layer), parts, strict=True):
            dst.index_copy_(0, blocks, src.to(dst.device))

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for p in self.read_block(0))

    @property
    def block_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(p.dtype for p in self.read_block(0))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers; fp8: with its scales)."""
        return sum(p.numel() * p.element_size() for p in self.read_block(0))

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, latent_dim: int = 0) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = latent_dim if latent_dim else 2 * num_kv_heads * head_dim
        scales = (1 if latent_dim else 2 * num_kv_heads) * SCALE_DTYPE.itemsize if dtype == FP8 else 0
        return num_layers * (block_size * per_token * elem + scales)

    @staticmethod
    def sequence_blocks(tokens: int, block_size: int, window: int = 0, step_tokens: int = 1) -> int:
        """Blocks one sequence of ``tokens`` tokens holds at most. With every layer windowed to
        ``window`` tokens, the blocks out of the window go back: a sequence then holds the window
        plus one step's ``step_tokens``, and a block more."""
        need = -(-tokens // block_size)
        if window:
            need = min(need, -(-(window + max(step_tokens, 1)) // block_size) + 1)
        return need
