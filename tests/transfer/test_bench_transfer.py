"""scripts/bench_transfer.py's CPU meter and hand-off floor: the meter counts
the CPU of this process's threads and of the peer processes it is given, and
a short latency run reports times and CPU for the tasks, the raw barrier and
the floor."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from _bench_util import load_script  # noqa: E402

bench = load_script("bench_transfer")

# A child that spins until it has used this much CPU, then waits to be told to exit.
SPIN_S = 0.3
SPIN = ("import sys, time\n"
        f"end = time.thread_time() + {SPIN_S}\n"
        "while time.thread_time() < end: pass\n"
        "print('spun', flush=True)\n"
        "sys.stdin.read()\n")


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_run_ns_counts_a_peers_cpu_and_nothing_for_a_gone_pid():
    child = _spinner()
    try:
        before = bench._run_ns([child.pid])
        assert child.stdout.readline().strip() == "spun"
        spent = (bench._run_ns([child.pid]) - before) / 1e9
        # It spun SPIN_S of CPU; "before" may have caught up to the start-up.
        assert SPIN_S * 0.5 <= spent <= SPIN_S * 3, spent
    finally:
        child.communicate("", timeout=30)
    assert bench._run_ns([child.pid]) == 0  # reaped: no /proc entry, no error


def test_cpu_meter_splits_this_process_from_its_peers():
    child = _spinner()
    meter = bench.CpuMeter([child.pid])

    def spin_here_then_wait_for_child(n: int) -> list[float]:
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        assert child.stdout.readline().strip() == "spun"
        return [1.0] * n

    try:
        assert meter.measure(spin_here_then_wait_for_child, 4) == [1.0] * 4
    finally:
        child.communicate("", timeout=30)
    per_call = meter.per_call_us()
    assert per_call["this_process"] >= 0.1 / 4 * 1e6 * 0.9  # our 0.1 s over 4 calls
    assert per_call["peers"] >= SPIN_S / 4 * 1e6 * 0.5  # the child's spin, most of it


def test_latency_run_reports_cpu_for_tasks_the_raw_barrier_and_the_floor():
    res = bench.latency_at(tp=2, iters=20, warmup=5, payload=bench.task_payload(), chunk=10)
    for side in ("task", "raw", "handoff"):
        assert res[side]["p50_us"] > 0
        cpu = res[side]["cpu_us"]
        # Each side's peers (workers, echo processes) run for every round trip.
        assert cpu["this_process"] > 0 and cpu["peers"] > 0, res
