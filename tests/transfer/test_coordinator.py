"""Transfer workers as real processes over real ZeroMQ sockets (CPU backend)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, toks
from helpers import pid_alive, wait_for

from kvcached import CacheManager, NoFreeBlocks, TransferFailed, WorkerLost
from kvcached.memory.kvshare import attach_kv_cache

FAST = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=1.5,
            engine_timeout_s=3.0, task_timeout_s=5.0, worker_start_timeout_s=60.0)


@pytest.fixture
def workers_manager(tmp_path):
    made = []

    def make(**kw) -> CacheManager:
        cfg = tiny_config(**{**FAST, "run_dir": str(tmp_path / f"w{len(made)}"), **kw})
        mgr = CacheManager(cfg)
        made.append(mgr)
        return mgr.start()

    yield make
    for m in made:
        m.close()


def fill(planes, block: int, rank: int, salt: int) -> None:
    for p, plane in enumerate(planes):
        plane[block].fill_(salt * 1000 + rank * 100 + p)


def test_tp2_swap_out_and_in_keep_every_byte_on_every_rank(workers_manager):
    mgr = workers_manager(tp_size=2, num_gpu_blocks=6, num_cpu_blocks=8, num_layers=2)
    planes = [attach_kv_cache(mgr.run_dir, r) for r in range(2)]
    prompt = toks(1, 2, 3, tail=1)
    a = mgr.allocate("r1", prompt)
    for i, b in enumerate(a.block_ids[:3]):
        for r in range(2):
            fill(planes[r], b, r, salt=i + 1)
    mgr.commit("r1", prompt, len(prompt))
    mgr.free("r1")

    # Another request takes every GPU block: r1's blocks are swapped out and
    # their GPU copies overwritten by the new request's KV.
    b = mgr.allocate("r2", toks(7, 8, 9, 10, 11, tail=1))
    for blk in b.block_ids:
        for r in range(2):
            fill(planes[r], blk, r, salt=77)
    mgr.commit("r2", toks(7, 8, 9, 10, 11, tail=1), 21)
    mgr.free("r2")
    assert mgr.stats().evictions.get("gpu_to_cpu", 0) >= 3

    c = mgr.allocate("r3", prompt)
    c.wait(timeout=10)
    assert c.hit.cpu_tokens > 0 and c.num_cached_tokens == 12
    for i, blk in enumerate(c.block_ids[:3]):
        for r in range(2):
            for p, plane in enumerate(planes[r]):
                want = (i + 1) * 1000 + r * 100 + p
                assert bool((plane[blk] == want).all()), (i, r, p, blk)
    st = mgr.stats()
    assert st.transfers["swap_in"]["done"] == 1
    assert [w["state"] for w in st.workers] == ["ready", "ready"]
    mgr.check_invariants()


def test_worker_command_line_and_logs(workers_manager):
    mgr = workers_manager(tp_size=2)
    pids = [w["pid"] for w in mgr.stats().workers]
    for rank, pid in enumerate(pids):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"kvcached" in cmd and b"worker" in cmd
        assert cmd[cmd.index(b"--rank") + 1] == str(rank).encode()
    log = mgr.run_dir / "logs" / "worker-rank1.log"
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 10, "worker log")
    assert all("worker-rank1" in line for line in log.read_text().splitlines() if line)


def test_a_kvcached_checkout_in_the_current_directory_is_not_the_workers(
        workers_manager, tmp_path, monkeypatch):
    """Workers run the engine's copy of kvcached: another one in the engine's
    current directory (a checkout of another version) would otherwise come
    first on the worker's path."""
    decoy = tmp_path / "cwd" / "kvcached"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy kvcached was imported')\n")
    (decoy / "__main__.py").write_text("raise SystemExit('the decoy kvcached ran')\n")
    monkeypatch.chdir(decoy.parent)
    mgr = workers_manager(tp_size=1)
    assert [w["state"] for w in mgr.stats().workers] == ["ready"]
    cmd = Path(f"/proc/{mgr.stats().workers[0]['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"-P" in cmd


def test_sigkill_worker_mid_task_fails_fast_and_serving_continues(workers_manager):
    mgr = workers_manager(tp_size=2, num_gpu_blocks=8, num_cpu_blocks=4)
    prompt = toks(1, 2, 3)
    mgr.allocate("r1", prompt)
    mgr.commit("r1", prompt, 12)
    mgr.free("r1")
    mgr.allocate("r2", toks(5, 6, 7, 8, 9, 10, tail=1))  # "3", "2" go to CPU
    mgr.free("r2")
    # Rank 1 is stopped: the swap-in is surely in flight (rank 0 answers, it cannot).
    victim = mgr.stats().workers[1]["pid"]
    os.kill(victim, signal.SIGSTOP)
    a = mgr.allocate("r3", prompt + [0])
    assert not a.ready and a.hit.cpu_tokens == 8
    os.kill(victim, signal.SIGKILL)  # the coordinator sees it exit: rank 1 is lost
    t0 = time.monotonic()
    with pytest.raises(WorkerLost):
        a.wait(timeout=10)
    assert time.monotonic() - t0 < 3.5  # within the worker deadline
    assert a.num_cached_tokens == 4  # only the GPU hit is left
    mgr.check_invariants()
    mgr.commit("r3", prompt + [0], 13)
    mgr.free("r3")

    # The rank is restarted and swaps work again.
    assert mgr.transfer.wait_ready(30)
    workers = mgr.stats().workers
    assert workers[1]["pid"] != victim and workers[1]["restarts"] == 1
    mgr.allocate("r4", toks(11, 12, 13, 14, 15, 16, 17, tail=1))  # evicts via swap_out
    mgr.free("r4")
    assert mgr.stats().transfers["swap_out"]["done"] >= 2
    mgr.check_invariants()


def test_a_hung_worker_never_blocks_the_engine(workers_manager):
    """A stopped (hung, not dead) worker reads nothing. Submitting more tasks than
    ZeroMQ's default queues hold (~1000 each side; submit blocked at the 1000th
    before) must return at once; the tasks fail with WorkerLost once the worker
    is declared lost, and the restarted rank serves again."""
    from kvcached.tasks import Task
    mgr = workers_manager(tp_size=1, num_cpu_blocks=4)
    t = mgr.transfer
    victim = mgr.stats().workers[0]["pid"]
    handles: list = []
    os.kill(victim, signal.SIGSTOP)
    try:
        th = threading.Thread(target=lambda: handles.extend(
            t.submit(Task("noop", [], [])) for _ in range(5000)))
        th.start()
        th.join(30)
        assert not th.is_alive(), f"submit blocked after {len(handles)} tasks"
        assert len(handles) == 5000
        for h in (handles[0], handles[-1]):
            assert h.wait(FAST["worker_timeout_s"] + 5), "a task waits past the deadline"
        assert all(h.done() and not h.result.ok for h in handles)
        assert handles[0].result.lost
    finally:
        if pid_alive(victim):
            os.kill(victim, signal.SIGCONT)
    assert "silent" in mgr.stats().workers[0]["lost_reason"]
    assert t.wait_ready(30)
    ok = t.submit(Task("noop", [], []))
    assert ok.wait(10) and ok.result.ok
    assert mgr.stats().workers[0]["pid"] != victim


def test_worker_that_cannot_restart_leaves_gpu_only_serving(workers_manager):
    mgr = workers_manager(tp_size=1, num_gpu_blocks=4, num_cpu_blocks=4,
                          max_worker_restarts=0)
    mgr.allocate("r1", toks(1, 2, 3))
    mgr.commit("r1", toks(1, 2, 3), 12)
    mgr.free("r1")
    mgr.allocate("r2", toks(5, 6, tail=1))  # two blocks now on CPU
    mgr.free("r2")
    os.kill(mgr.stats().workers[0]["pid"], signal.SIGKILL)
    wait_for(lambda: not mgr.transfer.healthy, 5, "the coordinator to give up")
    mgr.check_invariants()
    assert not mgr.cpu_enabled and mgr.stats().tiers["cpu"].used == 0
    for i in range(3):  # keeps serving by dropping GPU blocks
        mgr.allocate(f"g{i}", toks(10 + i, 20 + i, tail=1))
        mgr.commit(f"g{i}", toks(10 + i, 20 + i, tail=1), 9)
        mgr.free(f"g{i}")
    with pytest.raises(NoFreeBlocks):
        mgr.allocate("huge", toks(*range(40, 46)))
    mgr.check_invariants()


ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from conftest import tiny_config
    from kvcached import CacheManager
    cfg = tiny_config(transfer_mode="workers", tp_size=2, heartbeat_interval_s=0.1,
                      worker_timeout_s=1.5, engine_timeout_s=3.0, num_cpu_blocks=4)
    mgr = CacheManager(cfg).start()
    print(mgr.run_dir, *[w["pid"] for w in mgr.stats().workers], flush=True)
    time.sleep(600)
""")


def test_sigkill_engine_workers_exit_and_next_start_cleans_up(workers_manager, tmp_path):
    from kvcached.memory import shm
    tests = str(Path(__file__).resolve().parents[1])
    eng = subprocess.Popen([sys.executable, "-c", ENGINE.format(tests=tests)],
                           stdout=subprocess.PIPE, text=True)
    try:
        line = eng.stdout.readline().split()
        assert len(line) == 3, f"engine did not start: {line}"
        run_dir, pids = Path(line[0]), [int(p) for p in line[1:]]
        segs = [p.name for p in shm.shm_dir().glob(f"kvcached-{eng.pid}-*")]
        assert len(segs) >= 4  # KV planes + host pool, per rank
        eng.kill()
        eng.wait()
        t0 = time.monotonic()
        wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "workers to exit")
        assert time.monotonic() - t0 < 3.0 + 1.0  # engine_timeout_s, and in fact sooner
    finally:
        eng.kill()
        eng.stdout.close()
    # The next start removes the dead engine's segments and run directory.
    workers_manager(tp_size=1)
    assert not list(shm.shm_dir().glob(f"kvcached-{eng.pid}-*"))
    assert not run_dir.exists()


def test_mismatched_layout_is_refused_at_handshake(tmp_path):
    run_dir = tmp_path / "mm"
    cfg = tiny_config(**{**FAST, "run_dir": str(run_dir), "spawn_workers": False,
                         "worker_start_timeout_s": 20.0})
    mgr = CacheManager(cfg)
    other = tmp_path / "other.toml"
    other.write_text("num_layers = 1\nnum_kv_heads = 1\nhead_dim = 8\nblock_size = 4\n"
                     "num_gpu_blocks = 8\nnum_cpu_blocks = 0\nstorage_backend = \"none\"\n")
    worker = subprocess.Popen([sys.executable, "-m", "kvcached", "worker", "--rank", "0",
                               "--run-dir", str(run_dir), "--config", str(other)])
    try:
        with pytest.raises(TimeoutError, match="layout digest mismatch") as e:
            mgr.start()
        assert cfg.layout.digest in str(e.value)
        assert worker.wait(timeout=20) == 3  # the worker was told why and exited
    finally:
        worker.kill()
        mgr.close()


def test_task_with_out_of_range_ids_fails_cleanly(workers_manager):
    """A bad id fails the task on every rank; no memory is touched; workers live on."""
    from kvcached.tasks import Task
    mgr = workers_manager(tp_size=2, num_cpu_blocks=4)
    planes = attach_kv_cache(mgr.run_dir, 0)
    before = [p.clone() for p in planes]
    h = mgr.transfer.submit(Task("swap_in", [0, 1], [2, 9999]))
    assert h.wait(10)
    assert not h.result.ok and "9999" in h.result.error
    assert all(torch.equal(a, b) for a, b in zip(before, planes))
    h = mgr.transfer.submit(Task("noop", [], []))
    assert h.wait(10) and h.result.ok
    assert [w["state"] for w in mgr.stats().workers] == ["ready", "ready"]


def test_control_pause_holds_tasks_and_resume_runs_them_in_order(workers_manager):
    from kvcached.tasks import Task
    mgr = workers_manager(tp_size=2, num_cpu_blocks=4)
    t = mgr.transfer
    assert t.control("pause", {}, timeout_s=5)["ok"]
    handles = [t.submit(Task("swap_out", [i], [i])) for i in range(3)]
    time.sleep(0.3)  # the point is that nothing happens: give it a chance to
    assert not any(h.done() for h in handles)
    again = t.control("pause", {}, timeout_s=5)
    assert again["ok"] and not any(r["changed"] for r in again["ranks"].values())
    assert t.control("resume", {}, timeout_s=5)["ok"]
    for h in handles:
        assert h.wait(10) and h.result.ok
    order = [h.result.per_rank[0]["finished"] for h in handles]
    assert order == sorted(order)


def test_transfer_failed_is_raised_for_failed_swap_in(workers_manager, monkeypatch):
    mgr = workers_manager(tp_size=1, num_gpu_blocks=4, num_cpu_blocks=4)
    mgr.allocate("r1", toks(1, 2, 3))
    mgr.commit("r1", toks(1, 2, 3), 12)
    mgr.free("r1")
    mgr.allocate("r2", toks(5, 6, tail=1))
    mgr.free("r2")
    # Corrupt the plan: point the swap-in at a host block beyond the pool.
    real_submit = mgr.transfer.submit

    def bad_submit(task):
        if task.kind == "swap_in":
            task.src = [9999] * len(task.src)
        return real_submit(task)

    monkeypatch.setattr(mgr.transfer, "submit", bad_submit)
    a = mgr.allocate("r3", toks(1, 2, 3, tail=1))
    with pytest.raises(TransferFailed) as e:
        a.wait(timeout=10)
    assert not isinstance(e.value, WorkerLost)
    mgr.check_invariants()


def test_cpu_tier_survives_a_worker_crash(workers_manager):
    """The host pool belongs to the engine: a restarted worker re-attaches to it and
    blocks swapped out before the crash come back byte for byte."""
    mgr = workers_manager(tp_size=1, num_gpu_blocks=4, num_cpu_blocks=4)
    planes = attach_kv_cache(mgr.run_dir, 0)
    prompt = toks(1, 2, 3)
    a = mgr.allocate("r1", prompt)
    for i, b in enumerate(a.block_ids):
        fill(planes, b, 0, salt=i + 1)
    mgr.commit("r1", prompt, 12)
    mgr.free("r1")
    mgr.allocate("r2", toks(5, 6, tail=1))  # "3", "2" to CPU
    mgr.free("r2")
    old = mgr.stats().workers[0]["pid"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: mgr.stats().workers[0]["pid"] != old and mgr.transfer.wait_ready(0.1),
             30, "the worker to restart")
    c = mgr.allocate("r3", prompt + [0])
    c.wait(timeout=10)
    assert c.hit.cpu_tokens == 8 and c.num_cached_tokens == 12
    for i, blk in enumerate(c.block_ids[:3]):
        for p, plane in enumerate(planes):
            assert bool((plane[blk] == (i + 1) * 1000 + p).all()), (i, p)
    mgr.check_invariants()


def test_tasks_flow_when_the_engine_has_many_open_files(workers_manager):
    """Engines hold hundreds of descriptors: the coordinator's wake-up pipe then
    gets a number above 256, which Python does not cache as one int object. Its
    IO thread must still take submitted tasks (it once compared the fd by
    identity, and every task then waited forever)."""
    from kvcached.tasks import Task
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(300)]
    try:
        mgr = workers_manager(num_cpu_blocks=4)
        assert mgr.transfer._wake_r > 256  # the case under test
        t = mgr.transfer
        for kind, ids in (("noop", []), ("swap_out", [1]), ("swap_in", [1])):
            h = t.submit(Task(kind, ids, list(ids)))
            wait_for(h.done, 10, f"the IO thread to send and finish a {kind} task")
            assert h.result.ok, h.result.error
    finally:
        for fd in spare:
            os.close(fd)


def test_submit_never_touches_the_socket(workers_manager):
    """Only the IO thread uses the ROUTER: with it stalled, ``submit`` returns at
    once (the engine's scheduler never sends nor waits) and nothing reaches the
    workers; once it runs again, every task completes, once."""
    from kvcached.tasks import Task
    t = workers_manager(tp_size=2, num_cpu_blocks=4).transfer
    stalled, release = threading.Event(), threading.Event()

    def stall(fds, timeout):
        stalled.set()
        release.wait(30)
        return []

    t._io_wait = stall
    try:
        assert stalled.wait(5), "the IO thread never went back to sleep"
        handles = []
        for i in range(20):
            kind, ids = ("noop", []) if i % 2 else ("swap_out", [i % 4])
            handles.append(t.submit(Task(kind, ids, list(ids))))
        assert not any(h.wait(0.2) for h in handles[:1]) and not any(h.done() for h in handles)
        assert t.stats()["inflight"] == 0  # none was sent
    finally:
        del t._io_wait
        release.set()
    for i, h in enumerate(handles):
        assert h.wait(10), f"task {i} never finished"
        assert h.result.ok, h.result.error
    done = [h.task.task_id for h in t.completed]
    assert sorted(done) == sorted(h.task.task_id for h in handles)  # once each


def test_concurrent_waiters_each_get_their_answer_once(workers_manager):
    """Threads submitting and waiting at once: every task completes, each
    exactly once, and each waiter wakes for its own."""
    from kvcached.tasks import Task
    t = workers_manager(tp_size=2, num_cpu_blocks=8).transfer
    results, errors = {}, []

    def run(k: int) -> None:
        try:
            for i in range(25):
                ids = [] if i % 2 else [k]
                h = t.submit(Task("noop" if i % 2 else "swap_out", ids, list(ids)))
                assert h.wait(10), f"thread {k}: task {i} never finished"
                results[h.task.task_id] = h.result.ok
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not any(th.is_alive() for th in threads), errors
    assert len(results) == 100 and all(results.values())
    done = [h.task.task_id for h in t.completed]
    assert sorted(done) == sorted(results)  # completed once each


def test_close_returns_a_thread_that_waits(workers_manager):
    """close() while a thread waits on a task that cannot finish (its worker is
    stopped): the waiter comes back with the task failed, nothing hangs."""
    from kvcached.tasks import Task
    t = workers_manager(tp_size=1, num_cpu_blocks=4).transfer
    pid = t.workers[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        h = t.submit(Task("noop", [], []))
        out, waiting = {}, threading.Event()

        def wait() -> None:
            waiting.set()
            out["waited"] = h.wait(60)
        waiter = threading.Thread(target=wait)
        waiter.start()
        assert waiting.wait(5) and not h.wait(0.2)  # it waits on a task that cannot finish
        t.close()
        waiter.join(10)
        assert not waiter.is_alive() and out["waited"]
        assert not h.result.ok and "closed" in h.result.error
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_submitting_while_closing_never_hangs(workers_manager):
    """Tasks submitted while (or after) the transfer closes all complete: done, or
    failed with "transfer closed"; no wait is left without an answer."""
    from kvcached.tasks import Task
    t = workers_manager(tp_size=1, num_cpu_blocks=4).transfer
    handles, stop = [], threading.Event()

    def submit_forever() -> None:
        while not stop.is_set():
            h = t.submit(Task("noop", [], []))
            handles.append(h)
            h.wait(10)

    th = threading.Thread(target=submit_forever)
    th.start()
    wait_for(lambda: len(handles) > 20, 10, "tasks to flow")
    t.close()
    stop.set()
    th.join(15)
    assert not th.is_alive(), "a submit or wait hung across close()"
    assert all(h.done() for h in handles)
    late = t.submit(Task("noop", [], []))
    assert late.wait(1) and not late.result.ok and "closed" in late.result.error


def test_small_swaps_run_inline_and_give_the_same_bytes(workers_manager):
    """1-block swaps run on the worker's socket thread, a 9-block one on its lane
    (more than INLINE_MAX_BLOCKS); each moves the right bytes."""
    from kvcached.tasks import Task
    from kvcached.transfer.worker import INLINE_MAX_BLOCKS
    mgr = workers_manager(tp_size=2, num_gpu_blocks=16, num_cpu_blocks=16)
    planes = [attach_kv_cache(mgr.run_dir, r) for r in range(2)]
    for r in range(2):
        for b in range(16):
            fill(planes[r], b, r, salt=b + 1)
    big = list(range(INLINE_MAX_BLOCKS + 1))
    for task in (Task("swap_out", [3], [10]), Task("swap_out", big, big)):
        h = mgr.transfer.submit(task)
        assert h.wait(10) and h.result.ok, h.result
    for r in range(2):
        for b in [*big, 12]:
            fill(planes[r], b, r, salt=99)
    for task in (Task("swap_in", [10], [12]), Task("swap_in", big, big)):
        h = mgr.transfer.submit(task)
        assert h.wait(10) and h.result.ok, h.result
        assert h.result.result["bytes"] == 2 * len(task.src) * mgr.cfg.layout.block_bytes
    for r in range(2):
        for b, salt in [(12, 4), *((b, b + 1) for b in big)]:
            for p, plane in enumerate(planes[r]):
                assert bool((plane[b] == salt * 1000 + r * 100 + p).all()), (r, b, p)
    status = mgr.transfer.control("status")
    assert status["ok"]
    assert [status["ranks"][r]["fast"] for r in range(2)] == [2, 2]  # the two 1-block swaps
    assert [status["ranks"][r]["done"] for r in range(2)] == [4, 4]


def test_a_pause_waits_until_the_copies_dones_went_out(tmp_path):
    """A rank answers a pause only once every copy lane's Done was forwarded to
    the coordinator, not merely once the copy finished: the lanes report on
    separate sockets, so the control's answer could otherwise overtake a
    copy's Done, and the engine would see the pause before that copy."""
    from kvcached.transfer.worker import Worker
    cfg = tiny_config(transfer_mode="workers", run_dir=str(tmp_path / "run"))
    w = Worker(cfg, cfg.run_dir, 0, engine_pid=None)
    w.lanes["in"].outstanding = w._owed = 1  # a swap_in finished, its Done not yet sent on
    assert not w.lanes["in"].busy and w.lanes["in"].tasks.qsize() == 0
    assert not w.wait_idle(0.05)
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: w.wait_idle(10) and returned.set())
    waiter.start()
    assert not returned.wait(0.2)  # still owed
    w._forwarded("in")  # what the socket thread does once it sent the Done
    assert returned.wait(10)
    waiter.join(5)
    assert w.lanes["in"].outstanding == 0 and w._owed == 0 and w.wait_idle(0)


def test_start_returns_once_every_worker_attached(tmp_path):
    """A worker attaches (the engine's KV planes, the host pool, storage) after
    the coordinator accepted its hello; start() returns only after that, so the
    engine's first tasks never wait for an attach (a fresh vLLM's first storage
    lookups did, past their deadline). Here the engine exports its planes only
    once the worker's hello was accepted: start() must return after that."""
    from kvcached.memory import kvshare
    from kvcached.memory.shared_alloc import shared_empty
    run = tmp_path / "run"
    run.mkdir()
    cfg = tiny_config(**{**FAST, "run_dir": str(run), "external_gpu_tier": True,
                         "create_cache": False, "num_cpu_blocks": 8, "fused_kv": True})
    mgr = CacheManager(cfg)
    exported = threading.Event()
    hold = []

    def engine_exports_late() -> None:
        wait_for(lambda: mgr._transfer is not None
                 and all(w.ready for w in mgr._transfer.workers), 60, "the worker's hello")
        buf, region = shared_empty((1, 8, 1, 4, 8), torch.float32, "test-late-export")
        hold.append(region)  # the planes stay mapped while the manager runs
        kvshare.export_kv_cache(list(buf.unbind(0)), 0, str(run))
        exported.set()

    th = threading.Thread(target=engine_exports_late)
    th.start()
    try:
        mgr.start()
        assert exported.is_set(), "start() returned before the worker could attach"
        assert all(w.attached for w in mgr._transfer.workers)
    finally:
        th.join()
        mgr.close()


def test_swap_in_layers_copies_layer_by_layer_and_publishes_each(workers_manager, tmp_path):
    """A load inside an engine's step: every byte lands, the rank's progress
    channel names the task with every layer done; a copy that fails (two
    blocks into one) publishes the failure, and its Done fails."""
    from kvcached.memory.progress import StepProgress, progress_path
    from kvcached.tasks import Task
    run_dir = tmp_path / "w0"
    run_dir.mkdir()
    chan = StepProgress.create(progress_path(run_dir, 0))  # as vLLM's worker half does
    mgr = workers_manager(num_layers=3, num_gpu_blocks=6, num_cpu_blocks=4)
    planes = attach_kv_cache(mgr.run_dir, 0)
    for b in (0, 1):
        fill([planes[i] for i in range(len(planes))], b, 0, salt=b + 1)
    assert mgr.transfer.submit(Task("swap_out", [0, 1], [2, 3])).wait(10)
    for plane in planes:
        plane[4:6].zero_()
    h = mgr.transfer.submit(Task("swap_in_layers", [2, 3], [4, 5]))
    assert mgr.transfer.flush(10)  # on its way (the IO thread took it)
    assert h.wait(10) and h.result.ok, h.result
    assert chan.state() == (h.task.task_id, 3, False)
    assert chan.writer_pid() == mgr.stats().workers[0]["pid"]
    for b in (0, 1):
        for p, plane in enumerate(planes):
            assert bool((plane[4 + b] == (b + 1) * 1000 + p).all()), (b, p)
    bad = mgr.transfer.submit(Task("swap_in_layers", [2, 3], [4, 4]))
    assert bad.wait(10) and not bad.result.ok
    assert chan.state() == (bad.task.task_id, 0, True)
    chan.close()
