"""Sharing KV planes and host pools across processes (kvcached.memory.shm, kvshare, hostpool).

Segments go to a private directory under /dev/shm (the peer process is pointed
at it too), so stale-segment cleanup here never races other test runs, and the
fixture removes everything afterwards. The "other process" is a real one: a
peer interpreter that runs scripts on request (one torch import for the file).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import resource
import select
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from kvcached import config
from kvcached.layout import KVLayout
from kvcached.memory import kvshare, shm
from kvcached.memory.hostpool import HostPool

REPO = Path(__file__).resolve().parents[2]
# 8 planes x 16 KiB per block x 512 blocks = 64 MiB
BIG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16,
                      dtype="float32")
BIG_BLOCKS = 512
SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                        dtype="float16")


@pytest.fixture
def shm_dir(monkeypatch, tmp_path_factory):
    """A private segment directory (in /dev/shm when present), removed afterwards."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    d = root / f"kvtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", d)
    yield d
    for name in shm.created_segments():
        shm.forget_segment(name)
    shutil.rmtree(d, ignore_errors=True)


PEER_LOOP = r"""
import contextlib, io, json, sys, traceback
import torch, kvcached.memory.hostpool, kvcached.memory.kvshare  # import once, before the first task
print(json.dumps({"ok": True, "out": "ready"}), flush=True)
for line in sys.stdin:
    buf, ok = io.StringIO(), True
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(json.loads(line), "<peer>", "exec"), {"__name__": "__peer__"})
    except BaseException:
        ok = False
        buf.write(traceback.format_exc())
    print(json.dumps({"ok": ok, "out": buf.getvalue()}), flush=True)
"""


class Peer:
    """A real second Python process that runs scripts on request.

    One interpreter (one torch import) serves several tests; ``stop`` makes it
    exit like a crashed worker, and the next ``run`` starts a fresh one.
    """

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", PEER_LOOP], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._reply(60)["out"] == "ready"

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            pytest.fail(f"peer process did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        assert line, f"peer process died (rc={self.proc.wait()})"
        return json.loads(line)

    def run(self, script: str, shm_dir: Path, timeout: float = 60) -> str:
        """Run ``script`` (segments in ``shm_dir``); return its stdout, fail on error."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        prelude = f"from pathlib import Path\nfrom kvcached.memory import shm\nshm.SHM_DIR = Path({str(shm_dir)!r})\n"
        self.proc.stdin.write(json.dumps(prelude + textwrap.dedent(script)) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        assert reply["ok"], f"peer script failed:\n{reply['out']}"
        return reply["out"]

    def stop(self) -> None:
        """Make the peer exit (and reap it, so its pid is really gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.stop()


def pattern(i: int, nbytes: int) -> torch.Tensor:
    """Deterministic bytes for plane ``i``, distinct per 8-byte word and plane."""
    return (torch.arange(nbytes // 8, dtype=torch.int64) * 1000003 + i).view(torch.uint8)


# ------------------------------------------------------------ export/attach
def test_attach_in_another_process_shares_memory(shm_dir, tmp_path, peer):
    planes = kvshare.allocate_kv_cache(BIG_LAYOUT, BIG_BLOCKS, rank=0, run_dir=tmp_path)
    assert sum(p.numel() * p.element_size() for p in planes) == 64 << 20
    planes[3][5].fill_(42.0)  # the child must see the parent's writes too
    out = peer.run(f"""
        import time, torch
        from kvcached.memory import kvshare
        t0 = time.perf_counter()
        planes = kvshare.attach_kv_cache({str(tmp_path)!r}, 0, timeout_s=5)
        dt = time.perf_counter() - t0
        assert bool((planes[3][5] == 42.0).all())
        for i, p in enumerate(planes):
            n = p.numel() * p.element_size()
            p.view(torch.uint8).view(-1).copy_(
                (torch.arange(n // 8, dtype=torch.int64) * 1000003 + i).view(torch.uint8))
        print(f"ATTACH {{dt:.6f}} {{len(planes)}}")
    """, shm_dir)
    _, dt, count = out.split()[-3:]
    print(f"attach of a 64 MiB plane set in a second process: {float(dt) * 1e3:.2f} ms")
    assert int(count) == len(planes) == 8
    assert float(dt) < 1.0
    for i, p in enumerate(planes):
        got = p.view(torch.uint8).view(-1)
        assert torch.equal(got, pattern(i, got.numel())), f"plane {i} differs"
    kvshare.release_kv_cache(tmp_path, 0)
    assert not kvshare.descriptor_path(tmp_path, 0).exists()
    assert list(shm_dir.iterdir()) == []


def test_descriptor_format(shm_dir, tmp_path):
    kvshare.allocate_kv_cache(SMALL_LAYOUT, 8, rank=1, run_dir=tmp_path)
    desc = json.loads(kvshare.descriptor_path(tmp_path, 1).read_text())
    assert desc["device_type"] == "cpu" and desc["rank"] == 1 and desc["num_blocks"] == 8
    assert desc["run_id"] == shm.run_id(tmp_path) and len(desc["run_id"]) == 10
    assert len(desc["planes"]) == len(SMALL_LAYOUT.planes)
    for e in desc["planes"]:
        assert e["shape"] == [8, 2, 4, 8] and e["dtype"] == "float16"
        assert e["byte_offset"] % 64 == 0
        assert e["segment"] == shm.segment_name(os.getpid(), shm.run_id(tmp_path), 1, "kv")
    assert kvshare.read_descriptor(tmp_path, 1) == desc
    kvshare.release_kv_cache(tmp_path, 1)


def test_attach_missing_descriptor_times_out(shm_dir, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"kv-rank3\.json.*export_kv_cache"):
        kvshare.attach_kv_cache(tmp_path, 3, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    with pytest.raises(FileNotFoundError, match="export_kv_cache"):
        kvshare.read_descriptor(tmp_path, 3)


def test_export_plain_cpu_tensor_rejected(shm_dir, tmp_path):
    with pytest.raises(ValueError, match="must live in shared memory.*allocate_kv_cache"):
        kvshare.export_kv_cache([torch.zeros(4, 2, 8)], 0, tmp_path)
    assert not kvshare.descriptor_path(tmp_path, 0).exists()


def test_export_validation_names_plane(shm_dir, tmp_path):
    seg = shm.create_shm_tensor("kvcached-1-x-r0-kv", (4096,), torch.float32)
    a, b = seg[:1024].view(8, 128), seg[1024:2048].view(4, 256)
    with pytest.raises(ValueError, match="non-empty"):
        kvshare.export_kv_cache([], 0, tmp_path)
    with pytest.raises(ValueError, match="plane 1 has 4 blocks"):
        kvshare.export_kv_cache([a, b], 0, tmp_path)
    with pytest.raises(ValueError, match="plane 1 .*contiguous from dim 1"):
        kvshare.export_kv_cache([a, seg[:2048].view(8, 2, 128)[:, :, ::2]], 0, tmp_path)
    outside = seg[:1024].view(8, 128).clone()
    with pytest.raises(ValueError, match="plane 1: CPU KV planes must live in shared"):
        kvshare.export_kv_cache([a, outside], 0, tmp_path)


def test_check_planes_names_index():
    planes = [torch.zeros(8, 2, 4, 8, dtype=torch.float16) for _ in SMALL_LAYOUT.planes]
    kvshare.check_planes(planes, SMALL_LAYOUT, 8)
    # Same bytes per block in another per-block order is fine (engines differ).
    kvshare.check_planes([p.view(8, 4, 2, 8) for p in planes], SMALL_LAYOUT, 8)
    with pytest.raises(ValueError, match="expected 4 KV planes.*got 3"):
        kvshare.check_planes(planes[:3], SMALL_LAYOUT, 8)
    bad = list(planes)
    bad[1] = torch.zeros(8, 2, 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"plane 1 \(layer0\.v\): expected dtype float16, got float32"):
        kvshare.check_planes(bad, SMALL_LAYOUT, 8)
    bad = list(planes)
    bad[2] = torch.zeros(8, 2, 4, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="plane 2 .*expected 128 bytes per block.*got 64"):
        kvshare.check_planes(bad, SMALL_LAYOUT, 8)
    with pytest.raises(ValueError, match="plane 0 .*expected 16 blocks"):
        kvshare.check_planes(planes, SMALL_LAYOUT, 16)


def test_views_into_segment_with_offsets(shm_dir, tmp_path):
    seg = shm.create_shm_tensor(shm.segment_name(os.getpid(), "t", 0, "kv"),
                                (1 << 16,), torch.uint8)
    # vLLM-style [2, num_blocks, ...] tensor at a byte offset: K and V are views.
    kv = seg[256:256 + 2 * 8 * 64 * 2].view(torch.float16).view(2, 8, 4, 16)
    # Interleaved [num_blocks, 2, ...]: block stride is twice the block.
    inter = seg[8192:8192 + 8 * 2 * 32 * 4].view(torch.float32).view(8, 2, 32)
    planes = [kv[0], kv[1], inter[:, 0].view(torch.float16), inter[:, 1].view(torch.float16)]
    kvshare.export_kv_cache(planes, 0, tmp_path)
    desc = kvshare.read_descriptor(tmp_path, 0)
    assert [e["byte_offset"] for e in desc["planes"]] == [256, 256 + 1024, 8192, 8192 + 128]
    other = kvshare.attach_kv_cache(tmp_path, 0)  # a second mapping of the same file
    for i, (p, q) in enumerate(zip(planes, other, strict=True)):
        assert q.data_ptr() != p.data_ptr()
        assert q.shape == p.shape and q.stride() == p.stride() and q.dtype == p.dtype
        q.copy_(torch.full_like(q, i + 1))
    for i, p in enumerate(planes):
        assert bool((p == i + 1).all()), f"plane {i} not shared"
    assert int(seg[:256].sum()) == 0  # bytes before the first plane untouched
    kvshare.release_kv_cache(tmp_path, 0)


def test_segment_create_open_errors(shm_dir, tmp_path, monkeypatch):
    name = shm.segment_name(os.getpid(), shm.run_id(tmp_path), 0, "kv")
    shm.create_shm_tensor(name, (16,), "float32")
    with pytest.raises(FileExistsError, match="already exists"):
        shm.create_shm_tensor(name, (16,), "float32")
    with pytest.raises(ValueError, match="64 bytes but 128 were expected"):
        shm.open_shm_tensor(name, (32,), "float32")
    with pytest.raises(FileNotFoundError, match="is the engine running.*run_dir="):
        shm.open_shm_tensor("kvcached-1-nope-r0-kv", (16,), "float32", run_dir=tmp_path)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match=r"needs 64\.0 MiB but only 1\.0 MiB.*lower num_gpu_blocks"):
        kvshare.allocate_kv_cache(BIG_LAYOUT, BIG_BLOCKS, rank=0, run_dir=tmp_path)
    assert sorted(p.name for p in shm_dir.iterdir()) == [name]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _touch_every_page(t: torch.Tensor) -> None:
    t.view(-1, mmap.PAGESIZE)[:, 0] += 1


def test_segments_are_allocated_at_creation_and_mapped_populated(shm_dir, tmp_path):
    """A first touch of a page is a page fault: a copy into never-touched blocks
    ran at a quarter of memory speed. The segment's memory is allocated when it
    is created, and every process maps it with its pages in place."""
    nbytes, pages = 16 << 20, (16 << 20) // mmap.PAGESIZE
    name = shm.segment_name(os.getpid(), shm.run_id(tmp_path), 0, "pool")
    created = shm.create_shm_tensor(name, (nbytes,), torch.uint8)
    assert os.stat(shm_dir / name).st_blocks * 512 >= nbytes  # not a sparse file
    before = _minor_faults()
    _touch_every_page(created)
    assert _minor_faults() - before < pages // 8
    opened = shm.open_shm_tensor(name, (nbytes,), torch.uint8)
    before = _minor_faults()
    _touch_every_page(opened)
    assert _minor_faults() - before < pages // 8
    assert int(created.view(-1, mmap.PAGESIZE)[:, 0].sum()) == 2 * pages  # one memory


def test_a_segment_without_memory_is_an_error_at_creation(shm_dir, tmp_path, monkeypatch):
    """tmpfs full after the free-space check (another process took it): the
    allocation fails, the error names the fix, and no file is left behind."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ValueError, match=r"needs 1\.0 MiB but the memory could not be "
                                         r"allocated: lower num_cpu_blocks"):
        HostPool.create(tmp_path, 0, 4, 256 << 10)
    assert list(shm_dir.iterdir()) == []


def test_cuda_paths_need_hook(shm_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda"):
        kvshare.allocate_kv_cache(SMALL_LAYOUT, 4, rank=0, run_dir=tmp_path, device="tpu0")
    monkeypatch.setitem(sys.modules, "kvcached.memory.cuda_ipc", None)  # import fails
    with pytest.raises(RuntimeError, match="kvcached.memory.cuda_ipc"):
        kvshare.allocate_kv_cache(SMALL_LAYOUT, 4, rank=0, run_dir=tmp_path, device="cuda")
    desc = {"format": kvshare.FORMAT_VERSION, "device_type": "cuda", "planes": []}
    kvshare.descriptor_path(tmp_path, 0).write_text(json.dumps(desc))
    with pytest.raises(RuntimeError, match="kvcached.memory.cuda_ipc"):
        kvshare.attach_kv_cache(tmp_path, 0)
    fake = type(sys)("kvcached.memory.cuda_ipc")
    fake.open_cuda_planes = lambda d: ["opened", d["device_type"]]
    monkeypatch.setitem(sys.modules, "kvcached.memory.cuda_ipc", fake)
    assert kvshare.attach_kv_cache(tmp_path, 0) == ["opened", "cuda"]


# ---------------------------------------------------------------- host pool
def test_host_pool_shared_with_another_process(shm_dir, tmp_path, peer):
    pool = HostPool.create(tmp_path, rank=0, num_blocks=16, block_bytes=4096)
    assert pool.name == shm.segment_name(os.getpid(), shm.run_id(tmp_path), 0, "host")
    assert pool.nbytes == 16 * 4096 and pool.tensor.shape == (16, 4096)
    assert int(pool.tensor.sum()) == 0
    pool.block(1).copy_(pattern(1, 4096))
    peer.run(f"""
        import torch
        from kvcached.memory.hostpool import HostPool
        pool = HostPool.attach({str(tmp_path)!r}, 0, 16, 4096, owner_pid={os.getpid()})
        def pattern(i, n):
            return (torch.arange(n // 8, dtype=torch.int64) * 1000003 + i).view(torch.uint8)
        assert torch.equal(pool.block(1), pattern(1, 4096))
        pool.block(3).copy_(pattern(3, 4096))
        try:
            pool.remove()
            raise SystemExit("a non-owner removed the pool")
        except RuntimeError:
            pass
        pool.close()
    """, shm_dir)
    assert torch.equal(pool.block(3), pattern(3, 4096))
    again = HostPool.open_or_create(tmp_path, 0, 16, 4096, owner_pid=os.getpid())
    assert not again.created and torch.equal(again.block(3), pattern(3, 4096))
    with pytest.raises(IndexError):
        pool.block(16)
    pool.remove()
    assert not (shm_dir / pool.name).exists()
    again.close()
    with pytest.raises(RuntimeError, match="closed"):
        _ = again.tensor


def test_host_pool_too_large_is_clear(shm_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(config, "available_host_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match=r"needs 4\.0 MiB \(1024 blocks x 4096 bytes\).*"
                                         r"lower num_cpu_blocks"):
        HostPool.create(tmp_path, rank=2, num_blocks=1024, block_bytes=4096)
    assert list(shm_dir.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="is the engine running"):
        HostPool.attach(tmp_path, 2, 1024, 4096, owner_pid=os.getpid())


# ----------------------------------------------------------------- cleanup
def test_cleanup_removes_dead_keeps_live(shm_dir, tmp_path, peer):
    rid = shm.run_id(tmp_path)
    live = shm.segment_name(os.getpid(), rid, 0, "kv")
    shm.create_shm_tensor(live, (64,), torch.uint8)
    parent_live = shm.segment_name(os.getppid(), rid, 1, "kv")  # a live pid, not ours
    (shm_dir / parent_live).touch()
    (shm_dir / "unrelated-file").touch()
    # The child is a worker that dies: its own segment is stale, the KV planes it
    # made for us (owner = our pid) must survive it.
    out = peer.run(f"""
        import os, torch
        from kvcached.memory import kvshare, shm
        from kvcached.layout import KVLayout
        name = shm.segment_name(os.getpid(), {rid!r}, 0, "host")
        shm.create_shm_tensor(name, (4096,), torch.uint8)
        layout = KVLayout(2, 2, 8, 4, "float16")
        planes = kvshare.allocate_kv_cache(layout, 8, 2, {str(tmp_path)!r},
                                           owner_pid={os.getpid()})
        planes[1][7].fill_(3.0)
        print(name)  # exits without removing anything: a crashed worker
    """, shm_dir)
    peer.stop()
    dead = out.split()[-1]
    assert (shm_dir / dead).exists()
    assert shm.cleanup_stale_segments() == [dead]
    kv = shm.segment_name(os.getpid(), rid, 2, "kv")
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted(
        [live, kv, parent_live, "unrelated-file"])
    assert shm.cleanup_stale_segments() == []
    planes = kvshare.attach_kv_cache(tmp_path, 2)
    assert bool((planes[1][7] == 3.0).all()) and int(planes[0].count_nonzero()) == 0
    kvshare.release_kv_cache(tmp_path, 2)  # we own it: removed with the descriptor
    assert not (shm_dir / kv).exists() and not kvshare.descriptor_path(tmp_path, 2).exists()
    assert shm.remove_segment(live) and not shm.remove_segment(live)


def test_export_publishes_the_engines_event_handle(shm_dir, tmp_path):
    """CUDA engines pass an interprocess event; its handle reaches the descriptor,
    where the worker opens it so swap-outs wait for the engine's writes."""
    class FakeEvent:
        def ipc_handle(self):
            return bytes(range(64))

    planes = kvshare.allocate_kv_cache(SMALL_LAYOUT, 4, rank=0, run_dir=tmp_path)
    kvshare.export_kv_cache(planes, 0, tmp_path, event=FakeEvent())
    desc = kvshare.read_descriptor(tmp_path, 0)
    assert bytes.fromhex(desc["event_ipc_handle"]) == bytes(range(64))
    kvshare.export_kv_cache(planes, 0, tmp_path)
    assert "event_ipc_handle" not in kvshare.read_descriptor(tmp_path, 0)
    kvshare.release_kv_cache(tmp_path, 0)
