from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.cache import KVCache

__all__ = ["BlockManager", "KVCache"]
