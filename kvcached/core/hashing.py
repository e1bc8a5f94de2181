"""Chained block hashes, stable across processes and machines.

``h_i = blake2b(h_{i-1} || extra_key || tokens_i as little-endian int64)`` with
``h_{-1} = namespace_hash(model, weight version, salt)``. Never Python's
``hash()``: it is salted per process. The namespace keeps caches of different
models or weights apart; ``extra_key`` (a LoRA id, multimodal hashes) keeps
requests apart that share tokens but not KV.

The hashing itself is native (``kvcached.core._core``, BLAKE2b in C); the
manager hashes a prompt inside the core, with the hash memo (see
kvcached/native/core/hashing.h). ``block_hashes`` is the same chain for
callers outside the manager (storage tools, trace replay, tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from kvcached.core import _core

DIGEST = 16


def namespace_hash(model_id: str, weight_version: str, salt: str = "") -> bytes:
    """Root of every chain for one (model, weights, salt)."""
    raw = "\x00".join(("kvcached/v1", model_id, weight_version, salt)).encode()
    return blake2b(raw, digest_size=DIGEST).digest()


def engine_key(namespace: bytes, engine_hash: bytes) -> bytes:
    """kvcached's key of an engine's own block hash (as the core derives it:
    the namespace keeps models apart)."""
    return blake2b(namespace + engine_hash, digest_size=DIGEST).digest()


def extra_bytes(extra_key: object) -> bytes:
    """The bytes an extra key contributes to every block hash of a request."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, bytes):
        return extra_key
    if isinstance(extra_key, str):
        return extra_key.encode()
    if isinstance(extra_key, int):
        return str(extra_key).encode()
    if isinstance(extra_key, (tuple, list)):
        return b"\x1f".join(extra_bytes(x) for x in extra_key)
    raise TypeError("extra_key must be bytes, str, int or a tuple of them, "
                    f"got {type(extra_key).__name__}")


def token_input(tokens: Sequence[int]):
    """Tokens as the core reads them: a list or tuple of ints, or a contiguous
    integer buffer (numpy, array) as they are; anything else (a strided view,
    a range, a tensor) as a list."""
    if isinstance(tokens, (list, tuple)):
        return tokens
    try:
        with memoryview(tokens) as view:
            if view.c_contiguous:
                return tokens
    except TypeError:
        pass
    return list(tokens)


def block_hashes(parent: bytes, token_ids: Sequence[int], block_size: int,
                 extra_key: object = None, start: int = 0, stop: int | None = None) -> list[bytes]:
    """Hashes of full blocks ``start..stop-1`` of ``token_ids``, chained from ``parent``
    (the hash of block ``start-1``, or the namespace hash when ``start`` is 0).
    A partial trailing block is never hashed."""
    full = len(token_ids) // block_size
    stop = full if stop is None else min(stop, full)
    if stop <= start:
        return []
    return _core.chain(parent, token_input(token_ids), block_size, extra_bytes(extra_key),
                       start, stop)


def hash_input(record: bytes, parent: bytes, block_size: int, has_namespace: bool) -> bytes:
    """The BLAKE2b input a node's memo record stands for (its parent's hash, or
    the namespace the record carries for a first block, then the extra key and
    the ids widened back to int64): what the invariant check rehashes."""
    return _core.record_input(record, parent, block_size, has_namespace)


def impl() -> str:
    """The BLAKE2b compress in use: "avx512", "avx2" or "portable"."""
    return _core.impl()


def impls() -> tuple[str, ...]:
    """The compress implementations this CPU runs, best first."""
    return _core.impls()


def set_impl(name: str) -> str:
    """Use another compress implementation (tests, benchmarks); returns the previous."""
    return _core.set_impl(name)
