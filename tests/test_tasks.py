"""TaskHandle: the future every task is waited on through."""

from __future__ import annotations

import collections
import threading

from kvcached.tasks import Task, TaskHandle, TaskResult


def handle() -> tuple[TaskHandle, collections.deque]:
    sink: collections.deque = collections.deque()
    return TaskHandle(Task("noop", [], [], task_id=7), sink), sink


def test_wait_times_out_until_completed_then_always_passes():
    h, sink = handle()
    assert not h.done()
    assert h.wait(0.01) is False
    assert h.wait(0) is False
    h.complete(TaskResult(7, True))
    assert h.done() and h.result.ok
    assert h.wait(0) and h.wait(None) and h.wait(5)  # every later wait passes
    assert list(sink) == [h]


def test_every_waiter_wakes():
    h, _ = handle()
    woke = []
    threads = [threading.Thread(target=lambda: woke.append(h.wait(10))) for _ in range(4)]
    for t in threads:
        t.start()
    h.complete(TaskResult(7, True))
    for t in threads:
        t.join(10)
    assert woke == [True] * 4


def _race_to_complete(h: TaskHandle, start: threading.Barrier, ok: bool) -> None:
    start.wait()
    h.complete(TaskResult(7, ok, "" if ok else "closed"))


def test_completes_once_even_when_threads_race():
    for _ in range(50):
        h, sink = handle()
        start = threading.Barrier(4)
        threads = [threading.Thread(target=_race_to_complete, args=(h, start, i % 2 == 0))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert h.wait(0) and list(sink) == [h]  # one result, queued once, no double release
