"""Chained block hashes, stable across processes and machines.

``h_i = blake2b(h_{i-1} || extra_key || tokens_i as little-endian int64)`` with
``h_{-1} = blake2b(namespace)``. Never Python's ``hash()``: it is salted per
process. The namespace folds in the model, the weight version and a salt so
caches of different models or weights never share a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

DIGEST = 16


def namespace_hash(model_id: str, weight_version: str, salt: str = "") -> bytes:
    """Root of every chain for one (model, weights, salt)."""
    raw = "\x00".join(("kvcached/v1", model_id, weight_version, salt)).encode()
    return blake2b(raw, digest_size=DIGEST).digest()


def _extra_bytes(extra_key: object) -> bytes:
    if extra_key is None:
        return b""
    if isinstance(extra_key, bytes):
        return extra_key
    if isinstance(extra_key, str):
        return extra_key.encode()
    if isinstance(extra_key, int):
        return str(extra_key).encode()
    if isinstance(extra_key, (tuple, list)):
        return b"\x1f".join(_extra_bytes(x) for x in extra_key)
    raise TypeError(f"extra_key must be bytes, str, int or a tuple of them, got {type(extra_key).__name__}")


def block_hashes(parent: bytes, token_ids: Sequence[int], block_size: int,
                 extra_key: object = None, start: int = 0, stop: int | None = None) -> list[bytes]:
    """Hashes of full blocks ``start..stop-1`` of ``token_ids``, chained from ``parent``.

    ``parent`` is the hash of block ``start-1`` (or the namespace hash when
    ``start`` is 0). A partial trailing block is never hashed.
    """
    full = len(token_ids) // block_size
    stop = full if stop is None else min(stop, full)
    if stop <= start:
        return []
    extra = _extra_bytes(extra_key)
    raw = _token_bytes(token_ids, start * block_size, stop * block_size)
    step = block_size * 8
    out = []
    h = parent
    for pos in range(0, len(raw), step):
        # One-shot digest of one buffer: cheaper than blake2b() + update() calls.
        h = blake2b(h + extra + raw[pos:pos + step], digest_size=DIGEST).digest()
        out.append(h)
    return out


def _token_bytes(token_ids: Sequence[int], lo: int, hi: int) -> bytes:
    """Tokens ``lo..hi-1`` as little-endian int64 bytes (lists, arrays or tensors)."""
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids[lo:hi], dtype="<i8").tobytes()
    if isinstance(token_ids, list):  # fromiter beats asarray on Python lists
        return np.fromiter(token_ids[lo:hi], dtype="<i8", count=hi - lo).tobytes()
    return np.asarray(token_ids[lo:hi], dtype="<i8").tobytes()
