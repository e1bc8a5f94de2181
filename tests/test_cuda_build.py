"""The CUDA copy library without a GPU: it compiles, loads, validates, emulates.

Compiled once per session (and cached on disk by native_build). Validation
cases prove that checks run before any CUDA call: on a machine without a
driver, a rejected task comes back with its validation status, never with a
CUDA error. The kernel's own per-thread code runs on the CPU through
``kvc_emulate_kernel`` and is compared with a plain indexed copy.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from kvcached.copy import cuda as kvc
from kvcached.copy import native_build
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


def kernel_rc(lib, task, ws=FAKE_WS, ws_bytes=1 << 20, grid=4, threads=256) -> int:
    return lib.raw.kvc_copy_kernel(ctypes.byref(task) if task is not None else None, ws,
                                   ws_bytes, grid, threads, None, None)


def all_rcs(lib, task) -> set[int]:
    """The status of the same task through every entry point that validates it."""
    ref = ctypes.byref(task) if task is not None else None
    return {lib.raw.kvc_validate_task(ref), kernel_rc(lib, task),
            lib.raw.kvc_copy_direct(ref, 0, None, None),
            lib.raw.kvc_emulate_kernel(ref, 4, 256), lib.raw.kvc_emulate_direct(ref, 1)}


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


def test_workspace_bytes(lib):
    assert lib.workspace_bytes(3, 5) == 3 * 48 + 2 * 32
    assert lib.workspace_bytes(0, 5) == -1
    assert lib.workspace_bytes(3, 0) == -1


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
    assert kernel_rc(lib, fake_task(), grid=grid, threads=threads) == Status.BAD_GRID
    assert lib.raw.kvc_emulate_kernel(ctypes.byref(fake_task()), grid, threads) == Status.BAD_GRID


def test_bad_workspace(lib):
    task = fake_task()
    need = lib.workspace_bytes(3, 3)
    assert kernel_rc(lib, task, ws=None) == Status.NULL_POINTER
    assert kernel_rc(lib, task, ws=FAKE_WS + 8) == Status.MISALIGNED
    assert kernel_rc(lib, task, ws_bytes=need - 1) == Status.WORKSPACE
    assert f"the task needs {need}" in lib.last_error()


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
        lib.copy_kernel(task, FAKE_WS, 1 << 20, 4, 256)
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


def emulate(lib, layout, planes, host, src, dst, direction, path="kernel", grid=4,
            threads=256):
    """Copy on the CPU with the kernel's code, or the direct path's plan (runs / batch)."""
    cps = [CudaPlane(p.ctypes.data, p.strides[0], p.shape[1]) for p in planes]
    task = kvc.make_task(cps, layout.host_offsets, src, dst, direction, planes[0].shape[0],
                         host.shape[0], host.ctypes.data, host.shape[1])
    if path == "kernel":
        lib.emulate(task, grid, threads)
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


# ------------------------------------------------ the engine's Python glue
class EmulatedLib(kvc.KvcLib):
    """The real library, with CUDA runtime calls stubbed and copies run on the CPU:
    CudaCopyEngine's own logic (ids, workspace, modes, errors) end to end, no GPU."""

    def __init__(self, path):
        super().__init__(path)
        self.mallocs: list[int] = []

    def set_device(self, device):
        pass

    def host_device_pointer(self, host_ptr):
        return host_ptr  # UVA: the device address of pinned memory is its host address

    def stream_create(self):
        return 0x5000

    def stream_destroy(self, stream):
        pass

    def stream_synchronize(self, stream=0):
        pass

    def malloc(self, nbytes):
        self.mallocs.append(nbytes)
        return FAKE_WS  # never dereferenced: emulate() reads the host tables

    def free(self, ptr):
        pass

    def copy_kernel(self, task, workspace, workspace_bytes, grid_blocks, block_threads,
                    stream=0, wait_event=0):
        assert workspace and workspace_bytes >= self.workspace_bytes(task.num_planes, task.count)
        self.emulate(task, grid_blocks, block_threads)

    def copy_direct(self, task, use_batch=False, stream=0, wait_event=0):
        self.emulate_direct(task, use_batch)


@pytest.mark.parametrize("mode,batch", [("kernel", False), ("direct", False), ("direct", True)])
def test_engine_round_trip_emulated(build_info, mode, batch):
    layout, rng = LAYOUTS["fp8+scales"], np.random.default_rng(11)
    planes = make_planes(layout, NUM_DEV, rng)
    host = host_pool(layout, NUM_HOST, rng)
    emu = EmulatedLib(build_info.path)
    engine = kvc.CudaCopyEngine(
        [CudaPlane(p.ctypes.data, p.strides[0], p.shape[1]) for p in planes], host.ctypes.data,
        layout.host_offsets, host_block_bytes=host.shape[1], num_host_blocks=NUM_HOST,
        num_device_blocks=NUM_DEV, mode=mode, use_batch=batch, lib=emu)
    with engine:
        assert engine.swap_out([], []) == 0
        src, dst = [4, 9, 0], [11, 2, 5]
        assert engine.swap_out(src, dst) == 3 * sum(layout.plane_bytes)
        for p, o, n in zip(planes, layout.host_offsets, layout.plane_bytes, strict=True):
            np.testing.assert_array_equal(host[dst, o:o + n], p[src])
        assert engine.swap_in(dst, [1, 2, 3]) == 3 * sum(layout.plane_bytes)
        for p in planes:
            np.testing.assert_array_equal(p[[1, 2, 3]], p[src])
        with pytest.raises(kvc.CudaTaskInvalid, match="destination id 12"):
            engine.swap_out([0], [12])
        with pytest.raises(ValueError, match="lengths must match"):
            engine.swap_in([0, 1], [2])
        with pytest.raises(ValueError, match="int32"):
            engine.swap_out([1 << 40], [0])
        if mode == "kernel":  # workspace grows by doubling, not once per call
            engine.swap_out(list(range(NUM_HOST)), list(range(NUM_HOST)))
            assert len(emu.mallocs) == 1
    with pytest.raises(RuntimeError, match="closed"):
        engine.swap_out([0], [0])


def test_engine_rejects_bad_arguments(build_info):
    emu = EmulatedLib(build_info.path)
    plane = [CudaPlane(FAKE_DEV, 4096, 4096)]
    kw = dict(host_block_bytes=4096, num_host_blocks=4, num_device_blocks=4, lib=emu)
    with pytest.raises(ValueError, match="mode"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], mode="magic", **kw)
    with pytest.raises(ValueError, match="grid"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], grid_blocks=0, **kw)
    with pytest.raises(ValueError, match="host offsets"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0, 16], **kw)
    with pytest.raises(ValueError, match="num_device_blocks"):
        kvc.CudaCopyEngine(plane, 0x5500_0000_0000, [0], lib=emu, host_block_bytes=4096,
                           num_host_blocks=4)
