"""Control operations as a worker applies them (the coordinator fans them out).

pause: the coordinator holds new tasks (in order, nothing dropped); a rank
answers once it finished every task it had been sent. resume: the
coordinator sends what it held. sleep: pause and detach from the KV planes
and host pool. wakeup: re-attach and resume. Every op is idempotent and says
whether it changed anything.

``WorkerControl`` holds them as methods of the worker (``Worker`` inherits
it), so this module needs nothing from ``kvcached.transfer.worker``.
"""

from __future__ import annotations

import logging
from typing import Any

from kvcached.storage.objects import storage_namespace

logger = logging.getLogger(__name__)


class WorkerControl:
    """The control operations of a transfer worker, as its methods.

    The worker provides ``rank``, ``cfg``, ``paused``, ``executor``,
    ``wait_idle``, ``open_executor``, ``close_executor``, ``queue_depths`` and
    its task counters.
    """

    def control(self, args: dict[str, Any]) -> dict[str, Any]:
        """Apply the control operation ``args["op"]``; ValueError names the allowed ones."""
        op = args.get("op")
        handler = _OPS.get(op)
        if handler is None:
            raise ValueError(f"unknown control op {op!r}; allowed: {sorted(_OPS)}")
        result = handler(self, args)
        logger.info("worker rank %d: %s -> %s", self.rank, op, result)
        return result

    def _pause(self, args: dict[str, Any]) -> dict[str, Any]:
        changed = not self.paused
        self.paused = True
        if not self.wait_idle(float(args.get("timeout_s", 30.0))):
            raise TimeoutError(f"rank {self.rank}: tasks in flight did not finish")
        return {"changed": changed, "paused": True}

    def _resume(self, args: dict[str, Any]) -> dict[str, Any]:
        changed = self.paused
        self.paused = False
        return {"changed": changed, "paused": False}

    def _sleep(self, args: dict[str, Any]) -> dict[str, Any]:
        res = self._pause(args)
        changed = self.executor.planes is not None
        if changed:
            self.close_executor()
        return {"changed": changed or res["changed"], "asleep": True}

    def _wakeup(self, args: dict[str, Any]) -> dict[str, Any]:
        changed = self.executor.planes is None
        if changed:
            self.open_executor(float(args.get("timeout_s", 30.0)))
        self._resume(args)
        return {"changed": changed, "asleep": False}

    def _status(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"paused": self.paused, "asleep": self.executor.planes is None,
                "queues": self.queue_depths(), "done": self.tasks_done, "failed": self.tasks_failed,
                "fast": self.tasks_fast}

    def _update_weights(self, args: dict[str, Any]) -> dict[str, Any]:
        version = str(args.get("version", ""))
        if not version:
            raise ValueError("update_weights needs a non-empty 'version'")
        self.cfg = self.executor.cfg = self.cfg.replace(weight_version=version)  # a later attach uses it
        if self.executor.store is not None:  # without storage there is no namespace to switch
            self.executor.set_namespace(storage_namespace(self.cfg.model_id, version, self.cfg.salt))
        return {"changed": True, "version": version}

    def _attach_storage(self, args: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg.replace(storage_backend=args.get("backend"), storage_url=args.get("url", ""))
        changed = self.executor.attach_storage(cfg)
        self.cfg = cfg
        return {"changed": changed, "backend": cfg.storage_backend}

    def _detach_storage(self, args: dict[str, Any]) -> dict[str, Any]:
        changed = self.executor.detach_storage()
        self.cfg = self.cfg.replace(storage_backend=None)
        return {"changed": changed}


# control op -> the WorkerControl method that applies it
_OPS = {op: getattr(WorkerControl, "_" + op)
        for op in ("pause", "resume", "sleep", "wakeup", "status", "update_weights",
                   "attach_storage", "detach_storage")}
