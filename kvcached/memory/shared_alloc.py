"""CPU tensors allocated in shared memory, for an engine that allocates its
KV cache itself (vLLM's CPU build).

A transfer worker in another process copies blocks in and out of the
engine's KV cache, so the cache must live in memory both can map. vLLM lets
a connector choose the memory its KV cache is allocated in
(``get_mem_pool_context``): inside ``SharedAllocations`` every CPU
``torch.zeros`` / ``torch.empty`` is served from a memory file of its own
(``memfd_create``) mapped shared, instead of from the process's allocator.
Nothing else in the process changes: no allocator setting, no mapping
replaced. The file's memory is allocated (zeroed) and mapped populated at
once, as kvcached.memory.shm does for its segments; a transfer worker maps it
through ``/proc/<pid>/fd/<fd>``, and it disappears with the process, so an
engine that dies leaves nothing behind. A memory file is not limited by the
size of /dev/shm.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from kvcached.memory import shm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRegion:
    """Memory of this process backed by a shared memory file."""

    path: str  # /proc/<pid>/fd/<fd>: how another process maps it
    fd: int
    base: int  # page-aligned start address
    nbytes: int


def shared_empty(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype,
                 name: str) -> tuple[torch.Tensor, SharedRegion]:
    """A zeroed CPU tensor in a new shared memory file, registered with
    ``kvcached.memory.shm`` so that tensors inside it can be exported."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        shm.allocate(fd, size, name, "lower vLLM's KV cache size (--kv-cache-memory-bytes)")
        raw = shm.map_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise
    tensor = raw[:nbytes].view(dtype).view(tuple(shape))
    region = SharedRegion(f"/proc/{os.getpid()}/fd/{fd}", fd, raw.data_ptr(), size)
    shm.register_mapping(region.path, region.base, size, raw)
    logger.info("%s in shared memory (%s, %.1f MiB)", name, region.path, size / 2**20)
    return tensor, region


def _shape_of(args: tuple, kwargs: dict) -> tuple[int, ...]:
    size = kwargs.get("size", args[0] if len(args) == 1 else args)
    if isinstance(size, int):
        return (size,)
    return tuple(int(d) for d in size)


class SharedAllocations(TorchFunctionMode):
    """Inside it, CPU ``torch.zeros`` and ``torch.empty`` allocate in shared
    memory (``shared_empty``); ``regions`` lists what it allocated."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.regions: list[SharedRegion] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.zeros, torch.empty) and self._on_cpu(kwargs) and \
                kwargs.get("out") is None:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            tensor, region = shared_empty(_shape_of(args, kwargs), dtype,
                                          f"{self.name}-{len(self.regions)}")
            self.regions.append(region)
            return tensor
        return func(*args, **kwargs)

    @staticmethod
    def _on_cpu(kwargs: dict) -> bool:
        device = kwargs.get("device")
        return device is None or torch.device(device).type == "cpu"
