"""CudaCopyEngine: move KV blocks between GPU planes and the pinned host pool.

The native side is ``cuda/kv_copy.cu`` (C API in ``cuda/kv_copy.h``): a copy
kernel with no framework headers, a launcher that validates every input
before its first CUDA call, and thin CUDA runtime helpers. The sources ship
with the package (setup.py's build_py copies them into
``kvcached/copy/cuda_src/``; an editable install reads the checkout's
``cuda/``). It is built by ``nvcc`` (sm_80 + sm_90 + PTX, cudart linked
statically so the library loads on a machine without libcudart or a driver)
lazily on first use and cached by :mod:`kvcached.copy.native_build`, or ahead
of time with ``python -m kvcached.copy.cuda --build``.

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
import enum
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcached.copy.native_build import BuildError, build_shared_library

logger = logging.getLogger(__name__)

SOURCE_NAMES = ("kv_copy.cu", "kv_copy.h")


def _source_dir() -> Path:
    """Where the CUDA sources are: in the installed package (``cuda_src/``, put
    there by setup.py's build_py), else in the checkout's ``cuda/`` (an
    editable install, or the source tree on sys.path)."""
    here = Path(__file__).resolve().parent
    candidates = (here / "cuda_src", here.parents[1] / "cuda")
    for d in candidates:
        if all((d / n).is_file() for n in SOURCE_NAMES):
            return d
    return candidates[0]  # missing: the build names the file it could not find


SOURCE_DIR = _source_dir()
SOURCE = SOURCE_DIR / "kv_copy.cu"
HEADER = SOURCE_DIR / "kv_copy.h"
LIB_NAME = "kvc_cuda_copy"
ABI_VERSION = 2  # KVC_ABI_VERSION in kv_copy.h
DEFAULT_ARCHS = ("80", "90")  # A100 and H100/H200; PTX of the last one for newer GPUs
D2H, H2D = 0, 1  # kvc_direction
DIRECTIONS = {D2H: "d2h", H2D: "h2d"}
MODES = ("kernel", "direct", "batch")
IPC_HANDLE_BYTES = 64
UUID_BYTES = 16  # KVC_UUID_BYTES
INLINE_PAIRS = 64  # KVC_INLINE_PAIRS: smaller tasks need no id staging
MAX_GRID_BLOCKS = 1024  # KVC_MAX_GRID_BLOCKS
MAX_BLOCK_THREADS = 512  # KVC_MAX_BLOCK_THREADS
MIN_STAGING = 64 * 1024  # first id staging allocation; doubles when a task needs more


class Status(enum.IntEnum):
    """kvc_status of kv_copy.h; CUDA failures are ``CUDA_BASE + cudaError_t``."""

    OK = 0
    NULL_POINTER = 1
    MISALIGNED = 2
    BAD_COUNT = 3
    ID_OUT_OF_RANGE = 4
    DUPLICATE_DST = 5
    BAD_PLANE_COUNT = 6
    BAD_PLANE = 7
    BAD_DIRECTION = 8
    BAD_GRID = 9
    WORKSPACE = 10
    BAD_POOL = 11
    HOST_ALLOC = 12
    BAD_ARGUMENT = 13
    CUDA_BASE = 1000


# cudaError_t values that mean "this machine cannot run CUDA at all".
_NO_DEVICE_ERRORS = {35: "cudaErrorInsufficientDriver", 100: "cudaErrorNoDevice",
                     999: "cudaErrorUnknown", 3: "cudaErrorInitializationError",
                     34: "cudaErrorStubLibrary"}


class CudaCopyError(RuntimeError):
    """A kv_copy call failed; ``status`` is the raw code, ``cuda_error`` the CUDA code or None."""

    def __init__(self, op: str, status: int, name: str, detail: str):
        self.op = op
        self.status = status
        self.status_name = name
        self.cuda_error = status - Status.CUDA_BASE if status > Status.CUDA_BASE else None
        self.detail = detail
        hint = ""
        if self.cuda_error in _NO_DEVICE_ERRORS:
            hint = " (no CUDA device: this machine has no usable GPU or NVIDIA driver)"
        super().__init__(f"{op} failed with {name} ({status}): {detail or 'no detail'}{hint}")


class CudaTaskInvalid(CudaCopyError, ValueError):
    """The launcher rejected the task before touching any memory (bad id, size, pointer)."""


class CudaContextBroken(CudaCopyError):
    """A sticky CUDA error: this process's CUDA context is unusable from now on.

    ``fatal`` tells a transfer worker to fail the task and exit (a new process
    gets a new context); nothing of the task may be treated as copied.
    """

    fatal = True


# ----------------------------------------------------------------------- ctypes
class KvcPlane(ctypes.Structure):
    """``kvc_plane_t``."""

    _fields_ = [("dev_base", ctypes.c_uint64), ("dev_stride", ctypes.c_uint64),
                ("nbytes", ctypes.c_uint64), ("host_offset", ctypes.c_uint64)]


class KvcTask(ctypes.Structure):
    """``kvc_task_t``; build it with :func:`make_task`, which keeps its arrays alive."""

    _fields_ = [("planes", ctypes.POINTER(KvcPlane)), ("num_planes", ctypes.c_int32),
                ("direction", ctypes.c_int32), ("src_ids", ctypes.c_void_p),
                ("dst_ids", ctypes.c_void_p), ("count", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("num_dev_blocks", ctypes.c_int64),
                ("num_host_blocks", ctypes.c_int64), ("host_base", ctypes.c_uint64),
                ("host_block_bytes", ctypes.c_uint64)]


class KvcLaunch(ctypes.Structure):
    """``kvc_launch_t``: where a kernel launch finds its plane table and id staging."""

    _fields_ = [("plane_table", ctypes.c_void_p), ("table_fingerprint", ctypes.c_uint64),
                ("ids_host", ctypes.c_void_p), ("ids_dev", ctypes.c_void_p),
                ("ids_bytes", ctypes.c_uint64), ("staging_event", ctypes.c_void_p),
                ("grid_blocks", ctypes.c_int32), ("block_threads", ctypes.c_int32)]


_P, _I32, _I64, _U64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
_TASK = ctypes.POINTER(KvcTask)
_LAUNCH = ctypes.POINTER(KvcLaunch)
_H = ctypes.c_char_p  # 64-byte IPC handles (in and out buffers)
_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "kvc_abi_version": ([], ctypes.c_int),
    "kvc_cudart_build_version": ([], ctypes.c_int),
    "kvc_has_batch_memcpy": ([], ctypes.c_int),
    "kvc_status_name": ([ctypes.c_int], ctypes.c_char_p),
    "kvc_last_error": ([], ctypes.c_char_p),
    "kvc_plane_table_bytes": ([_I32], _I64),
    "kvc_pack_plane_table": ([ctypes.POINTER(KvcPlane), _I32, _P, _U64, ctypes.POINTER(_U64)],
                             ctypes.c_int),
    "kvc_ids_bytes": ([_I32], _I64),
    "kvc_validate_task": ([_TASK], ctypes.c_int),
    "kvc_copy_kernel": ([_TASK, _LAUNCH, _P, _P], ctypes.c_int),
    "kvc_copy_direct": ([_TASK, _I32, _P, _P], ctypes.c_int),
    "kvc_emulate_kernel": ([_TASK, _LAUNCH], ctypes.c_int),
    "kvc_emulate_direct": ([_TASK, _I32], ctypes.c_int),
    "kvc_is_sticky": ([ctypes.c_int], ctypes.c_int),
    "kvc_device_count": ([ctypes.POINTER(_I32)], ctypes.c_int),
    "kvc_set_device": ([_I32], ctypes.c_int),
    "kvc_get_device": ([ctypes.POINTER(_I32)], ctypes.c_int),
    "kvc_device_uuid": ([_I32, _H], ctypes.c_int),
    "kvc_device_pci_bus_id": ([_I32, _H, _I32], ctypes.c_int),
    "kvc_pointer_type": ([_P, ctypes.POINTER(_I32)], ctypes.c_int),
    "kvc_malloc": ([_U64, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_free": ([_P], ctypes.c_int),
    "kvc_host_alloc": ([_U64, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_host_free": ([_P], ctypes.c_int),
    "kvc_host_register": ([_P, _U64], ctypes.c_int),
    "kvc_host_unregister": ([_P], ctypes.c_int),
    "kvc_host_device_pointer": ([_P, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_memcpy_async": ([_P, _P, _U64, _P], ctypes.c_int),
    "kvc_stream_create": ([ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_stream_destroy": ([_P], ctypes.c_int),
    "kvc_stream_synchronize": ([_P], ctypes.c_int),
    "kvc_stream_wait_event": ([_P, _P], ctypes.c_int),
    "kvc_event_create": ([_I32, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_event_destroy": ([_P], ctypes.c_int),
    "kvc_event_record": ([_P, _P], ctypes.c_int),
    "kvc_event_synchronize": ([_P], ctypes.c_int),
    "kvc_event_query": ([_P], ctypes.c_int),
    "kvc_event_ipc_handle": ([_P, _H], ctypes.c_int),
    "kvc_event_open_ipc": ([_H, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_ipc_get_mem_handle": ([_P, _H], ctypes.c_int),
    "kvc_ipc_open_mem_handle": ([_H, ctypes.POINTER(_P)], ctypes.c_int),
    "kvc_ipc_close_mem_handle": ([_P], ctypes.c_int),
}
EXPORTED_SYMBOLS = tuple(_SIGNATURES)


# ------------------------------------------------------------------------ build
def find_nvcc() -> str | None:
    """``$KVCACHED_NVCC``, ``nvcc`` on PATH, or ``$CUDA_HOME``/``/usr/local/cuda``'s nvcc."""
    env = os.environ.get("KVCACHED_NVCC")
    if env:
        return shutil.which(env)
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def cuda_archs() -> list[str]:
    """SM versions to build for: ``$KVCACHED_CUDA_ARCHS`` ("80;90") or 80 and 90."""
    env = os.environ.get("KVCACHED_CUDA_ARCHS", "")
    archs = [a.strip() for a in env.replace(",", ";").split(";") if a.strip()]
    for a in archs:
        if not a.isdigit():
            raise ValueError(f"KVCACHED_CUDA_ARCHS entries must be like '90', got {a!r}")
    return archs or list(DEFAULT_ARCHS)


def nvcc_flags(archs: Sequence[str], werror: bool = True) -> list[str]:
    """Flags for the shared library: SASS per arch + PTX of the newest, static cudart."""
    flags = ["-O3", "-std=c++17", "-shared", "--cudart", "static",
             "-Xcompiler", "-fPIC,-fno-strict-aliasing,-Wall,-Wextra"]
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    newest = max(archs, key=int)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    if werror:
        flags += ["-Werror", "all-warnings", "-Xcompiler", "-Werror"]
    return flags


@dataclass(frozen=True)
class BuildInfo:
    """What :func:`build` produced."""

    path: Path
    nvcc: str
    archs: tuple[str, ...]
    werror: bool


def build(archs: Sequence[str] | None = None) -> BuildInfo:
    """Compile (or reuse from the cache) the CUDA copy library and return where it is.

    Built with ``-Werror all-warnings``; if only that fails (a newer nvcc with
    a new warning), it is rebuilt without it and the warnings are logged.
    Raises RuntimeError when nvcc is missing, BuildError when compiling fails.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (looked at $KVCACHED_NVCC, PATH, $CUDA_HOME, "
                           "/usr/local/cuda/bin); install the CUDA toolkit to build "
                           "the CUDA copy kernel")
    archs = tuple(archs or cuda_archs())
    try:
        path = build_shared_library(LIB_NAME, [SOURCE], [nvcc], nvcc_flags(archs, True),
                                    headers=[HEADER])
        return BuildInfo(path, nvcc, archs, True)
    except BuildError as e:
        logger.warning("CUDA copy library failed to build with -Werror; retrying without: %s", e)
    path = build_shared_library(LIB_NAME, [SOURCE], [nvcc], nvcc_flags(archs, False),
                                headers=[HEADER])
    return BuildInfo(path, nvcc, archs, False)


# ---------------------------------------------------------------------- binding
class KvcLib:
    """The loaded library: one thin typed method per C function, raising on failure.

    ``raw`` is the ctypes handle for callers (tests) that want the status code.
    """

    def __init__(self, path: str | os.PathLike):
        # CDLL, not PyDLL: every call drops the GIL, so copies overlap Python work.
        self.path = Path(path)
        self.raw = ctypes.CDLL(str(self.path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(self.raw, name)
            fn.argtypes = argtypes
            fn.restype = restype
        abi = self.raw.kvc_abi_version()
        if abi != ABI_VERSION:
            raise RuntimeError(f"{self.path} has ABI {abi}, this kvcached needs {ABI_VERSION}; "
                               "delete it (or the kvcached cache dir) to rebuild")

    # --------------------------------------------------------------- status
    def status_name(self, status: int) -> str:
        """``KVC_ERR_*`` or ``cudaError*`` name of a status."""
        return self.raw.kvc_status_name(status).decode()

    def last_error(self) -> str:
        """The launcher's explanation of this thread's last failure."""
        return self.raw.kvc_last_error().decode(errors="replace")

    def check(self, status: int, op: str) -> None:
        """Raise the right CudaCopyError for a non-zero status."""
        if status == Status.OK:
            return
        if 0 < status < Status.CUDA_BASE:
            cls = CudaTaskInvalid
        elif self.raw.kvc_is_sticky(status):
            cls = CudaContextBroken
        else:
            cls = CudaCopyError
        raise cls(op, status, self.status_name(status), self.last_error())

    def _call(self, name: str, *args) -> None:
        self.check(getattr(self.raw, name)(*args), name)

    def _out(self, name: str, *args) -> int:
        out = ctypes.c_void_p()
        self._call(name, *args, ctypes.byref(out))
        return out.value or 0

    # --------------------------------------------------------------- copies
    def ids_bytes(self, count: int) -> int:
        """Id staging a task of ``count`` pairs needs (0: inline; -1: out of range)."""
        return int(self.raw.kvc_ids_bytes(count))

    def pack_plane_table(self, table: ctypes.Array, num_planes: int) -> tuple[np.ndarray, int]:
        """The kernel's packed plane table (16-byte aligned host bytes) and its fingerprint."""
        nbytes = int(self.raw.kvc_plane_table_bytes(num_planes))
        if nbytes < 0:
            raise ValueError(f"num_planes {num_planes} is out of range")
        out = aligned_bytes(nbytes)
        fp = ctypes.c_uint64(0)
        self._call("kvc_pack_plane_table", ctypes.cast(table, ctypes.POINTER(KvcPlane)),
                   num_planes, out.ctypes.data, nbytes, ctypes.byref(fp))
        return out, fp.value

    def validate(self, task: KvcTask) -> None:
        """Validate ``task`` on the host only; raises CudaTaskInvalid."""
        self._call("kvc_validate_task", ctypes.byref(task))

    def is_sticky(self, status: int) -> bool:
        """Whether ``status`` leaves this process's CUDA context unusable."""
        return bool(self.raw.kvc_is_sticky(status))

    def copy_kernel(self, task: KvcTask, launch: KvcLaunch, stream: int = 0,
                    wait_event: int = 0) -> None:
        """Enqueue the kernel path on ``stream`` (after ``wait_event`` if non-zero)."""
        self._call("kvc_copy_kernel", ctypes.byref(task), ctypes.byref(launch), stream or None,
                   wait_event or None)

    def copy_direct(self, task: KvcTask, use_batch: bool = False, stream: int = 0,
                    wait_event: int = 0) -> None:
        """Enqueue the direct (cudaMemcpy) path on ``stream``."""
        self._call("kvc_copy_direct", ctypes.byref(task), int(use_batch), stream or None,
                   wait_event or None)

    def emulate(self, task: KvcTask, launch: KvcLaunch) -> None:
        """Run the kernel path's packing and the kernel's code on the CPU (host
        addresses only): tests without a GPU."""
        self._call("kvc_emulate_kernel", ctypes.byref(task), ctypes.byref(launch))

    def emulate_direct(self, task: KvcTask, use_batch: bool = False) -> None:
        """Run the direct path's copy plan with memcpy on the CPU (host addresses only)."""
        self._call("kvc_emulate_direct", ctypes.byref(task), int(use_batch))

    # --------------------------------------------------------------- runtime
    def device_count(self) -> int:
        n = ctypes.c_int32(0)
        self._call("kvc_device_count", ctypes.byref(n))
        return n.value

    def set_device(self, device: int) -> None:
        self._call("kvc_set_device", device)

    def get_device(self) -> int:
        n = ctypes.c_int32(0)
        self._call("kvc_get_device", ctypes.byref(n))
        return n.value

    def device_uuid(self, device: int) -> bytes:
        """The 16-byte UUID of CUDA device ``device`` (as numbered in this process)."""
        buf = ctypes.create_string_buffer(UUID_BYTES)
        self._call("kvc_device_uuid", device, buf)
        return buf.raw

    def device_pci_bus_id(self, device: int) -> str:
        """``domain:bus:device.function`` of CUDA device ``device``."""
        buf = ctypes.create_string_buffer(32)
        self._call("kvc_device_pci_bus_id", device, buf, len(buf))
        return buf.value.decode()

    def pointer_type(self, ptr: int) -> int:
        """cudaMemoryType of ``ptr``: 0 unregistered, 1 host, 2 device, 3 managed."""
        t = ctypes.c_int32(0)
        self._call("kvc_pointer_type", ptr, ctypes.byref(t))
        return t.value

    def malloc(self, nbytes: int) -> int:
        return self._out("kvc_malloc", nbytes)

    def free(self, ptr: int) -> None:
        self._call("kvc_free", ptr)

    def host_alloc(self, nbytes: int) -> int:
        return self._out("kvc_host_alloc", nbytes)

    def host_free(self, ptr: int) -> None:
        self._call("kvc_host_free", ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._call("kvc_host_register", ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        self._call("kvc_host_unregister", ptr)

    def host_device_pointer(self, host_ptr: int) -> int:
        return self._out("kvc_host_device_pointer", host_ptr)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        self._call("kvc_memcpy_async", dst, src, nbytes, stream or None)

    def stream_create(self) -> int:
        return self._out("kvc_stream_create")

    def stream_destroy(self, stream: int) -> None:
        self._call("kvc_stream_destroy", stream)

    def stream_synchronize(self, stream: int = 0) -> None:
        self._call("kvc_stream_synchronize", stream or None)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("kvc_stream_wait_event", stream or None, event)

    def event_create(self, interprocess: bool = False) -> int:
        return self._out("kvc_event_create", int(interprocess))

    def event_destroy(self, event: int) -> None:
        self._call("kvc_event_destroy", event)

    def event_record(self, event: int, stream: int = 0) -> None:
        self._call("kvc_event_record", event, stream or None)

    def event_synchronize(self, event: int) -> None:
        self._call("kvc_event_synchronize", event)

    def event_ipc_handle(self, event: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._call("kvc_event_ipc_handle", event, buf)
        return buf.raw

    def event_open_ipc(self, handle: bytes) -> int:
        return self._out("kvc_event_open_ipc", _handle(handle))

    def ipc_get_mem_handle(self, dev_ptr: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._call("kvc_ipc_get_mem_handle", dev_ptr, buf)
        return buf.raw

    def ipc_open_mem_handle(self, handle: bytes) -> int:
        return self._out("kvc_ipc_open_mem_handle", _handle(handle))

    def ipc_close_mem_handle(self, dev_ptr: int) -> None:
        self._call("kvc_ipc_close_mem_handle", dev_ptr)


def aligned_bytes(nbytes: int, align: int = 16) -> np.ndarray:
    """A zeroed uint8 array of ``nbytes`` whose data starts on an ``align`` boundary."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def _handle(handle: bytes) -> bytes:
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got "
                         f"{len(handle) if isinstance(handle, (bytes, bytearray)) else handle!r}")
    return bytes(handle)


_lock = threading.Lock()
_lib: KvcLib | None = None
_lib_error: str | None = None


def load() -> KvcLib:
    """Build (cached) and load the library once per process; RuntimeError says why not."""
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = KvcLib(build().path)
            except (OSError, RuntimeError) as e:
                _lib_error = f"{type(e).__name__}: {e}"
        if _lib is None:
            raise RuntimeError(f"CUDA copy library unavailable: {_lib_error}")
        return _lib


def driver_present() -> bool:
    """Whether the NVIDIA driver library loads here (cheap; builds nothing)."""
    try:
        ctypes.CDLL("libcuda.so.1")  # what cudart itself dlopens
        return True
    except OSError:
        return ctypes.util.find_library("cuda") is not None


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
