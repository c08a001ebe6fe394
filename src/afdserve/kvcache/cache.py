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

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
