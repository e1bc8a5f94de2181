"""RankExecutor: runs tasks on one rank's memory (its KV planes and host pool).

Used in the engine process by ``InProcessTransfer`` (one per rank) and in each
transfer worker process. It finds the rank's planes through the run
directory (``kvcached.export_kv_cache`` / ``allocate_kv_cache``) and the host
pool by name, so both transfer modes see exactly the same memory.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from kvcached.config import CacheConfig
from kvcached.transfer.base import Task

logger = logging.getLogger(__name__)

LOAD_CHUNK = 16  # blocks read per storage batch; the load policy is applied between


class RankExecutor:
    """Copies blocks for one rank; ``run`` raises on any failure, touching nothing."""

    def __init__(self, cfg: CacheConfig, run_dir, rank: int, owner_pid: int | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = rank
        self.owner_pid = owner_pid or os.getpid()
        self.planes = None
        self.host = None
        self.engine = None
        self.store = None  # BlockStore when a storage backend is configured
        self._pinned = None  # CUDA registration of the host pool mapping
        self._event = None  # the engine's IPC event that swap-outs wait on (CUDA)

    def open(self, timeout_s: float) -> None:
        """Attach planes (waiting for the engine to export them) and the host pool."""
        from kvcached.memory.hostpool import HostPool
        from kvcached.memory.kvshare import attach_kv_cache, check_planes
        layout = self.cfg.layout
        self.planes = attach_kv_cache(self.run_dir, self.rank, timeout_s=timeout_s)
        check_planes(self.planes, layout, self.cfg.num_gpu_blocks)
        if self.cfg.num_cpu_blocks:
            self.host = HostPool.attach(self.run_dir, self.rank, self.cfg.num_cpu_blocks,
                                        layout.block_bytes, owner_pid=self.owner_pid)
            self.engine = self._make_engine()
            if self.cfg.storage_backend and self.store is None:
                from kvcached.storage.blockstore import BlockStore
                self.store = BlockStore.from_config(self.cfg, self.rank)

    def _make_engine(self):
        offsets = self.cfg.layout.host_offsets
        if self.cfg.device == "cuda":
            from kvcached.copy.cuda import CudaCopyEngine
            from kvcached.memory.cuda_ipc import pin_host_memory
            # The shm mapping is this process's: register it (in chunks) here.
            self._pinned = pin_host_memory(self.host.tensor)
            self._event = self._open_engine_event()
            return CudaCopyEngine(self.planes, self.host.tensor, offsets)
        from kvcached.copy.cpu import CpuCopyEngine
        return CpuCopyEngine(self.planes, self.host.tensor, offsets,
                             threads=self.cfg.copy_threads)

    def _open_engine_event(self):
        """The engine's interprocess compute-stream event, if it exported one."""
        from kvcached.copy.cuda import open_ipc_event
        from kvcached.memory.kvshare import read_descriptor
        handle = read_descriptor(self.run_dir, self.rank).get("event_ipc_handle")
        return open_ipc_event(bytes.fromhex(handle)) if handle else None

    def _swap_out(self, device_ids, host_ids) -> int:
        if self._event is not None:  # order after the engine's writes (CUDA only)
            return self.engine.swap_out(device_ids, host_ids, wait_event=self._event)
        return self.engine.swap_out(device_ids, host_ids)

    def run(self, task: Task) -> dict[str, Any]:
        """Execute one task on this rank; returns {"bytes": n, ...} (the Done's
        elapsed_s times it)."""
        if task.kind == "noop":
            return {"bytes": 0}
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank}: no host pool (num_cpu_blocks=0, or asleep)")
        if task.kind == "swap_out":
            out = {"bytes": self._swap_out(task.src, task.dst)}
        elif task.kind == "swap_in":
            out = {"bytes": self.engine.swap_in(task.src, task.dst)}
        elif task.kind in ("store", "load", "lookup"):
            out = self._storage_task(task)
        else:
            raise ValueError(f"rank {self.rank}: unsupported task kind {task.kind!r}")
        return out

    # ---------------------------------------------------------------- storage
    def _storage_task(self, task: Task) -> dict[str, Any]:
        if self.store is None:
            raise RuntimeError(f"rank {self.rank}: no storage backend is attached")
        hashes = [bytes.fromhex(k) for k in task.args["keys"]]
        if task.kind == "lookup":
            return {"prefix": self.store.lookup(hashes)}
        if task.kind == "store":
            return self._store(task, hashes)
        return self._load(task, hashes)

    def _store(self, task: Task, hashes: list[bytes]) -> dict[str, Any]:
        """Write-through: optionally stage GPU blocks into the host blocks first."""
        device_ids = task.args.get("device_ids")
        nbytes = self._swap_out(device_ids, task.src) if device_ids else 0
        ok = self.store.store(hashes, self.host.tensor, task.src)
        return {"bytes": nbytes, "stored": [int(x) for x in ok]}

    def _load(self, task: Task, hashes: list[bytes]) -> dict[str, Any]:
        """Storage -> host blocks (chunk by chunk) -> GPU blocks; what arrived is
        used, the rest is recomputed. Between chunks, ``storage_load_policy``
        decides: ``best_effort`` stops at the first check (one chunk: it never
        waits for a second read), ``timeout`` once ``storage_load_timeout_s``
        passed, ``wait_complete`` never (every block the lookup found)."""
        policy = self.cfg.storage_load_policy
        deadline = task.args.get("deadline_s", self.cfg.storage_load_timeout_s)
        stop = time.monotonic() + deadline if policy == "timeout" else None
        done = 0
        while done < len(hashes):
            start, end = done, min(done + LOAD_CHUNK, len(hashes))
            done = start + self.store.load(hashes[start:end], self.host.tensor,
                                           task.dst[start:end])
            if (done < end or policy == "best_effort"
                    or (stop is not None and time.monotonic() > stop)):
                break
        device_ids = task.args.get("device_ids")
        nbytes = self.engine.swap_in(task.dst[:done], device_ids[:done]) if device_ids else 0
        return {"prefix": done, "bytes": nbytes}

    def attach_storage(self, cfg: CacheConfig) -> bool:
        """Open the storage backend ``cfg`` names (runtime attach); False if no change."""
        from kvcached.storage.blockstore import BlockStore
        same = (cfg.storage_backend, cfg.storage_url) == (self.cfg.storage_backend,
                                                          self.cfg.storage_url)
        if same and self.store is not None:
            return False
        self.detach_storage()
        self.cfg = cfg
        self.store = BlockStore.from_config(cfg, self.rank)
        return True

    def detach_storage(self) -> bool:
        """Close the backend and release what it holds (registered memory, sockets)."""
        if self.store is None:
            return False
        self.store.close()
        self.store = None
        return True

    def storage_health(self) -> dict[str, Any]:
        """This rank's storage as `kvcached status` shows it ({} without storage)."""
        store = self.store
        return store.health() if store is not None else {}

    def set_namespace(self, namespace: str) -> None:
        if self.store is not None:
            self.store.set_namespace(namespace)

    def close(self, final: bool = True) -> None:
        """Detach from the planes and host pool; ``final`` also closes storage."""
        if self.store is not None:
            self.store.release_host_pool()
            if final:
                self.store.close()
                self.store = None
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.engine = None
        if self._pinned is not None:
            from kvcached.memory.cuda_ipc import unpin
            unpin(self._pinned)
            self._pinned = None
        if self.host is not None:
            self.host.close()
            self.host = None
        self.planes = None
