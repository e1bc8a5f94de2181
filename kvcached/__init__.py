"""kvcached: a hierarchical KV cache (GPU, host memory, storage) for LLM engines."""

from kvcached.config import CacheConfig
from kvcached.errors import CacheAsleep, NoFreeBlocks, TransferFailed, WorkerLost

__all__ = ["CacheConfig", "NoFreeBlocks", "WorkerLost", "CacheAsleep", "TransferFailed"]
__version__ = "0.1.0"
