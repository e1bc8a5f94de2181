"""Pause never freezes serving; `sleep --drain` waits for running requests
instead of failing; status is answered meanwhile."""

from __future__ import annotations

import threading
import time

import pytest
from click.testing import CliRunner
from conftest import tiny_config, toks
from helpers import wait_for

from kvcached import CacheAsleep, CacheManager
from kvcached.ops.cli import main
from kvcached.ops.ctlserver import ControlServer, request

FAST = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=3.0,
            engine_timeout_s=5.0, task_timeout_s=10.0, worker_start_timeout_s=60.0)


def submitted(mgr) -> dict:
    return {k: t["submitted"] for k, t in mgr.stats().transfers.items()}


def test_while_paused_cpu_hits_are_misses_and_no_request_waits(tmp_path):
    """While paused, a CPU-tier prefix is served as a miss: no swap-in is
    planned and held, so no wait() blocks until resume."""
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), tp_size=2, num_gpu_blocks=8,
                      num_cpu_blocks=8, storage_backend="file",
                      storage_url=str(tmp_path / "store"))
    prompt = toks(1, 2, 3, tail=1)
    with CacheManager(cfg) as mgr:
        mgr.allocate("a", prompt).wait(10)
        mgr.commit("a", prompt, len(prompt))
        mgr.free("a")
        mgr.allocate("big", toks(*range(10, 17), tail=1))  # evicts "a" to the CPU tier
        mgr.free("big")
        wait_for(lambda: (t := mgr.stats().transfers["store"])["done"] == t["submitted"], 10,
                 "the write-through to finish")
        mgr.pause()
        before = submitted(mgr)
        t0 = time.monotonic()
        for i in range(5):
            a = mgr.allocate(f"p{i}", prompt)
            assert a.ready and a.hit.cpu_tokens == a.hit.storage_tokens == 0
            a.wait(0)
            mgr.commit(f"p{i}", prompt, len(prompt))
            mgr.free(f"p{i}")
        assert time.monotonic() - t0 < 5.0  # served, not held until resume
        assert submitted(mgr) == before  # nothing new that would wait on a transfer
        mgr.check_invariants()
        mgr.resume()
        # The recompute adopted the CPU copies: the prefix is on the GPU now.
        a = mgr.allocate("after", prompt)
        a.wait(10)
        assert a.num_cached_tokens == 12
        mgr.free("after")
        mgr.check_invariants()


class BlockingManager:
    """pause and sleep block until released; status answers at once."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)  # one release per op that started blocking

    def _block(self) -> dict:
        self.entered.release()
        self.release.wait(30)
        return {"changed": True}

    def pause(self):
        return self._block()

    def sleep(self, **kw):
        return self._block()

    def status(self):
        return {"paused": True, "stats": {}, "workers": []}


def test_status_is_answered_while_blocking_ops_wait(tmp_path):
    """With a pause draining and a sleep waiting on both op threads, status is
    still answered at once (it has a thread of its own)."""
    mgr = BlockingManager(tmp_path)
    server = ControlServer(mgr).start()
    try:
        ops = [threading.Thread(target=request, args=(tmp_path, op, {}, 20))
               for op in ("pause", "sleep", "pause")]
        for t in ops:
            t.start()
        for _ in range(2):  # both op threads are taken (the third op queues)
            assert mgr.entered.acquire(timeout=10), "the blocking ops never started"
        t0 = time.monotonic()
        assert request(tmp_path, "status", timeout_s=5)["paused"]
        assert time.monotonic() - t0 < 1.0
        assert all(t.is_alive() for t in ops)
    finally:
        mgr.release.set()
        for t in ops:
            t.join(30)
        server.close()


# ------------------------------------------------------------------ drain
def running_manager(make_manager):
    mgr = make_manager(num_gpu_blocks=16)
    a = mgr.allocate("running", toks(1, 2, tail=1), reserve_tokens=2)
    a.wait(1)
    return mgr


def test_sleep_drain_refuses_new_requests_and_sleeps_once_running_ones_finish(make_manager):
    mgr = running_manager(make_manager)
    with pytest.raises(RuntimeError, match="requests are still running"):
        mgr.sleep()  # without drain: refused, as before
    done = []
    t = threading.Thread(target=lambda: done.append(mgr.sleep(drain=True,
                                                              drain_timeout_s=30)))
    t.start()
    wait_for(lambda: mgr.status()["draining"], 5, "the drain to begin")
    with pytest.raises(CacheAsleep, match="draining"):
        mgr.allocate("new", toks(5, tail=1))  # at once, not after the drain
    assert mgr.extend("running", 6)  # the running request goes on
    mgr.commit("running", toks(1, 2, tail=1), 9)
    assert t.is_alive() and not mgr.status()["asleep"]
    mgr.free("running")
    t.join(10)
    assert done and done[0]["asleep"] and done[0]["changed"]
    st = mgr.status()
    assert st["asleep"] and not st["draining"]
    with pytest.raises(CacheAsleep):
        mgr.allocate("new", toks(5, tail=1))
    mgr.wakeup()
    mgr.allocate("new", toks(5, tail=1))
    mgr.check_invariants()


def test_a_drain_that_times_out_changes_nothing(make_manager):
    mgr = running_manager(make_manager)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="1 requests still running after 0.3s"):
        mgr.sleep(drain=True, drain_timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    st = mgr.status()
    assert not st["asleep"] and not st["draining"]
    mgr.allocate("new", toks(5, tail=1))  # served again
    mgr.check_invariants()


def test_ctl_sleep_drain_through_the_control_socket(make_manager):
    """`ctl sleep` refuses while a request runs; `ctl sleep --drain` waits for it."""
    mgr = running_manager(make_manager)
    rd = str(mgr.run_dir)
    res = CliRunner().invoke(main, ["ctl", "sleep", "--run-dir", rd])
    assert res.exit_code == 1 and "requests are still running" in res.output
    out = []
    t = threading.Thread(target=lambda: out.append(CliRunner().invoke(
        main, ["ctl", "sleep", "--drain", "--timeout", "30", "--run-dir", rd])))
    t.start()
    wait_for(lambda: mgr.status()["draining"], 10, "the drain to begin")
    text = CliRunner().invoke(main, ["status", "--run-dir", rd]).output
    assert text.startswith("kvcached: DRAINING")
    mgr.free("running")
    t.join(30)
    assert out[0].exit_code == 0 and "sleep: ok (changed)" in out[0].output
    assert mgr.status()["asleep"]
    res = CliRunner().invoke(main, ["ctl", "sleep", "--drain", "--timeout", "0.5", "--json",
                                    "--run-dir", rd])
    assert res.exit_code == 0 and '"changed": false' in res.output  # already asleep
