"""Host bookkeeping of KV pages: the refcounted pool and the version-keyed radix cache."""
from jaxrl_cache.cache.page_pool import PagePool
from jaxrl_cache.cache.radix import CacheStats, Match, PackedTokens, RadixCache

__all__ = ["PagePool", "CacheStats", "Match", "PackedTokens", "RadixCache"]
