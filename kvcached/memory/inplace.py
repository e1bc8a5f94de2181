"""Move an engine's CPU tensors into shared memory where they are.

vLLM's CPU build allocates its KV cache as ordinary process memory (one
``torch.zeros`` buffer), which a transfer worker in another process cannot
reach, and the model runner holds views of it everywhere. So the buffer is
not copied elsewhere: its pages are replaced by a shared mapping of the
same bytes at the same addresses. A memory file (``memfd_create``) gets the
buffer's current contents, then is mapped over the buffer with
``MAP_FIXED``; every existing view, pointer and stride stays valid, and a
transfer worker maps the same file through ``/proc/<pid>/fd/<fd>``.

The mapping covers whole pages, so the buffer must own every page it
touches: an allocation of its own (glibc, tcmalloc and jemalloc give large
allocations their own pages; a KV cache is large). A buffer in the malloc
heap shares its first and last pages with other allocations: moved, their
bytes would race with writers during the move, and every forked child would
then write into this process's heap. Such a buffer is refused, and
``own_pages_for_large_allocations`` (called before the engine allocates its
KV cache) makes glibc give even a small one its own pages. It is done a chunk at a time, so the move never holds two
copies of the cache. The engine must not write the buffer while it moves (vLLM
registers its KV cache before the first forward). A memory file is not
limited by the size of /dev/shm, and it disappears with the process: nothing
is left behind by an engine that dies.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass

from kvcached.memory import shm

logger = logging.getLogger(__name__)

_CHUNK = 64 << 20  # bytes copied into the file per write
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]


_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the most its dynamic threshold rises to


def own_pages_for_large_allocations(large: bool = True) -> bool:
    """``large`` True: every allocation of 1 MiB or more gets pages of its own
    (glibc's mmap threshold); False: back to a threshold of 32 MiB, the most
    glibc's own dynamic one rises to (so that the engine's later allocations
    are served as usual). Returns whether the allocator took it (only glibc
    has ``mallopt``). glibc still serves a large request from a free chunk
    the heap already holds, so this works in a young process (vLLM's worker
    allocates its KV cache soon after start); a buffer that lands in the heap
    anyway is refused by ``share_in_place``."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, (1 << 20) if large else _GLIBC_MMAP_THRESHOLD_MAX))


def _heap_overlaps(start: int, end: int) -> bool:
    """Whether [start, end) overlaps the malloc heap (``[heap]`` in /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if start < hi and lo < end:
                    return True
    return False


@dataclass(frozen=True)
class SharedRegion:
    """A range of this process's memory now backed by a shared memory file."""

    path: str  # /proc/<pid>/fd/<fd>: how another process maps it
    fd: int
    base: int  # page-aligned start address
    nbytes: int


def share_in_place(address: int, nbytes: int, name: str, keepalive: object) -> SharedRegion:
    """Back ``nbytes`` of this process's memory at ``address`` (and the rest of
    their pages) by a new memory file, in place; registers it with
    ``kvcached.memory.shm`` so that tensors inside it can be exported.
    ``keepalive`` (the tensor owning the memory) is held as long as it is
    registered. Raises OSError when the kernel refuses (the memory is then
    unchanged)."""
    if nbytes <= 0:
        raise ValueError(f"nothing to share: {nbytes} bytes")
    page = mmap.PAGESIZE
    base = address - address % page
    size = -(-(address + nbytes - base) // page) * page
    if _heap_overlaps(base, base + size):
        raise ValueError(
            f"{name}: the buffer at {address:#x} ({nbytes} bytes) lies in the malloc heap, "
            "where its first and last pages hold other allocations that must not be shared "
            "with another process; allocate it on pages of its own (an allocation of 1 MiB "
            "or more after own_pages_for_large_allocations(), or an mmap)")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10  # MAP_FIXED
    try:
        os.ftruncate(fd, size)
        # Chunk by chunk: each chunk's private pages are freed as soon as the
        # file's replace them, so the move needs one chunk of extra memory, not
        # a second copy of the KV cache. A failure part-way leaves every byte
        # where it was (moved chunks hold the same data).
        for off in range(0, size, _CHUNK):
            n = min(_CHUNK, size - off)
            if os.pwrite(fd, (ctypes.c_char * n).from_address(base + off), off) != n:
                raise OSError(f"short write into the memory file for {name}")
            if _libc.mmap(base + off, n, prot, flags, fd, off) != base + off:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap over {n} bytes at {base + off:#x} failed: "
                                   f"{os.strerror(err)}")
    except BaseException:
        os.close(fd)
        raise
    region = SharedRegion(f"/proc/{os.getpid()}/fd/{fd}", fd, base, size)
    shm.register_mapping(region.path, base, size, keepalive)
    logger.info("moved %s into shared memory in place (%s, %.1f MiB)", name, region.path,
                size / 2**20)
    return region
