"""The paged KV cache tensors: fixed-size blocks of key/value slots for every layer."""

from __future__ import annotations

import torch

from afdserve.model.config import ModelConfig


class KVCache:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens, for every layer.

    ``keys(layer)``/``values(layer)`` are ``[num_blocks * block_size, kv_heads, head_dim]`` views:
    slot ``b * block_size + o`` holds offset ``o`` of block ``b``.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem
