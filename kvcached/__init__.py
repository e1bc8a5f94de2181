"""kvcached: a hierarchical KV cache (GPU, host memory, storage) for LLM engines.

The engine's scheduler talks to ``CacheManager``; model runners share their
KV planes with ``export_kv_cache`` (or attach to planes kvcached created with
``attach_kv_cache``). See docs/architecture.md.

The names below are imported on first use (PEP 562): ``kvcached status`` and
``kvcached ctl`` import this package too, and must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "CacheConfig": "kvcached.config",
    "CacheManager": "kvcached.ops.wiring",
    "Allocation": "kvcached.types",
    "HitInfo": "kvcached.types",
    "CacheStats": "kvcached.types",
    "NoFreeBlocks": "kvcached.errors",
    "WorkerLost": "kvcached.errors",
    "CacheAsleep": "kvcached.errors",
    "TransferFailed": "kvcached.errors",
    "export_kv_cache": "kvcached.memory.kvshare",
    "attach_kv_cache": "kvcached.memory.kvshare",
    "allocate_kv_cache": "kvcached.memory.kvshare",
}

__all__ = [
    "CacheConfig", "CacheManager", "Allocation", "HitInfo", "CacheStats",
    "NoFreeBlocks", "WorkerLost", "CacheAsleep", "TransferFailed",
    "export_kv_cache", "attach_kv_cache", "allocate_kv_cache",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from kvcached.config import CacheConfig
    from kvcached.errors import CacheAsleep, NoFreeBlocks, TransferFailed, WorkerLost
    from kvcached.memory.kvshare import allocate_kv_cache, attach_kv_cache, export_kv_cache
    from kvcached.ops.wiring import CacheManager
    from kvcached.types import Allocation, CacheStats, HitInfo
