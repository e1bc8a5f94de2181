"""The CUDA path's logic that runs without a GPU.

- Ordering: the KV event's generation clock, the engine-side stamps and the
  worker-side checks (kvcached.memory.kvevent), the in-process event path
  (the exporter's own event object, never its IPC handle), re-opening a
  re-exported event.
- Faults: a fatal (sticky) error fails its task and ends the worker process,
  which the coordinator restarts (real processes and sockets, the error
  injected into the worker processes); an in-process transfer turns unhealthy.
- Device identity: a descriptor's GPU is found by UUID / PCI bus id in a
  (fake) list of visible devices, never by the exporter's index.
- Sleep: closing an executor releases the CUDA mappings in order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from helpers import wait_for

from kvcached.copy import cuda as kvc
from kvcached.memory import cuda_ipc, kvevent, kvshare
from kvcached.memory.cuda_ipc import DeviceInfo, map_device, normalize_pci_bus_id
from kvcached.memory.kvevent import EventClock, EventStamper, KVEvent, OrderingError
from kvcached.tasks import Task
from kvcached.transfer import protocol as P
from kvcached.transfer.executor import RankExecutor

REPO = Path(__file__).resolve().parents[2]


class FakeEvent:
    """Stands in for torch.cuda.Event(interprocess=True): records are counted."""

    _next = 0x7000

    def __init__(self):
        FakeEvent._next += 16
        self.cuda_event = FakeEvent._next
        self.records: list = []

    def record(self, stream=None):
        self.records.append(stream)

    def ipc_handle(self) -> bytes:
        return self.cuda_event.to_bytes(8, "little") * 8  # 64 bytes, unique per event


def cuda_cfg(run_dir, **kw):
    """A CUDA config (nothing in these tests touches a GPU)."""
    return tiny_config(device="cuda", run_dir=str(run_dir), **kw)


@pytest.fixture
def exported(tmp_path):
    """Rank 0's (CPU) planes exported with a KVEvent by this process."""
    from kvcached.layout import KVLayout
    run_dir = tmp_path / "run"
    kvshare.allocate_kv_cache(KVLayout(1, 1, 4, 4, "float32"), 8, 0, run_dir)
    ev = KVEvent(run_dir, 0, event=FakeEvent())
    kvshare.export_kv_event(ev, 0, run_dir)
    yield run_dir, ev
    kvshare.release_kv_cache(run_dir, 0)


# ------------------------------------------------------------------ the clock
def test_clock_counts_records_and_a_new_event_gets_a_new_epoch(tmp_path):
    ev = KVEvent(tmp_path, 3, event=FakeEvent())
    assert ev.generation == 0 and ev.epoch != 0
    assert kvevent.clock_path(tmp_path, 3).stat().st_size == kvevent.CLOCK_BYTES
    assert [ev.record("s1"), ev.record()] == [1, 2] and ev.event.records == ["s1", None]
    reader = EventClock.open(kvevent.clock_path(tmp_path, 3))
    assert (reader.epoch, reader.generation) == (ev.epoch, 2)
    again = KVEvent(tmp_path, 3, event=FakeEvent())  # a new event for the rank
    assert again.epoch != ev.epoch and reader.replaced()
    assert reader.epoch == ev.epoch  # the old mapping still names the old event, whole
    fields = again.descriptor_fields()
    assert fields["event_epoch"] == again.epoch and fields["event_pid"] == os.getpid()
    assert fields["event_clock"] == "kv-event-rank3.clock"
    assert bytes.fromhex(fields["event_ipc_handle"]) == again.event.ipc_handle()


def test_a_record_in_another_process_is_seen_by_the_stamper(tmp_path):
    ev = KVEvent(tmp_path, 1, event=FakeEvent())
    stamper = EventStamper(tmp_path, tp_size=2)
    assert stamper.stamps() == [[0, 0], [ev.epoch, 0]]  # rank 0 exported no event
    code = textwrap.dedent(f"""
        from kvcached.memory.kvevent import EventClock
        c = EventClock.open({str(kvevent.clock_path(tmp_path, 1))!r})
        for _ in range(5):
            c.bump()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    assert stamper.stamps() == [[0, 0], [ev.epoch, 5]]
    stamper.close()


def test_stamper_stamps_device_copies_only(tmp_path):
    assert EventStamper(tmp_path, 2).stamps() is None  # no clock at all: no stamp
    ev = KVEvent(tmp_path, 0, event=FakeEvent())
    ev.record()
    stamper = EventStamper(tmp_path, 1)
    cases = [
        (Task("swap_out", [1], [2]), True), (Task("swap_in", [1], [2]), True),
        (Task("store", [1], [], {"keys": ["a"], "device_ids": [3]}), True),
        (Task("load", [], [1], {"keys": ["a"], "device_ids": [3]}), True),
        (Task("store", [1], [], {"keys": ["a"]}), False),  # host -> storage only
        (Task("load", [], [1], {"keys": ["a"]}), False),
        (Task("lookup", [], [], {"keys": ["a"]}), False), (Task("noop", [], []), False),
        (Task("control", [], [], {"op": "status"}), False),
    ]
    for task, stamped in cases:
        stamper.stamp(task)
        assert (kvevent.STAMP_ARG in task.args) == stamped, task.kind
        if stamped:
            assert task.args[kvevent.STAMP_ARG] == [[ev.epoch, 1]]
    new = KVEvent(tmp_path, 0, event=FakeEvent())  # re-exported: the stamper follows
    assert stamper.stamps() == [[new.epoch, 0]]


# ------------------------------------------------------------------ the checks
@pytest.mark.parametrize("kind", ["swap_out", "store"])
def test_a_copy_of_model_writes_needs_a_record(tmp_path, kind):
    clock = KVEvent(tmp_path, 0, event=FakeEvent()).clock
    with pytest.raises(OrderingError, match="never recorded"):
        kvevent.check_stamp(kind, [[clock.epoch, 0]], 0, clock, True)
    kvevent.check_stamp("swap_in", [[clock.epoch, 0]], 0, clock, True)  # nothing ran yet
    kvevent.check_stamp("load", [[clock.epoch, 0]], 0, clock, True)


def test_stamp_check_failures(tmp_path):
    ev = KVEvent(tmp_path, 0, event=FakeEvent())
    ev.record()
    c, e = ev.clock, ev.epoch
    kvevent.check_stamp("swap_out", [[e, 1]], 0, c, True)
    kvevent.check_stamp("swap_out", [[0, 0]], 0, None, False)  # rank without an event
    bad = [([[e, 1]], 0, None, False, "holds no KV event"),
           ([[e, 1]], 0, c, False, "holds no KV event"),
           ([[e ^ 2, 1]], 0, c, True, "exported another event"),
           ([[e, 2]], 0, c, True, "not the engine's"),
           ([[e, 1]], 1, c, True, "malformed"),
           ("nonsense", 0, c, True, "malformed")]
    for stamp, rank, clock, has_event, text in bad:
        with pytest.raises(OrderingError, match=text):
            kvevent.check_stamp("swap_out", stamp, rank, clock, has_event)


def test_in_process_copies_use_the_exporters_own_event(exported, monkeypatch):
    """The executor in the exporting process takes the KVEvent's own handle: CUDA
    cannot open a process's own IPC event handle."""
    run_dir, ev = exported

    def no_ipc(handle):
        raise AssertionError("opened this process's own IPC event handle")
    monkeypatch.setattr(kvc, "open_ipc_event", no_ipc)
    ex = RankExecutor(cuda_cfg(run_dir), run_dir, 0)
    ex._open_engine_event()
    assert ex._event == ev.event.cuda_event and not ex._event_opened
    assert ex._clock.epoch == ev.epoch

    def task(kind):
        t = Task(kind, [1], [2])
        EventStamper(run_dir, 1).stamp(t)
        return t
    with pytest.raises(OrderingError, match="never recorded"):
        ex._ordered(task("swap_out"))
    assert ex._ordered(task("swap_in")) == {"wait_event": ev.event.cuda_event}
    ev.record()
    assert ex._ordered(task("swap_out")) == {"wait_event": ev.event.cuda_event}

    # The engine makes a new event and publishes it: the next stamp names it and
    # the executor re-opens the descriptor's event before checking.
    new = KVEvent(run_dir, 0, event=FakeEvent())
    kvshare.export_kv_event(new, 0, run_dir)
    new.record()
    assert ex._ordered(task("swap_out")) == {"wait_event": new.event.cuda_event}
    assert ex._clock.epoch == new.epoch
    # A stamp of an event the descriptor does not name fails, untouched.
    with pytest.raises(OrderingError, match="exported another event"):
        ex._ordered(Task("swap_out", [1], [2], {kvevent.STAMP_ARG: [[ev.epoch, 1]]}))
    ex._close_event()


def test_descriptor_without_event_fails_a_stamped_copy(exported):
    run_dir, ev = exported
    stamped = Task("swap_in", [1], [2], {kvevent.STAMP_ARG: [[ev.epoch, 0]]})
    desc = kvshare.read_descriptor(run_dir, 0)
    for key in ("event_ipc_handle", "event_epoch", "event_clock", "event_pid"):
        desc.pop(key)
    kvshare._write_atomic(kvshare.descriptor_path(run_dir, 0), desc)
    ex = RankExecutor(cuda_cfg(run_dir), run_dir, 0)
    ex._open_engine_event()
    assert ex._event is None
    with pytest.raises(OrderingError, match="holds no KV event"):
        ex._ordered(stamped)
    assert ex._ordered(Task("swap_in", [1], [2])) == {}  # unstamped (no KVEvent): no wait


def test_exported_event_gone_is_a_clear_error(exported):
    run_dir, ev = exported
    ex = RankExecutor(cuda_cfg(run_dir), run_dir, 0)
    kvevent._LOCAL.clear()
    with pytest.raises(RuntimeError, match="no longer holds it"):
        ex._open_engine_event()


def test_bare_torch_style_event_still_orders_in_process(tmp_path):
    from kvcached.layout import KVLayout
    run_dir = tmp_path / "run"
    planes = kvshare.allocate_kv_cache(KVLayout(1, 1, 4, 4, "float32"), 8, 0, run_dir)
    bare = FakeEvent()
    kvshare.export_kv_cache(planes, 0, run_dir, event=bare)
    desc = kvshare.read_descriptor(run_dir, 0)
    assert "event_clock" not in desc and desc["event_pid"] == os.getpid()
    ex = RankExecutor(cuda_cfg(run_dir), run_dir, 0)
    ex._open_engine_event()
    assert ex._event == bare.cuda_event and ex._clock is None
    kvshare.release_kv_cache(run_dir, 0)


# ------------------------------------------------------------------ device identity
DEVICES = (DeviceInfo(0, "aa" * 16, "0000:1b:00.0"), DeviceInfo(1, "bb" * 16, "0000:3b:00.0"),
           DeviceInfo(2, "cc" * 16, "0000:5e:00.0"))


def test_device_is_found_by_uuid_not_by_the_exporters_index():
    # The exporter saw the GPU as its device 0 (CUDA_VISIBLE_DEVICES=2); here it is 2.
    assert map_device({"device_index": 0, "device_uuid": "cc" * 16,
                       "pci_bus_id": "0000:5e:00.0"}, DEVICES) == 2
    # PCI bus id when the UUID is unknown, in nvidia-smi's spelling.
    assert map_device({"device_index": 0, "pci_bus_id": "00000000:3B:00.0"}, DEVICES) == 1
    # UUID wins over a (stale) PCI id.
    assert map_device({"device_index": 0, "device_uuid": "aa" * 16,
                       "pci_bus_id": "0000:5e:00.0"}, DEVICES) == 0


def test_invisible_device_names_the_gpu_and_what_is_visible():
    with pytest.raises(RuntimeError, match=r"GPU dd+ .*cannot see.*0: aa+ \(0000:1b:00.0\)"
                                           r".*CUDA_VISIBLE_DEVICES"):
        map_device({"device_index": 1, "device_uuid": "dd" * 16, "pci_bus_id": "0000:af:00.0"},
                   DEVICES)
    with pytest.raises(RuntimeError, match="visible: none"):
        map_device({"device_index": 0, "device_uuid": "aa" * 16}, ())


def test_descriptor_without_identity_falls_back_to_the_index(caplog):
    assert map_device({"device_index": 1}, DEVICES) == 1
    assert "by index only" in caplog.text


def test_pci_bus_id_normalization():
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id(" 0001:AF:1F.7 ") == "0001:af:1f.7"
    assert normalize_pci_bus_id("weird") == "weird"


# ------------------------------------------------------------------ sleep
def test_closing_an_executor_releases_cuda_mappings_in_order(tmp_path, monkeypatch):
    """Sleep: the copy engine finishes first, then the event, the host registration
    and the planes' IPC mappings go; every step runs even when one fails."""
    calls = []

    class Engine:
        def close(self):
            calls.append("engine")

    class Lib:
        def event_destroy(self, ev):
            calls.append(("event", ev))
            raise kvc.CudaCopyError("kvc_event_destroy", 1001, "cudaErrorInvalidValue", "x")

    monkeypatch.setattr(kvc, "load", lambda: Lib())
    monkeypatch.setattr(cuda_ipc, "unpin", lambda p: calls.append(("unpin", p)))

    def close_planes(planes):
        calls.append(("planes", list(planes)))
        planes.clear()
    monkeypatch.setattr(cuda_ipc, "close_cuda_planes", close_planes)
    ex = RankExecutor(cuda_cfg(tmp_path), tmp_path, 0)
    planes = ["p0", "p1"]
    ex.engine, ex.planes, ex._pinned = Engine(), planes, "pinned"
    ex._event, ex._event_opened = 0x99, True
    ex.close(final=False)  # the event's failure is logged, not raised
    assert calls == ["engine", ("event", 0x99), ("unpin", "pinned"), ("planes", ["p0", "p1"])]
    assert planes == [] and ex.planes is None and ex.engine is None and ex._event is None


def test_close_raises_its_first_failure_unless_cuda_broke(tmp_path, monkeypatch):
    """A failed release is an error, except after a fatal error (every CUDA call
    fails then; the worker exits with its own code)."""
    def close_planes(planes):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(cuda_ipc, "close_cuda_planes", close_planes)
    ex = RankExecutor(cuda_cfg(tmp_path), tmp_path, 0)
    ex.planes = ["p"]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ex.close()

    class Broken:
        def swap_out(self, *a, **kw):
            raise kvc.CudaContextBroken("kvc_event_synchronize", 1700,
                                        "cudaErrorIllegalAddress", "injected")

        def close(self):
            pass
    ex = RankExecutor(cuda_cfg(tmp_path), tmp_path, 0)
    ex.engine, ex.planes = Broken(), ["p"]
    with pytest.raises(kvc.CudaContextBroken):
        ex.run(Task("swap_out", [1], [2]))
    ex.close()  # logged, not raised
    assert ex.planes is None and ex.engine is None


def test_cuda_engine_close_lets_go_of_the_planes(tmp_path):
    """A closed CudaCopyEngine holds no tensor: the IPC mapping can close."""
    import weakref

    from test_cuda_build import EmulatedLib
    lib = EmulatedLib(kvc.build().path)
    plane = torch.zeros(4, 64, dtype=torch.uint8)
    host = kvc.aligned_bytes(4 * 64)
    engine = kvc.CudaCopyEngine([plane], host.ctypes.data, [0], host_block_bytes=64,
                                num_host_blocks=4, num_device_blocks=4, lib=lib, device=0)
    ref = weakref.ref(plane)
    del plane
    assert ref() is not None
    engine.close()
    assert ref() is None


def test_cuda_worker_never_copies_on_its_socket_thread(tmp_path):
    """A CUDA copy may wait a forward pass for the engine's event: even a one-block
    swap goes to its lane, so heartbeats and the other direction keep flowing."""
    from kvcached.transfer.worker import Worker

    class Sock:
        sent: list = []

        def send(self, frame, flags=0):
            self.sent.append(frame)
    for device, inline in (("cpu", True), ("cuda", False)):
        w = Worker(tiny_config(device=device, run_dir=str(tmp_path)), tmp_path, 0, None)
        w.executor.run = lambda task: {"bytes": 0}
        sock = Sock()
        sock.sent = []
        w._run_task(sock, P.Task(1, "swap_out", [1], [2]))
        w._run_task(sock, P.Task(2, "noop"))
        assert len(sock.sent) == (2 if inline else 1), device  # a noop always inline
        assert w.lanes["out"].tasks.qsize() == (0 if inline else 1), device


# ------------------------------------------------------------------ faults
def test_fatal_error_in_process_turns_the_transfer_unhealthy(tmp_path, monkeypatch):
    from kvcached.transfer.inprocess import InProcessTransfer
    cfg = tiny_config(run_dir=str(tmp_path), num_cpu_blocks=4)
    tr = InProcessTransfer(cfg, tmp_path)

    def broken(self, task):
        raise kvc.CudaContextBroken("kvc_event_synchronize", 1700, "cudaErrorIllegalAddress",
                                    "injected")
    monkeypatch.setattr(RankExecutor, "run", broken)
    res = tr.submit(Task("swap_out", [1], [2])).result
    assert not res.ok and "cudaErrorIllegalAddress" in res.error and res.blocks_done == 0
    assert not tr.healthy


INJECT = """
import os
marker = os.environ.get("KVC_TEST_FATAL_MARKER")
if marker:
    import kvcached.transfer.executor as executor
    from kvcached.copy.cuda import CudaContextBroken
    run = executor.RankExecutor.run

    def faulty(self, task):
        path = f"{marker}.{self.rank}"
        if task.kind == "swap_out" and os.path.exists(path):
            os.unlink(path)  # one fault: the restarted worker is healthy
            raise CudaContextBroken("kvc_event_synchronize", 1700, "cudaErrorIllegalAddress",
                                    "injected: an illegal address in the copy kernel")
        return run(self, task)
    executor.RankExecutor.run = faulty
"""


@pytest.fixture
def faulty_workers(tmp_path, monkeypatch):
    """Spawned workers whose swap-outs fail fatally once per marker file."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(inject), str(REPO), os.environ.get("PYTHONPATH", "")]))
    marker = tmp_path / "fault"
    monkeypatch.setenv("KVC_TEST_FATAL_MARKER", str(marker))
    from kvcached import CacheManager
    cfg = tiny_config(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=2.0,
                      engine_timeout_s=5.0, task_timeout_s=10.0, worker_start_timeout_s=60.0,
                      run_dir=str(tmp_path / "run"), tp_size=2, num_gpu_blocks=16,
                      num_cpu_blocks=16)
    mgr = CacheManager(cfg).start()
    yield mgr, marker
    mgr.close()


@pytest.mark.parametrize("count", [1, 12], ids=["inline", "lane"])
def test_fatal_error_fails_the_task_and_the_worker_restarts(faulty_workers, count):
    """The task fails (nothing of it counts as copied), the worker exits with
    EXIT_FATAL, the coordinator restarts it, and the same copy then succeeds."""
    from kvcached.transfer.worker import EXIT_FATAL
    mgr, marker = faulty_workers
    planes = [kvshare.attach_kv_cache(mgr.run_dir, r) for r in range(2)]
    for r in range(2):
        for p in planes[r]:
            p[:count].copy_(torch.arange(count, dtype=p.dtype).view(-1, *[1] * (p.dim() - 1))
                            + 10 * r + 1)
    victim = mgr.stats().workers[1]["pid"]
    Path(f"{marker}.1").touch()
    src, dst = list(range(count)), list(range(count))
    handle = mgr.transfer.submit(Task("swap_out", src, dst))
    assert handle.wait(15)
    first = handle.result
    # Whichever came first (the failed Done or the exit), the task failed.
    assert not first.ok
    assert "cudaErrorIllegalAddress" in first.error or f"code {EXIT_FATAL}" in first.error
    wait_for(lambda: mgr.stats().workers[1]["restarts"] == 1, 20, "rank 1 restart")
    assert mgr.transfer.wait_ready(30)
    assert mgr.stats().workers[1]["pid"] != victim
    log = (mgr.run_dir / "logs" / "worker-rank1.log").read_text()
    assert "worker rank 1 exits: fatal: CudaContextBroken" in log
    again = mgr.transfer.submit(Task("swap_out", src, dst))
    assert again.wait(15) and again.result.ok, again.result.error
    pools = mgr._host_pools
    offsets, sizes = mgr.cfg.layout.host_offsets, mgr.cfg.layout.plane_bytes
    for r in range(2):
        for p, o, n in zip(planes[r], offsets, sizes, strict=True):
            assert torch.equal(pools[r].tensor[dst, o:o + n],
                               p[src].contiguous().view(torch.uint8).view(count, -1))


# ------------------------------------------------------------------ create_cache
def test_rank_device(monkeypatch):
    assert kvshare.rank_device("cpu", 3) == "cpu"
    assert kvshare.rank_device("cuda:1", 3) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [kvshare.rank_device("cuda", r) for r in range(4)] == [
        "cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        kvshare.rank_device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_create_cache_on_cuda_without_a_gpu_fails_at_start(tmp_path):
    """create_cache with device='cuda' allocates the planes in start(): without a GPU
    it says so at once (the workers do not wait for a descriptor until they time
    out), and leaves nothing behind."""
    from kvcached import CacheManager
    from kvcached.memory import shm
    cfg = tiny_config(device="cuda", create_cache=True, num_cpu_blocks=4,
                      run_dir=str(tmp_path / "run"))
    run = shm.run_id(cfg.run_dir)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        CacheManager(cfg).start()
    assert not [p for p in shm.shm_dir().glob(f"{shm.PREFIX}*{run}*")]  # host pool removed
    assert not kvshare.descriptor_path(cfg.run_dir, 0).exists()


def test_a_load_inside_the_step_on_cuda_enqueues_each_layer_before_publishing_it(tmp_path):
    """On CUDA a swap_in_layers task enqueues its layers on one stream: layer 0's
    copy waits on the engine's KV event (and so every layer after it), each copy
    is followed by the record of its layer event, and only then is the layer
    published (the engine's compute stream waits on that event: a wait on an
    event not yet recorded would wait on nothing); the Done waits for the
    stream. A task the engine gave up on enqueues nothing, and one without the
    engine's layer events fails before any copy. (The copies themselves:
    tests/copy/test_cuda_gpu.py, on a GPU.)"""
    from kvcached.copy.cuda import H2D
    from kvcached.memory.progress import Cancelled, StepProgress, progress_path
    ex = RankExecutor(cuda_cfg(tmp_path, num_layers=3), tmp_path, 0)
    ex._progress = reader = StepProgress.create(progress_path(tmp_path, 0))
    calls = []

    class LayerEngine:
        def __init__(self, layer):
            self.layer = layer

        def swap_in(self, src, dst, **kw):
            calls.append(("copy", self.layer, list(src), list(dst), kw))
            return 64 * len(src)

        def record_event(self, event, direction):
            calls.append(("record", event, direction, reader.state()))

        def synchronize(self):
            calls.append(("sync", self.layer, reader.state()))

    ex.engine = "the rank's engine"
    ex._layer_engines = [LayerEngine(i) for i in range(3)]
    ex._layer_events = ["ev0", "ev1", "ev2"]
    ex._event = "the KV event"
    t = Task("swap_in_layers", [3, 4], [5, 6])
    t.task_id = 17
    assert ex.run(t) == {"bytes": 384}
    assert calls == [
        ("copy", 0, [3, 4], [5, 6], {"sync": False, "wait_event": "the KV event"}),
        ("record", "ev0", H2D, (0, 0, False)),  # recorded before it is published
        ("copy", 1, [3, 4], [5, 6], {"sync": False}),
        ("record", "ev1", H2D, (17, 1, False)),
        ("copy", 2, [3, 4], [5, 6], {"sync": False}),
        ("record", "ev2", H2D, (17, 2, False)),
        ("sync", 0, (17, 3, False))]
    calls.clear()
    assert reader.cancel(18, time.monotonic() + 1)
    t.task_id = 18
    with pytest.raises(Cancelled):
        ex.run(t)
    assert calls == [] and reader.state() == (18, 0, True)
    ex._layer_events = []
    t.task_id = 19
    with pytest.raises(RuntimeError, match="needs the engine's 3 layer events"):
        ex.run(t)
    assert calls == [] and reader.state() == (19, 0, True)
    ex._progress = ex._layer_engines = None
    reader.close()
