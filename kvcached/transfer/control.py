"""Control operations as a worker applies them (the coordinator fans them out).

pause: the coordinator holds new tasks (in order, nothing dropped); a rank
answers once it finished every task it had been sent. resume: the
coordinator sends what it held. sleep: pause and detach from the KV planes
and host pool. wakeup: re-attach and resume. Every op is idempotent and says
whether it changed anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcached.transfer.worker import Worker

logger = logging.getLogger(__name__)


def apply_worker_control(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    op = args.get("op")
    handler = _OPS.get(op)
    if handler is None:
        raise ValueError(f"unknown control op {op!r}; allowed: {sorted(_OPS)}")
    result = handler(w, args)
    logger.info("worker rank %d: %s -> %s", w.rank, op, result)
    return result


def _pause(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    changed = not w.paused
    w.paused = True
    if not w.wait_idle(float(args.get("timeout_s", 30.0))):
        raise TimeoutError(f"rank {w.rank}: tasks in flight did not finish")
    return {"changed": changed, "paused": True}


def _resume(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    changed = w.paused
    w.paused = False
    return {"changed": changed, "paused": False}


def _sleep(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    res = _pause(w, args)
    changed = w.executor.planes is not None
    if changed:
        w.close_executor()
    return {"changed": changed or res["changed"], "asleep": True}


def _wakeup(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    changed = w.executor.planes is None
    if changed:
        w.open_executor(float(args.get("timeout_s", 30.0)))
    _resume(w, args)
    return {"changed": changed, "asleep": False}


def _status(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    return {"paused": w.paused, "asleep": w.executor.planes is None,
            "queues": w.queue_depths(), "done": w.tasks_done, "failed": w.tasks_failed,
            "fast": w.tasks_fast}


def _update_weights(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    from kvcached.storage.objects import storage_namespace
    version = str(args.get("version", ""))
    if not version:
        raise ValueError("update_weights needs a non-empty 'version'")
    w.cfg = w.executor.cfg = w.cfg.replace(weight_version=version)  # a later attach uses it
    if w.executor.store is not None:  # without storage there is no namespace to switch
        w.executor.set_namespace(storage_namespace(w.cfg.model_id, version, w.cfg.salt))
    return {"changed": True, "version": version}


def _attach_storage(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    cfg = w.cfg.replace(storage_backend=args.get("backend"), storage_url=args.get("url", ""))
    changed = w.executor.attach_storage(cfg)
    w.cfg = cfg
    return {"changed": changed, "backend": cfg.storage_backend}


def _detach_storage(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    changed = w.executor.detach_storage()
    w.cfg = w.cfg.replace(storage_backend=None)
    return {"changed": changed}


_OPS = {"pause": _pause, "resume": _resume, "sleep": _sleep, "wakeup": _wakeup,
        "status": _status, "update_weights": _update_weights,
        "attach_storage": _attach_storage, "detach_storage": _detach_storage}
