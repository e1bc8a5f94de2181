"""Mooncake Store backend through ``mooncake-transfer-engine-non-cuda``.

The store's memory is contributed by storage nodes (``mooncake_client
--global_segment_size=...``, or a client created with ``segment_bytes > 0``);
the master only keeps metadata. kvcached's workers are plain clients
(``segment_bytes=0``) so objects outlive a worker restart.

Reads and writes use the zero-copy batch calls into registered memory: the
BlockStore registers the host pool and its header arenas, and an object is
moved as ``[header, host block]`` with ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``. ``put`` never overwrites an existing key,
which is fine for content-addressed blocks (damaged objects are deleted by
the BlockStore so they can be written again).

Weak spots handled here:

- A dead or restarting master makes calls block for seconds inside the
  library (~4 s observed) and loses every object. Calls cannot be abandoned
  mid-flight (a late transfer would write into a host block that was reused),
  so the library's own timeouts bound them; a failed or slow call trips the
  circuit breaker, which then fails calls fast; its probe first checks with a
  plain TCP connect that the master is listening.
- ``setup`` against a dead master retries for a long time: the backend sets
  ``MC_STORE_CLIENT_SETUP_RETRIES=1`` (unless set) and connects lazily, so
  opening it never fails because the server is down.
- Reads lease objects (10 s by default) and a leased object cannot be removed
  normally: deletes use ``force=True``.

The transfer engine binds its TCP sockets on every interface unless
``MC_TCP_BIND_ADDRESS`` is set; the backend sets it to ``local_hostname``
(unless already set).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time

import numpy as np

from kvcached.storage.base import (
    OVERSIZE,
    BackendError,
    BackendTimeout,
    CircuitBreaker,
    StorageBackend,
    copy_into_parts,
    parts_len,
)

logger = logging.getLogger(__name__)

PIN_VERSION = "0.3.13.post1"  # the version this backend was tested with
NOT_FOUND = -704  # OBJECT_NOT_FOUND
RPC_FAIL = -900


def _import_mooncake():
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        raise ImportError(
            "storage_backend='mooncake' needs 'mooncake-transfer-engine-non-cuda' "
            f"(pip install 'kvcached[mooncake]', tested with {PIN_VERSION}) and Debian's "
            f"libibverbs1 (apt-get install libibverbs1); import failed: {e}") from e
    return MooncakeDistributedStore, ReplicateConfig


def _ptr(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


class MooncakeBackend(StorageBackend):
    """Objects in a Mooncake Store; see the module docstring."""

    kind = "mooncake"

    def __init__(self, master: str, local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 device_names: str = "", segment_bytes: int = 0,
                 local_buffer_bytes: int = 16 << 20, prefix: str = "kvcached/",
                 replicas: int = 1, op_timeout_s: float = 2.0, connect_timeout_s: float = 0.5,
                 breaker_threshold: int = 2, breaker_cooldown_s: float = 2.0) -> None:
        super().__init__(CircuitBreaker(breaker_threshold, breaker_cooldown_s))
        self._Store, self._ReplicateConfig = _import_mooncake()
        host, _, port = master.rpartition(":")
        self.master = master
        self._master_addr = (host.strip("[]"), int(port))
        self.local_hostname = local_hostname
        self.metadata_server = metadata_server
        self.protocol = protocol
        self.device_names = device_names
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.prefix = prefix
        self.replicas = replicas
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._store = None
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, object]] = {}  # ptr -> (size, keep-alive)
        self.counters.declare("key_errors", "slow_calls", "odd_size_reads")
        if protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        try:
            self._ensure()
        except BackendError as e:  # a down server is not an error at open: calls miss
            logger.warning("mooncake storage: master %s not reachable yet (%s); "
                           "will retry", master, e)
            self.breaker.record_failure()

    # ------------------------------------------------------------ client
    def _master_listening(self) -> bool:
        try:
            with socket.create_connection(self._master_addr, timeout=self.connect_timeout_s):
                return True
        except OSError:
            return False

    def _ensure(self):
        """The connected store; connects on first use, after checking the master."""
        with self._lock:
            if self._store is not None:
                if self.breaker.probing and not self._master_listening():
                    raise BackendError(f"master {self.master} is not listening")
                return self._store
            if not self._master_listening():
                raise BackendError(f"master {self.master} is not listening")
            store = self._Store()
            rc = store.setup(self.local_hostname, self.metadata_server, self.segment_bytes,
                             self.local_buffer_bytes, self.protocol, self.device_names,
                             self.master)
            if rc != 0:
                raise BackendError(f"setup against master {self.master} failed (code {rc})")
            for ptr, (size, _) in self._regions.items():
                store.register_buffer(ptr, size)
            self._store = store
            logger.info("mooncake storage: connected to master %s", self.master)
            return store

    def register_memory(self, buf) -> None:
        """Register ``buf`` (host pool, header arena) for zero-copy transfers."""
        mv = memoryview(buf).cast("B")
        ptr, size = _ptr(mv), mv.nbytes
        with self._lock:
            if ptr in self._regions:
                return
            self._regions[ptr] = (size, mv)
            store = self._store
        if store is not None:
            rc = store.register_buffer(ptr, size)
            if rc != 0:
                logger.warning("mooncake storage: register_buffer(%d bytes) failed: %d",
                               size, rc)

    def unregister_memory(self, buf) -> None:
        """Forget a region registered with :meth:`register_memory`."""
        ptr = _ptr(memoryview(buf).cast("B"))
        with self._lock:
            known = self._regions.pop(ptr, None)
            store = self._store
        if known is not None and store is not None:
            store.unregister_buffer(ptr)

    # ------------------------------------------------------------ calls
    def _run(self, what: str, fn, *args) -> list[int]:
        """Call the store; all keys failing with an RPC error = backend failure."""
        t0 = time.monotonic()
        codes = list(fn(*args))
        slow = time.monotonic() - t0 > self.op_timeout_s
        if slow:
            self.counters.inc("slow_calls")
        failed = [c for c in codes if c < 0 and c != NOT_FOUND]
        if codes and len(failed) == len(codes):
            msg = f"{what} failed for all {len(codes)} keys (codes {sorted(set(failed))})"
            raise BackendTimeout(msg) if slow else BackendError(msg)
        if failed:
            self.counters.inc("key_errors", len(failed))
        return codes

    def _pkeys(self, keys: list[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def _exists(self, keys: list[str]) -> list[bool]:
        store = self._ensure()
        codes = self._run("batch_is_exist", store.batch_is_exist, self._pkeys(keys))
        return [c == 1 for c in codes]

    def _get_into(self, keys: list[str], parts: list[list[memoryview]]) -> list[int]:
        store = self._ensure()
        pkeys = self._pkeys(keys)
        if all(len(p) == 1 for p in parts):
            codes = self._run("batch_get_into", store.batch_get_into, pkeys,
                              [_ptr(p[0]) for p in parts], [p[0].nbytes for p in parts])
        else:
            codes = self._run("batch_get_into_multi_buffers",
                              store.batch_get_into_multi_buffers, pkeys,
                              [[_ptr(x) for x in p] for p in parts],
                              [[x.nbytes for x in p] for p in parts])
        return [c if c >= 0 else self._get_odd_size(store, k, p, c)
                for k, p, c in zip(pkeys, parts, codes, strict=True)]

    def _get_odd_size(self, store, pkey: str, parts: list[memoryview], code: int) -> int:
        """Slow path after a failed read: an object of another size (truncated,
        overwritten) fails multi-buffer reads outright. Read it whole so the
        BlockStore sees a short read, rejects it and deletes it (Mooncake never
        overwrites, so it could not be stored again otherwise)."""
        if code == NOT_FOUND or code == RPC_FAIL:
            return -1
        size = store.get_size(pkey)
        if size > parts_len(parts):
            self.counters.inc("oversize_objects")
            return OVERSIZE  # never read: nothing is allocated beyond a block
        if size < 0 or size == parts_len(parts):
            return -1  # gone, too large to be ours, or a real transfer failure
        tmp = np.empty(max(size, 1), dtype=np.uint8)
        n = store.get_into(pkey, tmp.ctypes.data, size)
        if n != size:
            return -1
        self.counters.inc("odd_size_reads")
        return copy_into_parts(memoryview(tmp)[:size], parts)

    def _put_from(self, keys: list[str], parts: list[list[memoryview]]) -> list[bool]:
        store = self._ensure()
        cfg = self._ReplicateConfig()
        cfg.replica_num = self.replicas
        pkeys = self._pkeys(keys)
        if all(len(p) == 1 for p in parts):
            codes = self._run("batch_put_from", store.batch_put_from, pkeys,
                              [_ptr(p[0]) for p in parts], [parts_len(p) for p in parts], cfg)
        else:
            codes = self._run("batch_put_from_multi_buffers",
                              store.batch_put_from_multi_buffers, pkeys,
                              [[_ptr(x) for x in p] for p in parts],
                              [[x.nbytes for x in p] for p in parts], cfg)
        return [c == 0 for c in codes]

    def upsert_from(self, keys: list[str], buffers: list) -> list[bool]:
        """Overwrite objects (tests use it to plant damaged objects)."""
        store = self._ensure()
        pkeys = self._pkeys(keys)
        mvs = [memoryview(b).cast("B") for b in buffers]
        codes = store.batch_upsert_from(pkeys, [_ptr(m) for m in mvs],
                                        [m.nbytes for m in mvs], self._ReplicateConfig())
        return [c == 0 for c in codes]

    def _delete(self, keys: list[str]) -> None:
        store = self._ensure()
        # force: objects read in the last lease period (10 s) cannot be removed otherwise
        codes = store.batch_remove(self._pkeys(keys), True)
        bad = [c for c in codes if c < 0 and c != NOT_FOUND]
        if bad:
            self.counters.inc("key_errors", len(bad))

    def _clear(self) -> None:
        store = self._ensure()
        n = store.remove_by_regex("^" + re.escape(self.prefix), True)
        if n < 0:
            raise BackendError(f"remove_by_regex failed (code {n})")

    def _ping(self) -> bool:
        store = self._ensure()
        self._run("ping", store.batch_is_exist, [self.prefix + "__ping__"])
        return True

    def _close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            for ptr in list(self._regions):
                store.unregister_buffer(ptr)
            store.close()

    def _extra_stats(self) -> dict:
        return {"master": self.master, "connected": self._store is not None,
                "prefix": self.prefix}
