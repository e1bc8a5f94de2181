"""The CUDA copy library without a GPU: it compiles, loads, validates, emulates.

Compiled once per session (and cached on disk by native_build). Validation
cases prove that checks run before any CUDA call: on a machine without a
driver, a rejected task comes back with its validation status, never with a
CUDA error. The kernel path's own parameter packing and per-thread code run
on the CPU through ``kvc_emulate_kernel`` and are compared with a plain
indexed copy; ``CudaCopyEngine`` runs end to end over a fake CUDA runtime
(host buffers, memmove) whose launches go through that same packing.
The compiled kernel itself is checked with ptxas (registers, spills) and
its PTX (16-byte streaming accesses).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import re
import shutil
import subprocess

import hybrid_pages as hp
import numpy as np
import pytest

from kvcached import native_build
from kvcached.copy import cuda as kvc
from kvcached.copy.cuda import D2H, H2D, CudaPlane, Status
from kvcached.layout import KVLayout

FAKE_DEV = 0x7F00_0000_0000  # never dereferenced: validation or the driver stops first
FAKE_WS = 0x7E00_0000_0000
NUM_DEV, NUM_HOST = 16, 12


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def build_info() -> kvc.BuildInfo:
    if kvc.find_nvcc() is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): cannot build the kernel")
    return kvc.build()


@pytest.fixture(scope="session")
def lib(build_info) -> kvc.KvcLib:
    return kvc.KvcLib(build_info.path)


@pytest.fixture(scope="session")
def has_gpu(lib) -> bool:
    try:
        return lib.device_count() > 0
    except kvc.CudaCopyError:
        return False


@pytest.fixture
def no_gpu(has_gpu):
    if has_gpu:
        pytest.skip("a GPU is present: this checks behaviour without one")


# ------------------------------------------------------------------- helpers
def fake_task(**over) -> kvc.KvcTask:
    """A valid D2H task over fake addresses: 3 planes, the middle one not 16-byte sized."""
    planes = [CudaPlane(FAKE_DEV, 4096, 4096), CudaPlane(FAKE_DEV + (1 << 24), 1040, 1000),
              CudaPlane(FAKE_DEV + (1 << 25), 512, 512)]
    args = dict(planes=planes, host_offsets=[0, 4096, 5104], src_ids=[3, 0, 15],
                dst_ids=[1, 11, 0], direction=D2H, num_dev_blocks=NUM_DEV,
                num_host_blocks=NUM_HOST, host_base=0x5500_0000_0000, host_block_bytes=5632)
    null = over.pop("null", None)
    fields = {k: over.pop(k) for k in list(over) if k not in args}
    task = kvc.make_task(**{**args, **over})
    for k, v in fields.items():  # raw field overrides: num_planes, count, reserved, ...
        setattr(task, k, v)
    if null:
        setattr(task, null, None)
    return task


def fake_launch(lib, task, grid=4, threads=256, ids=FAKE_WS, ids_bytes=1 << 20,
                table=FAKE_WS) -> kvc.KvcLaunch:
    """A launch whose fingerprint matches ``task``'s planes, over fake addresses."""
    fp = 0
    if task is not None and task.planes and 0 < task.num_planes <= 4096:
        fp = lib.pack_plane_table(task.planes, task.num_planes)[1]
    return kvc.KvcLaunch(table, fp, ids, ids, ids_bytes, None, grid, threads)


def kernel_rc(lib, task, launch=None, **kw) -> int:
    launch = launch if launch is not None else fake_launch(lib, task, **kw)
    return lib.raw.kvc_copy_kernel(ctypes.byref(task) if task is not None else None,
                                   ctypes.byref(launch), None, None)


def all_rcs(lib, task) -> set[int]:
    """The status of the same task through every entry point that validates it
    (the emulation only with a launch that would fail later, if at all)."""
    ref = ctypes.byref(task) if task is not None else None
    launch = fake_launch(lib, task)
    return {lib.raw.kvc_validate_task(ref), kernel_rc(lib, task, launch),
            lib.raw.kvc_copy_direct(ref, 0, None, None),
            lib.raw.kvc_emulate_kernel(ref, ctypes.byref(launch)),
            lib.raw.kvc_emulate_direct(ref, 1)}


# --------------------------------------------------------------- build / load
def test_builds_with_werror_and_static_cudart(build_info):
    assert build_info.werror, "the kernel must compile cleanly with -Werror all-warnings"
    assert set(build_info.archs) >= {"80", "90"}
    readelf = shutil.which("readelf")
    if readelf:
        needed = subprocess.run([readelf, "-d", str(build_info.path)], capture_output=True,
                                text=True, check=True).stdout
        assert "libcudart" not in needed and "libcuda.so" not in needed, needed


def test_build_is_cached(build_info):
    before = native_build.compile_count
    assert kvc.build().path == build_info.path
    assert native_build.compile_count == before


def test_cli_build_prints_json(build_info, capsys):
    assert kvc.main(["--build"]) == 0
    out = capsys.readouterr().out
    assert '"built": true' in out and str(build_info.path) in out


def test_exported_symbols_and_abi(lib, build_info):
    missing = [s for s in kvc.EXPORTED_SYMBOLS if not hasattr(lib.raw, s)]
    assert not missing
    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(build_info.path)],
                              capture_output=True, text=True, check=True).stdout
        assert all(f" {s}\n" in syms for s in kvc.EXPORTED_SYMBOLS)
    assert lib.raw.kvc_abi_version() == kvc.ABI_VERSION
    assert lib.raw.kvc_cudart_build_version() >= 12000
    assert lib.status_name(Status.MISALIGNED) == "KVC_ERR_MISALIGNED"
    assert lib.status_name(Status.CUDA_BASE + 100) == "cudaErrorNoDevice"


def test_table_and_staging_sizes(lib):
    assert lib.raw.kvc_plane_table_bytes(3) == 3 * 48
    assert lib.raw.kvc_plane_table_bytes(0) == -1
    assert lib.raw.kvc_plane_table_bytes(4097) == -1
    assert lib.ids_bytes(1) == 0 and lib.ids_bytes(kvc.INLINE_PAIRS) == 0  # inline
    assert lib.ids_bytes(kvc.INLINE_PAIRS + 1) == 2 * 272  # src, dst: 16-byte aligned each
    assert lib.ids_bytes(0) == -1
    assert lib.ids_bytes((1 << 22) + 1) == -1


# ----------------------------------------------------------------- validation
def test_valid_task_validates(lib):
    lib.validate(fake_task())
    lib.validate(fake_task(direction=H2D, src_ids=[11, 0], dst_ids=[15, 0]))


BIG = 1 << 62
VALIDATION_CASES = {
    # name: (task overrides, expected status)
    "planes null": (dict(null="planes"), Status.NULL_POINTER),
    "src ids null": (dict(null="src_ids"), Status.NULL_POINTER),
    "dst ids null": (dict(null="dst_ids"), Status.NULL_POINTER),
    "host base null": (dict(host_base=0), Status.NULL_POINTER),
    "plane base null": (dict(planes=[CudaPlane(0, 4096, 4096)], host_offsets=[0]),
                        Status.NULL_POINTER),
    "host base misaligned": (dict(host_base=0x5500_0000_0008), Status.MISALIGNED),
    "host offset misaligned": (dict(host_offsets=[0, 4104, 5104]), Status.MISALIGNED),
    "host block bytes misaligned": (dict(host_block_bytes=5640), Status.MISALIGNED),
    "count 0": (dict(count=0), Status.BAD_COUNT),
    "count negative": (dict(count=-3), Status.BAD_COUNT),
    "count too large": (dict(count=(1 << 22) + 1), Status.BAD_COUNT),
    "src id = num dev blocks": (dict(src_ids=[3, 16, 1]), Status.ID_OUT_OF_RANGE),
    "src id negative": (dict(src_ids=[3, -1, 1]), Status.ID_OUT_OF_RANGE),
    "dst id = num host blocks": (dict(dst_ids=[1, 12, 0]), Status.ID_OUT_OF_RANGE),
    "h2d host id out of range": (dict(direction=H2D, src_ids=[12], dst_ids=[0]),
                                 Status.ID_OUT_OF_RANGE),
    "h2d dev id out of range": (dict(direction=H2D, src_ids=[0], dst_ids=[16]),
                                Status.ID_OUT_OF_RANGE),
    "duplicate destination": (dict(dst_ids=[1, 4, 1]), Status.DUPLICATE_DST),
    "0 planes": (dict(num_planes=0), Status.BAD_PLANE_COUNT),
    "negative planes": (dict(num_planes=-1), Status.BAD_PLANE_COUNT),
    "too many planes": (dict(num_planes=4097), Status.BAD_PLANE_COUNT),
    "plane nbytes 0": (dict(planes=[CudaPlane(FAKE_DEV, 4096, 0)], host_offsets=[0]),
                       Status.BAD_PLANE),
    "stride < nbytes": (dict(planes=[CudaPlane(FAKE_DEV, 2048, 4096)], host_offsets=[0]),
                        Status.BAD_PLANE),
    "plane past host block": (dict(host_offsets=[0, 4096, 5136]), Status.BAD_PLANE),
    "planes overlap on host": (dict(host_offsets=[0, 4080, 5104]), Status.BAD_PLANE),
    "device span overflows": (dict(planes=[CudaPlane(BIG, BIG, 16)], host_offsets=[0]),
                              Status.BAD_PLANE),
    "direction 2": (dict(direction=2), Status.BAD_DIRECTION),
    "direction -1": (dict(direction=-1), Status.BAD_DIRECTION),
    "0 device blocks": (dict(num_dev_blocks=0), Status.BAD_POOL),
    "host blocks negative": (dict(num_host_blocks=-5), Status.BAD_POOL),
    "host block bytes 0": (dict(host_block_bytes=0), Status.BAD_POOL),
    "host span overflows": (dict(host_base=BIG, host_block_bytes=BIG >> 1), Status.BAD_POOL),
    "reserved set": (dict(reserved=1), Status.BAD_ARGUMENT),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_rejected_before_any_cuda_call(lib, case):
    over, expected = VALIDATION_CASES[case]
    rcs = all_rcs(lib, fake_task(**over))
    # Same status everywhere; without a driver a CUDA call would have said cudaError*.
    assert rcs == {int(expected)}, (case, [lib.status_name(r) for r in rcs], lib.last_error())
    assert lib.last_error()


def test_null_task(lib):
    assert all_rcs(lib, None) == {Status.NULL_POINTER}
    assert "task is null" in lib.last_error()


def test_misaligned_id_array(lib):
    task = fake_task()
    buf = np.zeros(8, dtype=np.int32)
    task.src_ids = buf.ctypes.data + 1  # int32 ids at an odd address
    assert all_rcs(lib, task) == {Status.MISALIGNED}


@pytest.mark.parametrize("grid,threads", [(0, 256), (-1, 256), (1025, 256), (4, 0),
                                          (4, 33), (4, 544), (4, 1024)])
def test_bad_grid(lib, grid, threads):
    task = fake_task()
    launch = fake_launch(lib, task, grid=grid, threads=threads)
    assert kernel_rc(lib, task, launch) == Status.BAD_GRID
    assert lib.raw.kvc_emulate_kernel(ctypes.byref(task), ctypes.byref(launch)) == \
        Status.BAD_GRID


def big_fake_task(n: int = kvc.INLINE_PAIRS + 1) -> kvc.KvcTask:
    """A valid task too large for inline ids: it needs the id staging."""
    plane = [CudaPlane(FAKE_DEV, 4096, 4096)]
    return kvc.make_task(plane, [0], list(range(n)), list(range(n)), D2H, n, n,
                         0x5500_0000_0000, 4096)


def test_bad_launch(lib):
    """Every launch field is checked before the first CUDA call (and in the emulation)."""
    task, big = fake_task(), big_fake_task()
    need = lib.ids_bytes(big.count)
    cases = [
        (task, fake_launch(lib, task, table=None), Status.NULL_POINTER, "plane_table is null"),
        (task, fake_launch(lib, task, table=FAKE_WS + 8), Status.MISALIGNED, "plane_table"),
        (big, fake_launch(lib, big, ids=None), Status.NULL_POINTER, "needs ids_host and ids_dev"),
        (big, fake_launch(lib, big, ids=FAKE_WS + 4), Status.MISALIGNED, "16-byte aligned"),
        (big, fake_launch(lib, big, ids_bytes=need - 1), Status.WORKSPACE,
         f"the task needs {need}"),
    ]
    for t, launch, status, text in cases:
        for fn in (lib.raw.kvc_copy_kernel, lib.raw.kvc_emulate_kernel):
            args = (ctypes.byref(t), ctypes.byref(launch))
            rc = fn(*args, None, None) if fn is lib.raw.kvc_copy_kernel else fn(*args)
            assert rc == status, (text, lib.status_name(rc), lib.last_error())
            assert text in lib.last_error()
    assert lib.raw.kvc_copy_kernel(ctypes.byref(task), None, None, None) == Status.NULL_POINTER


def test_launch_quoting_another_table_is_refused(lib):
    task = fake_task()
    other = fake_task(planes=[CudaPlane(FAKE_DEV, 4096, 4096), CudaPlane(FAKE_DEV + (1 << 24),
                                                                          1040, 1000),
                              CudaPlane(FAKE_DEV + (1 << 26), 512, 512)])  # plane 2 moved
    launch = fake_launch(lib, other)
    assert kernel_rc(lib, task, launch) == Status.WORKSPACE
    assert "packed for other planes" in lib.last_error()
    assert lib.raw.kvc_emulate_kernel(ctypes.byref(task), ctypes.byref(launch)) == \
        Status.WORKSPACE


def test_pack_plane_table_layout(lib):
    """The packed table holds each plane and its first chunk (4 KiB chunks)."""
    task = fake_task()
    table, fp = lib.pack_plane_table(task.planes, 3)
    rows = table.view(np.uint64).reshape(3, 6)
    assert rows[:, 0].tolist() == [FAKE_DEV, FAKE_DEV + (1 << 24), FAKE_DEV + (1 << 25)]
    assert rows[:, 2].tolist() == [4096, 1000, 512]
    assert rows[:, 3].tolist() == [0, 4096, 5104]
    assert rows[:, 4].tolist() == [0, 1, 2]  # chunk_begin: one chunk each
    assert table.ctypes.data % 16 == 0 and fp == fake_launch(lib, task).table_fingerprint
    bad = np.zeros(200, dtype=np.uint8)
    assert lib.raw.kvc_pack_plane_table(task.planes, 3, bad.ctypes.data, 100,
                                        ctypes.byref(ctypes.c_uint64())) == Status.WORKSPACE
    assert lib.raw.kvc_pack_plane_table(task.planes, 0, bad.ctypes.data, 200,
                                        ctypes.byref(ctypes.c_uint64())) == Status.BAD_PLANE_COUNT


def test_bad_batch_flag(lib):
    assert lib.raw.kvc_copy_direct(ctypes.byref(fake_task()), 2, None, None) == \
        Status.BAD_ARGUMENT
    assert lib.raw.kvc_emulate_direct(ctypes.byref(fake_task()), -1) == Status.BAD_ARGUMENT


def test_error_text_names_the_id(lib):
    with pytest.raises(kvc.CudaTaskInvalid, match=r"KVC_ERR_ID_OUT_OF_RANGE.*source id 16 "
                       r"at index 1 is outside the device pool \[0, 16\)") as ei:
        lib.validate(fake_task(src_ids=[3, 16, 1]))
    assert isinstance(ei.value, ValueError) and ei.value.status == Status.ID_OUT_OF_RANGE


# ----------------------------------------------------------------- no GPU here
def test_valid_call_without_gpu_is_a_cuda_error(lib, no_gpu):
    task = fake_task()
    for rc in (kernel_rc(lib, task), lib.raw.kvc_copy_direct(ctypes.byref(task), 0, None, None)):
        assert rc > Status.CUDA_BASE, lib.status_name(rc)
        assert lib.status_name(rc).startswith("cudaError")
    with pytest.raises(kvc.CudaCopyError, match="no CUDA device") as ei:
        lib.copy_kernel(task, fake_launch(lib, task))
    assert ei.value.cuda_error is not None and not isinstance(ei.value, ValueError)
    with pytest.raises(kvc.CudaCopyError, match="cudaGetDeviceCount"):
        lib.device_count()


def test_engine_without_gpu_raises_clearly(lib, no_gpu):
    with pytest.raises(kvc.CudaCopyError, match="no CUDA device"):
        kvc.CudaCopyEngine([CudaPlane(FAKE_DEV, 4096, 4096)], 0x5500_0000_0000, [0],
                           host_block_bytes=4096, num_host_blocks=4, num_device_blocks=4, lib=lib)


def test_cuda_ipc_without_gpu_raises_clearly(no_gpu):
    import torch

    from kvcached.memory import cuda_ipc
    t = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="^no CUDA device"):
        cuda_ipc.pin_host_memory(t)
    with pytest.raises(RuntimeError, match="^no CUDA device"):
        cuda_ipc.device_pointer(t.data_ptr())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="^no CUDA device"):
            cuda_ipc.allocate_cuda_planes(KVLayout(1, 1, 8, 4, "bfloat16"), 4)
        with pytest.raises(RuntimeError, match="^no CUDA device"):
            cuda_ipc.export_cuda_planes([t.view(1, -1)])
        with pytest.raises(RuntimeError, match="^no CUDA device"):
            cuda_ipc.open_cuda_planes({"planes": []})


def test_pin_chunks_are_page_aligned():
    from kvcached.memory.cuda_ipc import PAGE, _chunks
    base = 10 * PAGE + 100
    chunks = _chunks(base, 5 * PAGE, 2 * PAGE)
    assert chunks[0][0] == base and sum(n for _, n in chunks) == 5 * PAGE
    for (a, n), (b, _) in zip(chunks, chunks[1:], strict=False):
        assert a + n == b and b % PAGE == 0
    assert _chunks(base, 100, 1 << 30) == [(base, 100)]


# ------------------------------------------------------ the kernel on the CPU
LAYOUTS = {
    "bf16": KVLayout(2, 3, 5, 4, "bfloat16"),
    "fp16": KVLayout(2, 2, 8, 4, "float16"),
    "fp8+scales": KVLayout(2, 3, 5, 4, "float8_e4m3fn"),
    "mla-bf16": KVLayout(3, 1, 12, 4, "bfloat16", mla=True),
    "multi-chunk": KVLayout(1, 5, 129, 8, "float16"),  # 10320-byte planes: 3 chunks + tail
}


def make_planes(layout: KVLayout, num_blocks: int, rng, misalign: int = 0, pad: int = 48):
    """Random uint8 planes [num_blocks, plane_bytes] with padded strides, shifted by
    ``misalign`` bytes (so the kernel must fall back to narrower vectors)."""
    out = []
    for nbytes in layout.plane_bytes:
        stride = nbytes + pad
        raw = rng.integers(0, 256, size=num_blocks * stride + 64, dtype=np.uint8)
        start = (-raw.ctypes.data) % 16 + misalign
        out.append(np.lib.stride_tricks.as_strided(raw[start:], (num_blocks, nbytes),
                                                   (stride, 1)))
    return out


def host_launch(lib, task, grid=4, threads=256) -> kvc.KvcLaunch:
    """A launch over host memory: the packed table and the id staging are host buffers."""
    table, fp = lib.pack_plane_table(task.planes, task.num_planes)
    need = max(lib.ids_bytes(task.count), 16)
    staging, dev = kvc.aligned_bytes(need), kvc.aligned_bytes(need)
    launch = kvc.KvcLaunch(table.ctypes.data, fp, staging.ctypes.data, dev.ctypes.data, need,
                           None, grid, threads)
    launch._keep = (table, staging, dev)
    return launch


def emulate(lib, layout, planes, host, src, dst, direction, path="kernel", grid=4,
            threads=256):
    """Copy on the CPU with the kernel path (packing + the kernel's code), or the
    direct path's plan (runs / batch)."""
    cps = [CudaPlane(p.ctypes.data, p.strides[0], p.shape[1]) for p in planes]
    task = kvc.make_task(cps, layout.host_offsets, src, dst, direction, planes[0].shape[0],
                         host.shape[0], host.ctypes.data, host.shape[1])
    if path == "kernel":
        lib.emulate(task, host_launch(lib, task, grid, threads))
    else:
        lib.emulate_direct(task, use_batch=path == "batch")


def run_ids(rng, n_src: int, n_dst: int, lengths=(3, 1, 2)) -> tuple[list, list]:
    """Pairs made of runs consecutive on both sides (what the direct path merges),
    in random, non-adjacent windows of 4 blocks."""
    src_w = rng.permutation(n_src // 4)[:len(lengths)]
    dst_w = rng.permutation(n_dst // 4)[:len(lengths)]
    src, dst = [], []
    for n, a, b in zip(lengths, src_w, dst_w, strict=True):
        src += [4 * int(a) + k for k in range(n)]
        dst += [4 * int(b) + k for k in range(n)]
    return src, dst


def host_pool(layout: KVLayout, n: int, rng) -> np.ndarray:
    # 16-byte aligned base, as the real (page-aligned) pool.
    raw = rng.integers(0, 256, size=n * layout.block_bytes + 16, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16
    return raw[start:start + n * layout.block_bytes].reshape(n, layout.block_bytes)


@pytest.mark.parametrize("path", ["kernel", "direct", "batch"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("misalign", [0, 1, 2, 4, 8])
def test_emulated_copy_matches_indexed_copy(lib, name, misalign, path):
    layout, rng = LAYOUTS[name], np.random.default_rng(misalign)
    planes = make_planes(layout, NUM_DEV, rng, misalign)
    host = host_pool(layout, NUM_HOST, rng)
    offs, nbs = layout.host_offsets, layout.plane_bytes
    src, dst = run_ids(rng, NUM_DEV, NUM_HOST)

    expect = host.copy()  # swap_out reference: plain indexed copy of the same bytes
    for s, d in zip(src, dst, strict=True):
        for p, o, n in zip(planes, offs, nbs, strict=True):
            expect[d, o:o + n] = p[s]
    emulate(lib, layout, planes, host, src, dst, D2H, path)
    np.testing.assert_array_equal(host, expect)  # padding and other blocks untouched

    before = [p.copy() for p in planes]  # swap_in into other device blocks
    back, _ = run_ids(rng, NUM_DEV, NUM_HOST)
    emulate(lib, layout, planes, host, dst, back, H2D, path, grid=3, threads=96)
    for i, (p, b) in enumerate(zip(planes, before, strict=True)):
        exp = b.copy()
        exp[back] = b[src]
        np.testing.assert_array_equal(p, exp, err_msg=f"plane {i}")


@pytest.mark.parametrize("path", ["direct", "batch"])
def test_emulated_direct_merges_contiguous_runs(lib, path):
    # One plane, no padding anywhere: a run is one contiguous span on both sides.
    layout, rng = KVLayout(1, 1, 8, 4, "bfloat16", mla=True), np.random.default_rng(5)
    planes = make_planes(layout, NUM_DEV, rng, pad=0)
    host = host_pool(layout, NUM_HOST, rng)
    src, dst = [5, 6, 7, 8, 0, 2], [1, 2, 3, 4, 9, 11]
    emulate(lib, layout, planes, host, src, dst, D2H, path)
    np.testing.assert_array_equal(host[dst], planes[0][src])


def test_emulated_kernel_one_big_block_tiny_grid(lib):
    layout, rng = KVLayout(1, 8, 128, 256, "bfloat16", mla=True), np.random.default_rng(7)
    planes = make_planes(layout, 2, rng, pad=0)  # one 512 KiB plane: 128 chunks
    host = host_pool(layout, 2, rng)
    emulate(lib, layout, planes, host, [1], [0], D2H, grid=1, threads=32)
    np.testing.assert_array_equal(host[0, :layout.plane_bytes[0]], planes[0][1])


def test_emulated_kernel_staged_ids_match_inline_ids(lib):
    """A task above KVC_INLINE_PAIRS takes the staged-id path; both give the indexed copy."""
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(13)
    n = kvc.INLINE_PAIRS * 2 + 3
    planes = make_planes(layout, n + 9, rng)
    for count in (kvc.INLINE_PAIRS, kvc.INLINE_PAIRS + 1, n):
        host = host_pool(layout, n + 4, rng)
        src = rng.permutation(n + 9)[:count].tolist()
        dst = rng.permutation(n + 4)[:count].tolist()
        expect = host.copy()
        for sb, db in zip(src, dst, strict=True):
            for p, o, nb in zip(planes, layout.host_offsets, layout.plane_bytes, strict=True):
                expect[db, o:o + nb] = p[sb]
        emulate(lib, layout, planes, host, src, dst, D2H, grid=2, threads=64)
        np.testing.assert_array_equal(host, expect, err_msg=f"count {count}")


# ------------------------------------------------ the compiled kernel itself
@pytest.fixture(scope="session")
def ptxas_report(build_info) -> dict[str, str]:
    """``nvcc -Xptxas -v`` output per arch, with the library's own flags."""
    out = {}
    for arch in build_info.archs:
        flags = [f for f in kvc.nvcc_flags([arch], werror=False) if f != "-shared"]
        res = subprocess.run([build_info.nvcc, *flags, "-Xptxas", "-v", "-c", str(kvc.SOURCE),
                              "-o", "/dev/null"], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        out[arch] = res.stdout + res.stderr
    return out


def test_kernel_fits_registers_without_spills(ptxas_report):
    """<= 128 registers (two blocks of 256 threads per SM at least), no spills, no stack:
    the inline ids are read in place (__grid_constant__), never copied to local memory."""
    for arch, text in ptxas_report.items():
        m = re.search(r"Compiling entry function '(\w*kv_copy_kernel\w*)' for 'sm_\d+'"
                      r"(.*?)Used (\d+) registers", text, re.S)
        assert m, f"sm_{arch}: no kv_copy_kernel in ptxas output:\n{text[-2000:]}"
        block = m.group(2)
        assert int(m.group(3)) <= 128, f"sm_{arch}: {m.group(3)} registers"
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in block, \
            f"sm_{arch}: {block}"


def test_ptx_streams_16_byte_vectors(build_info, tmp_path):
    """Device memory and pinned host memory are read and written with 16-byte
    evict-first accesses (ld.global.cs.v4 / st.global.cs.v4 or wider)."""
    arch = max(build_info.archs, key=int)
    ptx = tmp_path / "kv_copy.ptx"
    flags = ["-O3", "-std=c++17", f"-arch=compute_{arch}", "-ptx"]
    subprocess.run([build_info.nvcc, *flags, str(kvc.SOURCE), "-o", str(ptx)], check=True,
                   capture_output=True, timeout=600)
    text = ptx.read_text()
    loads = re.findall(r"ld\.global\.cs\.v(\d)\.(?:u|b|s)(\d+)", text)
    stores = re.findall(r"st\.global\.cs\.v(\d)\.(?:u|b|s)(\d+)", text)
    assert any(int(v) * int(b) >= 128 for v, b in loads), "no 16-byte streaming load"
    assert any(int(v) * int(b) >= 128 for v, b in stores), "no 16-byte streaming store"
    assert "ld.local" not in text and "st.local" not in text


# ------------------------------------------------ the engine's Python glue
class EmulatedLib(kvc.KvcLib):
    """The real library over a fake CUDA runtime: device and pinned allocations are
    host buffers, copies are memmoves, streams and events are handles whose use is
    logged. CudaCopyEngine runs its real logic (lanes, the one table upload, id
    staging, the launch struct, errors) and every kernel launch goes through the
    library's own packing and kernel code (kvc_emulate_kernel).

    ``fail[name]``: statuses that the next calls of runtime method ``name`` fail
    with (a sticky CUDA error, say), one per call."""

    def __init__(self, path):
        super().__init__(path)
        self.mallocs: list[int] = []
        self.host_allocs: list[int] = []
        self.buffers: dict[int, np.ndarray] = {}  # live device / pinned allocations
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.log: list[tuple] = []
        self.fail: dict[str, list[int]] = {}
        self._ids = itertools.count(0x5000)

    def _maybe_fail(self, name: str) -> None:
        if self.fail.get(name):
            self.check(self.fail[name].pop(0), f"kvc_{name}")

    def _alloc(self, nbytes: int) -> int:
        buf = kvc.aligned_bytes(nbytes, 256)
        self.buffers[buf.ctypes.data] = buf
        return buf.ctypes.data

    def set_device(self, device):
        self._maybe_fail("set_device")

    def host_device_pointer(self, host_ptr):
        return host_ptr  # UVA: the device address of pinned memory is its host address

    def stream_create(self):
        h = next(self._ids)
        self.streams.add(h)
        return h

    def stream_destroy(self, stream):
        self.streams.remove(stream)

    def stream_synchronize(self, stream=0):
        self._maybe_fail("stream_synchronize")
        self.log.append(("stream_sync", stream))

    def event_create(self, interprocess=False):
        h = next(self._ids)
        self.events.add(h)
        return h

    def event_destroy(self, event):
        self.events.remove(event)

    def event_record(self, event, stream=0):
        self.log.append(("record", event, stream))

    def event_synchronize(self, event):
        self._maybe_fail("event_synchronize")
        self.log.append(("event_sync", event))

    def malloc(self, nbytes):
        self._maybe_fail("malloc")
        self.mallocs.append(nbytes)
        return self._alloc(nbytes)

    def host_alloc(self, nbytes):
        self.host_allocs.append(nbytes)
        return self._alloc(nbytes)

    def free(self, ptr):
        del self.buffers[ptr]

    host_free = free

    def memcpy_async(self, dst, src, nbytes, stream=0):
        self.log.append(("memcpy", dst, nbytes, stream))
        ctypes.memmove(dst, src, nbytes)

    def copy_kernel(self, task, launch, stream=0, wait_event=0):
        self._maybe_fail("copy_kernel")
        assert launch.plane_table in self.buffers, "the table lives in a device allocation"
        self.emulate(task, launch)  # raises (and logs nothing) for a rejected task
        self.log.append(("kernel", stream, wait_event, task.count))

    def copy_direct(self, task, use_batch=False, stream=0, wait_event=0):
        self._maybe_fail("copy_direct")
        self.emulate_direct(task, use_batch)
        self.log.append(("batch" if use_batch else "direct", stream, wait_event, task.count))


def emulated_engine(emu, planes, host, layout, **kw) -> kvc.CudaCopyEngine:
    return kvc.CudaCopyEngine(
        [CudaPlane(p.ctypes.data, p.strides[0], p.shape[1]) for p in planes], host.ctypes.data,
        layout.host_offsets, host_block_bytes=host.shape[1], num_host_blocks=host.shape[0],
        num_device_blocks=planes[0].shape[0], lib=emu, **kw)


def assert_swapped_out(planes, host, layout, src, dst) -> None:
    for p, o, n in zip(planes, layout.host_offsets, layout.plane_bytes, strict=True):
        np.testing.assert_array_equal(host[dst, o:o + n], p[src])


@pytest.mark.parametrize("mode", ["kernel", "direct", "batch", ("batch", "kernel")])
def test_engine_round_trip_emulated(build_info, mode):
    layout, rng = LAYOUTS["fp8+scales"], np.random.default_rng(11)
    n_dev, n_host = 3 * kvc.INLINE_PAIRS, 2 * kvc.INLINE_PAIRS
    planes = make_planes(layout, n_dev, rng)
    host = host_pool(layout, n_host, rng)
    emu = EmulatedLib(build_info.path)
    engine = emulated_engine(emu, planes, host, layout, mode=mode)
    with engine:
        assert engine.swap_out([], []) == 0
        src, dst = [4, 9, 0], [11, 2, 5]
        assert engine.swap_out(src, dst) == 3 * sum(layout.plane_bytes)
        assert_swapped_out(planes, host, layout, src, dst)
        assert engine.swap_in(dst, [1, 2, 3]) == 3 * sum(layout.plane_bytes)
        for p in planes:
            np.testing.assert_array_equal(p[[1, 2, 3]], p[src])
        with pytest.raises(kvc.CudaTaskInvalid, match=f"destination id {n_host}"):
            engine.swap_out([0], [n_host])
        with pytest.raises(ValueError, match="lengths must match"):
            engine.swap_in([0, 1], [2])
        with pytest.raises(ValueError, match="int32"):
            engine.swap_out([1 << 40], [0])
        # A large task (staged ids on the kernel path), both directions.
        big_src = rng.permutation(n_dev)[:n_host - 3].tolist()
        big_dst = rng.permutation(n_host)[:n_host - 3].tolist()
        engine.swap_out(big_src, big_dst)
        assert_swapped_out(planes, host, layout, big_src, big_dst)
        back = rng.permutation(n_dev)[:n_host - 3].tolist()
        engine.swap_in(big_dst, back)
        for p, o, n in zip(planes, layout.host_offsets, layout.plane_bytes, strict=True):
            np.testing.assert_array_equal(p[back], host[big_dst, o:o + n])
        kernel_lanes = [m for m in engine.modes.values() if m == "kernel"]
        assert len(emu.mallocs) == 1 + len(kernel_lanes)  # the table; a staging per lane
        assert len(emu.host_allocs) == len(kernel_lanes)
        launched = [e[0] for e in emu.log if e[0] in ("kernel", "direct", "batch")]
        want = engine.modes
        assert launched == [want[kvc.D2H], want[kvc.H2D], want[kvc.D2H], want[kvc.H2D]]
    assert not emu.buffers and not emu.streams and not emu.events  # close frees all
    with pytest.raises(RuntimeError, match="closed"):
        engine.swap_out([0], [0])


def test_engine_uploads_the_plane_table_once_and_stages_only_large_tasks(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(2)
    n = 9000  # > 8192 pairs: more than the first 64 KiB of staging holds
    planes = make_planes(layout, n, rng)
    host = host_pool(layout, n, rng)
    emu = EmulatedLib(build_info.path)
    with emulated_engine(emu, planes, host, layout) as engine:
        table_bytes = emu.raw.kvc_plane_table_bytes(len(planes))
        assert [e for e in emu.log if e[0] == "memcpy"] == [
            ("memcpy", engine._dev_table, table_bytes, engine.stream_of(kvc.D2H))]
        for _ in range(3):
            engine.swap_out([1, 2], [3, 4])
        assert emu.host_allocs == []  # small tasks: ids inline, no staging at all
        for count in (kvc.INLINE_PAIRS + 1, 200, 120):
            ids = rng.permutation(n)[:count].tolist()
            engine.swap_out(ids, ids[::-1])
            assert_swapped_out(planes, host, layout, ids, ids[::-1])
        assert emu.host_allocs == [kvc.MIN_STAGING]  # allocated once, then reused
        ids = rng.permutation(n).tolist()
        engine.swap_out(ids, ids[::-1])
        assert_swapped_out(planes, host, layout, ids, ids[::-1])
        assert emu.host_allocs == [kvc.MIN_STAGING, 2 * kvc.MIN_STAGING]  # doubled
        assert sum(e[0] == "memcpy" for e in emu.log) == 1  # the table, never again


def test_each_direction_has_its_stream_and_completes_on_its_event(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(3)
    planes = make_planes(layout, 16, rng)
    host = host_pool(layout, 16, rng)
    emu = EmulatedLib(build_info.path)
    with emulated_engine(emu, planes, host, layout) as engine:
        out_s, in_s = engine.stream_of(kvc.D2H), engine.stream_of(kvc.H2D)
        assert out_s != in_s and {out_s, in_s} <= emu.streams
        emu.log.clear()
        engine.swap_out([1], [2], wait_event=0x77)
        engine.swap_in([2], [5], wait_event=0x88)
        kernels = [e for e in emu.log if e[0] == "kernel"]
        assert kernels == [("kernel", out_s, 0x77, 1), ("kernel", in_s, 0x88, 1)]
        d2h_done, h2d_done = (engine._lanes[d].done for d in (kvc.D2H, kvc.H2D))
        assert d2h_done != h2d_done
        assert ("record", d2h_done, out_s) in emu.log and ("record", h2d_done, in_s) in emu.log
        assert ("event_sync", d2h_done) in emu.log and ("event_sync", h2d_done) in emu.log
        assert not any(e[0] == "stream_sync" for e in emu.log)  # never a whole stream
        emu.log.clear()
        engine.swap_in([2], [6], sync=False)
        assert not any(e[0] in ("event_sync", "stream_sync") for e in emu.log)
        engine.synchronize()
        assert {e[1] for e in emu.log if e[0] == "stream_sync"} == {out_s, in_s}


def test_sticky_error_breaks_the_engine_and_close_still_frees_everything(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(4)
    planes = make_planes(layout, 16, rng)
    host = host_pool(layout, 16, rng)
    snapshot = host.copy()
    emu = EmulatedLib(build_info.path)
    engine = emulated_engine(emu, planes, host, layout, mode="direct")
    engine.swap_out([1], [2], sync=False)  # ok so far
    host[:] = snapshot
    illegal_address = Status.CUDA_BASE + 700
    emu.fail["event_synchronize"] = [illegal_address]
    with pytest.raises(kvc.CudaContextBroken, match="cudaErrorIllegalAddress") as ei:
        engine.swap_out([3], [4])
    assert ei.value.fatal and engine.broken is ei.value
    n = len(emu.log)
    with pytest.raises(kvc.CudaContextBroken, match="broke earlier"):
        engine.swap_in([4], [5])
    with pytest.raises(kvc.CudaContextBroken):
        engine.synchronize()
    assert len(emu.log) == n  # refused without a CUDA call
    emu.fail["stream_synchronize"] = [illegal_address] * 4
    engine.close()  # never raises after a sticky error ...
    assert not emu.buffers and not emu.streams and not emu.events  # ... and frees all


def test_non_sticky_cuda_error_fails_one_task_only(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(5)
    planes = make_planes(layout, 16, rng)
    host = host_pool(layout, 16, rng)
    emu = EmulatedLib(build_info.path)
    with emulated_engine(emu, planes, host, layout) as engine:
        emu.fail["copy_kernel"] = [Status.CUDA_BASE + 1]  # cudaErrorInvalidValue
        with pytest.raises(kvc.CudaCopyError, match="cudaErrorInvalidValue") as ei:
            engine.swap_out([1], [2])
        assert not isinstance(ei.value, kvc.CudaContextBroken) and engine.broken is None
        engine.swap_out([1], [2])
        assert_swapped_out(planes, host, layout, [1], [2])


def test_close_frees_everything_then_raises_the_first_failure(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(6)
    planes = make_planes(layout, 200, rng)
    host = host_pool(layout, 200, rng)
    emu = EmulatedLib(build_info.path)
    engine = emulated_engine(emu, planes, host, layout)
    engine.swap_in(list(range(100)), list(range(100)))  # staging on the h2d lane
    emu.fail["stream_synchronize"] = [Status.CUDA_BASE + 1]
    with pytest.raises(kvc.CudaCopyError, match="cudaErrorInvalidValue"):
        engine.close()
    assert not emu.buffers and not emu.streams and not emu.events
    engine.close()  # idempotent


def test_failed_construction_frees_what_it_made(build_info):
    layout, rng = LAYOUTS["bf16"], np.random.default_rng(7)
    planes = make_planes(layout, 8, rng)
    host = host_pool(layout, 8, rng)
    emu = EmulatedLib(build_info.path)
    emu.fail["malloc"] = [Status.CUDA_BASE + 2]  # cudaErrorMemoryAllocation: the table
    with pytest.raises(kvc.CudaCopyError, match="cudaErrorMemoryAllocation"):
        emulated_engine(emu, planes, host, layout)
    assert not emu.buffers and not emu.streams and not emu.events


def test_sticky_status_classification(lib):
    sticky = [700, 702, 710, 714, 715, 716, 717, 718, 719, 214]
    for err in sticky:
        assert lib.is_sticky(Status.CUDA_BASE + err), err
    for status in [0, Status.MISALIGNED, Status.ID_OUT_OF_RANGE, Status.CUDA_BASE + 1,
                   Status.CUDA_BASE + 2, Status.CUDA_BASE + 100, Status.CUDA_BASE + 35]:
        assert not lib.is_sticky(status), status
    with pytest.raises(kvc.CudaContextBroken):
        lib.check(Status.CUDA_BASE + 719, "x")
    with pytest.raises(kvc.CudaCopyError) as ei:
        lib.check(Status.CUDA_BASE + 2, "x")
    assert type(ei.value) is kvc.CudaCopyError


# ------------------------------------------------------- a hybrid model's pages
@pytest.mark.parametrize("mode", ["kernel", "direct", "batch"])
def test_hybrid_pages_round_trip_emulated(build_info, mode):
    """A hybrid model's KV cache as vLLM lays it (``hybrid_pages``: sliding-window,
    full-attention and Mamba groups over two regions of one buffer, 544-token
    pages) through the engine, emulated, against the CPU oracle: every group's
    block, Mamba states included, comes back whole. gpu_check.sh's ``hybrid``
    step runs the same on a GPU (test_cuda_gpu.py)."""
    import torch
    pages = hp.HybridPages.random(hp.NUM_BLOCKS, "cpu")
    layout = pages.layout()
    host = torch.from_numpy(host_pool(layout, hp.NUM_HOST, np.random.default_rng(4)))
    emu = EmulatedLib(build_info.path)
    with kvc.CudaCopyEngine([kvc.plane_from_tensor(p) for p in pages.planes], host.data_ptr(),
                            layout.host_offsets, host_block_bytes=layout.block_bytes,
                            num_host_blocks=hp.NUM_HOST, num_device_blocks=hp.NUM_BLOCKS,
                            lib=emu, mode=mode) as engine:
        hp.check_round_trip(pages, host, hp.OWNERS, hp.HOST_IDS, hp.BACK,
                            lambda s, h, b: (engine.swap_out(s, h), engine.swap_in(h, b)))


# ------------------------------------------- offsets above 4 GiB (sparse files)
def sparse_array(path, nbytes: int) -> np.ndarray:
    """A zero-filled uint8 array over a sparse file: only the pages written take space.
    (The mapping is released when the array goes.)"""
    with open(path, "wb") as f:
        f.truncate(nbytes)
    with open(path, "r+b") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), nbytes), dtype=np.uint8)


@pytest.mark.parametrize("mode", ["kernel", "direct", "batch"])
def test_offsets_above_4_gib(build_info, tmp_path, mode):
    """Device and host blocks past 4 GiB (64-bit offsets everywhere), through the
    engine: the last ids of 5 GiB planes and a 5.6 GiB host pool, in tasks with
    inline and with staged ids, both directions."""
    kib = 1 << 10
    n_dev, n_host = 81_920, 60_000
    p0, p1 = 64 * kib, 32 * kib  # plane 0: 5 GiB, then plane 1 (at 5 GiB): 2.5 GiB
    dev = sparse_array(tmp_path / "dev", n_dev * (p0 + p1))
    host = sparse_array(tmp_path / "host", n_host * (p0 + p1))
    base = dev.ctypes.data
    planes = [CudaPlane(base, p0, p0), CudaPlane(base + n_dev * p0, p1, p1)]
    spans = [(0, p0, p0), (n_dev * p0, p1, p1)]  # (offset in dev, stride, bytes) per plane
    emu = EmulatedLib(build_info.path)
    rng = np.random.default_rng(9)
    with kvc.CudaCopyEngine(planes, host.ctypes.data, [0, p0], host_block_bytes=p0 + p1,
                            num_host_blocks=n_host, num_device_blocks=n_dev, lib=emu,
                            mode=mode) as engine:
        for count in (3, kvc.INLINE_PAIRS + 5):
            src = (n_dev - 1 - 7 * np.arange(count)).tolist()  # the pools' last blocks
            dst = (n_host - 1 - 3 * np.arange(count)).tolist()
            back = (n_dev - 2 - 7 * np.arange(count)).tolist()  # none of src
            assert src[-1] * p0 > 1 << 32 and dst[-1] * (p0 + p1) > 1 << 32
            for s in src:
                for off, stride, nb in spans:
                    dev[off + s * stride:off + s * stride + nb] = rng.integers(
                        0, 256, nb, dtype=np.uint8)
            engine.swap_out(src, dst)
            engine.swap_in(dst, back)
            for s, d, b in zip(src, dst, back, strict=True):
                h = d * (p0 + p1)
                for (off, stride, nb), hoff in zip(spans, (0, p0), strict=True):
                    want = dev[off + s * stride:off + s * stride + nb]
                    assert np.array_equal(host[h + hoff:h + hoff + nb], want), (s, d)
                    assert np.array_equal(dev[off + b * stride:off + b * stride + nb], want)


def test_engine_rejects_bad_arguments(build_info):
    emu = EmulatedLib(build_info.path)
    plane = [CudaPlane(FAKE_DEV, 4096, 4096)]
    kw = dict(host_block_bytes=4096, num_host_blocks=4, num_device_blocks=4, lib=emu)
    with pytest.raises(ValueError, match="mode"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], mode="magic", **kw)
    with pytest.raises(ValueError, match="h2d mode"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], mode=("kernel", "dma"), **kw)
    with pytest.raises(ValueError, match="grid"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], grid_blocks=0, **kw)
    with pytest.raises(ValueError, match="host offsets"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0, 16], **kw)
    with pytest.raises(ValueError, match="num_device_blocks"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], lib=emu, host_block_bytes=4096,
                           num_host_blocks=4)
    assert kvc.resolve_modes("direct", use_batch=True) == {kvc.D2H: "batch", kvc.H2D: "batch"}


def test_device_helpers_without_gpu_raise_clearly(lib, no_gpu):
    for call in (lambda: lib.device_uuid(0), lambda: lib.device_pci_bus_id(0),
                 lambda: lib.get_device()):
        with pytest.raises(kvc.CudaCopyError, match="no CUDA device|cudaError"):
            call()
