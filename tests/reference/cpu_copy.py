"""The reference CPU block copy (tests only): torch slicing, one block-plane at a time.

What ``kvcached.copy.cpu.CpuCopyEngine`` (native, ``cpu_copy.c``) must do to
the bytes, written to be obviously right rather than fast: device block ``d``
of plane ``p`` is ``planes[p][d]``'s bytes; host block ``h`` holds it at
``host_pool[h, host_offsets[p]:host_offsets[p] + plane bytes]``. Nothing else
of either side changes (host padding between planes included). The ids must
be valid (the engine's own checks are tested separately): the reference does
not validate them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_bytes(plane: torch.Tensor, b: int) -> torch.Tensor:
    """Device block ``b`` of ``plane`` as a writable uint8 view (any dtype, any
    block stride: a block is one contiguous run of bytes)."""
    return plane[b].reshape(-1).view(torch.uint8)


class ReferenceCpuCopy:
    """``swap_out`` / ``swap_in`` with CpuCopyEngine's signatures and return values."""

    def __init__(self, planes: Sequence[torch.Tensor], host_pool: torch.Tensor,
                 host_offsets: Sequence[int]):
        self.planes = list(planes)
        self.host_pool = host_pool
        self.host_offsets = [int(o) for o in host_offsets]
        self.bytes_per_block = sum(block_bytes(p, 0).numel() for p in self.planes)

    def _slot(self, h: int, p: int, nbytes: int) -> torch.Tensor:
        off = self.host_offsets[p]
        return self.host_pool[h, off:off + nbytes]

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> int:
        """Device block ``device_ids[i]`` -> host block ``host_ids[i]``; returns bytes moved."""
        for d, h in zip(device_ids, host_ids, strict=True):
            for p, plane in enumerate(self.planes):
                src = block_bytes(plane, int(d))
                self._slot(int(h), p, src.numel()).copy_(src)
        return len(device_ids) * self.bytes_per_block

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> int:
        """Host block ``host_ids[i]`` -> device block ``device_ids[i]``; returns bytes moved."""
        for h, d in zip(host_ids, device_ids, strict=True):
            for p, plane in enumerate(self.planes):
                dst = block_bytes(plane, int(d))
                dst.copy_(self._slot(int(h), p, dst.numel()))
        return len(device_ids) * self.bytes_per_block
