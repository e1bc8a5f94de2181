"""CudaCopyEngine on a real GPU against a plain indexed copy (skipped without one).

Grid: dtype (bf16, fp16, fp8 + scales, odd-sized bf16, MLA) x bytes per
block-plane (4 KiB ... 2 MiB) x count (1 ... 1024) x path (kernel, direct,
batch), both directions, random non-contiguous ids, exact byte equality.
Plus stream ordering (a swap-out waits for the model's event, also across
processes through an IPC event handle, and in the exporting process through
its own event; a swap-in waits too), both directions at once on their own
streams, a load inside the engine's step (a transfer worker in another
process copies it layer by layer, the compute stream waits on each layer's
event, and on the copies enqueued when the engine gives up), pools above 4 GiB, a kernel fault (a broken context, in a child
process), sleep/wakeup releasing and re-mapping the IPC planes, CUDA IPC (a
second process attaches the exported planes and sees the engine's writes,
and vice versa), and the manager creating the planes itself (create_cache).

scripts/gpu_check.sh runs this file and fails if any test is skipped: every
test here must run on a GPU machine that has torch with CUDA, numpy and
pytest but no pyzmq or msgpack (in-process transfers only).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import hybrid_pages as hp
import numpy as np
import pytest
import torch

from kvcached.layout import KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() "
           "== False (CPU-only torch build or no GPU/driver)")]

from kvcached.copy import cuda as kvc  # noqa: E402
from kvcached.memory import cuda_ipc  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ helpers
@pytest.fixture(scope="session")
def lib() -> kvc.KvcLib:
    try:
        return kvc.load()
    except RuntimeError as e:
        pytest.fail(f"a GPU is present but the CUDA copy library is not usable: {e}")


def layout_for(dtype: str, plane_bytes: int, mla: bool = False) -> KVLayout:
    """Two layers, head_dim 128, heads/tokens chosen so one block-plane is plane_bytes."""
    esize = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[dtype]
    tokens_x_heads = plane_bytes // (128 * esize)
    heads = 8 if tokens_x_heads >= 64 else 1
    return KVLayout(2, heads, 128, tokens_x_heads // heads, dtype, mla=mla)


def byte_view(plane: torch.Tensor) -> torch.Tensor:
    """uint8 ``[num_blocks, bytes per block]`` view of a plane (any dtype / block stride)."""
    elem = plane.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=plane.device).set_(plane.untyped_storage())
    return raw.as_strided((plane.size(0), plane[0].numel() * elem), (plane.stride(0) * elem, 1),
                          plane.storage_offset() * elem)


class HostPool:
    """A page-aligned anonymous mmap (like the /dev/shm pool), pinned in small chunks."""

    def __init__(self, layout: KVLayout, num_blocks: int, chunk_bytes: int = 8 << 20):
        self.mm = mmap.mmap(-1, num_blocks * layout.block_bytes)
        arr = np.frombuffer(self.mm, dtype=np.uint8).reshape(num_blocks, layout.block_bytes)
        self.tensor = torch.from_numpy(arr)
        self.tensor.copy_(torch.randint(0, 256, self.tensor.shape, dtype=torch.uint8))
        self.pinned = cuda_ipc.pin_host_memory(self.tensor, chunk_bytes=chunk_bytes)

    def close(self) -> None:
        cuda_ipc.unpin(self.pinned)
        self.tensor = None


def random_planes(layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    planes = cuda_ipc.allocate_cuda_planes(layout, num_blocks)
    for p in planes:
        byte_view(p).copy_(torch.randint(0, 256, byte_view(p).shape, dtype=torch.uint8,
                                         device=p.device))
    torch.cuda.synchronize()  # the engine's stream does not wait for torch's
    return planes


def check_round_trip(layout, planes, pool, engine, count, rng) -> None:
    """swap_out then swap_in random non-contiguous ids; compare with indexed copies."""
    num_dev, num_host = planes[0].shape[0], pool.tensor.shape[0]
    dev_ids = rng.choice(num_dev, count, replace=False)
    host_ids = rng.choice(num_host, count, replace=False)
    offs, nbs = layout.host_offsets, layout.plane_bytes

    expect = pool.tensor.clone()
    for p, o, n in zip(planes, offs, nbs, strict=True):
        expect[torch.from_numpy(host_ids), o:o + n] = byte_view(p).cpu()[dev_ids]
    moved = engine.swap_out(dev_ids, host_ids)
    assert moved == count * sum(nbs)
    assert torch.equal(pool.tensor, expect), "swap_out differs from the indexed copy"

    back = rng.choice(num_dev, count, replace=False)
    before = [byte_view(p).cpu() for p in planes]
    engine.swap_in(host_ids, back)
    for i, (p, b, o, n) in enumerate(zip(planes, before, offs, nbs, strict=True)):
        b[back] = pool.tensor[torch.from_numpy(host_ids), o:o + n]
        assert torch.equal(byte_view(p).cpu(), b), f"swap_in differs in plane {i}"


# ------------------------------------------------------------- the grid
LAYOUTS = {
    "bf16": lambda pb: layout_for("bfloat16", pb),
    "fp16": lambda pb: layout_for("float16", pb),
    "fp8+scales": lambda pb: layout_for("float8_e4m3fn", pb),
    "mla-bf16": lambda pb: layout_for("bfloat16", pb, mla=True),
}
SIZES = [(4 << 10, 1), (4 << 10, 1024), (16 << 10, 300), (64 << 10, 64), (256 << 10, 33),
         (2 << 20, 1), (2 << 20, 16)]
PATHS = ["kernel", "direct", "batch"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("plane_bytes,count", SIZES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_indexed_copy(lib, name, plane_bytes, count, path):
    # "batch" without cudaMemcpyBatchAsync (CUDA < 12.8) runs the per-run copies.
    layout = LAYOUTS[name](plane_bytes)
    rng = np.random.default_rng(count)
    planes = random_planes(layout, count + 7)
    pool = HostPool(layout, count + 5)
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets, mode=path) as engine:
            check_round_trip(layout, planes, pool, engine, count, rng)
    finally:
        pool.close()


@pytest.mark.parametrize("name,layout", [
    ("odd bf16", KVLayout(2, 3, 5, 4, "bfloat16")),      # 120-byte planes: 8-byte vectors
    ("odd fp8", KVLayout(2, 3, 7, 3, "float8_e4m3fn")),  # 63-byte planes + 72-byte scales
    ("odd mla", KVLayout(3, 1, 12, 5, "bfloat16", mla=True)),
])
@pytest.mark.parametrize("grid", [(1, 32), (4, 256), (16, 512)])
def test_odd_sizes_and_grids(lib, name, layout, grid):
    rng = np.random.default_rng(1)
    planes = random_planes(layout, 40)
    pool = HostPool(layout, 30)
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets, grid_blocks=grid[0],
                                block_threads=grid[1]) as engine:
            check_round_trip(layout, planes, pool, engine, 17, rng)
    finally:
        pool.close()


def test_padded_and_shifted_planes(lib):
    """Planes that are views: K and V interleaved per block (stride 2x), V shifted by
    one block-plane, plus a plane starting 2 bytes into its allocation."""
    layout = KVLayout(1, 2, 64, 16, "bfloat16")
    kv = torch.randint(0, 256, (24, 2, layout.plane_bytes[0]), dtype=torch.uint8, device="cuda")
    planes = [kv[:, 0].view(torch.bfloat16), kv[:, 1].view(torch.bfloat16)]
    odd = torch.randint(0, 256, (24 * 4098 + 2,), dtype=torch.uint8, device="cuda")
    shifted = odd[2:].as_strided((24, 4096), (4098, 1))
    layout2 = KVLayout(1, 1, 64, 32, "bfloat16", mla=True)  # one 4096-byte plane
    torch.cuda.synchronize()
    for lay, pl in ((layout, planes), (layout2, [shifted])):
        pool = HostPool(lay, 20)
        try:
            with kvc.CudaCopyEngine(pl, pool.tensor, lay.host_offsets) as engine:
                check_round_trip(lay, pl, pool, engine, 11, np.random.default_rng(3))
        finally:
            pool.close()


# ------------------------------------------------------- a hybrid model's pages
# scripts/gpu_check.sh runs these as its own step ("hybrid"): sliding-window,
# full-attention and Mamba groups over two regions of one allocation, as vLLM
# lays them (tests/copy/hybrid_pages.py), against the CPU oracle.
def hybrid_copy(engine):
    return lambda src, host, back: (engine.swap_out(src, host), engine.swap_in(host, back))


@pytest.mark.parametrize("mode", ["kernel", "direct", "batch"])
def test_hybrid_pages_round_trip(lib, mode):
    pages = hp.HybridPages.random(hp.NUM_BLOCKS, "cuda")
    layout = pages.layout()
    torch.cuda.synchronize()  # the engine's stream does not wait for torch's
    pool = HostPool(layout, hp.NUM_HOST)
    try:
        with kvc.CudaCopyEngine(pages.planes, pool.tensor, layout.host_offsets,
                                mode=mode) as engine:
            hp.check_round_trip(pages, pool.tensor, hp.OWNERS, hp.HOST_IDS, hp.BACK,
                                hybrid_copy(engine))
    finally:
        pool.close()


HYBRID_CHILD = r"""
import json, sys
from kvcached.config import CacheConfig
from kvcached.tasks import Task
from kvcached.transfer.executor import RankExecutor
cfg = CacheConfig.from_dict(json.loads(sys.argv[2]))
src, host, back = json.loads(sys.argv[4])
ex = RankExecutor(cfg, sys.argv[1], 0, owner_pid=int(sys.argv[3]))
ex.open(30)
out = [ex.run(Task("swap_out", src, host))["bytes"], ex.run(Task("swap_in", host, back))["bytes"]]
ex.close()
print(json.dumps(out), flush=True)
"""


def test_hybrid_pages_through_a_transfer_worker(lib, tmp_path):
    """The transfer worker's path: the hybrid planes (two regions of one CUDA
    allocation) exported by CUDA IPC, attached and checked against kvcached's
    layout in another process, copied there by its executor."""
    from kvcached.config import CacheConfig
    from kvcached.memory.hostpool import HostPool as ShmPool
    from kvcached.memory.kvevent import KVEvent
    from kvcached.memory.kvshare import export_kv_cache
    pages = hp.HybridPages.random(hp.NUM_BLOCKS, "cuda")
    layout = pages.layout()
    cfg = CacheConfig.load(device="cuda", **layout.to_dict(), num_gpu_blocks=hp.NUM_BLOCKS,
                           num_cpu_blocks=hp.NUM_HOST, storage_backend=None,
                           run_dir=str(tmp_path))
    assert cfg.layout == layout
    torch.cuda.synchronize()
    event = KVEvent(tmp_path, 0)
    export_kv_cache(pages.planes, 0, tmp_path, event=event)
    pool = ShmPool.create(tmp_path, 0, hp.NUM_HOST, layout.block_bytes)

    def copy(src, host, back):
        res = subprocess.run([sys.executable, "-c", HYBRID_CHILD, str(tmp_path),
                              json.dumps(cfg.to_dict()), str(os.getpid()),
                              json.dumps([src, host, back])],
                             capture_output=True, text=True, timeout=180, env=_child_env())
        assert res.returncode == 0, res.stderr[-4000:]
        moved = json.loads(res.stdout.strip().splitlines()[-1])
        assert moved == [len(src) * layout.block_bytes] * 2, moved

    try:
        hp.check_round_trip(pages, pool.tensor, hp.OWNERS, hp.HOST_IDS, hp.BACK, copy)
    finally:
        pool.remove()


# ------------------------------------------- library only (compute-sanitizer)
def _pinned(lib, nbytes: int) -> tuple[int, np.ndarray]:
    ptr = lib.host_alloc(nbytes)
    return ptr, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _download(lib, dev: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    lib.memcpy_async(out.ctypes.data, dev, nbytes, 0)
    lib.stream_synchronize(0)
    return out


@pytest.mark.parametrize("mode", ["kernel", "direct", "batch"])
@pytest.mark.parametrize("count", [5, 100], ids=["inline", "staged"])
@pytest.mark.parametrize("shift", [0, 2], ids=["aligned", "shifted"])
def test_lib_only_round_trip(lib, mode, count, shift):
    """The library and numpy only (no torch CUDA kernels): what scripts/gpu_check.sh
    runs under compute-sanitizer memcheck. Three odd-sized padded planes, ids
    inline and staged, 16-byte and 2-byte aligned planes."""
    nplanes, nbytes, stride = 3, 4144 + 6, 4224
    n_dev, n_host = count + 40, count + 20
    hoff = [i * 4160 for i in range(nplanes)]  # 16-byte aligned plane offsets
    hblock = nplanes * 4160
    rng = np.random.default_rng(count + shift)
    span = nplanes * n_dev * stride + 64
    ref = rng.integers(0, 256, span, dtype=np.uint8)
    dev = lib.malloc(span)
    host_ptr, host = _pinned(lib, n_host * hblock)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    try:
        lib.memcpy_async(dev, ref.ctypes.data, span, 0)
        lib.stream_synchronize(0)
        planes = [kvc.CudaPlane(dev + shift + p * n_dev * stride, stride, nbytes)
                  for p in range(nplanes)]

        def dev_block(buf, p, b):
            o = shift + p * n_dev * stride + b * stride
            return buf[o:o + nbytes]
        src = rng.permutation(n_dev)[:count]
        dst = rng.permutation(n_host)[:count]
        back = rng.permutation(n_dev)[:count]
        expect_host = host.copy().reshape(n_host, hblock)
        for s_, d in zip(src, dst, strict=True):
            for p in range(nplanes):
                expect_host[d, hoff[p]:hoff[p] + nbytes] = dev_block(ref, p, s_)
        with kvc.CudaCopyEngine(planes, host_ptr, hoff, host_block_bytes=hblock,
                                num_host_blocks=n_host, num_device_blocks=n_dev, lib=lib,
                                mode=mode) as engine:
            engine.swap_out(src, dst)
            np.testing.assert_array_equal(host.reshape(n_host, hblock), expect_host)
            engine.swap_in(dst, back)
        expect_dev = ref.copy()
        for b, d in zip(back, dst, strict=True):
            for p in range(nplanes):
                dev_block(expect_dev, p, b)[:] = expect_host[d, hoff[p]:hoff[p] + nbytes]
        np.testing.assert_array_equal(_download(lib, dev, span), expect_dev)
    finally:
        lib.free(dev)
        lib.host_free(host_ptr)


# ------------------------------------------------------------ errors
def test_bad_ids_rejected_and_nothing_moves(lib):
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 8)
    pool = HostPool(layout, 4)
    snapshot = pool.tensor.clone()
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets) as engine:
            with pytest.raises(kvc.CudaTaskInvalid, match="destination id 4"):
                engine.swap_out([0, 1], [0, 4])
            with pytest.raises(ValueError, match="duplicate|twice"):
                engine.swap_out([0, 1], [2, 2])
            assert torch.equal(pool.tensor, snapshot)
    finally:
        pool.close()


def test_unpinned_host_pool_is_a_clear_error(lib):
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 4)
    with pytest.raises(kvc.CudaCopyError, match="pin_host_memory"):
        kvc.CudaCopyEngine(planes, torch.zeros(4, layout.block_bytes, dtype=torch.uint8),
                           layout.host_offsets)


# ---------------------------------------------------------- stream ordering
def test_swap_out_waits_for_the_model_event(lib):
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 8)
    pool = HostPool(layout, 4)
    compute = torch.cuda.Stream()
    ev = torch.cuda.Event()
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets) as engine:
            with torch.cuda.stream(compute):
                torch.cuda._sleep(200_000_000)  # the "model" is still busy...
                byte_view(planes[0])[3].fill_(0x5A)  # ...then writes the KV
                ev.record(compute)
            engine.swap_out([3], [1], wait_event=ev)
            assert bool((pool.tensor[1, :layout.plane_bytes[0]] == 0x5A).all())
    finally:
        pool.close()


@pytest.mark.parametrize("mode", ["kernel", "batch"])
def test_swap_in_waits_for_the_model_event(lib, mode):
    """A kernel still reading block 3 (queued behind a long sleep) reads the old
    KV: the swap-in that overwrites block 3 waits on the event recorded after it."""
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 8)
    pool = HostPool(layout, 4)
    n = layout.plane_bytes[0]
    before = byte_view(planes[0])[3].clone()
    late_read = torch.empty_like(before)
    compute = torch.cuda.Stream()
    ev = torch.cuda.Event()
    torch.cuda.synchronize()
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets, mode=mode) as engine:
            with torch.cuda.stream(compute):
                torch.cuda._sleep(200_000_000)  # the "model" is still busy...
                late_read.copy_(byte_view(planes[0])[3])  # ...then reads block 3
                ev.record(compute)
            engine.swap_in([1], [3], wait_event=ev)
            torch.cuda.synchronize()
            assert torch.equal(late_read, before), "the swap-in overwrote a block still read"
            assert torch.equal(byte_view(planes[0])[3].cpu(), pool.tensor[1, :n])
    finally:
        pool.close()


@pytest.mark.parametrize("mode", ["kernel", ("batch", "kernel")])
def test_directions_overlap_on_their_own_streams(lib, mode):
    """A swap-out waiting for a busy model does not hold up a swap-in: the swap-in
    completes (on its own event) while the swap-out is still queued."""
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 8)
    pool = HostPool(layout, 4)
    n = layout.plane_bytes[0]
    compute = torch.cuda.Stream()
    ev = torch.cuda.Event()
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets, mode=mode) as engine:
            assert engine.stream_of(kvc.D2H) != engine.stream_of(kvc.H2D)
            with torch.cuda.stream(compute):
                torch.cuda._sleep(1_000_000_000)  # ~0.5 s of "model"
                byte_view(planes[0])[3].fill_(0x5A)
                ev.record(compute)
            engine.swap_out([3], [1], wait_event=ev, sync=False)  # queued behind the model
            engine.swap_in([2], [5])  # returns on its own completion event
            assert torch.equal(byte_view(planes[0])[5].cpu(), pool.tensor[2, :n])
            out_done = lib.raw.kvc_event_query(engine._lanes[kvc.D2H].done)
            assert out_done == kvc.Status.CUDA_BASE + 600, (  # cudaErrorNotReady
                "the swap-out finished before the model did, or the swap-in waited for it")
            engine.synchronize()
            assert bool((pool.tensor[1, :n] == 0x5A).all())
    finally:
        pool.close()


def test_pools_above_4_gib(lib):
    """A 4.5 GiB plane and a 4.6 GiB pinned host pool: the last blocks of both, with
    inline and staged ids, in every mode (64-bit offsets on the device)."""
    pb0, pb1 = 64 << 10, 4 << 10
    n_dev, n_host = 73_728, 70_000  # plane 0: 4.5 GiB; host: 70_000 x 68 KiB = 4.5 GiB
    planes = [torch.empty((n_dev, pb0), dtype=torch.uint8, device="cuda"),
              torch.empty((n_dev, pb1), dtype=torch.uint8, device="cuda")]
    mm = mmap.mmap(-1, n_host * (pb0 + pb1))
    host = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8).reshape(n_host, pb0 + pb1))
    pinned = cuda_ipc.pin_host_memory(host)
    try:
        for mode in ("kernel", "direct", "batch"):
            with kvc.CudaCopyEngine(planes, host, [0, pb0], mode=mode) as engine:
                for count in (3, kvc.INLINE_PAIRS + 36):
                    src = torch.arange(n_dev - 1, n_dev - 1 - 5 * count, -5)
                    dst = torch.arange(n_host - 1, n_host - 1 - 3 * count, -3)
                    back = src - 1
                    assert int(src[-1]) * pb0 > 1 << 32 and int(dst[-1]) * (pb0 + pb1) > 1 << 32
                    for p, pb in zip(planes, (pb0, pb1), strict=True):
                        p[src.cuda()] = torch.randint(0, 256, (count, pb), dtype=torch.uint8,
                                                      device="cuda")
                    torch.cuda.synchronize()
                    engine.swap_out(src.tolist(), dst.tolist())
                    engine.swap_in(dst.tolist(), back.tolist())
                    for p, off, pb in zip(planes, (0, pb0), (pb0, pb1), strict=True):
                        want = p[src.cuda()].cpu()
                        assert torch.equal(host[dst, off:off + pb], want), (mode, count)
                        assert torch.equal(p[back.cuda()].cpu(), want), (mode, count)
    finally:
        cuda_ipc.unpin(pinned)
        del host


FAULT_CHILD = r"""
import json
from kvcached.copy import cuda as kvc
lib = kvc.load()
lib.set_device(0)
host = lib.host_alloc(16 * 65536)
# A non-null, aligned address no GPU mapping covers: the kernel faults on it.
bad = 0x100000
engine = kvc.CudaCopyEngine([kvc.CudaPlane(bad, 65536, 65536)], host, [0],
                            host_block_bytes=65536, num_host_blocks=16,
                            num_device_blocks=16, lib=lib, mode="kernel")
out = {}
try:
    engine.swap_out([1], [2])
    out["first"] = ["ok"]
except kvc.CudaContextBroken as e:
    out["first"] = ["broken", e.status_name]
except kvc.CudaCopyError as e:
    out["first"] = ["error", e.status_name]
try:
    engine.swap_in([2], [3])
    out["second"] = ["ok"]
except kvc.CudaContextBroken as e:
    out["second"] = ["broken", str(e)]
engine.close()
out["closed"] = True
print(json.dumps(out), flush=True)
"""


def test_kernel_fault_breaks_the_engine_not_the_caller(lib, tmp_path):
    """An illegal address inside the kernel surfaces as CudaContextBroken at the
    task's completion event; later tasks are refused without CUDA calls and
    close() still returns (in a child process: the fault breaks its context)."""
    res = subprocess.run([sys.executable, "-c", FAULT_CHILD], capture_output=True, text=True,
                         timeout=180, env=_child_env())
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["first"][0] == "broken", out
    assert out["first"][1] in ("cudaErrorIllegalAddress", "cudaErrorLaunchFailure"), out
    assert out["second"][0] == "broken" and "broke earlier" in out["second"][1], out
    assert out["closed"]


def _child_env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **extra}


SLEEP_CHILD = r"""
import gc, json, sys, torch
from kvcached.config import CacheConfig
from kvcached.copy import cuda as kvc
from kvcached.tasks import Task
from kvcached.transfer.executor import RankExecutor
cfg = CacheConfig.from_dict(json.loads(sys.argv[2]))
ex = RankExecutor(cfg, sys.argv[1], 0, owner_pid=int(sys.argv[3]))
lib = kvc.load()
ex.open(30)
ptr = ex.planes[0].data_ptr()
out = {"device": str(ex.planes[0].device), "before": lib.pointer_type(ptr)}
out["out"] = ex.run(Task("swap_out", [3], [1]))["bytes"]
ex.close(final=False)  # sleep
gc.collect()
out["asleep"] = lib.pointer_type(ptr)
ex.open(30)  # wakeup
out["in"] = ex.run(Task("swap_in", [1], [5]))["bytes"]
ex.close()
print(json.dumps(out), flush=True)
"""


def test_sleep_unmaps_the_planes_and_wakeup_maps_them_again(lib, tmp_path):
    """A worker's executor in another process (its GPU named by UUID in its
    CUDA_VISIBLE_DEVICES): sleep closes the IPC mapping (the address is no longer
    CUDA memory there), wakeup maps the planes again and copies work."""
    from kvcached.config import CacheConfig
    from kvcached.memory.hostpool import HostPool as ShmPool
    from kvcached.memory.kvevent import KVEvent
    from kvcached.memory.kvshare import export_kv_cache
    layout = KVLayout(2, 2, 128, 16, "bfloat16")
    cfg = CacheConfig.load(device="cuda", num_layers=2, num_kv_heads=2, head_dim=128,
                           block_size=16, dtype="bfloat16", num_gpu_blocks=16, num_cpu_blocks=8,
                           storage_backend=None, run_dir=str(tmp_path))
    planes = random_planes(layout, 16)
    event = KVEvent(tmp_path, 0)
    export_kv_cache(planes, 0, tmp_path, event=event)
    pool = ShmPool.create(tmp_path, 0, 8, layout.block_bytes)
    uuid = cuda_ipc.local_devices()[0].uuid
    visible = f"GPU-{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:]}"
    try:
        res = subprocess.run([sys.executable, "-c", SLEEP_CHILD, str(tmp_path),
                              json.dumps(cfg.to_dict()), str(os.getpid())],
                             capture_output=True, text=True, timeout=180,
                             env=_child_env(CUDA_VISIBLE_DEVICES=visible))
        assert res.returncode == 0, res.stderr[-4000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["before"] == 2, out  # cudaMemoryTypeDevice: mapped
        assert out["asleep"] == 0, out  # unregistered: the IPC mapping was closed
        assert out["out"] == out["in"] == layout.block_bytes
        torch.cuda.synchronize()
        for p, o, n in zip(planes, layout.host_offsets, layout.plane_bytes, strict=True):
            assert torch.equal(pool.tensor[1, o:o + n], byte_view(p)[3].cpu())
            assert torch.equal(byte_view(p)[5].cpu(), byte_view(p)[3].cpu())
    finally:
        pool.remove()


STEP_CHILD = r"""
import json, sys
from kvcached.config import CacheConfig
from kvcached.tasks import Task
from kvcached.transfer.executor import RankExecutor
cfg = CacheConfig.from_dict(json.loads(sys.argv[2]))
ex = RankExecutor(cfg, sys.argv[1], 0, owner_pid=int(sys.argv[3]))
ex.open(30)  # the planes, the host pool, the KV event, the channel and its layer events
print("ready", flush=True)
task = Task("swap_in_layers", json.loads(sys.argv[4]), json.loads(sys.argv[5]))
task.task_id = int(sys.stdin.readline())
print(json.dumps(ex.run(task)), flush=True)
ex.close()
"""


def _line(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"child said nothing within {timeout}s: {_err(proc)}")
    out = proc.stdout.readline().strip()
    if not out:
        raise RuntimeError(f"child exited: {_err(proc)}")
    return out


@pytest.fixture
def step_load(lib, tmp_path):
    """An engine's side of a load inside its step (3 layers of K and V planes,
    the KV event, one interprocess event per layer in the step progress
    channel, the host pool) and a transfer worker's executor in another
    process, attached and ready to copy host blocks ``src`` to ``dst``."""
    from types import SimpleNamespace

    from kvcached.config import CacheConfig
    from kvcached.memory.hostpool import HostPool as ShmPool
    from kvcached.memory.kvevent import KVEvent
    from kvcached.memory.kvshare import export_kv_cache
    from kvcached.memory.progress import StepProgress, progress_path
    layers = 3
    layout = KVLayout(layers, 2, 128, 16, "bfloat16")
    cfg = CacheConfig.load(device="cuda", num_layers=layers, num_kv_heads=2, head_dim=128,
                           block_size=16, dtype="bfloat16", num_gpu_blocks=16, num_cpu_blocks=8,
                           storage_backend=None, run_dir=str(tmp_path))
    planes = random_planes(layout, 16)
    kv_event = KVEvent(tmp_path, 0)
    events = [torch.cuda.Event(interprocess=True) for _ in range(layers)]
    chan = StepProgress.create(progress_path(tmp_path, 0), [bytes(e.ipc_handle()) for e in events])
    export_kv_cache(planes, 0, tmp_path, event=kv_event)
    pool = ShmPool.create(tmp_path, 0, 8, layout.block_bytes)
    pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
    src, dst = [5, 1, 6], [9, 2, 14]
    err = open(tmp_path / "child.err", "w")  # closed below
    proc = subprocess.Popen([sys.executable, "-c", STEP_CHILD, str(tmp_path),
                             json.dumps(cfg.to_dict()), str(os.getpid()), json.dumps(src),
                             json.dumps(dst)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=err, text=True, env=_child_env())
    proc.stderr_file = err
    try:
        assert _line(proc) == "ready"
        yield SimpleNamespace(layers=layers, layout=layout, planes=planes,
                              per=len(planes) // layers, kv_event=kv_event, events=events,
                              chan=chan, pool=pool, src=src, dst=dst, proc=proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        err.close()
        chan.close()
        pool.remove()


def _slow_forward_then_load(rig, task_id: int) -> torch.cuda.Stream:
    """The forward before is still running (~1 s) when the load is sent: every
    copy of it waits for the KV event recorded after that forward."""
    model = torch.cuda.Stream()
    with torch.cuda.stream(model):
        torch.cuda._sleep(2_000_000_000)
        rig.kv_event.record(model)
    rig.proc.stdin.write(f"{task_id}\n")
    rig.proc.stdin.flush()
    return model


def _host_bytes(rig, plane: int) -> torch.Tensor:
    o, n = rig.layout.host_offsets[plane], rig.layout.plane_bytes[plane]
    return rig.pool.tensor[rig.src, o:o + n]


def test_a_load_inside_the_step_is_waited_for_layer_by_layer(step_load):
    """A transfer worker's executor in another process copies a load inside the
    step layer by layer, recording each layer's event (the engine's, opened by
    IPC handle from the step progress channel) after its copy; the engine
    (kvcached.memory.stepwait) waits on the CPU only until a layer is
    published, then its compute stream waits on that layer's event. The copy is
    held back on the GPU (it waits for a slow forward), so a read of layer i's
    blocks on the compute stream, enqueued long before, sees the loaded bytes
    only if the wait orders it after that layer's copy. Every layer holds
    exactly its host blocks' bytes."""
    from kvcached.memory.stepwait import StepWait
    rig = step_load
    waits = StepWait(rig.chan, rig.layers, events=rig.events)
    waits.expect(7, rig.dst, timeout_s=60)
    model = _slow_forward_then_load(rig, 7)
    reads = []
    with torch.cuda.stream(torch.cuda.Stream()):  # the compute stream
        waits.start()
        for i in range(rig.layers):
            waits.layer(i)  # the layer's copy is enqueued, its event recorded
            reads.append([byte_view(p)[rig.dst].clone()
                          for p in rig.planes[i * rig.per:(i + 1) * rig.per]])
        waits.finish()
    assert not model.query(), "the slow forward ended before the reads were enqueued"
    assert json.loads(_line(rig.proc)) == {"bytes": len(rig.src) * sum(rig.layout.plane_bytes)}
    torch.cuda.synchronize()
    assert waits.take_errors() == set() and rig.chan.state() == (7, rig.layers, False)
    for i in range(rig.layers):
        for k in range(rig.per):
            j = i * rig.per + k
            assert torch.equal(reads[i][k].cpu(), _host_bytes(rig, j)), f"layer {i} read early"
            assert torch.equal(byte_view(rig.planes[j])[rig.dst].cpu(), _host_bytes(rig, j))
    assert rig.proc.wait(timeout=60) == 0, _err(rig.proc)  # it closed its executor


def test_giving_up_orders_later_compute_after_the_copies_enqueued(step_load):
    """The engine gives up on a load whose copies are enqueued but still held
    back on the GPU (here it waits for a fourth layer that never comes, past a
    short deadline). Its blocks are computed again, on the compute stream: the
    give-up makes that stream wait on the last layer enqueued, so the KV
    computed again is written after the late copy, never overwritten by it."""
    from kvcached.memory.stepwait import StepWait
    rig = step_load
    waits = StepWait(rig.chan, rig.layers + 1, events=rig.events)
    waits.expect(8, rig.dst, timeout_s=0.2)
    model = _slow_forward_then_load(rig, 8)
    with torch.cuda.stream(torch.cuda.Stream()):  # the compute stream
        waits.start()
        waits.finish()  # three layers enqueued, the fourth never: given up
        assert waits.take_errors() == set(rig.dst)
        assert not model.query(), "the copies ran before the engine gave up"
        for p in rig.planes:  # the blocks computed again
            byte_view(p)[rig.dst] = 0xEE
    assert json.loads(_line(rig.proc)) == {"bytes": len(rig.src) * sum(rig.layout.plane_bytes)}
    torch.cuda.synchronize()
    for j, p in enumerate(rig.planes):
        assert bool((byte_view(p)[rig.dst] == 0xEE).all()), f"plane {j}: the copy landed last"
    assert rig.proc.wait(timeout=60) == 0, _err(rig.proc)


def test_device_identity_matches_the_driver(lib):
    """UUIDs and PCI bus ids as nvidia-smi reports them; a plane's entry names its GPU."""
    devs = cuda_ipc.local_devices()
    assert len(devs) == torch.cuda.device_count() >= 1
    smi = subprocess.run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    assert smi.returncode == 0, smi.stderr
    rows = [line.split(",") for line in smi.stdout.strip().splitlines()]
    smi_ids = {(u.strip().removeprefix("GPU-").replace("-", "").lower(),
                cuda_ipc.normalize_pci_bus_id(b)) for u, b in rows}
    assert {(d.uuid, d.pci_bus_id) for d in devs} <= smi_ids
    entry = cuda_ipc.export_cuda_planes([torch.zeros(2, 16, device="cuda")])[0]
    assert entry["device_uuid"] == devs[0].uuid
    assert cuda_ipc.map_device(entry, devs) == 0


def test_manager_creates_cuda_planes_and_orders_copies_in_process(lib, tmp_path):
    """create_cache on CUDA, in-process transfers, the engine's own KVEvent: a
    swap-out planned right after commit waits for the (slow) forward that wrote
    the blocks, and the blocks come back intact through the CPU tier."""
    from kvcached import CacheConfig, CacheManager
    from kvcached.memory.kvevent import KVEvent
    from kvcached.memory.kvshare import attach_kv_cache, export_kv_event
    bs = 16
    cfg = CacheConfig.load(device="cuda", create_cache=True, transfer_mode="inprocess",
                           control_socket=False, storage_backend=None, num_layers=2,
                           num_kv_heads=2, head_dim=128, block_size=bs, dtype="bfloat16",
                           num_gpu_blocks=8, num_cpu_blocks=16, run_dir=str(tmp_path / "run"))
    compute = torch.cuda.Stream()

    def forward(planes, blocks, values, event):
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # a slow forward pass...
            for b, v in zip(blocks, values, strict=True):
                for p in planes:
                    byte_view(p)[b].fill_(v)  # ...that writes the blocks' KV
            event.record(compute)  # after the forward, before commit

    with CacheManager(cfg) as mgr:
        planes = attach_kv_cache(mgr.run_dir, 0)
        assert planes[0].is_cuda
        event = KVEvent(mgr.run_dir, 0)
        export_kv_event(event, 0, mgr.run_dir)
        prompt = [7] * (3 * bs) + [1]
        a = mgr.allocate("r1", prompt)
        forward(planes, a.block_ids[:3], [11, 12, 13], event)
        mgr.commit("r1", prompt, len(prompt))
        mgr.free("r1")
        other = list(range(100, 100 + 7 * bs)) + [1]  # takes every GPU block
        b = mgr.allocate("r2", other)  # r1's blocks are swapped out here
        forward(planes, b.block_ids, [0x77] * len(b.block_ids), event)
        mgr.commit("r2", other, len(other))
        mgr.free("r2")
        assert mgr.stats().evictions.get("gpu_to_cpu", 0) >= 3
        c = mgr.allocate("r3", prompt)
        c.wait(timeout=30)
        assert c.hit.cpu_tokens == 3 * bs and c.num_cached_tokens == 3 * bs
        torch.cuda.synchronize()
        for blk, v in zip(c.block_ids[:3], [11, 12, 13], strict=True):
            for p in planes:
                assert bool((byte_view(p)[blk] == v).all()), (blk, v)
        mgr.free("r3")
        mgr.check_invariants()


# ------------------------------------------------------------------- IPC
CHILD = r"""
import sys, torch
from kvcached.memory.kvshare import attach_kv_cache
planes = attach_kv_cache(sys.argv[1], 0, timeout_s=30)
def bv(p):
    e = p.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=p.device).set_(p.untyped_storage())
    return raw.as_strided((p.size(0), p[0].numel() * e), (p.stride(0) * e, 1), p.storage_offset() * e)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "read":          # bytes of block int(cmd[1]) of every plane, as hex digests
        torch.cuda.synchronize()
        import hashlib
        print(" ".join(hashlib.blake2b(bv(p)[int(cmd[1])].cpu().numpy().tobytes()).hexdigest()
                       for p in planes), flush=True)
    elif cmd[0] == "write":       # slow write of 0xAB into block int(cmd[1]), IPC event after
        ev = torch.cuda.Event(interprocess=True)
        torch.cuda._sleep(200_000_000)
        for p in planes:
            bv(p)[int(cmd[1])].fill_(0xAB)
        ev.record()
        print(bytes(ev.ipc_handle()).hex(), flush=True)
    elif cmd[0] == "quit":
        break
"""


def _ask(proc: subprocess.Popen, line: str, timeout: float = 60.0) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"child did not answer {line!r} within {timeout}s: {_err(proc)}")
    out = proc.stdout.readline().strip()
    if not out:
        raise RuntimeError(f"child exited without answering {line!r}: {_err(proc)}")
    return out


def _err(proc: subprocess.Popen) -> str:
    """The tail of the child's stderr (a file: a full pipe would block the child)."""
    proc.stderr_file.flush()
    return Path(proc.stderr_file.name).read_text()[-4000:]


def test_second_process_sees_engine_writes_and_vice_versa(lib, tmp_path):
    import hashlib

    from kvcached.memory.kvshare import export_kv_cache
    layout = KVLayout(2, 2, 128, 16, "float8_e4m3fn")  # K, V and scale planes
    planes = random_planes(layout, 16)
    export_kv_cache(planes, rank=0, run_dir=tmp_path)
    pool = HostPool(layout, 8)
    env = _child_env()
    err = open(tmp_path / "child.err", "w")  # closed in finally
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    proc.stderr_file = err
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets) as engine:
            engine.swap_in([2], [5])  # the engine writes block 5 ...
            mine = " ".join(hashlib.blake2b(byte_view(p)[5].cpu().numpy().tobytes()).hexdigest()
                            for p in planes)
            assert _ask(proc, "read 5") == mine  # ... and the other process sees it
            handle = bytes.fromhex(_ask(proc, "write 9"))  # the other process writes block 9
            event = kvc.open_ipc_event(handle)
            engine.swap_out([9], [0], wait_event=event)  # ordered after it by the IPC event
            lib.event_destroy(event)
            spans = [pool.tensor[0, o:o + n] for o, n in zip(layout.host_offsets,
                                                              layout.plane_bytes, strict=True)]
            assert all(bool((s == 0xAB).all()) for s in spans)
        _ask_quit(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        err.close()
        pool.close()


def _ask_quit(proc: subprocess.Popen) -> None:
    proc.stdin.write("quit\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode == 0, _err(proc)


def test_open_in_exporting_process_returns_same_memory(lib):
    layout = KVLayout(1, 1, 128, 16, "bfloat16")
    planes = random_planes(layout, 4)
    again = cuda_ipc.open_cuda_planes(cuda_ipc.export_cuda_planes(planes))
    assert [p.data_ptr() for p in again] == [p.data_ptr() for p in planes]
