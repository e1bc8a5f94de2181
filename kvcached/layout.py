"""KV layout: the "planes" a rank holds and the block-major host span of a block.

A plane is one tensor whose first dimension is the block: layer l's K, its V
(absent for MLA) and, for fp8 caches, its scale tensor. The copy engines only
need, per plane, the bytes of one block; the host pool stores a block's planes
back to back (each aligned to 16 bytes for vector copies) in one span.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def __getattr__(name: str) -> Any:
    """``TORCH_DTYPES`` (dtype name -> torch.dtype), built on first use: the config,
    and with it the control client, must not import torch (PEP 562)."""
    if name != "TORCH_DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch
    table = {dtype: getattr(torch, dtype) for dtype in DTYPE_SIZES}
    globals()["TORCH_DTYPES"] = table
    return table
HOST_ALIGN = 16  # bytes; the CUDA kernel moves 16-byte vectors


def _align(n: int, a: int = HOST_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class PlaneSpec:
    """One KV plane of a rank: ``shape`` excludes the leading block dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def block_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class KVLayout:
    """Per-rank layout: device planes ``[num_blocks, kv_heads, block_size, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    mla: bool = False
    fused_kv: bool = False  # K and V of a layer in one plane (vLLM's CPU attention)

    @cached_property
    def planes(self) -> tuple[PlaneSpec, ...]:
        """Planes in contract order: layer 0 K, layer 0 V, [layer 0 scale], layer 1 K, ...
        (one ``kv`` plane per layer, twice as wide, with ``fused_kv``)."""
        kv_shape = (self.num_kv_heads, self.block_size, self.head_dim)
        if self.fused_kv:
            kinds, kv_shape = ("kv",), (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        else:
            kinds = ("k",) if self.mla else ("k", "v")
        out: list[PlaneSpec] = []
        for layer in range(self.num_layers):
            for kind in kinds:
                out.append(PlaneSpec(f"layer{layer}.{kind}", kv_shape, self.dtype))
            if self.dtype == "float8_e4m3fn":
                # One fp32 scale per (K/V, head, token): what fp8 attention kernels read.
                out.append(PlaneSpec(f"layer{layer}.scale",
                                     (len(kinds), self.num_kv_heads, self.block_size),
                                     "float32"))
        return tuple(out)

    @cached_property
    def plane_bytes(self) -> tuple[int, ...]:
        return tuple(p.block_bytes for p in self.planes)

    @cached_property
    def host_offsets(self) -> tuple[int, ...]:
        """Byte offset of each plane inside a block's host span."""
        offs, pos = [], 0
        for nbytes in self.plane_bytes:
            offs.append(pos)
            pos += _align(nbytes)
        return tuple(offs)

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block in the host pool (all planes, aligned)."""
        return sum(_align(n) for n in self.plane_bytes)

    @cached_property
    def digest(self) -> str:
        """Stable fingerprint: engine and workers must agree on it at handshake."""
        desc = {"block_size": self.block_size,
                "planes": [[p.name, list(p.shape), p.dtype] for p in self.planes]}
        raw = json.dumps(desc, sort_keys=True).encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size,
                "dtype": self.dtype, "mla": self.mla, "fused_kv": self.fused_kv}
