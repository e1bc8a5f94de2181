"""Restarting transfer workers: consecutive crashes count (one rule with
`kvcached launch`), and `kvcached ctl restart-workers` brings back a rank
that gave up, CPU tier included. Real worker processes, real signals."""

from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner
from conftest import tiny_config, toks
from helpers import wait_for

from kvcached import CacheManager
from kvcached.ops.cli import main
from kvcached.transfer.coordinator import WorkerTransfer
from kvcached.transfer.supervisor import backoff_s, count_crash, may_restart

STABLE_S = 3.0
FAST = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=1.5,
            engine_timeout_s=3.0, task_timeout_s=5.0, worker_start_timeout_s=60.0)


def test_the_rule_counts_crashes_in_a_row():
    assert count_crash(0, 1.0, crashed=True, stable_s=30) == 1
    assert count_crash(1, 1.0, crashed=True, stable_s=30) == 2
    assert count_crash(5, 30.0, crashed=True, stable_s=30) == 1  # it had been healthy
    assert count_crash(5, 1.0, crashed=False, stable_s=30) == 0  # a clean exit
    assert may_restart(3, 3) and not may_restart(4, 3) and may_restart(10**6, None)
    assert [backoff_s(n, 0.2, 1.0) for n in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]


def worker(mgr) -> dict:
    return mgr.stats().workers[0]


def kill_and_wait(mgr, want_state: str) -> dict:
    """SIGKILL rank 0's worker; wait until the coordinator has dealt with it."""
    pid = worker(mgr)["pid"]
    os.kill(pid, signal.SIGKILL)
    return wait_for(lambda: (w := worker(mgr))["pid"] != pid and w["state"] == want_state
                    and w, 30, f"rank 0 to be {want_state} after killing pid {pid}")


def round_trip(mgr, rid: str) -> int:
    """Cache a prompt, push it to the CPU tier, hit it: the CPU tier's tokens."""
    prompt = toks(1, 2, tail=1)
    mgr.allocate(f"{rid}-a", prompt).wait(10)
    mgr.commit(f"{rid}-a", prompt, len(prompt))
    mgr.free(f"{rid}-a")
    big = toks(*range(20, 27), tail=1)  # as large as the GPU tier: evicts the prompt
    mgr.allocate(f"{rid}-b", big)
    mgr.free(f"{rid}-b")
    a = mgr.allocate(f"{rid}-c", prompt)
    a.wait(10)
    mgr.free(f"{rid}-c")
    return a.hit.cpu_tokens


def test_a_rank_healthy_for_a_while_keeps_its_budget_and_restart_workers_brings_one_back(
        tmp_path):
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), tp_size=1, num_gpu_blocks=8,
                      num_cpu_blocks=8, max_worker_restarts=1, worker_stable_s=STABLE_S)
    with CacheManager(cfg) as mgr:
        assert kill_and_wait(mgr, "ready")["crashes"] == 1
        wait_for(lambda: worker(mgr)["ready_s"] > STABLE_S + 0.1, STABLE_S + 30,
                 "rank 0 to stay up longer than worker_stable_s")  # so...
        w = kill_and_wait(mgr, "ready")  # ...so this crash starts the count over
        assert w["crashes"] == 1 and w["restarts"] == 2 and mgr.transfer.healthy
        assert round_trip(mgr, "a") == 8  # the CPU tier still serves

        # Killed again at once: two crashes in a row > max_worker_restarts = 1.
        pid = w["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: worker(mgr)["state"] == "failed", 30, "rank 0 to give up")
        wait_for(lambda: not mgr.status()["cpu_tier"], 10, "the CPU tier to go off")
        st = CliRunner().invoke(main, ["status", "--run-dir", str(mgr.run_dir)]).output
        assert "UNHEALTHY" in st and "restart-workers" in st

        res = CliRunner().invoke(main, ["ctl", "restart-workers", "--run-dir",
                                        str(mgr.run_dir), "--timeout", "60"])
        assert res.exit_code == 0, res.output
        assert "restart-workers: ok (changed, restarted ranks [0])" in res.output
        w = worker(mgr)
        assert w["state"] == "ready" and w["crashes"] == 0 and w["pid"] != pid
        assert mgr.status()["cpu_tier"] and mgr.transfer.healthy
        assert round_trip(mgr, "b") == 8  # swaps work again
        mgr.check_invariants()
        again = CliRunner().invoke(main, ["ctl", "restart-workers", "--run-dir",
                                          str(mgr.run_dir)])
        assert "no change" in again.output


def test_restart_workers_without_worker_processes_changes_nothing(make_manager):
    mgr = make_manager(num_cpu_blocks=4)  # in-process transfer
    assert mgr.restart_workers() == {"changed": False, "restarted": [], "cpu_tier": True}


def test_restart_workers_refuses_launched_workers(tmp_path):
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), spawn_workers=False)
    with pytest.raises(RuntimeError, match="kvcached launch"):
        WorkerTransfer(cfg, tmp_path / "run").restart_workers(1.0)


def test_worker_entries_have_the_same_keys_before_the_first_heartbeat(tmp_path):
    """`stats().workers` has queues/done/fast/... from the start, not only after a
    heartbeat."""
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), tp_size=1, num_cpu_blocks=4)
    early = WorkerTransfer(cfg, tmp_path / "run").stats()["workers"][0]
    with CacheManager(cfg) as mgr:
        wait_for(lambda: worker(mgr)["queues"], 10, "a heartbeat (it fills in the queues)")
        assert set(early) == set(worker(mgr))
    assert {"queues", "done", "fast", "failed", "paused", "storage", "crashes"} <= set(early)


def test_a_lost_worker_s_last_words_reach_the_engine_s_stderr(tmp_path, capfd):
    """A worker that dies takes its run dir's logs with it when that dir is
    temporary (vLLM's, by default): the engine's error, on its stderr, which
    the operator keeps, carries the end of the dead worker's stderr."""
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), tp_size=1, num_gpu_blocks=8,
                      num_cpu_blocks=8)
    with CacheManager(cfg) as mgr:
        capfd.readouterr()
        with open(mgr.transfer.log_dir / "worker-rank0.stderr", "a") as f:
            f.write("Traceback (most recent call last):\nMemoryError: the worker's last words\n")
        kill_and_wait(mgr, "ready")
        err = capfd.readouterr().err
    assert "rank 0 lost: " in err and "; its stderr ends:" in err, err
    assert "MemoryError: the worker's last words" in err, err
