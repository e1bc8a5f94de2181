"""The CUDA library of kvcached, bound with ctypes: build, load, one typed method per C function.

``cuda/kv_copy.cu`` (C API in ``cuda/kv_copy.h``) holds the copy kernel, its
validating launcher and thin CUDA runtime helpers (devices, pinned host
memory, streams, events, IPC handles). This module builds it with ``nvcc``
on first use (cached by :mod:`kvcached.native_build`), loads it once per
process and turns every non-zero status into :class:`CudaCopyError`. It sits
below both the copy engine (:mod:`kvcached.copy.cuda`) and the memory
sharing code (:mod:`kvcached.memory.cuda_ipc`), which both call it.
Importing it builds and loads nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcached.native_build import BuildError, build_shared_library

logger = logging.getLogger(__name__)

SOURCE_NAMES = ("kv_copy.cu", "kv_copy.h")


def _source_dir() -> Path:
    """Where the CUDA sources are: in the installed package (``native/cuda/``,
    put there by setup.py's build_py), else in the checkout's ``cuda/`` (an
    editable install, or the source tree on sys.path)."""
    here = Path(__file__).resolve().parent
    candidates = (here / "native" / "cuda", here.parent / "cuda")
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
