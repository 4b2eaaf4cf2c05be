"""Paged KV cache bookkeeping (no tensors here: the executor owns the cache memory)."""
from heterollm.kv_cache.data_parallel import DataParallelKVCacheManager
from heterollm.kv_cache.manager import BlockPool, KVCacheManager

__all__ = ["BlockPool", "DataParallelKVCacheManager", "KVCacheManager"]
