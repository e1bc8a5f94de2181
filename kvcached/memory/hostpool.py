"""The per-rank host pool: block-major KV blocks in shared memory (DESIGN §3).

One uint8 tensor ``[num_blocks, block_bytes]``: block i is one contiguous span
holding all of its planes back to back (offsets from ``KVLayout.host_offsets``),
so a block is one storage object, one I/O and one DMA range.

It lives in ``/dev/shm`` under a name derived from the run, the rank and the
owner pid (the engine), not from the worker: a worker that crashes leaves the
pool (and the blocks the manager believes are cached there) intact, and its
restarted successor attaches to the same name.
"""

from __future__ import annotations

import logging
import os

import torch

from kvcached import config
from kvcached.memory import shm

logger = logging.getLogger(__name__)


class HostPool:
    """A rank's host pool mapped in this process. Use :meth:`create` or :meth:`attach`."""

    def __init__(self, name: str, tensor: torch.Tensor, owner_pid: int, created: bool):
        self.name = name
        self.owner_pid = owner_pid
        self.created = created
        self._tensor: torch.Tensor | None = tensor
        self.num_blocks, self.block_bytes = tensor.shape
        # CUDA hook: on the CUDA backend the mapping is pinned here with
        # cudaHostRegister, in chunks (one huge registration fails, vLLM #51080),
        # and unregistered in close(). Added by kvcached's CUDA support.

    # ------------------------------------------------------------ naming
    @staticmethod
    def name_for(run_dir: str | os.PathLike, rank: int, owner_pid: int) -> str:
        """The segment name of rank ``rank``'s pool in run ``run_dir``."""
        return shm.segment_name(owner_pid, shm.run_id(run_dir), rank, "host")

    # ----------------------------------------------------------- factory
    @classmethod
    def create(cls, run_dir: str | os.PathLike, rank: int, num_blocks: int,
               block_bytes: int, owner_pid: int | None = None) -> HostPool:
        """Create the pool (zeroed); ValueError with the sizes if memory does not suffice."""
        owner_pid = os.getpid() if owner_pid is None else owner_pid
        _check_size(rank, num_blocks, block_bytes)
        name = cls.name_for(run_dir, rank, owner_pid)
        if num_blocks * block_bytes >= 1 << 30:  # its memory comes now: ~0.5 s per GiB
            logger.info("allocating the CPU tier of rank %d: %.1f GiB", rank,
                        num_blocks * block_bytes / 2**30)
        tensor = shm.create_shm_tensor(name, (num_blocks, block_bytes), torch.uint8,
                                       hint="lower num_cpu_blocks")
        # The pool is never exported as KV planes; keep only our own reference.
        shm.forget_segment(name)
        logger.info("created host pool %s: %d blocks x %d bytes (%.2f GiB)",
                    name, num_blocks, block_bytes, num_blocks * block_bytes / 2**30)
        return cls(name, tensor, owner_pid, created=True)

    @classmethod
    def attach(cls, run_dir: str | os.PathLike, rank: int, num_blocks: int,
               block_bytes: int, owner_pid: int) -> HostPool:
        """Map an existing pool (e.g. after a worker restart); sizes must match."""
        name = cls.name_for(run_dir, rank, owner_pid)
        tensor = shm.open_shm_tensor(name, (num_blocks, block_bytes), torch.uint8,
                                     run_dir=run_dir)
        logger.info("attached host pool %s (%d blocks)", name, num_blocks)
        return cls(name, tensor, owner_pid, created=False)

    @classmethod
    def open_or_create(cls, run_dir: str | os.PathLike, rank: int, num_blocks: int,
                       block_bytes: int, owner_pid: int) -> HostPool:
        """Attach if the pool exists (a restarted worker), otherwise create it."""
        if shm.segment_path(cls.name_for(run_dir, rank, owner_pid)).exists():
            return cls.attach(run_dir, rank, num_blocks, block_bytes, owner_pid)
        return cls.create(run_dir, rank, num_blocks, block_bytes, owner_pid)

    # ------------------------------------------------------------ access
    @property
    def tensor(self) -> torch.Tensor:
        """The ``[num_blocks, block_bytes]`` uint8 tensor (RuntimeError after close)."""
        if self._tensor is None:
            raise RuntimeError(f"host pool {self.name} is closed")
        return self._tensor

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def block(self, i: int) -> torch.Tensor:
        """Block ``i``'s span as a uint8 view (no copy)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"host block {i} out of range [0, {self.num_blocks})")
        return self.tensor[i]

    # ---------------------------------------------------------- teardown
    def close(self) -> None:
        """Drop this process's mapping (once no views remain); the pool stays."""
        self._tensor = None

    def remove(self) -> None:
        """Unlink the pool's segment. Only its creator or its owner process may."""
        if not (self.created or os.getpid() == self.owner_pid):
            raise RuntimeError(f"host pool {self.name} belongs to pid {self.owner_pid}; "
                               "only its creator or owner removes it")
        shm.remove_segment(self.name)
        logger.info("removed host pool %s", self.name)

    def __repr__(self) -> str:
        return (f"HostPool({self.name!r}, blocks={self.num_blocks}, "
                f"block_bytes={self.block_bytes})")


def _check_size(rank: int, num_blocks: int, block_bytes: int) -> None:
    """Fail at start with the sizes rather than with SIGBUS when pages run out later."""
    if num_blocks <= 0 or block_bytes <= 0:
        raise ValueError(f"host pool needs num_blocks > 0 and block_bytes > 0, "
                         f"got {num_blocks} and {block_bytes}")
    need = num_blocks * block_bytes
    avail = config.available_host_memory()
    if need > avail:
        raise ValueError(
            f"host pool of rank {rank} needs {shm.format_bytes(need)} ({num_blocks} blocks x "
            f"{block_bytes} bytes) but only {shm.format_bytes(avail)} of host memory is "
            "available; lower num_cpu_blocks")
