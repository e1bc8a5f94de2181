"""CpuCopyEngine (the extension kvcached.copy._cpu_copy, kvcached/native/copy/,
built at install) against the reference copy (tests/reference/cpu_copy.py:
torch slicing, block by block), and the extension's own checks."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import threading
import time
import weakref
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


# Up to 32 destinations are checked for duplicates pairwise, more with a bitmap.
@pytest.mark.parametrize("n", [16, 33])
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


# Planes of 7 x 67 x 9 bf16 = 8,442 bytes, not a multiple of 16 or 64: an odd
# device block starts off a 16-byte boundary, so a plane streamed into it
# starts with a head copied up to the boundary, and every plane ends with a tail.
STREAMED = KVLayout(2, 7, 67, 9, "bfloat16")


@pytest.mark.parametrize("threads", [1, 2])
def test_copies_past_the_stream_size_are_byte_exact(threads):
    """A call moving STREAM_MIN_BYTES or more writes with streaming stores: the
    reference's bytes both ways, padding and other blocks untouched. One block
    fewer stays under the size (plain memcpy) and gives the same bytes."""
    per_block = sum(STREAMED.plane_bytes)
    assert all(b % 16 for b in STREAMED.plane_bytes)
    n = -(-_cpu_copy.STREAM_MIN_BYTES // per_block)  # the fewest blocks that stream
    assert (n - 1) * per_block < _cpu_copy.STREAM_MIN_BYTES <= n * per_block
    pool = n + 6
    planes, host = make_planes(STREAMED, pool, seed=5), make_host(STREAMED, pool, seed=6)
    originals = snapshot(planes)
    rng = np.random.default_rng(11)
    for count in (n, n - 1):
        dev_ids = rng.choice(pool, count, replace=False).tolist()
        host_ids = rng.choice(pool, count, replace=False).tolist()
        eng = engine(planes, host, STREAMED, threads=threads)
        want = expected_host(host, planes, STREAMED.host_offsets, dev_ids, host_ids)
        assert eng.swap_out(dev_ids, host_ids) == count * per_block
        assert torch.equal(host, want)

        back = [torch.zeros_like(p) for p in planes]
        ref = [torch.zeros_like(p) for p in planes]
        order = rng.permutation(pool)[:count].tolist()  # other device blocks, another order
        engine(back, host, STREAMED, threads=threads).swap_in(host_ids, order)
        ReferenceCpuCopy(ref, host.clone(), STREAMED.host_offsets).swap_in(host_ids, order)
        assert_planes_equal(back, ref)
    assert_planes_equal(planes, originals)  # a swap out reads its planes only


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


# Lists and tuples are read by the extension itself: every item must be an int
# (or have __index__, as numpy's integers do), not a bool, and fit in int64.
LIST_BAD_CASES = {
    "past uint64": ([2**64 + 1], [0], "device block id 18446744073709551617 at index 0 does "
                                      "not fit in int64"),
    "past int64": ([2**63], [0], "does not fit in int64"),
    "bool": ([True], [0], "device ids must be integers, got bool at index 0"),
    "float": ([0], [1.0], "host ids must be integers, got float at index 0"),
    "numpy float": ([0, np.float64(1)], [0, 1], "device ids must be integers, got "
                                                "numpy.float64 at index 1"),
    "None": ([0], [None], "host ids must be integers, got NoneType at index 0"),
    "nested": ([[0]], [0], "device ids must be integers, got list at index 0"),
    "too large, last of 16": (list(range(5, -1, -1)) * 2 + [0, 1, 2, 6],
                              list(range(4)) * 4, "device block id 6 at index 15"),
    "duplicate of 16 (pairwise)": ([0] * 16, [0, 1, 2, 3] * 4,
                                   "block id 0 is a destination twice \\(indices 0 and 4\\)"),
    "duplicate of 40 (bitmap)": ([0] * 40, [0, 1, 2, 3, 3] + [0] * 35,
                                 "block id 3 is a destination twice \\(indices 3 and 4\\)"),
    "length mismatch, 70 (heap)": ([0] * 70, [0] * 69, "70 device ids but 69 host ids"),
}


@pytest.mark.parametrize("as_tuple", [False, True])
@pytest.mark.parametrize("direction", ["swap_out", "swap_in"])
@pytest.mark.parametrize("case", list(LIST_BAD_CASES))
def test_list_bad_ids_raise_and_touch_nothing(case, direction, as_tuple):
    dev, hst, msg = LIST_BAD_CASES[case]
    if direction == "swap_in" and case.startswith("duplicate"):
        dev, hst = hst, dev  # the duplicate case names the destination side: swap the roles
    if as_tuple:
        dev, hst = tuple(dev), tuple(hst)
    assert_refused_untouched(direction, dev, hst, msg)


def test_lists_and_tuples_go_straight_to_the_extension(monkeypatch):
    """Lists and tuples of any length, numpy integers among their items or not,
    go to the extension as they are; any other sequence (numpy arrays of any
    int dtype, ranges) becomes an int64 array first. All copy the same bytes."""
    layout, n = LAYOUTS["bf16"], 70  # more than the extension's stack buffer (64)
    planes, host = make_planes(layout, n + 1), make_host(layout, n + 1)
    eng = engine(planes, host, layout)
    converted = []
    as_ids = cpu._as_ids
    monkeypatch.setattr(cpu, "_as_ids", lambda ids, side: converted.append(side)
                        or as_ids(ids, side))
    for ids, took_numpy in [([3], False), ((3,), False), (list(range(n)), False),
                            ([np.int64(3), np.int32(4)], False), (np.array([3]), True),
                            (np.array([3, 5], dtype=np.int32), True),
                            (np.arange(8)[::2], True), (range(3), True)]:
        converted.clear()
        rev = list(ids)[::-1]
        want = expected_host(host, planes, layout.host_offsets, [int(i) for i in ids],
                             [int(i) for i in rev])
        assert eng.swap_out(ids, rev) == len(rev) * eng.bytes_per_block
        assert torch.equal(host, want)
        assert bool(converted) == took_numpy, ids


def test_threads_share_an_engine():
    """Threads calling one engine at once (the copy runs without the GIL): no
    thread's ids leak into another's copy."""
    workers, per, rounds = 4, 16, 30
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


# ------------------------------------------------------------ the extension
def native_case():
    """An engine over 6 device and 4 host blocks, with snapshots of both sides
    (to prove a refused call touched nothing)."""
    layout = LAYOUTS["fp8+scales"]
    planes, host = make_planes(layout, 6), make_host(layout, 4)
    return layout, planes, host, snapshot(planes), host.clone(), \
        engine(planes, host, layout)


def native_engine(eng: CpuCopyEngine, offsets=None, threads=1) -> _cpu_copy.Engine:
    """An extension Engine over ``eng``'s memory, with nothing checked in Python."""
    return _cpu_copy.Engine([p.data_ptr() for p in eng.planes], eng.stride_bytes,
                            eng.plane_bytes, eng.host_offsets if offsets is None else offsets,
                            eng.num_device_blocks, eng.host_pool.data_ptr(),
                            eng.host_block_bytes, eng.num_host_blocks, threads,
                            keep=(eng.planes, eng.host_pool))


def test_the_c_copy_rejects_bad_input_itself():
    """kvc_cpu_engine_copy (what Engine.copy and the transfer fast path call)
    checks every id, the direction and the plane geometry on its own: called
    without the extension's checks, it refuses and touches nothing."""
    layout, planes, host, planes_before, host_before, eng = native_case()
    bad_offsets = list(layout.host_offsets[:-1]) + [layout.block_bytes - 1]
    raw = eng._native.unchecked_copy
    cases = [  # (device ids, host ids, direction, engine) -> (code, index)
        (([0, 1, 6], [0, 1, 2], cpu.TO_HOST, None), (_cpu_copy.ERR_DEVICE_ID, 2)),
        (([0, -1], [0, 1], cpu.TO_DEVICE, None), (_cpu_copy.ERR_DEVICE_ID, 1)),
        (([0, 1], [-5, 1], cpu.TO_HOST, None), (_cpu_copy.ERR_HOST_ID, 0)),
        ((np.array([0, 1]), np.array([0, 4]), cpu.TO_DEVICE, None), (_cpu_copy.ERR_HOST_ID, 1)),
        (([0], [0], 7, None), (_cpu_copy.ERR_DIRECTION, -1)),
        (([0], [0], cpu.TO_HOST, bad_offsets), (_cpu_copy.ERR_PLANE, len(bad_offsets) - 1)),
    ]
    for (dev, hst, direction, offsets), want in cases:
        call = raw if offsets is None else native_engine(eng, offsets).unchecked_copy
        assert call(dev, hst, direction) == want, (dev, hst, direction)
        assert _cpu_copy.strerror(want[0]) != "unknown error code"
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)
    assert _cpu_copy.strerror(12345) == "unknown error code"
    assert raw([2], [3], cpu.TO_HOST) == (_cpu_copy.OK, -1)  # the same engine, a good task
    assert torch.equal(block_bytes(host, 3), expected_host(
        host_before, planes, layout.host_offsets, [2], [3])[3])


def test_a_refusal_of_the_c_copy_is_a_value_error():
    """An engine whose geometry only the C copy checks (the Engine type leaves it
    to kvc_cpu_copy) fails every copy with the C side's words, touching nothing."""
    layout, planes, host, planes_before, host_before, eng = native_case()
    bad = native_engine(eng, list(layout.host_offsets[:-1]) + [layout.block_bytes - 1])
    with pytest.raises(ValueError, match=r"native CPU copy rejected the task \(code -3: a "
                       rf"plane's bytes.*\) at index {len(layout.plane_bytes) - 1}"):
        bad.copy([0], [0], cpu.TO_HOST)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)


def test_the_extension_words_bad_ids_itself():
    """Engine.copy checks and words every error CpuCopyEngine raises for ids,
    for lists and int64 buffers alike, with no Python check before it."""
    _, planes, host, planes_before, host_before, eng = native_case()
    copy = eng._native.copy
    for dev, hst, direction, msg in [
        (np.array([9]), np.array([0]), cpu.TO_HOST, "device block id 9 at index 0 is out of "
         "range: allowed 0..5 \\(6 device blocks\\)"),
        ([0, 1], np.array([1, 4]), cpu.TO_DEVICE, "host block id 4 at index 1 .*0\\.\\.3"),
        (np.array([0, 1, 2]), [0, 1], cpu.TO_HOST, "3 device ids but 2 host ids"),
        (np.array([0, 1]), np.array([2, 2]), cpu.TO_HOST, "host block id 2 is a destination "
         "twice"),
        (np.array([3, 3]), np.array([0, 1]), cpu.TO_DEVICE, "device block id 3 is a "
         "destination twice"),
        ([0], [0], 2, "direction must be 0 \\(device to host\\) or 1 \\(host to device\\), "
         "got 2"),
    ]:
        with pytest.raises(ValueError, match=msg):
            copy(dev, hst, direction)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)
    assert copy(np.array([], dtype=np.int64), [], cpu.TO_HOST) == 0


@pytest.mark.parametrize("ids, error, msg", [
    (np.array([1], dtype=np.int32), ValueError, "device ids must be int64, got a buffer of "
     "format 'i'"),
    (np.array([1], dtype=np.uint64), ValueError, "must be int64, got a buffer of format 'L'"),
    (np.array([1.0]), ValueError, "must be int64, got a buffer of format 'd'"),
    (np.zeros((1, 1), dtype=np.int64), ValueError, "must be one-dimensional, got 2 dimensions"),
    (np.arange(4)[::2], ValueError, "must be a C-contiguous int64 buffer"),
    (b"\x00" * 8, ValueError, "must be int64, got a buffer of format 'B'"),
    ({1}, TypeError, "device ids must be a list or tuple of ints or an int64 buffer, got set"),
    (range(1), TypeError, "got range"),
])
def test_the_extension_refuses_other_id_containers(ids, error, msg):
    """The extension reads lists, tuples and one-dimensional contiguous int64
    buffers only (CpuCopyEngine converts anything else first)."""
    _, planes, host, planes_before, host_before, eng = native_case()
    with pytest.raises(error, match=msg):
        eng._native.copy(ids, [0], cpu.TO_HOST)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)


def test_a_list_changed_while_read_is_refused():
    """An item's __index__ runs Python code, which may shrink the list being
    read: the read stops there instead of reading past its end."""
    _, planes, host, planes_before, host_before, eng = native_case()
    ids = [0, 1, 2]

    class Shrinks:
        def __index__(self):
            del ids[1:]
            return 0

    ids[0] = Shrinks()
    with pytest.raises(ValueError, match="device ids changed size while being read"):
        eng._native.copy(ids, [0, 1, 2], cpu.TO_HOST)
    assert torch.equal(host, host_before)
    assert_planes_equal(planes, planes_before)


def test_the_engine_type_checks_its_tables():
    _, _, _, _, _, eng = native_case()
    n = len(eng.planes)
    with pytest.raises(ValueError, match="threads must be 1"):
        native_engine(eng, threads=0)
    with pytest.raises(ValueError, match=f"host_offsets has {n - 1} entries for {n} planes"):
        native_engine(eng, offsets=eng.host_offsets[:-1])
    with pytest.raises(ValueError, match="an engine needs 1"):
        _cpu_copy.Engine([], [], [], [], 1, 1, 1, 1)
    with pytest.raises(ValueError, match="host address non-zero"):
        _cpu_copy.Engine([1] * n, [1] * n, [1] * n, [0] * n, 1, 0, 1, 1)
    with pytest.raises(TypeError, match="sequences of ints"):
        _cpu_copy.Engine([1] * n, 5, [1] * n, [0] * n, 1, 1, 1, 1)
    native = native_engine(eng, threads=3)
    assert (native.num_device_blocks, native.num_host_blocks, native.num_planes,
            native.threads, native.bytes_per_block) == (6, 4, n, 3, eng.bytes_per_block)


def test_the_engine_keeps_the_memory_it_copies_alive():
    """The extension's Engine holds the tensors it has addresses into, so it
    stays safe to call after every other reference is gone, and lets them go
    when it goes."""
    layout = LAYOUTS["fp16"]
    planes, host = make_planes(layout, 2), make_host(layout, 2)
    want = expected_host(host, planes, layout.host_offsets, [1], [0])
    native = engine(planes, host, layout)._native  # the CpuCopyEngine is gone
    alive = [weakref.ref(t) for t in (*planes, host)]
    host_bytes = np.frombuffer(host.numpy(), dtype=np.uint8)  # numpy's view of the bytes
    del planes, host
    gc.collect()
    assert all(r() is not None for r in alive)
    assert native.copy([1], [0], cpu.TO_HOST) == native.bytes_per_block
    assert np.array_equal(host_bytes, want.numpy().ravel())
    del native
    gc.collect()
    assert all(r() is None for r in alive)


def test_the_copy_releases_the_gil():
    """While one thread copies, another keeps running Python. Were the GIL held
    for a copy, the other thread would stall for the whole of it: every copy
    would hold a pause in the other thread at least as long as a copy alone
    takes. One copy without a pause half that long proves the GIL released
    (one, not all, and up to three tries: on a busy machine the scheduler
    pauses threads too)."""
    # 128 planes of 32 bytes: a copy of 2M small pieces (64 MiB) takes tens of
    # ms, well above the pauses a busy machine's scheduler makes.
    num, planes = 16384, [torch.zeros(16384, 32, dtype=torch.uint8) for _ in range(128)]
    host = torch.zeros(num, 128 * 32, dtype=torch.uint8)
    eng = CpuCopyEngine(planes, host, [32 * p for p in range(128)])
    ids = np.random.default_rng(0).permutation(num).tolist()
    for _ in range(3):
        one_copy = min(timed(lambda: eng.swap_out(ids, ids)) for _ in range(3))
        longest = pauses_during_copies(lambda: eng.swap_out(ids, ids), copies=5)
        if min(longest) < one_copy / 2:
            return
    pytest.fail(f"a pause as long as a copy in every copy: one copy {one_copy:.4f} s, "
                f"longest pauses {longest}")


def pauses_during_copies(copy, copies: int) -> list[float]:
    """The longest pause of this thread's Python loop during each of ``copies``
    copies run by another thread."""
    spans, stop = [], threading.Event()

    def copier():
        for _ in range(copies):
            t0 = time.perf_counter()
            copy()
            spans.append((t0, time.perf_counter()))
        stop.set()

    notes = []
    t = threading.Thread(target=copier)
    t.start()
    while not stop.is_set():
        notes.append(time.perf_counter())
    t.join()
    return [float(np.diff([a, *(x for x in notes if a < x < b), b]).max()) for a, b in spans]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_the_extension_is_built_at_install():
    """kvcached/native/copy/ is compiled by setup.py into kvcached.copy._cpu_copy,
    next to cpu.py: nothing is compiled at run time, and there is no other copy path."""
    assert Path(_cpu_copy.__file__).parent == Path(cpu.__file__).parent
    layout = LAYOUTS["fp16"]
    eng = engine(make_planes(layout, 2), make_host(layout, 2), layout)
    assert type(eng._native) is _cpu_copy.Engine


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
