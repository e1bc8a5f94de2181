"""Storage tier: object format, backends (file, Redis, Mooncake) and BlockStore.

Typical use on a worker::

    from kvcached.storage import BlockStore, open_backend, storage_namespace
    backend = open_backend("file", "/var/cache/kvcached", max_bytes=64 << 30)
    bs = BlockStore(backend, layout.digest, rank, tp_size,
                    storage_namespace(model_id, weight_version, salt))
    bs.store(hashes, host_pool, host_ids)       # -> [True, ...]
    n = bs.lookup(hashes)                       # contiguous prefix present
    n = bs.load(hashes, host_pool, host_ids)    # contiguous prefix loaded intact

Remote backends are imported lazily, so their client packages are optional
(extras ``redis`` and ``mooncake``).
"""

from __future__ import annotations

from kvcached.storage.backends import BACKEND_KINDS, open_backend
from kvcached.storage.base import (
    BackendError,
    BackendTimeout,
    CircuitBreaker,
    StorageBackend,
)
from kvcached.storage.blockstore import BlockStore
from kvcached.storage.objects import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    object_key,
    storage_namespace,
)

__all__ = [
    "BackendError", "BackendTimeout", "BlockStore", "CircuitBreaker", "FORMAT_VERSION",
    "HEADER_SIZE", "MAGIC", "StorageBackend", "object_key", "open_backend",
    "storage_namespace", "BACKEND_KINDS",
]
