"""The paged KV cache tensors: fixed-size blocks of key/value slots for every layer."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    ``keys(layer)``/``values(layer)`` are ``[num_blocks * block_size, kv_heads, head_dim]`` views:
    slot ``b * block_size + o`` holds offset ``o`` of block ``b``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one block's keys and values, ``[num_layers, block_size, kv_heads, head_dim]`` each."""
        s = slice(block * self.block_size, (block + 1) * self.block_size)
        return self.k[:, s], self.v[:, s]

    def write_block(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        dk, dv = self.read_block(block)
        dk.copy_(k, non_blocking=True)
        dv.copy_(v, non_blocking=True)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values (all layers)."""
        return 2 * self.k[:, : self.block_size].numel() * self.k.element_size()

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
