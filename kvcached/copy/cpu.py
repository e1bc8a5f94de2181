"""CpuCopyEngine: move KV blocks between device planes and the host pool on the CPU.

The device side is a list of planes (one tensor per layer K/V/scale, dim 0 =
block, each block one contiguous run of bytes); the host side is the
block-major pool ``[num_cpu_blocks, block_bytes]`` with plane p of a block at
``host_offsets[p]`` (see ``kvcached.layout``).

The copy is the extension ``kvcached.copy._cpu_copy`` (``kvcached/native/copy/``,
compiled at install by setup.py): memcpy per block-plane, optionally split
over pthreads, about memcpy speed, with the GIL released while blocks move so
a worker's other threads keep running. This module checks the tensors and
hands their addresses to its ``Engine``.

Every id is checked before any byte moves: a bad id raises ValueError naming
it, and neither side is touched. Lists and tuples of ints go to the extension
as they are, which reads and checks them itself (a one-block task is mostly
call overhead); any other sequence becomes an int64 array first. The C copy
checks the ids again on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

from kvcached.copy import _cpu_copy  # built at install (setup.py): kvcached/native/copy/

TO_HOST, TO_DEVICE = _cpu_copy.TO_HOST, _cpu_copy.TO_DEVICE
_DIRECT_IDS = (list, tuple)  # id containers the extension reads itself


class CpuCopyEngine:
    """Copies blocks between ``planes`` and ``host_pool`` for all planes in one call.

    ``threads``: large copies are split over up to this many threads.
    """

    def __init__(self, planes: list[torch.Tensor], host_pool: torch.Tensor,
                 host_offsets: Sequence[int], threads: int = 1):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.planes = list(planes)
        self.host_pool = host_pool
        self.num_device_blocks = _check_planes(self.planes)
        self.num_host_blocks, self.host_block_bytes = _check_host_pool(host_pool)
        elem = [p.element_size() for p in self.planes]
        self.plane_bytes = [_numel(p) * e for p, e in zip(self.planes, elem, strict=True)]
        self.stride_bytes = [p.stride(0) * e for p, e in zip(self.planes, elem, strict=True)]
        self.host_offsets = _check_offsets(host_offsets, self.plane_bytes, self.host_block_bytes)
        self._bytes_per_block = sum(self.plane_bytes)
        # The native engine keeps the tensors alive itself (keep=): it holds
        # raw addresses into them, whoever ends up holding it.
        self._native = _cpu_copy.Engine(
            [p.data_ptr() for p in self.planes], self.stride_bytes, self.plane_bytes,
            self.host_offsets, self.num_device_blocks, host_pool.data_ptr(),
            self.host_block_bytes, self.num_host_blocks, threads,
            keep=(tuple(self.planes), host_pool))
        self._copy = self._native.copy  # bound once: a call is then one lookup less

    @property
    def bytes_per_block(self) -> int:
        """Payload bytes moved per block (all planes, without host padding)."""
        return self._bytes_per_block

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> int:
        """Copy device blocks ``device_ids[i]`` to host blocks ``host_ids[i]``; returns bytes moved."""
        if type(device_ids) not in _DIRECT_IDS or type(host_ids) not in _DIRECT_IDS:
            device_ids, host_ids = _as_ids(device_ids, "device"), _as_ids(host_ids, "host")
        return self._copy(device_ids, host_ids, TO_HOST)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> int:
        """Copy host blocks ``host_ids[i]`` to device blocks ``device_ids[i]``; returns bytes moved."""
        if type(device_ids) not in _DIRECT_IDS or type(host_ids) not in _DIRECT_IDS:
            device_ids, host_ids = _as_ids(device_ids, "device"), _as_ids(host_ids, "host")
        return self._copy(device_ids, host_ids, TO_DEVICE)


# -------------------------------------------------------------------- helpers
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
    """Any id sequence but a list or tuple, as the int64 array the extension reads
    in place; the checks numpy's conversion needs (integers, flat, fitting int64)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{side} ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{side} ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(arr))
        raise ValueError(f"{side} block id {arr[i]} at index {i} does not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)
