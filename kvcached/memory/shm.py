"""File-backed shared tensors in ``/dev/shm``: how processes of one run share memory.

A segment is a plain file under :data:`SHM_DIR` mapped shared
(:func:`map_shared`): every process that maps the same file sees the same
bytes, nothing is copied or pickled.

A segment's memory is allocated when it is created (``posix_fallocate``),
and every process maps it populated (``MAP_POPULATE``): a first touch of a
page costs a page fault, and a block of a few hundred KiB is a hundred
pages, so a copy into blocks nobody touched yet ran at a quarter of memory
speed, and a full tmpfs showed up as a SIGBUS in the middle of a copy
instead of as an error at start. We deliberately avoid
``multiprocessing.shared_memory``: its resource tracker unlinks segments that
other processes still use when the creating process exits (DESIGN §5).

Names are ``kvcached-<owner_pid>-<run id>-r<rank>-<kind>``. The owner pid is
the process whose lifetime the segment follows (the engine or model runner),
so :func:`cleanup_stale_segments` can remove the leftovers of dead runs at
start-up without touching live ones.

Segments created by this process are kept in a process-local registry (and
stay mapped until removed), so :mod:`kvcached.memory.kvshare` can tell which segment
and byte offset a CPU tensor lives in.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcached.layout import TORCH_DTYPES
from kvcached.memory.rundir import pid_alive

logger = logging.getLogger(__name__)

SHM_DIR = Path(os.environ.get("KVCACHED_SHM_DIR", "/dev/shm"))
PREFIX = "kvcached-"
_NAME_RE = re.compile(r"^kvcached-(\d+)-")
_KIND_RE = re.compile(r"^[A-Za-z0-9_]+$")
_PROC_FD_RE = re.compile(r"^/proc/\d+/fd/\d+$")


@dataclass
class _Segment:
    """A segment this process created; ``tensor`` keeps the mapping alive."""

    name: str
    base: int  # address of the mapping in this process
    nbytes: int
    tensor: object  # keeps the mapping alive (a tensor over it, or its owner)


# base address -> segment. Holding the tensor means an address can never be
# reused by another allocation while it is registered (no stale lookups).
_REGISTRY: dict[int, _Segment] = {}
_LOCK = threading.Lock()


# ------------------------------------------------------------------ naming
def shm_dir() -> Path:
    """The directory segments live in (read at call time so tests can redirect it)."""
    return SHM_DIR


def run_id(run_dir: str | os.PathLike) -> str:
    """Short id of a run, the same in every process: blake2b of the real run dir path."""
    path = os.path.realpath(os.fspath(run_dir))
    return hashlib.blake2b(path.encode(), digest_size=5).hexdigest()


def segment_name(owner_pid: int, rid: str, rank: int, kind: str) -> str:
    """``kvcached-{owner_pid}-{rid}-r{rank}-{kind}``; ``kind`` is e.g. ``kv`` or ``host``."""
    if owner_pid <= 0 or rank < 0:
        raise ValueError(f"owner_pid must be > 0 and rank >= 0, got {owner_pid}, {rank}")
    if not _KIND_RE.match(kind):
        raise ValueError(f"segment kind must be alphanumeric/underscore, got {kind!r}")
    return f"{PREFIX}{owner_pid}-{rid}-r{rank}-{kind}"


def segment_path(name: str) -> Path:
    """Path of segment ``name`` (rejects names that would escape the shm directory).
    A memory file another process holds open (``/proc/<pid>/fd/<n>``: an
    engine's KV cache allocated in a memfd, kvcached.memory.shared_alloc) is
    its own path."""
    if _PROC_FD_RE.match(name or ""):
        return Path(name)
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return shm_dir() / name


# ---------------------------------------------------------------- create/open
def _to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in TORCH_DTYPES:
        return TORCH_DTYPES[dtype]
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        if int(d) < 0:
            raise ValueError(f"negative dimension in shape {tuple(shape)}")
        n *= int(d)
    return n


def format_bytes(n: int) -> str:
    """``n`` bytes for humans: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def shm_free_bytes() -> int:
    """Bytes still free on the shared-memory filesystem."""
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize


def _check_shm_space(name: str, nbytes: int, hint: str) -> None:
    free = shm_free_bytes()
    if nbytes > free:
        raise ValueError(
            f"shared-memory segment {name!r} needs {format_bytes(nbytes)} but only "
            f"{format_bytes(free)} is free on {shm_dir()}; "
            f"{hint or 'lower the number of blocks'} or enlarge {shm_dir()} "
            "(docker: --shm-size; host: mount -o remount,size=...)")


def create_shm_tensor(name: str, shape: tuple[int, ...] | list[int],
                      dtype: torch.dtype | str, *, hint: str = "") -> torch.Tensor:
    """Create segment ``name`` (must not exist) and map it as a zeroed tensor.

    ``hint`` says what to lower when it does not fit (e.g. "lower num_cpu_blocks").
    The segment is registered as created by this process until :func:`remove_segment`.
    """
    dt = _to_dtype(dtype)
    numel = _numel(shape)
    nbytes = numel * dt.itemsize
    if nbytes == 0:
        raise ValueError(f"shared-memory segment {name!r} would be empty (shape {tuple(shape)})")
    path = segment_path(name)
    _check_shm_space(name, nbytes, hint)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"shared-memory segment {path} already exists: another run uses it, or a "
            "previous one crashed (kvcached.memory.shm.cleanup_stale_segments() removes those "
            "of dead processes)") from None
    try:
        allocate(fd, nbytes, name, hint)
        tensor = map_shared(fd, nbytes).view(dt)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    _register(name, tensor, nbytes)
    logger.debug("created shm segment %s (%d bytes)", name, nbytes)
    return tensor.view(tuple(int(d) for d in shape))


def open_shm_tensor(name: str, shape: tuple[int, ...] | list[int],
                    dtype: torch.dtype | str, *, run_dir: str | os.PathLike | None = None
                    ) -> torch.Tensor:
    """Map an existing segment as a tensor of ``shape``/``dtype`` (its size must match)."""
    dt = _to_dtype(dtype)
    numel = _numel(shape)
    path = segment_path(name)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {path} does not exist: is the engine running? "
            f"run_dir={run_dir}") from None
    if size != numel * dt.itemsize:
        raise ValueError(
            f"shared-memory segment {path} has {size} bytes but {numel * dt.itemsize} were "
            f"expected for shape {tuple(shape)} {dt}: the processes disagree on the layout "
            "or the number of blocks")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        tensor = map_shared(fd, size).view(dt)
    finally:
        os.close(fd)
    return tensor.view(tuple(int(d) for d in shape))


def allocate(fd: int, nbytes: int, name: str, hint: str = "") -> None:
    """Give the file behind ``fd`` all its ``nbytes`` of memory now (zeroed), so
    that a full tmpfs is an error here rather than a SIGBUS at a later touch."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise ValueError(
            f"shared-memory segment {name!r} needs {format_bytes(nbytes)} but the memory "
            f"could not be allocated: {hint or 'lower the number of blocks'} or enlarge "
            f"{shm_dir()} (docker: --shm-size; host: mount -o remount,size=...)") from None


def map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of the file ``fd``, mapped shared
    with its page tables filled in (the tensor keeps the mapping; ``fd`` may be
    closed)."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)


# ---------------------------------------------------------------- registry
def _register(name: str, tensor: torch.Tensor, nbytes: int) -> None:
    seg = _Segment(name, tensor.untyped_storage().data_ptr(), nbytes, tensor)
    with _LOCK:
        _REGISTRY[seg.base] = seg


def register_mapping(name: str, base: int, nbytes: int, keepalive: object) -> None:
    """Register memory this process mapped itself (``base``, ``nbytes``) as segment
    ``name``, so that planes inside it can be exported; ``keepalive`` holds it."""
    with _LOCK:
        _REGISTRY[base] = _Segment(name, base, nbytes, keepalive)


def forget_segment(name: str) -> None:
    """Drop this process's registry entry for ``name`` (the mapping goes with the last view)."""
    with _LOCK:
        for base in [b for b, s in _REGISTRY.items() if s.name == name]:
            del _REGISTRY[base]


def find_segment(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """``(segment name, byte offset, segment bytes)`` holding ``tensor``, or None.

    The whole extent of the tensor (first to last element) must lie in the segment.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    span = 1 + sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride(), strict=True))
    end = start + span * tensor.element_size()
    with _LOCK:
        for seg in _REGISTRY.values():
            if seg.base <= start and end <= seg.base + seg.nbytes:
                return seg.name, start - seg.base, seg.nbytes
    return None


def created_segments() -> list[str]:
    """Names of the segments this process created and has not removed."""
    with _LOCK:
        return sorted({s.name for s in _REGISTRY.values()})


# ----------------------------------------------------------------- cleanup
def remove_segment(name: str) -> bool:
    """Unlink segment ``name`` and forget it; True if a file was removed.

    Processes that still map it keep their memory until they unmap it.
    """
    forget_segment(name)
    try:
        segment_path(name).unlink()
    except FileNotFoundError:
        return False
    logger.debug("removed shm segment %s", name)
    return True


def stale_segments() -> list[str]:
    """Names of ``kvcached-<pid>-*`` segments whose owner pid is gone."""
    try:
        entries = sorted(os.listdir(shm_dir()))
    except FileNotFoundError:
        return []
    return [name for name in entries
            if (m := _NAME_RE.match(name)) is not None and not pid_alive(int(m.group(1)))]


def cleanup_stale_segments(dry_run: bool = False) -> list[str]:
    """Remove ``kvcached-<pid>-*`` segments whose owner pid is gone; return their names
    (``dry_run``: only list them).

    Segments of live pids are never touched, whoever owns them.
    """
    removed: list[str] = []
    for name in stale_segments():
        if dry_run:
            removed.append(name)
            continue
        try:
            (shm_dir() / name).unlink()
        except FileNotFoundError:
            continue  # another process cleaned it first
        except OSError as e:
            logger.warning("could not remove stale shm segment %s: %s", name, e)
            continue
        removed.append(name)
    if removed and not dry_run:
        logger.info("removed %d stale shm segment(s) of dead runs: %s",
                    len(removed), ", ".join(removed))
    return removed
