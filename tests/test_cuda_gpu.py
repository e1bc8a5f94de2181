"""CudaCopyEngine on a real GPU against a plain indexed copy (skipped without one).

Grid: dtype (bf16, fp16, fp8 + scales, odd-sized bf16, MLA) x bytes per
block-plane (4 KiB ... 2 MiB) x count (1 ... 1024) x path (kernel, direct,
batch), both directions, random non-contiguous ids, exact byte equality.
Plus stream ordering (a swap-out waits for the model's event, also across
processes through an IPC event handle) and CUDA IPC (a second process
attaches the exported planes and sees the engine's writes, and vice versa).
"""

from __future__ import annotations

import mmap
import os
import select
import subprocess
import sys
import time
from pathlib import Path

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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    if path == "batch" and not lib.raw.kvc_has_batch_memcpy():
        pytest.skip("built without cudaMemcpyBatchAsync (CUDA < 12.8)")
    layout = LAYOUTS[name](plane_bytes)
    rng = np.random.default_rng(count)
    planes = random_planes(layout, count + 7)
    pool = HostPool(layout, count + 5)
    mode = "kernel" if path == "kernel" else "direct"
    try:
        with kvc.CudaCopyEngine(planes, pool.tensor, layout.host_offsets, mode=mode,
                                use_batch=path == "batch") as engine:
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
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
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
