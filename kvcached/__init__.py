"""kvcached: a hierarchical KV cache (GPU, host memory, storage) for LLM engines.

The engine's scheduler talks to ``CacheManager``; model runners share their
KV planes with ``export_kv_cache`` (or attach to planes kvcached created with
``attach_kv_cache``). See docs/architecture.md.

The names below are imported on first use, so that importing a submodule
(the control client of ``kvcached status``, the native core) does not load
torch.
"""

import importlib

_EXPORTS = {
    "CacheConfig": "kvcached.config",
    "CacheManager": "kvcached.core.manager",
    "Allocation": "kvcached.types", "HitInfo": "kvcached.types", "CacheStats": "kvcached.types",
    "NoFreeBlocks": "kvcached.errors", "WorkerLost": "kvcached.errors",
    "CacheAsleep": "kvcached.errors", "TransferFailed": "kvcached.errors",
    "export_kv_cache": "kvcached.memory.kvshare", "attach_kv_cache": "kvcached.memory.kvshare",
    "allocate_kv_cache": "kvcached.memory.kvshare",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
