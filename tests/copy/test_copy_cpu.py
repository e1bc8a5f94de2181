"""CpuCopyEngine (kvcached/copy/native/cpu_copy.c, built at install) against the
reference copy (tests/reference/cpu_copy.py: torch slicing, block by block)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference.cpu_copy import ReferenceCpuCopy, block_bytes

from kvcached import native_build
from kvcached.copy import _cpu_copy, cpu
from kvcached.copy.cpu import CpuCopyEngine
from kvcached.layout import TORCH_DTYPES, KVLayout
from kvcached.native_build import BuildError, CompilerNotFound, build_shared_library

# Odd head counts / head dims so planes are not multiples of 16 bytes and the
# host pool has padding between planes that must stay untouched.
LAYOUTS = {
    "bf16": KVLayout(2, 3, 5, 4, "bfloat16"),
    "fp16": KVLayout(2, 2, 8, 4, "float16"),
    "fp32": KVLayout(2, 3, 5, 4, "float32"),
    "fp8+scales": KVLayout(2, 3, 5, 4, "float8_e4m3fn"),
    "mla-bf16": KVLayout(3, 1, 12, 4, "bfloat16", mla=True),
    "mla-fp8": KVLayout(2, 1, 7, 4, "float8_e4m3fn", mla=True),
}
BIG = KVLayout(4, 4, 64, 16, "float32")  # the default layout: 8 planes of 16 KiB


# ------------------------------------------------------------------ helpers
def make_planes(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes in every plane (any bit pattern is fine: we compare bytes)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in layout.planes:
        raw = torch.randint(0, 256, (num_blocks, spec.block_bytes), dtype=torch.uint8, generator=g)
        out.append(raw.view(TORCH_DTYPES[spec.dtype]).view(num_blocks, *spec.shape))
    return out


def make_host(layout: KVLayout, num_blocks: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, layout.block_bytes), dtype=torch.uint8, generator=g)


def expected_host(host: torch.Tensor, planes, offsets, dev_ids, host_ids) -> torch.Tensor:
    """The host pool after the reference swaps ``dev_ids`` out to ``host_ids``."""
    out = host.clone()
    ReferenceCpuCopy(planes, out, offsets).swap_out(dev_ids, host_ids)
    return out


def snapshot(planes) -> list[torch.Tensor]:
    return [p.clone() for p in planes]


def assert_planes_equal(a, b) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"plane {i} differs"


def engine(planes, host, layout, threads=1) -> CpuCopyEngine:
    return CpuCopyEngine(planes, host, layout.host_offsets, threads=threads)


def pick_ids(rng, pattern: str, num_dev: int, num_host: int, n: int):
    if pattern == "consecutive":  # runs on both sides, broken in the middle
        return [2, 3, 4, 7, 8][:n], [0, 1, 2, 3, 9][:n]
    return (rng.choice(num_dev, n, replace=False).tolist(),
            rng.choice(num_host, n, replace=False).tolist())


# ------------------------------------------------------------- round trips
@pytest.mark.parametrize("pattern", ["random", "consecutive"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_is_byte_exact(name, pattern):
    layout, rng = LAYOUTS[name], np.random.default_rng(7)
    planes, host = make_planes(layout, 12), make_host(layout, 16)
    originals = snapshot(planes)
    dev_ids, host_ids = pick_ids(rng, pattern, 12, 16, 5)
    eng = engine(planes, host, layout)

    want = expected_host(host, planes, layout.host_offsets, dev_ids, host_ids)
    moved = eng.swap_out(dev_ids, host_ids)
    assert moved == 5 * sum(layout.plane_bytes)
    assert torch.equal(host, want)  # copied slots and untouched padding/other blocks
    assert_planes_equal(planes, originals)

    # Back into different device blocks, in another order.
    free = [b for b in range(12) if b not in dev_ids]
    targets = rng.choice(free, 5, replace=False).tolist()
    order = rng.permutation(5)
    assert eng.swap_in([host_ids[i] for i in order], [targets[i] for i in order]) == moved
    for i in range(5):
        for p, orig in zip(planes, originals, strict=True):
            assert torch.equal(block_bytes(p, targets[i]), block_bytes(orig, dev_ids[i]))
    untouched = [b for b in range(12) if b not in targets]
    for p, orig in zip(planes, originals, strict=True):
        assert torch.equal(p[untouched].view(torch.uint8), orig[untouched].view(torch.uint8))


def test_padded_block_stride_and_sliced_planes():
    """vLLM-style [2, num_blocks, ...] planes and blocks with a gap between them."""
    layout = LAYOUTS["fp16"]
    shape = layout.planes[0].shape
    kv = torch.randn(2, 6, *shape).half()
    gapped = torch.randn(6, 2, *shape).half()[:, 1]  # stride(0) is two blocks
    planes = [kv[0], kv[1], gapped, gapped.clone()]
    host = make_host(layout, 4)
    originals = snapshot(planes)
    eng = engine(planes, host, layout)
    want = expected_host(host, planes, layout.host_offsets, [5, 0], [3, 1])
    eng.swap_out([5, 0], [3, 1])
    assert torch.equal(host, want)
    eng.swap_in([3, 1], [2, 4])
    for p, orig in zip(planes, originals, strict=True):
        assert torch.equal(block_bytes(p, 2), block_bytes(orig, 5))
        assert torch.equal(block_bytes(p, 4), block_bytes(orig, 0))
    for b in (0, 1, 3, 5):
        assert torch.equal(block_bytes(kv[0], b), block_bytes(originals[0], b))


def test_empty_task_moves_nothing():
    layout = LAYOUTS["fp32"]
    planes, host = make_planes(layout, 3), make_host(layout, 3)
    before = host.clone()
    eng = engine(planes, host, layout)
    assert eng.swap_out([], []) == 0 and eng.swap_in([], []) == 0
    assert torch.equal(host, before)


@pytest.mark.parametrize("n", [cpu.SMALL_IDS, 33])  # the short-list path and the numpy path
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_bytes(threads, n):
    planes, rng = make_planes(BIG, 40), np.random.default_rng(3)
    dev_ids, host_ids = pick_ids(rng, "random", 40, 40, n)  # 2-4 MiB: the C side splits it
    hosts = []
    for t in (1, threads):
        host = torch.zeros(40, BIG.block_bytes, dtype=torch.uint8)
        engine(planes, host, BIG, threads=t).swap_out(dev_ids, host_ids)
        hosts.append(host)
    assert torch.equal(hosts[0], hosts[1])
    back = [torch.zeros_like(p) for p in planes]
    engine(back, hosts[1], BIG, threads=threads).swap_in(host_ids, dev_ids)
    for p, b in zip(planes, back, strict=True):
        assert torch.equal(p[dev_ids].view(torch.uint8), b[dev_ids].view(torch.uint8))


# ---------------------------------------------------------------- bad input
BAD_CASES = {
    "negative device": ([1, -1], [0, 1], "device block id -1 at index 1"),
    "device too large": ([1, 6], [0, 1], "device block id 6 at index 1 .*0\\.\\.5"),
    "negative host": ([1, 2], [-3, 1], "host block id -3 at index 0"),
    "host too large": ([1, 2], [0, 4], "host block id 4 at index 1 .*0\\.\\.3"),
    "length mismatch": ([1, 2, 3], [0, 1], "3 device ids but 2 host ids"),
    "duplicate destination": ([1, 2], [2, 2], "destination twice"),
    "not integers": ([1.5], [0], "must be integers"),
}


def assert_refused_untouched(direction: str, dev: list, hst: list, msg: str) -> None:
    """A copy with bad ids raises ``msg`` and leaves every plane and host byte as it was.
    ``dev``/``hst`` are the device and host ids of a swap_out; a swap_in takes them
    the other way round (``hst`` are its sources)."""
    layout = LAYOUTS["fp8+scales"]
    planes, host = make_planes(layout, 6), make_host(layout, 4)
    planes_before, host_before = snapshot(planes), host.clone()
    eng = engine(planes, host, layout)
    with pytest.raises(ValueError, match=msg):
        if direction == "swap_out":
            eng.swap_out(dev, hst)
        else:
            eng.swap_in(hst, dev)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)


@pytest.mark.parametrize("direction", ["swap_out", "swap_in"])
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_ids_raise_and_touch_nothing(case, direction):
    dev, hst, msg = BAD_CASES[case]
    if case == "duplicate destination" and direction == "swap_in":
        dev, hst, msg = [3, 3], [0, 1], "device block id 3 is a destination twice"
    assert_refused_untouched(direction, dev, hst, msg)


# Ids the short-list path must not hand to ctypes, which would wrap 2**64 + 1
# to 1 or take True as 1: they go to the general path and fail there.
SHORT_BAD_CASES = {
    "wraps in int64": ([2**64 + 1], [0], "must be integers"),
    "past int64": ([2**63], [0], "does not fit in int64"),
    "bool": ([True], [0], "must be integers"),
    "float": ([0], [1.0], "must be integers"),
    "too large, last of 16": (list(range(5, -1, -1)) * 2 + [0, 1, 2, 6],
                              list(range(4)) * 4, "device block id 6 at index 15"),
    "duplicate, last of 16": ([0] * 16, [0, 1, 2, 3] * 3 + [0, 1, 2, 0],
                              "destination twice"),
}


@pytest.mark.parametrize("direction", ["swap_out", "swap_in"])
@pytest.mark.parametrize("case", list(SHORT_BAD_CASES))
def test_short_list_bad_ids_raise_and_touch_nothing(case, direction):
    dev, hst, msg = SHORT_BAD_CASES[case]
    if direction == "swap_in" and case.startswith("duplicate"):
        dev, hst = hst, dev  # the duplicate case names the device side: swap the roles
    assert_refused_untouched(direction, dev, hst, msg)


def test_short_lists_skip_the_general_path(monkeypatch):
    """Up to SMALL_IDS plain ints go straight to C; longer lists, tuples and numpy
    ids take the general (numpy) checks. Both copy the same bytes."""
    layout, n = LAYOUTS["bf16"], cpu.SMALL_IDS
    planes, host = make_planes(layout, n + 1), make_host(layout, n + 1)
    eng = engine(planes, host, layout)
    general = []
    check_ids = eng._check_ids
    monkeypatch.setattr(eng, "_check_ids", lambda d, h: general.append(len(d)) or check_ids(d, h))
    for ids, took_general in [([3], False), (list(range(n)), False), (list(range(n + 1)), True),
                              ((3,), True), (np.array([3]), True), ([np.int64(3)], True)]:
        general.clear()
        rev = list(ids)[::-1]
        want = expected_host(host, planes, layout.host_offsets, list(ids), rev)
        assert eng.swap_out(ids, rev) == len(rev) * eng.bytes_per_block
        assert torch.equal(host, want)
        assert bool(general) == took_general, ids


def test_threads_share_an_engine():
    """Threads calling one engine at once: each has its own id buffers (the C call
    runs without the GIL), so no thread's ids leak into another's copy."""
    workers, per, rounds = 4, cpu.SMALL_IDS, 30
    planes = make_planes(BIG, 2 * workers * per)  # worker w: sources, then targets
    host = torch.zeros(workers * per, BIG.block_bytes, dtype=torch.uint8)
    originals = snapshot(planes)
    eng = engine(planes, host, BIG)
    start, errors = threading.Barrier(workers), []

    def work(w: int) -> None:
        rng = np.random.default_rng(w)
        src0, dst0, host0 = 2 * w * per, (2 * w + 1) * per, w * per
        start.wait()
        for _ in range(rounds):
            k = int(rng.integers(1, per + 1))
            picks = rng.choice(per, k, replace=False).tolist()
            host_ids = [host0 + i for i in picks]
            host[host0:host0 + per] = 0
            eng.swap_out([src0 + i for i in picks], host_ids)
            want = expected_host(host, originals, BIG.host_offsets,
                                 [src0 + i for i in picks], host_ids)
            if not torch.equal(host[host0:host0 + per], want[host0:host0 + per]):
                errors.append(f"worker {w}: swap_out of {picks} wrote wrong host blocks")
            for p in planes:
                p[dst0:dst0 + per] = 0
            eng.swap_in(host_ids, [dst0 + i for i in picks])
            for p, orig in zip(planes, originals, strict=True):
                if not all(torch.equal(block_bytes(p, dst0 + i), block_bytes(orig, src0 + i))
                           for i in picks):
                    errors.append(f"worker {w}: swap_in of {picks} wrote wrong device blocks")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_bad_planes_and_pool_are_rejected():
    layout = LAYOUTS["fp32"]
    planes, host = make_planes(layout, 4), make_host(layout, 2)
    with pytest.raises(ValueError, match="contiguous from dim 1"):
        CpuCopyEngine([planes[0].transpose(1, 2)] + planes[1:], host, layout.host_offsets)
    with pytest.raises(ValueError, match="same number of blocks"):
        CpuCopyEngine([planes[0][:3]] + planes[1:], host, layout.host_offsets)
    with pytest.raises(ValueError, match="uint8"):
        CpuCopyEngine(planes, host.float(), layout.host_offsets)
    with pytest.raises(ValueError, match="outside the host block"):
        CpuCopyEngine(planes, host[:, :-16].contiguous(), layout.host_offsets)
    with pytest.raises(ValueError, match="contiguous CPU uint8"):
        CpuCopyEngine(planes, host[:, :-16], layout.host_offsets)
    with pytest.raises(ValueError, match="host offsets"):
        CpuCopyEngine(planes, host, layout.host_offsets[:-1])


# ------------------------------------------------------------ native library
def raw_call(eng: CpuCopyEngine, dev, host, direction=cpu.TO_HOST, offsets=None):
    """kvc_cpu_copy with the engine's tables, bypassing every Python check."""
    dev, host = np.asarray(dev, dtype=np.int64), np.asarray(host, dtype=np.int64)
    offs = eng._offsets if offsets is None else np.asarray(offsets, dtype=np.int64)
    err = ctypes.c_int64(123)
    rc = eng._lib.kvc_cpu_copy(
        eng._ptrs.ctypes.data, eng._strides.ctypes.data, eng._nbytes.ctypes.data,
        offs.ctypes.data, len(eng.planes), eng.num_device_blocks, eng.host_pool.data_ptr(),
        eng.host_block_bytes, eng.num_host_blocks, dev.ctypes.data, host.ctypes.data,
        dev.size, direction, 1, ctypes.addressof(err))
    return rc, err.value


def native_case():
    """An engine over 6 device and 4 host blocks, with snapshots of both sides
    (to prove a refused call touched nothing)."""
    layout = LAYOUTS["fp8+scales"]
    planes, host = make_planes(layout, 6), make_host(layout, 4)
    return layout, planes, host, snapshot(planes), host.clone(), \
        engine(planes, host, layout)


def test_native_library_rejects_bad_ids_itself():
    layout, planes, host, planes_before, host_before, eng = native_case()
    bad_offsets = list(layout.host_offsets[:-1]) + [layout.block_bytes - 1]
    cases = [  # (device ids, host ids, direction, offsets) -> (code, index)
        (([0, 1, 6], [0, 1, 2], cpu.TO_HOST, None), (cpu.ERR_DEVICE_ID, 2)),
        (([0, -1], [0, 1], cpu.TO_DEVICE, None), (cpu.ERR_DEVICE_ID, 1)),
        (([0, 1], [-5, 1], cpu.TO_HOST, None), (cpu.ERR_HOST_ID, 0)),
        (([0, 1], [0, 4], cpu.TO_DEVICE, None), (cpu.ERR_HOST_ID, 1)),
        (([0], [0], 7, None), (-6, -1)),
        (([0], [0], cpu.TO_HOST, bad_offsets), (-3, len(bad_offsets) - 1)),
    ]
    for args, want in cases:
        assert raw_call(eng, *args) == want, args
        assert eng._lib.kvc_cpu_copy_strerror(want[0]) != b"unknown error code"
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)
    assert raw_call(eng, [2], [3]) == (0, -1)  # the same tables work for a good task
    with pytest.raises(ValueError, match="device block id 9 at index 0"):
        eng._copy_native(np.array([9]), np.array([0]), cpu.TO_HOST)


def test_native_engine_entry_rejects_bad_input_itself():
    """kvc_cpu_engine_copy (the entry the engine calls) checks like kvc_cpu_copy."""
    _, planes, host, planes_before, host_before, eng = native_case()
    no_threads = cpu._CpuEngine.from_buffer_copy(eng._engine)
    no_threads.num_threads = 0

    def call(dev, hst, direction=cpu.TO_HOST, table=eng._engine_ref):
        dev, hst = np.asarray(dev, dtype=np.int64), np.asarray(hst, dtype=np.int64)
        err = ctypes.c_int64(123)
        rc = eng._copy_fn(table, ctypes.c_void_p(dev.ctypes.data),
                          ctypes.c_void_p(hst.ctypes.data), ctypes.c_int64(dev.size),
                          ctypes.c_int64(direction), ctypes.byref(err))
        return rc, err.value

    assert call([0, 1, 6], [0, 1, 2]) == (cpu.ERR_DEVICE_ID, 2)
    assert call([0, -1], [0, 1], cpu.TO_DEVICE) == (cpu.ERR_DEVICE_ID, 1)
    assert call([0, 1], [0, 4], cpu.TO_DEVICE) == (cpu.ERR_HOST_ID, 1)
    assert call([0], [0], 7) == (-6, -1)
    assert call([0], [0], table=None) == (-1, -1)  # NULL engine
    assert call([0], [0], table=ctypes.byref(no_threads)) == (-2, -1)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)
    assert call([2], [3]) == (0, -1)


def test_native_call_releases_the_gil():
    # ctypes drops the GIL around calls through CDLL, never through PyDLL.
    assert isinstance(cpu.LIB, ctypes.CDLL) and not isinstance(cpu.LIB, ctypes.PyDLL)


def test_the_library_is_the_extension_built_at_install():
    """cpu_copy.c is compiled by setup.py into kvcached.copy._cpu_copy, next to
    cpu.py: nothing is compiled at run time, and there is no other copy path."""
    built = Path(_cpu_copy.__file__)
    assert built.parent == Path(cpu.__file__).parent
    assert Path(cpu.LIB._name) == built
    layout = LAYOUTS["fp16"]
    eng = engine(make_planes(layout, 2), make_host(layout, 2), layout)
    assert eng._copy_fn is cpu.LIB.kvc_cpu_engine_copy


# ------------------------------------------------- against the reference copy
@st.composite
def tasks(draw):
    """A layout, a thread count and a task: distinct destinations, ids in range,
    runs of consecutive ids likely (they are what pools hand out)."""
    name = draw(st.sampled_from(list(LAYOUTS)))
    num_dev, num_host = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    n = draw(st.integers(0, min(num_dev, num_host)))
    if draw(st.booleans()):  # runs
        d0, h0 = draw(st.integers(0, num_dev - n)), draw(st.integers(0, num_host - n))
        dev, host = list(range(d0, d0 + n)), list(range(h0, h0 + n))
    else:
        dev = draw(st.permutations(range(num_dev)))[:n]
        host = draw(st.permutations(range(num_host)))[:n]
    ids_as = draw(st.sampled_from(["list", "tuple", "numpy"]))
    return name, num_dev, num_host, dev, host, ids_as, draw(st.integers(1, 4))


@settings(max_examples=200, deadline=None)
@given(task=tasks(), seed=st.integers(0, 1 << 16))
def test_same_bytes_as_the_reference(task, seed):
    """Both directions, every layout, short and long id lists (the short-list
    path and the numpy path), any thread count: byte for byte what the
    reference does, on both sides, padding included."""
    name, num_dev, num_host, dev, host_ids, ids_as, threads = task
    layout = LAYOUTS[name]
    planes, host = make_planes(layout, num_dev, seed), make_host(layout, num_host, seed + 1)
    ref_planes, ref_host = snapshot(planes), host.clone()
    eng, ref = engine(planes, host, layout, threads), ReferenceCpuCopy(ref_planes, ref_host,
                                                                       layout.host_offsets)
    as_ids = {"list": list, "tuple": tuple, "numpy": np.array}[ids_as]
    assert eng.swap_out(as_ids(dev), as_ids(host_ids)) == ref.swap_out(dev, host_ids)
    assert torch.equal(host, ref_host)
    assert_planes_equal(planes, ref_planes)
    # Back in over scribbled planes, each block to another's place (reversed).
    targets = dev[::-1]
    for p, q in zip(planes, ref_planes, strict=True):
        p.view(torch.uint8).fill_(seed % 251)
        q.view(torch.uint8).fill_(seed % 251)
    assert eng.swap_in(as_ids(host_ids), as_ids(targets)) == ref.swap_in(host_ids, targets)
    assert_planes_equal(planes, ref_planes)
    assert torch.equal(host, ref_host)


def test_the_reference_is_what_slicing_says():
    """The oracle itself, on one hand-checked pair: plane p of device block 2
    lands at host block 1, offset host_offsets[p]; nothing else moves."""
    layout = LAYOUTS["fp8+scales"]
    planes, host = make_planes(layout, 3), torch.zeros(2, layout.block_bytes, dtype=torch.uint8)
    ReferenceCpuCopy(planes, host, layout.host_offsets).swap_out([2], [1])
    want = torch.zeros_like(host)
    for p, off in zip(planes, layout.host_offsets, strict=True):
        raw = p[2].contiguous().view(torch.uint8).flatten()
        want[1, off:off + raw.numel()] = raw
    assert torch.equal(host, want) and int(host[0].sum()) == 0


# ------------------------------------------------------------------- build
# native_build is the CUDA library's lazy builder; a C compiler stands in for nvcc.
C_FLAGS = ("-O3", "-shared", "-fPIC", "-Wall", "-Werror")


def c_compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def test_lazy_build_is_cached(tmp_path, monkeypatch):
    cc = c_compiler()
    monkeypatch.setenv("KVCACHED_CACHE_DIR", str(tmp_path / "cache"))
    src, hdr = tmp_path / "lib.c", tmp_path / "lib.h"
    hdr.write_text("#define ANSWER 42\n")
    src.write_text('#include "lib.h"\nint kvc_answer(void) { return ANSWER; }\n')
    count = native_build.compile_count
    first = build_shared_library("answer", [src], cc, C_FLAGS, headers=[hdr])
    assert native_build.compile_count == count + 1
    mtime = first.stat().st_mtime_ns
    assert build_shared_library("answer", [src], cc, C_FLAGS, headers=[hdr]) == first  # cached
    assert native_build.compile_count == count + 1 and first.stat().st_mtime_ns == mtime
    assert ctypes.CDLL(str(first)).kvc_answer() == 42
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]

    src.write_text('#include "lib.h"\nint kvc_answer(void) { return ANSWER + 1; }\n')
    second = build_shared_library("answer", [src], cc, C_FLAGS, headers=[hdr])  # new source
    assert second != first and ctypes.CDLL(str(second)).kvc_answer() == 43
    hdr.write_text("#define ANSWER 50\n")  # an edited header rebuilds too
    third = build_shared_library("answer", [src], cc, C_FLAGS, headers=[hdr])
    assert third not in (first, second) and ctypes.CDLL(str(third)).kvc_answer() == 51


def test_build_errors_are_clear(tmp_path, monkeypatch):
    cc = c_compiler()
    monkeypatch.setenv("KVCACHED_CACHE_DIR", str(tmp_path))
    src = tmp_path / "broken.c"
    src.write_text("int broken(void) { return }\n")
    with pytest.raises(BuildError, match="broken.c"):
        build_shared_library("broken", [src], cc, C_FLAGS)
    assert not list(tmp_path.glob("broken-*.so")) and not list(tmp_path.glob(".*tmp"))
    with pytest.raises(CompilerNotFound, match="no-such-compiler-kvc"):
        build_shared_library("broken", [src], "no-such-compiler-kvc", C_FLAGS)
    with pytest.raises(ValueError, match="empty command"):
        build_shared_library("broken", [src], [], C_FLAGS)
    with pytest.raises(FileNotFoundError, match="missing.h"):
        build_shared_library("broken", [src], cc, C_FLAGS, headers=[tmp_path / "missing.h"])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CompilerNotFound):
        build_shared_library("broken", [src], os.path.basename(cc), C_FLAGS)
    assert os.environ["PATH"].endswith("empty")
