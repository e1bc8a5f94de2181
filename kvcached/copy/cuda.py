"""CudaCopyEngine: move KV blocks between GPU planes and the pinned host pool.

The native side is ``cuda/kv_copy.cu`` (C API in ``cuda/kv_copy.h``): a copy
kernel with no framework headers, a launcher that validates every input
before its first CUDA call, and thin CUDA runtime helpers. The sources ship
with the package (setup.py's build_py copies them into
``kvcached/native/cuda/``; an editable install reads the checkout's
``cuda/``). It is built by ``nvcc`` (sm_80 + sm_90 + PTX, cudart linked
statically so the library loads on a machine without libcudart or a driver)
lazily on first use and cached by :mod:`kvcached.native_build`, or ahead
of time with ``python -m kvcached.copy.cuda --build``. The ctypes binding
(build, load, one typed method per C function, the errors) is
:mod:`kvcached.cuda_lib`; its names are re-exported here.

Three modes move the same bytes, chosen per direction:

- ``kernel``: one launch per task over all (pair, plane) chunks, 16-byte
  vectors, reading/writing pinned host memory through its device pointer
  (UVA), on a small grid (default 4 x 256) that leaves the SMs to the model.
  The plane table is uploaded once per engine; a task's ids go in the kernel
  parameters (<= 64 pairs) or through pinned staging, never a pageable upload.
- ``direct``: ``cudaMemcpy2DAsync`` per run of consecutive ids and plane: the
  copy engines (DMA), no SM time.
- ``batch``: the same copies in one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8;
  ``direct`` where the toolkit lacks it).

Each direction has its own stream, id staging and completion event, so a
swap-in never queues behind a swap-out that waits for the model, and a task
completes on its own event, not on a whole-stream synchronize.

Every native status becomes :class:`CudaCopyError` (a bad task:
:class:`CudaTaskInvalid`, also a ``ValueError`` like the CPU engine's) whose
text names the status and the launcher's explanation. A fault that leaves the
CUDA context unusable (an illegal address, ...) is :class:`CudaContextBroken`
(``fatal``): the engine refuses every later task, and a transfer worker exits
so that its coordinator starts a fresh process. Importing this module never
builds or loads anything.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcached.cuda_lib import (  # noqa: F401  (re-exported: callers use kvc.NAME)
    ABI_VERSION,
    D2H,
    DEFAULT_ARCHS,
    DIRECTIONS,
    EXPORTED_SYMBOLS,
    H2D,
    HEADER,
    INLINE_PAIRS,
    IPC_HANDLE_BYTES,
    LIB_NAME,
    MAX_BLOCK_THREADS,
    MAX_GRID_BLOCKS,
    MIN_STAGING,
    MODES,
    SOURCE,
    SOURCE_DIR,
    SOURCE_NAMES,
    UUID_BYTES,
    BuildInfo,
    CudaContextBroken,
    CudaCopyError,
    CudaTaskInvalid,
    KvcLaunch,
    KvcLib,
    KvcPlane,
    KvcTask,
    Status,
    aligned_bytes,
    build,
    cuda_archs,
    driver_present,
    find_nvcc,
    load,
    nvcc_flags,
)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------ tasks
@dataclass(frozen=True)
class CudaPlane:
    """One plane as raw numbers: device address of block 0, block stride, block bytes."""

    dev_base: int
    dev_stride: int
    nbytes: int


def plane_table(planes: Sequence[CudaPlane], host_offsets: Sequence[int]) -> ctypes.Array:
    """The ``kvc_plane_t`` array of a plane list (build once, reuse for every task)."""
    if len(planes) != len(host_offsets):
        raise ValueError(f"got {len(host_offsets)} host offsets for {len(planes)} planes")
    table = (KvcPlane * max(1, len(planes)))()
    for i, (p, off) in enumerate(zip(planes, host_offsets, strict=True)):
        table[i] = KvcPlane(p.dev_base, p.dev_stride, p.nbytes, off)
    return table


def make_task(planes: Sequence[CudaPlane] | ctypes.Array, host_offsets: Sequence[int] | None,
              src_ids, dst_ids, direction: int, num_dev_blocks: int, num_host_blocks: int,
              host_base: int, host_block_bytes: int, num_planes: int | None = None) -> KvcTask:
    """A ``kvc_task_t``; its plane table and id arrays hang off it (kept alive with it).

    ``planes`` is a CudaPlane list (with ``host_offsets``) or a :func:`plane_table`
    (then ``num_planes`` entries of it are used).
    """
    if isinstance(planes, ctypes.Array):
        table, n = planes, len(planes) if num_planes is None else num_planes
    else:
        table, n = plane_table(planes, host_offsets or []), len(planes)
    src = _ids32(src_ids)
    dst = _ids32(dst_ids)
    task = KvcTask(ctypes.cast(table, ctypes.POINTER(KvcPlane)), n, direction,
                   src.ctypes.data, dst.ctypes.data, min(src.size, dst.size), 0,
                   num_dev_blocks, num_host_blocks, host_base, host_block_bytes)
    task._keep = (table, src, dst)  # ctypes holds raw addresses only
    return task


def _ids32(ids) -> np.ndarray:
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1 \
            and ids.flags.c_contiguous:
        return ids  # already checked by the caller that made it
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"block ids must be a flat sequence of integers, got {arr.dtype} "
                         f"{arr.shape}")
    if arr.size and (arr.max() > np.iinfo(np.int32).max or arr.min() < np.iinfo(np.int32).min):
        raise ValueError("block ids must fit in int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def plane_from_tensor(t) -> CudaPlane:
    """CudaPlane of a tensor whose dim 0 is the block and each block is contiguous."""
    if t.dim() < 1:
        raise ValueError("a KV plane needs a block dimension (dim 0)")
    elem = t.element_size()
    inner = t[0] if t.size(0) > 0 else t
    if t.size(0) == 0 or not inner.is_contiguous():
        raise ValueError(f"plane of shape {tuple(t.shape)} stride {t.stride()} must have "
                         "blocks and be contiguous from dim 1 on")
    return CudaPlane(t.data_ptr(), t.stride(0) * elem, inner.numel() * elem)


def _handle_of(obj) -> int:
    """A raw cudaStream_t / cudaEvent_t from an int, a torch.cuda.Stream/Event, or None."""
    if obj is None:
        return 0
    if isinstance(obj, int):
        return obj
    for attr in ("cuda_stream", "cuda_event"):
        if hasattr(obj, attr):
            return int(getattr(obj, attr))
    raise TypeError(f"expected a CUDA stream/event handle (int, torch.cuda.Stream/Event), "
                    f"got {type(obj).__name__}")


# ----------------------------------------------------------------------- engine
def resolve_modes(mode, use_batch: bool = False) -> dict[int, str]:
    """``{D2H: mode, H2D: mode}`` from one mode or a ``(d2h, h2d)`` pair.

    ``use_batch`` (the older spelling) turns ``direct`` into ``batch``.
    """
    pair = (mode, mode) if isinstance(mode, str) else tuple(mode)
    if len(pair) != 2:
        raise ValueError(f"mode must be one of {MODES} or a (d2h, h2d) pair, got {mode!r}")
    out = {}
    for direction, m in zip((D2H, H2D), pair, strict=True):
        if m not in MODES:
            raise ValueError(f"{DIRECTIONS[direction]} mode must be one of {MODES}, got {m!r}")
        out[direction] = "batch" if (use_batch and m == "direct") else m
    return out


class _Lane:
    """One direction's stream, completion event and id staging (used under ``lock``)."""

    __slots__ = ("direction", "mode", "stream", "own_stream", "done", "staging_event",
                 "launch", "lock", "ids_host", "ids_dev", "ids_bytes")

    def __init__(self, direction: int, mode: str, stream: int, own_stream: bool):
        self.direction, self.mode = direction, mode
        self.stream, self.own_stream = stream, own_stream
        self.done = self.staging_event = 0
        self.launch = KvcLaunch()
        self.lock = threading.Lock()
        self.ids_host = self.ids_dev = self.ids_bytes = 0


class CudaCopyEngine:
    """Copies blocks between GPU ``planes`` and a pinned, block-major host pool.

    ``planes``: CUDA tensors (dim 0 = block) or :class:`CudaPlane` (then pass
    ``num_device_blocks``). ``host_pool``: a pinned CPU uint8 tensor
    ``[num_cpu_blocks, block_bytes]`` (as the CPU engine takes) or its address
    (then pass ``host_block_bytes`` and ``num_host_blocks``); it must be pinned
    and mapped (``kvcached.memory.cuda_ipc.pin_host_memory`` or ``cudaHostAlloc``).

    ``mode``: ``kernel``, ``direct`` or ``batch``, or a ``(d2h, h2d)`` pair.
    Each direction runs on its own stream (created here unless ``stream`` is
    given, which both directions then share). ``swap_out``/``swap_in`` wait
    for ``wait_event`` first (the engine's event after the forward that wrote,
    or last read, the blocks). With ``sync=True`` (default) they return once
    the task's own completion event fired; else call :meth:`synchronize`.
    """

    def __init__(self, planes: Sequence, host_pool, host_offsets: Sequence[int], *,
                 host_block_bytes: int | None = None, num_host_blocks: int | None = None,
                 num_device_blocks: int | None = None, mode="kernel",
                 grid_blocks: int = 4, block_threads: int = 256, use_batch: bool = False,
                 stream=None, device: int | None = None, lib: KvcLib | None = None):
        self.modes = resolve_modes(mode, use_batch)
        if not (1 <= grid_blocks <= MAX_GRID_BLOCKS) or block_threads % 32 or not (
                32 <= block_threads <= MAX_BLOCK_THREADS):
            raise ValueError(f"grid must be 1..{MAX_GRID_BLOCKS} blocks of 32.."
                             f"{MAX_BLOCK_THREADS} threads (multiple of 32), got "
                             f"{grid_blocks} x {block_threads}")
        self.grid_blocks, self.block_threads = grid_blocks, block_threads
        self.lib = lib or load()
        self._tensors = [p for p in planes if not isinstance(p, CudaPlane)]  # kept alive
        self.planes = [p if isinstance(p, CudaPlane) else plane_from_tensor(p) for p in planes]
        if not self.planes:
            raise ValueError("planes must hold at least one plane")
        if num_device_blocks is None and any(isinstance(p, CudaPlane) for p in planes):
            raise ValueError("raw CudaPlane planes need num_device_blocks")
        self.num_device_blocks = num_device_blocks or min(int(p.shape[0]) for p in planes)
        self.device = device if device is not None else _device_of(planes)
        self._host_pool = host_pool  # kept alive
        host_ptr, self.host_block_bytes, self.num_host_blocks = _host_geometry(
            host_pool, host_block_bytes, num_host_blocks)
        self.host_offsets = [int(o) for o in host_offsets]
        self._table = plane_table(self.planes, self.host_offsets)  # once, not per task
        self.bytes_per_block = sum(p.nbytes for p in self.planes)
        self._broken: CudaContextBroken | None = None
        self._closed = False
        self._lanes: dict[int, _Lane] = {}
        self._dev_table = 0
        try:
            self.lib.set_device(self.device)
            self.host_base = self._device_pointer(host_ptr)
            self._open_lanes(stream)
            self._upload_table()
        except BaseException:
            self.close(quiet=True)  # what was created so far
            raise

    def _device_pointer(self, host_ptr: int) -> int:
        try:
            return self.lib.host_device_pointer(host_ptr)
        except CudaCopyError as e:
            raise CudaCopyError(e.op, e.status, e.status_name,
                                f"{e.detail}; is the host pool pinned and mapped? pin it with "
                                "kvcached.memory.cuda_ipc.pin_host_memory()") from e

    def _open_lanes(self, stream) -> None:
        shared = None if stream is None else _handle_of(stream)
        for direction in (D2H, H2D):
            own = shared is None
            lane = _Lane(direction, self.modes[direction],
                         self.lib.stream_create() if own else shared, own)
            self._lanes[direction] = lane
            lane.done = self.lib.event_create(False)
            lane.staging_event = self.lib.event_create(False)
            lane.launch.staging_event = lane.staging_event
            lane.launch.grid_blocks, lane.launch.block_threads = (self.grid_blocks,
                                                                  self.block_threads)

    def _upload_table(self) -> None:
        """Pack the kernel's plane table and upload it, once for the engine's life."""
        host, fingerprint = self.lib.pack_plane_table(self._table, len(self.planes))
        self._dev_table = self.lib.malloc(host.nbytes)
        stream = self._lanes[D2H].stream
        self.lib.memcpy_async(self._dev_table, host.ctypes.data, host.nbytes, stream)
        self.lib.stream_synchronize(stream)  # `host` is pageable and goes away
        for lane in self._lanes.values():
            lane.launch.plane_table, lane.launch.table_fingerprint = self._dev_table, fingerprint

    # ------------------------------------------------------------ public API
    @property
    def stream(self) -> int | None:
        """The swap-out stream (kept for callers of the one-stream engine)."""
        lane = self._lanes.get(D2H)
        return None if self._closed or lane is None else lane.stream

    def stream_of(self, direction: int) -> int:
        """The stream that ``direction``'s (D2H or H2D) copies run on."""
        return self._lanes[direction].stream

    @property
    def broken(self) -> CudaContextBroken | None:
        """The sticky CUDA error that ended this engine, if any."""
        return self._broken

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int], *,
                 wait_event=None, sync: bool = True) -> int:
        """Copy device blocks ``device_ids[i]`` to host blocks ``host_ids[i]``; returns bytes."""
        return self._copy(device_ids, host_ids, D2H, wait_event, sync)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int], *,
                wait_event=None, sync: bool = True) -> int:
        """Copy host blocks ``host_ids[i]`` to device blocks ``device_ids[i]``; returns bytes."""
        return self._copy(host_ids, device_ids, H2D, wait_event, sync)

    def synchronize(self) -> None:
        """Wait until every copy enqueued on this engine (both directions) is done."""
        self._check_usable()
        for stream in {lane.stream for lane in self._lanes.values()}:
            self._guard(self.lib.stream_synchronize, stream)

    def record_event(self, event, direction: int = H2D) -> None:
        """Record ``event`` on ``direction``'s stream (e.g. so the engine's compute
        stream waits for a swap-in before reading the blocks)."""
        self._check_usable()
        self._guard(self.lib.event_record, _handle_of(event), self._lanes[direction].stream)

    def close(self, quiet: bool = False) -> None:
        """Wait for pending copies, then free the id staging, plane table, events and
        owned streams. Everything is freed even when a step fails; the first
        failure is raised afterwards (only logged after a sticky error, when
        every CUDA call fails, or with ``quiet``)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []

        def attempt(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as e:  # keep freeing the rest
                errors.append(e)

        attempt(self.lib.set_device, self.device)
        if self._broken is None:  # in flight copies still read staging and table
            for stream in {lane.stream for lane in self._lanes.values()}:
                attempt(self.lib.stream_synchronize, stream)
        for lane in self._lanes.values():
            if lane.ids_dev:
                attempt(self.lib.free, lane.ids_dev)
            if lane.ids_host:
                attempt(self.lib.host_free, lane.ids_host)
            for ev in (lane.done, lane.staging_event):
                if ev:
                    attempt(self.lib.event_destroy, ev)
            if lane.own_stream and lane.stream:
                attempt(self.lib.stream_destroy, lane.stream)
            lane.ids_dev = lane.ids_host = lane.ids_bytes = lane.done = lane.staging_event = 0
        self._lanes.clear()
        if self._dev_table:
            attempt(self.lib.free, self._dev_table)
            self._dev_table = 0
        # Let go of the memory we copied: an IPC mapping closes with its last tensor.
        self._tensors, self._host_pool = [], None
        if errors:
            if quiet or self._broken is not None or any(
                    isinstance(e, CudaContextBroken) for e in errors):
                logger.warning("CudaCopyEngine.close: %d step(s) failed, first: %s",
                               len(errors), errors[0])
            else:
                raise errors[0]

    def __enter__(self) -> CudaCopyEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- internals
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("CudaCopyEngine is closed")
        if self._broken is not None:
            b = self._broken
            raise CudaContextBroken(b.op, b.status, b.status_name,
                                    f"the CUDA context broke earlier ({b.detail}); this "
                                    "process cannot copy any more")

    def _guard(self, fn, *args):
        """Call ``fn``; a sticky CUDA error marks the engine broken for good."""
        try:
            return fn(*args)
        except CudaContextBroken as e:
            if self._broken is None:
                self._broken = e
                logger.error("CUDA context broken (%s): the copy engine refuses further "
                             "tasks", e)
            raise

    def _copy(self, src_ids, dst_ids, direction: int, wait_event, sync: bool) -> int:
        self._check_usable()
        src, dst = _ids32(src_ids), _ids32(dst_ids)
        if src.size != dst.size:
            raise ValueError(f"got {src.size} source ids but {dst.size} destination ids; "
                             "they pair up one to one, so the lengths must match")
        if src.size == 0:
            return 0
        task = make_task(self._table, None, src, dst, direction, self.num_device_blocks,
                         self.num_host_blocks, self.host_base, self.host_block_bytes,
                         len(self.planes))
        event = _handle_of(wait_event)
        lane = self._lanes[direction]
        with lane.lock:  # one task at a time per direction: its staging and its event
            self._guard(self._enqueue, lane, task, event)
            if sync:
                self._guard(self.lib.event_synchronize, lane.done)
        return int(src.size) * self.bytes_per_block

    def _enqueue(self, lane: _Lane, task: KvcTask, event: int) -> None:
        self.lib.set_device(self.device)  # per thread in CUDA: workers may use several
        if lane.mode == "kernel":
            self._ensure_staging(lane, task.count)
            self.lib.copy_kernel(task, lane.launch, lane.stream, event)
        else:
            self.lib.copy_direct(task, lane.mode == "batch", lane.stream, event)
        self.lib.event_record(lane.done, lane.stream)

    def _ensure_staging(self, lane: _Lane, count: int) -> None:
        need = self.lib.ids_bytes(count)
        if need < 0:
            raise ValueError(f"a task of {count} pairs is too large")
        if need <= lane.ids_bytes:
            return
        # Doubling: a few allocations over the engine's life, never one per call.
        size = max(need, 2 * lane.ids_bytes, MIN_STAGING)
        if lane.ids_bytes:
            self.lib.stream_synchronize(lane.stream)  # a queued kernel may still read them
            self.lib.free(lane.ids_dev)
            self.lib.host_free(lane.ids_host)
            lane.ids_dev = lane.ids_host = lane.ids_bytes = 0
            lane.launch.ids_dev = lane.launch.ids_host = None
            lane.launch.ids_bytes = 0
        lane.ids_host = self.lib.host_alloc(size)  # pinned: its copy never blocks the caller
        lane.ids_dev = self.lib.malloc(size)
        lane.ids_bytes = size
        lane.launch.ids_host, lane.launch.ids_dev, lane.launch.ids_bytes = (
            lane.ids_host, lane.ids_dev, size)


def _device_of(planes: Sequence) -> int:
    for p in planes:
        dev = getattr(p, "device", None)
        if dev is not None:
            if dev.type != "cuda":
                raise ValueError(f"CudaCopyEngine needs CUDA planes, got a plane on {dev}")
            return dev.index or 0
    return 0


def _host_geometry(host_pool, block_bytes: int | None, num_blocks: int | None
                   ) -> tuple[int, int, int]:
    """(address, block bytes, blocks) of a host pool tensor or raw address."""
    if isinstance(host_pool, int):
        if not block_bytes or not num_blocks:
            raise ValueError("a raw host pool address needs host_block_bytes and "
                             "num_host_blocks")
        return host_pool, int(block_bytes), int(num_blocks)
    if (host_pool.device.type != "cpu" or host_pool.dim() != 2
            or host_pool.element_size() != 1 or not host_pool.is_contiguous()):
        raise ValueError("host_pool must be a contiguous CPU uint8 tensor "
                         f"[num_cpu_blocks, block_bytes], got {host_pool.dtype} "
                         f"{tuple(host_pool.shape)} on {host_pool.device}")
    return host_pool.data_ptr(), int(host_pool.shape[1]), int(host_pool.shape[0])


# ------------------------------------------------------- module-level helpers
def create_stream() -> int:
    """A new non-blocking CUDA stream (raw handle)."""
    return load().stream_create()


def create_event(interprocess: bool = False) -> int:
    """A new CUDA event (timing disabled; ``interprocess`` for IPC sharing)."""
    return load().event_create(interprocess)


def event_ipc_handle(event: int) -> bytes:
    """The 64-byte IPC handle of an interprocess event."""
    return load().event_ipc_handle(_handle_of(event))


def open_ipc_event(handle: bytes) -> int:
    """Open another process's event from its IPC handle (e.g. torch's ``Event.ipc_handle()``)."""
    return load().event_open_ipc(handle)


def stream_wait_event(stream, event) -> None:
    """Make ``stream`` wait for the last record of ``event`` (no host blocking)."""
    load().stream_wait_event(_handle_of(stream), _handle_of(event))


def synchronize(stream=None) -> None:
    """Block until ``stream`` (default: the legacy default stream) is idle."""
    load().stream_synchronize(_handle_of(stream))


# -------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcached.copy.cuda --build``: build ahead of time, print a JSON summary."""
    ap = argparse.ArgumentParser(prog="python -m kvcached.copy.cuda", description=main.__doc__)
    ap.add_argument("--build", action="store_true", help="build (or reuse) the library")
    ap.add_argument("--archs", default=None, help="SM versions, e.g. '80;90'")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    archs = cuda_archs() if args.archs is None else [a for a in args.archs.split(";") if a]
    try:
        info = build(archs)
        lib = KvcLib(info.path)
    except (OSError, RuntimeError) as e:
        print(json.dumps({"built": False, "error": str(e)}))
        return 1
    print(json.dumps({"built": True, "path": str(info.path), "nvcc": info.nvcc,
                      "archs": list(info.archs), "werror": info.werror,
                      "cudart": lib.raw.kvc_cudart_build_version(),
                      "batch_memcpy": bool(lib.raw.kvc_has_batch_memcpy())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
