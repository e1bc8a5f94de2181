"""The reference chained block hashes (tests only): hashlib over numpy bytes.

``h_i = blake2b(h_{i-1} || extra_key || tokens_i as little-endian int64)``,
``h_{-1}`` the namespace hash. The native core must produce the same bytes
(tests/core/test_hashing.py compares them on many inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

from kvcached.core.hashing import extra_bytes, namespace_hash  # noqa: F401 (re-exported)

DIGEST = 16


def block_hashes(parent: bytes, token_ids: Sequence[int], block_size: int,
                 extra_key: object = None, start: int = 0, stop: int | None = None) -> list[bytes]:
    """Hashes of full blocks ``start..stop-1`` of ``token_ids``, chained from ``parent``."""
    full = len(token_ids) // block_size
    stop = full if stop is None else min(stop, full)
    if stop <= start:
        return []
    extra = extra_bytes(extra_key)
    raw = np.asarray(token_ids[start * block_size:stop * block_size], dtype="<i8").tobytes()
    step = block_size * 8
    out, h = [], parent
    for pos in range(0, len(raw), step):
        h = blake2b(h + extra + raw[pos:pos + step], digest_size=DIGEST).digest()
        out.append(h)
    return out
