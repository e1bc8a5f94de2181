"""CpuCopyEngine: move KV blocks between device planes and the host pool on the CPU.

The device side is a list of planes (one tensor per layer K/V/scale, dim 0 =
block, each block one contiguous run of bytes); the host side is the
block-major pool ``[num_cpu_blocks, block_bytes]`` with plane p of a block at
``host_offsets[p]`` (see ``kvcached.layout``).

The copy is ``kvcached/copy/native/cpu_copy.c``: memcpy per block-plane,
optionally split over pthreads, about memcpy speed. It is compiled at install
into the extension ``kvcached.copy._cpu_copy`` (setup.py) and called through
ctypes, which releases the GIL for the call, so a worker's other threads keep
running while blocks move.

Every id is checked before any byte moves: a bad id raises ValueError naming
it, and neither side is touched. The C library checks again on its own.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

from kvcached.copy import _cpu_copy  # built at install (setup.py): cpu_copy.c

TO_HOST, TO_DEVICE = 0, 1  # directions understood by kvc_cpu_copy
ERR_DEVICE_ID, ERR_HOST_ID = -4, -5  # kvc_cpu_copy codes that carry the index of the bad id
SMALL_IDS = 16  # id lists up to this long are checked in plain Python (no numpy)


class _CpuEngine(ctypes.Structure):
    """``kvc_cpu_engine`` of cpu_copy.c (same field order and types): an engine's
    fixed tables, built once so a call passes one pointer instead of nine values."""

    _fields_ = [("plane_ptrs", ctypes.c_void_p), ("plane_stride_bytes", ctypes.c_void_p),
                ("plane_bytes", ctypes.c_void_p), ("host_offsets", ctypes.c_void_p),
                ("num_planes", ctypes.c_int64), ("num_device_blocks", ctypes.c_int64),
                ("host", ctypes.c_void_p), ("host_block_bytes", ctypes.c_int64),
                ("num_host_blocks", ctypes.c_int64), ("num_threads", ctypes.c_int64)]


# kvc_cpu_engine_copy is called without argtypes, so every argument must already
# be a ctypes object of the C parameter's type: arrays and byref() go as
# pointers, a c_int64 goes by value. These never change (read-only).
_IdBuffer = ctypes.c_int64 * SMALL_IDS
_C_COUNTS = tuple(ctypes.c_int64(n) for n in range(SMALL_IDS + 1))
_C_DIRECTIONS = (ctypes.c_int64(TO_HOST), ctypes.c_int64(TO_DEVICE))


def _new_id_buffers() -> tuple:
    """One thread's (device ids, host ids, error index, pointer to the error index)."""
    err = ctypes.c_int64(-1)
    return _IdBuffer(), _IdBuffer(), err, ctypes.byref(err)


def _open_library(path: str) -> ctypes.CDLL:
    """The C API of the built extension file (its Python module is empty)."""
    # CDLL (not PyDLL): ctypes drops the GIL for the duration of every call.
    lib = ctypes.CDLL(path)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.kvc_cpu_copy.argtypes = [ptr, ptr, ptr, ptr, i32, i64, ptr, i64, i64,
                                 ptr, ptr, i64, i32, i32, ptr]
    lib.kvc_cpu_copy.restype = ctypes.c_int
    lib.kvc_cpu_copy_strerror.argtypes = [ctypes.c_int]
    lib.kvc_cpu_copy_strerror.restype = ctypes.c_char_p
    # No argtypes on purpose: converting six arguments through argtypes costs
    # ~0.6 us per call, a third of a 1-block copy. Callers pass exact ctypes
    # types (see _C_COUNTS); restype is the default int.
    lib.kvc_cpu_engine_copy.argtypes = None
    return lib


LIB = _open_library(_cpu_copy.__file__)


class CpuCopyEngine:
    """Copies blocks between ``planes`` and ``host_pool`` for all planes in one call.

    ``threads``: large copies are split over up to this many threads.
    """

    def __init__(self, planes: list[torch.Tensor], host_pool: torch.Tensor,
                 host_offsets: Sequence[int], threads: int = 1):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.planes = list(planes)  # kept alive: the C side holds raw pointers into them
        self.host_pool = host_pool
        self.num_device_blocks = _check_planes(self.planes)
        self.num_host_blocks, self.host_block_bytes = _check_host_pool(host_pool)
        elem = [p.element_size() for p in self.planes]
        self.plane_bytes = [_numel(p) * e for p, e in zip(self.planes, elem, strict=True)]
        self.stride_bytes = [p.stride(0) * e for p, e in zip(self.planes, elem, strict=True)]
        self.host_offsets = _check_offsets(host_offsets, self.plane_bytes, self.host_block_bytes)
        self._bytes_per_block = sum(self.plane_bytes)
        self._lib = LIB
        self._init_native()

    # ------------------------------------------------------------ public API
    @property
    def bytes_per_block(self) -> int:
        """Payload bytes moved per block (all planes, without host padding)."""
        return self._bytes_per_block

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> int:
        """Copy device blocks ``device_ids[i]`` to host blocks ``host_ids[i]``; returns bytes moved."""
        if self._small_native(device_ids, host_ids, host_ids, TO_HOST):
            return len(device_ids) * self._bytes_per_block
        dev, host = self._check_ids(device_ids, host_ids)
        _check_unique(host, "host")
        return self._copy(dev, host, TO_HOST)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> int:
        """Copy host blocks ``host_ids[i]`` to device blocks ``device_ids[i]``; returns bytes moved."""
        if self._small_native(device_ids, host_ids, device_ids, TO_DEVICE):
            return len(device_ids) * self._bytes_per_block
        dev, host = self._check_ids(device_ids, host_ids)
        _check_unique(dev, "device")
        return self._copy(dev, host, TO_DEVICE)

    def _small_native(self, dev, host, dst, direction: int) -> bool:
        """Short lists of valid plain ints skip numpy (its fixed cost dominates a
        1-block task); anything unusual returns False and takes the general path,
        which checks everything and words the errors. The id buffers are the
        calling thread's own, reused across calls."""
        n = len(dev)
        if (type(dev) is not list or type(host) is not list
                or not 0 < n <= SMALL_IDS or len(host) != n or (n > 1 and len(set(dst)) != n)):
            return False
        nd, nh = self.num_device_blocks, self.num_host_blocks
        # Exact ints in range only: ctypes would silently wrap an id >= 2**63.
        for d, h in zip(dev, host):
            if type(d) is not int or type(h) is not int or not (0 <= d < nd and 0 <= h < nh):
                return False
        try:
            dev_buf, host_buf, err, err_ref = self._tls.buffers
        except AttributeError:  # first call on this thread
            dev_buf, host_buf, err, err_ref = self._tls.buffers = _new_id_buffers()
        dev_buf[:n] = dev
        host_buf[:n] = host
        rc = self._copy_fn(self._engine_ref, dev_buf, host_buf, _C_COUNTS[n],
                           _C_DIRECTIONS[direction], err_ref)
        if rc != 0:  # not expected: the ids were checked above; the C side checks again
            self._raise_native(rc, err.value, dev, host)
        return True

    # ------------------------------------------------------------ validation
    def _check_ids(self, device_ids: Sequence[int], host_ids: Sequence[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
        dev = _as_ids(device_ids, "device")
        host = _as_ids(host_ids, "host")
        if dev.size != host.size:
            raise ValueError(f"got {dev.size} device ids but {host.size} host ids; "
                             "they pair up one to one, so the lengths must match")
        _check_range(dev, self.num_device_blocks, "device")
        _check_range(host, self.num_host_blocks, "host")
        return dev, host

    def _copy(self, dev: np.ndarray, host: np.ndarray, direction: int) -> int:
        if dev.size == 0:
            return 0
        self._copy_native(dev, host, direction)
        return int(dev.size) * self.bytes_per_block

    # ---------------------------------------------------------------- native
    def _init_native(self) -> None:
        # Pointer tables built once and kept alive as attributes: the engine
        # struct only holds their addresses. Each call passes the struct by
        # pointer plus the two id arrays.
        self._ptrs = np.array([p.data_ptr() for p in self.planes], dtype=np.uint64)
        self._strides = np.array(self.stride_bytes, dtype=np.int64)
        self._nbytes = np.array(self.plane_bytes, dtype=np.int64)
        self._offsets = np.array(self.host_offsets, dtype=np.int64)
        self._engine = _CpuEngine(self._ptrs.ctypes.data, self._strides.ctypes.data,
                                  self._nbytes.ctypes.data, self._offsets.ctypes.data,
                                  len(self.planes), self.num_device_blocks,
                                  self.host_pool.data_ptr(), self.host_block_bytes,
                                  self.num_host_blocks, self.threads)
        self._engine_ref = ctypes.byref(self._engine)
        self._copy_fn = self._lib.kvc_cpu_engine_copy
        # Per-thread id buffers and error slot for _small_native: threads may
        # share an engine, and the C call runs without the GIL.
        self._tls = threading.local()

    def _copy_native(self, dev: np.ndarray, host: np.ndarray, direction: int) -> None:
        err = ctypes.c_int64(-1)
        rc = self._copy_fn(self._engine_ref, ctypes.c_void_p(dev.ctypes.data),
                           ctypes.c_void_p(host.ctypes.data), ctypes.c_int64(dev.size),
                           _C_DIRECTIONS[direction], ctypes.byref(err))
        if rc != 0:
            self._raise_native(rc, err.value, dev, host)

    def _raise_native(self, rc: int, index: int, dev, host) -> None:
        raise ValueError(native_error(self._lib, rc, index, np.asarray(dev, dtype=np.int64),
                                      np.asarray(host, dtype=np.int64),
                                      self.num_device_blocks, self.num_host_blocks))


# -------------------------------------------------------------------- helpers
def native_error(lib: ctypes.CDLL, rc: int, index: int, dev: np.ndarray, host: np.ndarray,
                 num_device_blocks: int, num_host_blocks: int) -> str:
    """Message for a non-zero ``kvc_cpu_copy`` code, naming the bad id when there is one."""
    msg = f"native CPU copy rejected the task (code {rc}: {lib.kvc_cpu_copy_strerror(rc).decode()})"
    if rc == ERR_DEVICE_ID and 0 <= index < dev.size:
        msg += f": device block id {dev[index]} at index {index}, allowed 0..{num_device_blocks - 1}"
    elif rc == ERR_HOST_ID and 0 <= index < host.size:
        msg += f": host block id {host[index]} at index {index}, allowed 0..{num_host_blocks - 1}"
    elif index >= 0:
        msg += f" at index {index}"
    return msg


def _numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _check_planes(planes: list[torch.Tensor]) -> int:
    """Validate the device planes; return their common number of blocks."""
    if not planes:
        raise ValueError("planes must hold at least one tensor")
    num_blocks = None
    for i, p in enumerate(planes):
        if not isinstance(p, torch.Tensor) or p.device.type != "cpu":
            raise ValueError(f"plane {i} must be a CPU tensor, got "
                             f"{getattr(p, 'device', type(p).__name__)}")
        if p.dim() < 1:
            raise ValueError(f"plane {i} must have a block dimension (dim 0), got a scalar")
        if not _contiguous_from_dim1(p):
            raise ValueError(f"plane {i} (shape {tuple(p.shape)}, stride {p.stride()}) must be "
                             "contiguous from dim 1 on: each block one run of bytes")
        if p.size(0) > 1 and p.stride(0) < _numel(p):
            raise ValueError(f"plane {i}: block stride {p.stride(0)} is smaller than a block "
                             f"({_numel(p)} elements), blocks would overlap")
        if num_blocks is not None and p.size(0) != num_blocks:
            raise ValueError(f"plane {i} has {p.size(0)} blocks but plane 0 has {num_blocks}; "
                             "all planes must have the same number of blocks")
        num_blocks = p.size(0)
    return num_blocks


def _contiguous_from_dim1(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_host_pool(host_pool: torch.Tensor) -> tuple[int, int]:
    if (not isinstance(host_pool, torch.Tensor) or host_pool.device.type != "cpu"
            or host_pool.dtype != torch.uint8 or host_pool.dim() != 2
            or not host_pool.is_contiguous()):
        desc = (f"{host_pool.dtype} {tuple(host_pool.shape)} on {host_pool.device}"
                if isinstance(host_pool, torch.Tensor) else type(host_pool).__name__)
        raise ValueError("host_pool must be a contiguous CPU uint8 tensor "
                         f"[num_cpu_blocks, block_bytes], got {desc}")
    return host_pool.size(0), host_pool.size(1)


def _check_offsets(host_offsets: Sequence[int], plane_bytes: list[int],
                   block_bytes: int) -> list[int]:
    offs = [int(o) for o in host_offsets]
    if len(offs) != len(plane_bytes):
        raise ValueError(f"got {len(offs)} host offsets for {len(plane_bytes)} planes")
    spans = sorted((o, o + nb, p) for p, (o, nb) in enumerate(zip(offs, plane_bytes, strict=True)))
    for o, end, p in spans:
        if o < 0 or end > block_bytes:
            raise ValueError(f"plane {p}: host span [{o}, {end}) lies outside the host block "
                             f"of {block_bytes} bytes; does the host pool match the layout?")
    for (_, end_a, pa), (o_b, _, pb) in pairwise(spans):
        if o_b < end_a:
            raise ValueError(f"planes {pa} and {pb} overlap in the host block")
    return offs


def _as_ids(ids: Sequence[int], side: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{side} ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{side} ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr))
        raise ValueError(f"{side} block id {arr[i]} at index {i} does not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_range(ids: np.ndarray, limit: int, side: str) -> None:
    # Negative ids wrap to huge unsigned values: one comparison catches both ends.
    bad = ids.view(np.uint64) >= limit
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"{side} block id {int(ids[i])} at index {i} is out of range: "
                         f"allowed 0..{limit - 1} ({limit} {side} blocks)")


def _check_unique(ids: np.ndarray, side: str) -> None:
    """Destinations must be distinct: two sources into one block is an upstream bug
    (two owners of one block), and with threads it would be a data race.

    A set of Python ints: for the short lists tasks carry it is several times
    cheaper than numpy's sort (a 28-id stable argsort took ~14 us)."""
    if ids.size < 2:
        return
    listed = ids.tolist()
    if len(set(listed)) == len(listed):
        return
    first_seen: dict[int, int] = {}
    for i, b in enumerate(listed):
        if b in first_seen:
            raise ValueError(f"{side} block id {b} is a destination twice (indices "
                             f"{first_seen[b]} and {i}); destination ids must be distinct")
        first_seen[b] = i
