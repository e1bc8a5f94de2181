"""The engine's wait for a load inside its step (kvcached.memory.stepwait): which
wait a forward uses, layer by layer on the CPU, a failure given up at once, and
giving up for good: a real transfer worker stopped in the middle of a layer's
copy writes nothing into the load's blocks after the engine gave up on them.
(On CUDA, the stream waits: tests/copy/test_cuda_gpu.py.)"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from helpers import pid_alive, wait_for

from kvcached import CacheManager
from kvcached.memory.kvshare import attach_kv_cache
from kvcached.memory.progress import Cancelled, StepProgress, progress_path
from kvcached.memory.stepwait import StepWait, layerwise
from kvcached.tasks import Task


def test_which_wait_a_forward_uses():
    """Per layer wherever the per-layer hook runs: always on the CPU; on CUDA
    unless a full CUDA graph may replay the forward (vLLM's cudagraph mode has
    full graphs, or this forward's runtime mode is FULL), which skips the hook:
    then the whole load is waited for before the forward."""
    assert layerwise(on_cuda=False, full_graphs=True, runtime_mode="FULL")
    assert layerwise(on_cuda=True, full_graphs=False, runtime_mode=None)
    assert layerwise(on_cuda=True, full_graphs=False, runtime_mode="PIECEWISE")
    assert not layerwise(on_cuda=True, full_graphs=True, runtime_mode="PIECEWISE")
    assert not layerwise(on_cuda=True, full_graphs=False, runtime_mode="FULL")

    class Mode:  # vLLM's CUDAGraphMode is an enum: its name is what counts
        name = "FULL"
    assert not layerwise(on_cuda=True, full_graphs=False, runtime_mode=Mode())


def test_each_layer_is_waited_for_before_its_attention(chan):
    reader, writer = chan
    waits = StepWait(reader, num_layers=3)
    waits.expect(7, [4, 5], timeout_s=0.05)
    waits.start()
    writer.publish(7, 1)
    waits.layer(0)  # landed: no wait
    t0 = time.monotonic()
    waits.layer(1)  # never lands: the deadline passes, the load is given up
    assert time.monotonic() - t0 < 5.0
    assert waits.take_errors() == {4, 5} and not waits.active
    with pytest.raises(Cancelled):  # its writer copies nothing more of it
        with writer.layer_gate(7):
            pass
    waits.layer(2)  # given up: nothing more to wait for
    waits.finish()
    assert waits.take_errors() == set()


def test_without_per_layer_waits_the_whole_load_is_waited_for_first(chan):
    """Where a full CUDA graph may run the forward, every layer is waited for
    before it starts: a layer that never lands is given up there, not later."""
    reader, writer = chan
    waits = StepWait(reader, num_layers=2)
    waits.expect(8, [1], timeout_s=0.05)
    writer.publish(8, 1)  # layer 0 landed, layer 1 never does
    waits.start(layerwise=False)
    assert waits.take_errors() == {1} and not waits.active
    waits.expect(9, [2], timeout_s=5.0)
    writer.publish(9, 2)
    waits.start(layerwise=False)
    waits.finish()
    assert waits.take_errors() == set() and not waits.active


def test_a_failed_copy_is_given_up_at_once(chan):
    reader, writer = chan
    waits = StepWait(reader, num_layers=4)
    waits.expect(9, [3], timeout_s=30.0)
    waits.start()
    writer.publish(9, 1, failed=True)
    t0 = time.monotonic()
    waits.finish()
    assert time.monotonic() - t0 < 5.0 and waits.take_errors() == {3}


# ----------------------------------------------- a layer in flight at give-up
def layer_state(planes, layer: int, blocks: range) -> str:
    """"new" (every sampled value 1.0), "old" (every one 0.0) or "partial": a
    few values of each block of ``layer``'s two planes (its first and last)."""
    seen = set()
    for plane in planes[2 * layer:2 * layer + 2]:
        flat = plane[blocks.start:blocks.stop].reshape(len(blocks), -1)
        seen.update(flat[:, 0].tolist())
        seen.update(flat[:, -1].tolist())
    if seen == {1.0}:
        return "new"
    return "old" if seen == {0.0} else "partial"


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (a SIGSTOP reaches them one by one)."""
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT" for t in tasks)


def stop_inside_a_layer(mgr, planes, src, dst, deadline: float):
    """Submit the in-step load until its worker is caught (SIGSTOP) in the middle
    of a layer's copy; (handle, layer, worker pid)."""
    pid = mgr.stats().workers[0]["pid"]
    while time.monotonic() < deadline:
        for p in planes:
            p[dst.start:dst.stop].zero_()
        handle = mgr.transfer.submit(Task("swap_in_layers", list(src), list(dst)))
        while not handle.done():
            mid = [i for i in range(2) if layer_state(planes, i, dst) == "partial"]
            if mid:
                os.kill(pid, signal.SIGSTOP)
                wait_for(lambda: stopped(pid), 30, "the worker to stop")
                if layer_state(planes, mid[0], dst) == "partial":
                    return handle, mid[0], pid
                os.kill(pid, signal.SIGCONT)  # it finished that layer meanwhile: again
                break
        assert handle.wait(30) and handle.result.ok, handle.result
    pytest.fail("the transfer worker was never caught inside a layer's copy")


def test_a_layer_in_flight_when_the_engine_gives_up_never_lands_after(tmp_path, caplog):
    """The engine gives up on an in-step load while its worker is in the middle
    of copying a layer (here: stopped there). vLLM computes those blocks again,
    so nothing of the load may land afterwards: the give-up waits for the layer
    in flight (one more timeout), then kills the worker stuck in it. Without
    that, the worker, once it runs again, finishes the layer into blocks the
    engine already wrote again."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    chan = StepProgress.create(progress_path(run_dir, 0))  # as vLLM's worker half does
    # 2 layers of K and V planes, 1 MiB per block-plane: a layer of 8 blocks is
    # 16 MiB, milliseconds to copy. The coordinator would declare a stopped
    # worker lost only after 60 s: the give-up here is what stops it.
    cfg = tiny_config(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=60,
                      engine_timeout_s=120, task_timeout_s=60, worker_start_timeout_s=60,
                      run_dir=str(run_dir), num_layers=2, num_kv_heads=8, head_dim=128,
                      block_size=256, num_gpu_blocks=16, num_cpu_blocks=8, copy_threads=1)
    mgr = CacheManager(cfg).start()
    pid = 0
    try:
        planes = attach_kv_cache(mgr.run_dir, 0)
        assert len(planes) == 4
        src, dst = range(0, 8), range(8, 16)
        for p in planes:
            p[src.start:src.stop].fill_(1.0)
        assert mgr.transfer.submit(Task("swap_out", list(src), list(src))).wait(30)
        handle, layer, pid = stop_inside_a_layer(mgr, planes, src, dst,
                                                 time.monotonic() + 120)
        waits = StepWait(chan, num_layers=2)
        waits.expect(handle.task.task_id, list(dst), timeout_s=0.2)
        waits.start()
        with caplog.at_level(logging.ERROR, logger="kvcached.memory.stepwait"):
            waits.finish()  # the deadline passes with the layer half copied
        assert waits.take_errors() == set(dst)
        given_up = [p[dst.start:dst.stop].clone() for p in planes]
        assert layer_state(planes, layer, dst) == "partial"
        if pid_alive(pid):  # without the fix: it runs on from where it stopped
            os.kill(pid, signal.SIGCONT)
        assert handle.wait(60)
        landed = [i for i, (before, p) in enumerate(zip(given_up, planes, strict=True))
                  if not torch.equal(before, p[dst.start:dst.stop])]
        assert not landed, f"a copy landed in planes {landed} after the give-up"
        assert not handle.result.ok  # its worker died with it
        assert not pid_alive(pid)
        assert "is stuck copying a layer" in caplog.text
        # the coordinator starts a new worker, which copies the next load whole
        wait_for(lambda: mgr.stats().workers[0]["pid"] != pid
                 and mgr.stats().workers[0]["state"] == "ready", 60, "a new worker")
        again = mgr.transfer.submit(Task("swap_in_layers", list(src), list(dst)))
        assert again.wait(60) and again.result.ok, again.result
        assert all(layer_state(planes, i, dst) == "new" for i in range(2))
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
        mgr.close()
        chan.close()
