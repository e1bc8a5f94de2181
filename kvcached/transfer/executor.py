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

    def open(self, timeout_s: float) -> None:
        """Attach planes (waiting for the engine to export them) and the host pool."""
        from kvcached.hostpool import HostPool
        from kvcached.kvshare import attach_kv_cache, check_planes
        layout = self.cfg.layout
        self.planes = attach_kv_cache(self.run_dir, self.rank, timeout_s=timeout_s)
        check_planes(self.planes, layout, self.cfg.num_gpu_blocks)
        if self.cfg.num_cpu_blocks:
            self.host = HostPool.attach(self.run_dir, self.rank, self.cfg.num_cpu_blocks,
                                        layout.block_bytes, owner_pid=self.owner_pid)
            self.engine = self._make_engine()

    def _make_engine(self):
        offsets = self.cfg.layout.host_offsets
        if self.cfg.device == "cuda":
            from kvcached.copy.cuda import CudaCopyEngine
            return CudaCopyEngine(self.planes, self.host.tensor, offsets)
        from kvcached.copy.cpu import CpuCopyEngine
        return CpuCopyEngine(self.planes, self.host.tensor, offsets,
                             threads=self.cfg.copy_threads)

    def run(self, task: Task) -> dict[str, Any]:
        """Execute one task on this rank; returns {"bytes": n, ...}."""
        t0 = time.perf_counter()
        if task.kind == "noop":
            nbytes = 0
        elif task.kind in ("swap_out", "swap_in"):
            if self.engine is None:
                raise RuntimeError(f"rank {self.rank}: the CPU tier is off (num_cpu_blocks=0)")
            if task.kind == "swap_out":
                nbytes = self.engine.swap_out(task.src, task.dst)
            else:
                nbytes = self.engine.swap_in(task.src, task.dst)
        else:
            raise ValueError(f"rank {self.rank}: unsupported task kind {task.kind!r}")
        return {"bytes": nbytes, "copy_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.engine = None
        if self.host is not None:
            self.host.close()
            self.host = None
        self.planes = None
