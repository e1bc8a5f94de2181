"""The Transfer interface: how the manager's planned moves get executed.

The manager plans tasks (which blocks move where) and hands them to a
Transfer; it never touches KV memory itself. ``InProcessTransfer`` copies in
the engine process; ``WorkerTransfer`` fans each task out to one worker
process per TP rank and completes it when every rank has answered.

Completion is reported two ways: the ``TaskHandle`` (a future to wait on)
and the Transfer's ``completed`` queue, which the manager drains on its own
thread so that every tree transition happens in one place.
"""

from __future__ import annotations

import collections
import itertools
from abc import ABC, abstractmethod
from typing import Any

from kvcached.tasks import Task, TaskHandle


class Transfer(ABC):
    """Executes the manager's tasks on every rank."""

    def __init__(self) -> None:
        self.completed: collections.deque[TaskHandle] = collections.deque()
        self._ids = itertools.count(1)

    def new_handle(self, task: Task) -> TaskHandle:
        task.task_id = next(self._ids)
        return TaskHandle(task, self.completed)

    @abstractmethod
    def start(self) -> None:
        """Attach to every rank's KV planes and host pool; return when all are ready."""

    @abstractmethod
    def submit(self, task: Task) -> TaskHandle:
        """Start ``task`` on every rank; never blocks on the copy itself."""

    def flush(self, timeout_s: float) -> bool:
        """Wait until every task submitted so far is on its way to the ranks
        (True), or ``timeout_s`` passed. Nothing to wait for here."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Stop; tasks still in flight fail."""

    def control(self, op: str, args: dict[str, Any] | None = None,
                timeout_s: float = 10.0) -> dict[str, Any]:
        """Apply a control operation on every rank (pause, resume, ...)."""
        return {"ok": True, "op": op, "ranks": {}}

    def restart_workers(self, timeout_s: float) -> dict[str, Any]:
        """Restart the workers that gave up; returns once every rank is ready (or
        ``timeout_s`` passed). Nothing to restart without worker processes."""
        return {"changed": False, "restarted": []}

    def stats(self) -> dict[str, Any]:
        return {}

    @property
    def healthy(self) -> bool:
        """False once the transfer cannot move blocks any more (the CPU tier must go)."""
        return True
