"""kvcached: a hierarchical KV cache (GPU, host memory, storage) for LLM engines.

The engine's scheduler talks to ``CacheManager``; model runners share their
KV planes with ``export_kv_cache`` (or attach to planes kvcached created with
``attach_kv_cache``). See docs/architecture.md.
"""

from kvcached.config import CacheConfig
from kvcached.core.manager import CacheManager
from kvcached.errors import CacheAsleep, NoFreeBlocks, TransferFailed, WorkerLost
from kvcached.memory.kvshare import allocate_kv_cache, attach_kv_cache, export_kv_cache
from kvcached.types import Allocation, CacheStats, HitInfo

__all__ = [
    "CacheConfig", "CacheManager", "Allocation", "HitInfo", "CacheStats",
    "NoFreeBlocks", "WorkerLost", "CacheAsleep", "TransferFailed",
    "export_kv_cache", "attach_kv_cache", "allocate_kv_cache",
]
__version__ = "0.1.0"
