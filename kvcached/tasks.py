"""Tasks: the unit of work the manager plans and a transfer executes on every rank.

``Task`` says which blocks move where, ``TaskResult`` is every rank's
combined answer, and ``TaskHandle`` is the future a caller waits on. They sit
below both the manager (which plans tasks) and the transfers (which run
them), so neither has to import the other for them.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

TASK_KINDS = ("swap_out", "swap_in", "swap_in_layers", "store", "load", "lookup", "control",
              "noop")


@dataclass(slots=True)
class Task:
    """One unit of work sent to every rank. ids are block ids of the source/destination tier."""

    kind: str
    src: list[int]
    dst: list[int]
    args: dict[str, Any] = field(default_factory=dict)
    task_id: int = 0


@dataclass(slots=True)
class TaskResult:
    """The combined answer of every rank."""

    task_id: int
    ok: bool
    error: str = ""
    lost: bool = False  # a rank's worker was lost: the error is a WorkerLost
    elapsed_s: float = 0.0
    blocks_done: int = 0
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)


class TaskHandle:
    """A future for one task; completed exactly once by the transfer.

    Waiting is on a plain lock held from creation until completion: cheaper to
    create and to wake than a ``threading.Event`` (a Condition over a lock),
    and a task is created and waited on for every swap. A waiter that gets
    the lock hands it straight back, so every waiter (and every later wait)
    passes.
    """

    __slots__ = ("task", "result", "_pending", "_sink")

    def __init__(self, task: Task, sink: collections.deque):
        self.task = task
        self.result: TaskResult | None = None
        self._pending = threading.Lock()  # the C lock itself: no Python wrapper
        self._pending.acquire()  # released by complete()
        self._sink = sink

    def done(self) -> bool:
        return self.result is not None

    def wait(self, timeout: float | None = None) -> bool:
        """True when completed within ``timeout`` seconds."""
        if self.result is not None:
            return True
        got = self._pending.acquire(True, -1 if timeout is None else max(timeout, 0.0))
        if got:
            self._pending.release()
        return got

    def complete(self, result: TaskResult) -> None:
        with _complete_lock:  # the IO thread and close() may race to complete
            if self.result is not None:
                return  # a late answer after a failure was already reported
            self.result = result
        self._sink.append(self)  # deque.append is atomic: safe from any thread
        self._pending.release()


_complete_lock = threading.Lock()


def merge_results(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Combine rank answers: byte counts add up, a usable prefix is the minimum."""
    out: dict[str, Any] = {}
    for res in per_rank.values():
        if isinstance(res.get("bytes"), int):
            out["bytes"] = out.get("bytes", 0) + res["bytes"]
        if isinstance(res.get("prefix"), int):
            out["prefix"] = min(out.get("prefix", res["prefix"]), res["prefix"])
        for key in ("stored", "prefixes"):  # stored, found: on every rank
            if isinstance(res.get(key), list):
                prev = out.get(key, res[key])
                out[key] = [min(a, b) for a, b in zip(prev, res[key])]
    return out
