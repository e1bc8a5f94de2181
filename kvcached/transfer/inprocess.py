"""InProcessTransfer: copies run in the engine process, synchronously.

For tests, benchmarks and single-process engines. Tasks complete before
``submit`` returns; a failure on any rank fails the task (the copy engines
validate every id before touching memory, so a failed task moved nothing).
"""

from __future__ import annotations

import logging
import time

from kvcached.config import CacheConfig
from kvcached.tasks import Task, TaskHandle, TaskResult, merge_results
from kvcached.transfer.base import Transfer
from kvcached.transfer.executor import RankExecutor

logger = logging.getLogger(__name__)


class InProcessTransfer(Transfer):
    """One RankExecutor per TP rank, all in this process."""

    def __init__(self, cfg: CacheConfig, run_dir):
        super().__init__()
        self.cfg = cfg
        self.executors = [RankExecutor(cfg, run_dir, r) for r in range(cfg.tp_size)]
        self._stamper = None  # CUDA: stamps copies with the engine's KV event generations
        if cfg.device == "cuda":
            from kvcached.memory.kvevent import EventStamper
            self._stamper = EventStamper(run_dir, cfg.tp_size)
        self._broken = ""  # a sticky CUDA error: this process cannot copy any more

    def start(self) -> None:
        for ex in self.executors:
            ex.open(timeout_s=self.cfg.worker_start_timeout_s)

    def submit(self, task: Task) -> TaskHandle:
        handle = self.new_handle(task)
        if self._stamper is not None:
            self._stamper.stamp(task)
        t0 = time.perf_counter()
        per_rank, errors = {}, []
        for ex in self.executors:
            try:
                per_rank[ex.rank] = ex.run(task)
            except Exception as e:  # a bad task fails; the engine keeps serving
                errors.append(f"rank {ex.rank}: {e}")
                per_rank[ex.rank] = {"error": str(e)}
                if getattr(e, "fatal", False) and not self._broken:
                    # No copy can run in this process again: the CPU tier goes off.
                    self._broken = str(e)
                    logger.error("in-process transfer broken, the CPU tier goes off: %s", e)
        ok = not errors
        handle.complete(TaskResult(task.task_id, ok, "; ".join(errors),
                                   elapsed_s=time.perf_counter() - t0,
                                   blocks_done=len(task.src) if ok else 0, per_rank=per_rank,
                                   result=merge_results(per_rank) if ok else {}))
        return handle

    @property
    def healthy(self) -> bool:
        return not self._broken

    def close(self) -> None:
        for ex in self.executors:
            ex.close()
        if self._stamper is not None:
            self._stamper.close()

    def stats(self) -> dict:
        """Each rank's storage health (workers report theirs in heartbeats)."""
        health = [{"rank": ex.rank, **h} for ex in self.executors
                  if (h := ex.storage_health())]
        return {"storage_ranks": health} if health else {}

    def control(self, op: str, args=None, timeout_s: float = 10.0) -> dict:
        """Copies are synchronous here, so pause/resume have nothing to hold."""
        args = args or {}
        if op == "update_weights":  # a later attach_storage must use the new version
            self.cfg = self.cfg.replace(weight_version=str(args["version"]))
        for ex in self.executors:
            if op == "sleep":
                ex.close(final=False)
            elif op == "wakeup":
                ex.open(timeout_s=timeout_s)
            elif op == "attach_storage":
                ex.attach_storage(self.cfg.replace(storage_backend=args.get("backend"),
                                                   storage_url=args.get("url", "")))
            elif op == "detach_storage":
                ex.detach_storage()
            elif op == "update_weights":
                ex.cfg = ex.cfg.replace(weight_version=self.cfg.weight_version)
                if ex.store is not None:
                    from kvcached.storage.objects import storage_namespace
                    ex.set_namespace(storage_namespace(self.cfg.model_id, args["version"],
                                                       self.cfg.salt))
        return {"ok": True, "op": op, "ranks": {ex.rank: {"changed": True}
                                               for ex in self.executors}}
