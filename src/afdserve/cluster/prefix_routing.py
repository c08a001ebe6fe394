"""Cache-aware routing: the front end's approximate record of which prompt blocks each attention
worker holds, as SGLang's router keeps an approximate radix tree.

A request's full prompt blocks are keyed as the workers key them (``afdserve.kvcache.prefix``
``block_hashes``: a chain, so block i's key stands for the whole prefix up to it). The record
remembers the keys sent to each worker, least recently used first out, bounded by what the worker
can keep (its device blocks plus its host tier); it does not see evictions, so it is an estimate.
``AttentionBalancer.pick`` weighs a worker's cached prefix against its load.
"""

from __future__ import annotations

from collections import OrderedDict

from afdserve.balance.attention import AttentionBalancer
from afdserve.config import EngineConfig
from afdserve.engine.builder import kv_block_bytes, kv_blocks
from afdserve.kvcache.prefix import block_hashes
from afdserve.model.config import ModelConfig


class PrefixRecord:
    def __init__(self, workers: list[str], block_size: int, salt: bytes, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.block_size, self.salt, self.capacity = block_size, salt, capacity_blocks
        self.keys: dict[str, OrderedDict[bytes, None]] = {w: OrderedDict() for w in workers}

    def key(self, token_ids: list[int]) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, self.salt)

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """Tokens of the longest recorded prefix of ``keys`` on each worker."""
        out = {}
        for w, held in self.keys.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out[w] = n * self.block_size
        return out

    def add(self, worker: str, keys: list[bytes]) -> None:
        """``worker`` was sent these blocks: they are the most recently used there."""
        held = self.keys.setdefault(worker, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, worker: str) -> None:
        """``worker`` was replaced: it holds nothing."""
        self.keys[worker] = OrderedDict()

    def drop(self, worker: str) -> None:
        """``worker`` left the pool (a resize)."""
        self.keys.pop(worker, None)


def record_capacity(cfg: EngineConfig, model_cfg: ModelConfig, max_len: int) -> int:
    """The blocks an attention worker can keep cached: its KV cache plus its host tier."""
    per_block = kv_block_bytes(cfg, model_cfg)
    return kv_blocks(cfg, model_cfg, max_len) + int(cfg.prefix_cache_host_gb * 2**30 // per_block)


def place(balancer: AttentionBalancer, routes: PrefixRecord | None, request_id: str, prompt_token_ids: list[int],
          max_tokens: int, several: bool) -> str:
    """The attention worker a new request goes to, booked there: the least predicted attention time,
    or the longest cached prefix while its load is not far above (``several``: there is a choice;
    with one worker the record is not consulted)."""
    keys = routes.key(prompt_token_ids) if routes is not None and several else []
    cached = routes.match(keys) if keys and routes is not None else None
    target = balancer.pick(len(prompt_token_ids), max_tokens, cached)
    if keys and routes is not None:
        routes.add(target, keys)
    balancer.add(target, request_id, len(prompt_token_ids))
    return target
