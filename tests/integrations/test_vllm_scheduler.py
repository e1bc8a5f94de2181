"""The scheduler half's wait in a step with nothing scheduled
(``SchedulerHalf._wait_idle``): it sleeps, the GIL released, until the oldest
lookup or load in flight lands, and never longer than ``IDLE_WAIT_S``; with
nothing in flight it returns at once. (vLLM's own runs of it: the storage
hits of tests/integrations/test_vllm_conformance.py and ``bench_vllm``.)"""

from __future__ import annotations

import collections
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")
from kvcached.integrations.vllm import scheduler as S  # noqa: E402
from kvcached.tasks import Task, TaskHandle, TaskResult  # noqa: E402


def half_with(lookup_handle=None, load_handle=None) -> S.SchedulerHalf:
    """A scheduler half holding one tracked request with that work in flight."""
    half = S.SchedulerHalf.__new__(S.SchedulerHalf)  # no vLLM config: only its state
    t = S.Tracked(request=None, creq=None)
    if lookup_handle is not None:
        t.lookup = S.Lookup(0, 4, None, handle=lookup_handle)
    if load_handle is not None:
        t.loads.append(S.Load(plan=None, parts=[S.Part(batch=load_handle)]))
    half.reqs = {"r": t}
    return half


def handle() -> TaskHandle:
    return TaskHandle(Task("noop", [], []), collections.deque())


def complete_after(h: TaskHandle, seconds: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(seconds),
                                          h.complete(TaskResult(task_id=0, ok=True))))
    th.start()
    return th


@pytest.mark.parametrize("kind", ["lookup", "load"])
def test_an_idle_step_waits_for_the_work_in_flight(monkeypatch, kind):
    monkeypatch.setattr(S, "IDLE_WAIT_S", 30.0)  # longer than the test may take
    h = handle()
    half = half_with(**{f"{kind}_handle": h})
    th = complete_after(h, 0.05)
    t0 = time.monotonic()
    half._wait_idle()
    assert h.done(), "the idle step returned before the work it waits for landed"
    assert time.monotonic() - t0 < 10.0  # woken by the completion, not the bound
    th.join()


def test_the_wait_is_bounded_and_nothing_in_flight_returns_at_once(monkeypatch):
    monkeypatch.setattr(S, "IDLE_WAIT_S", 0.05)
    h = handle()  # never completes
    t0 = time.monotonic()
    half_with(lookup_handle=h)._wait_idle()
    waited = time.monotonic() - t0
    assert 0.04 <= waited < 10.0 and not h.done()
    done = handle()
    done.complete(TaskResult(task_id=0, ok=True))
    monkeypatch.setattr(S, "IDLE_WAIT_S", 30.0)
    t0 = time.monotonic()
    half_with(lookup_handle=done)._wait_idle()  # landed already: nothing to wait for
    half_with()._wait_idle()  # nothing in flight
    assert time.monotonic() - t0 < 10.0
