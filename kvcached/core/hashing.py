"""Chained block hashes, stable across processes and machines.

``h_i = blake2b(h_{i-1} || extra_key || tokens_i as little-endian int64)`` with
``h_{-1} = blake2b(namespace)``. Never Python's ``hash()``: it is salted per
process. The namespace folds in the model, the weight version and a salt so
caches of different models or weights never share a block.

``block_hashes`` runs in native code when it can: ``cuda/block_hash.c``, a
small CPython extension with its own BLAKE2b, built lazily on first use into
the kvcached build cache (``kvcached.copy.native_build``) and reading list
items directly. Its results are byte-identical to ``_block_hashes_py``, the
pure-Python reference (numpy conversion + hashlib), which is used when there
is no compiler or Python headers (one warning) or ``KVCACHED_NO_NATIVE=1``
(read once, at the first call).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Sequence
from hashlib import blake2b
from pathlib import Path
from types import ModuleType

import numpy as np

DIGEST = 16
NATIVE_SOURCE = Path(__file__).resolve().parents[2] / "cuda" / "block_hash.c"
NATIVE_MODULE = "kvcached._block_hash"  # PyInit__block_hash in block_hash.c


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
    ``start`` is 0). A partial trailing block is never hashed. ``token_ids``
    is a list or tuple of ints, a numpy array or anything numpy converts.
    """
    mod = _native
    if mod is _UNTRIED:
        mod = load_native()
    if mod is None:
        return _block_hashes_py(parent, token_ids, block_size, extra_key, start, stop)
    full = len(token_ids) // block_size
    stop = full if stop is None else min(stop, full)
    if stop <= start:
        return []
    if type(parent) is not bytes or type(block_size) is not int or start < 0:
        # Odd arguments: the reference defines what they do (or raise).
        return _block_hashes_py(parent, token_ids, block_size, extra_key, start, stop)
    extra = _extra_bytes(extra_key)
    try:
        if isinstance(token_ids, (list, tuple)):
            return mod.chain(parent, token_ids, block_size, extra, start, stop)
        arr = _token_array(token_ids, start * block_size, stop * block_size)
        if arr.ndim == 1:
            return mod.chain(parent, np.ascontiguousarray(arr), block_size, extra, 0,
                             stop - start)
    except TypeError:
        # An item that is not an int (a float, a string): the reference converts
        # it through numpy exactly as before, or raises numpy's error.
        pass
    return _block_hashes_py(parent, token_ids, block_size, extra_key, start, stop)


def block_hashes_memo(parent: bytes, token_ids: Sequence[int], block_size: int,
                      extra_key: object, memo, start: int = 0, stop: int | None = None
                      ) -> tuple[list[bytes], list[bytes] | None, list[int] | None]:
    """``block_hashes`` that skips BLAKE2b for blocks the cache already holds.

    ``memo`` finds a candidate node for each block's key: a tree node (the
    one block ``start`` hangs under; each block asks the previous block's
    node ``memo_child(key)``, and the first miss ends the walk), a flat dict
    ``{key: node}``, or None (no memo). A candidate has ``input`` (its memo
    record: the bytes it was hashed from, parent hash ‖ extra key ‖ tokens,
    with token ids narrowed to uint16 or uint32 where they fit; see ``hash_input``) and
    ``hash``: when a block's record equals a node's, the node's hash is taken
    (equal records, equal inputs, equal hashes; the key, computed from what
    follows the parent hash, only picks the candidate). Returns ``(hashes,
    records, keys)``: the same hashes as ``block_hashes``, plus each block's
    record and memo key for new nodes to be remembered by; records and keys
    are None on the Python path (no memo: every block is hashed).
    """
    mod = _native
    if mod is _UNTRIED:
        mod = load_native()
    if mod is not None and type(parent) is bytes and type(block_size) is int and start >= 0:
        full = len(token_ids) // block_size
        stop = full if stop is None else min(stop, full)
        if stop <= start:
            return [], [], []
        extra = b"" if extra_key is None else _extra_bytes(extra_key)
        try:
            if isinstance(token_ids, (list, tuple)):
                return mod.chain_memo(parent, token_ids, block_size, extra, start, stop, memo)
            arr = _token_array(token_ids, start * block_size, stop * block_size)
            if arr.ndim == 1:
                return mod.chain_memo(parent, np.ascontiguousarray(arr), block_size, extra, 0,
                                      stop - start, memo)
        except TypeError:
            pass  # an odd token: the reference path decides (see block_hashes)
    return block_hashes(parent, token_ids, block_size, extra_key, start, stop), None, None


def memo_key(record: bytes) -> int:
    """The memo key of one block's memo record (native path only; process-local)."""
    return load_native().memo_key(record)


def hash_input(record: bytes, block_size: int) -> bytes:
    """The BLAKE2b input a memo record stands for (parent ‖ extra ‖ tokens as
    int64): a record narrows the ids to uint16 or uint32 when they all fit,
    marked by its last byte (2, 4, or 8 for the int64 form)."""
    width = record[-1] if record else 0
    if width not in (2, 4, 8) or len(record) < 1 + width * block_size:
        raise ValueError(f"not a memo record of {block_size}-token blocks "
                         f"({len(record)} bytes, width byte {width})")
    split = len(record) - 1 - width * block_size
    ids = record[split:-1]
    if width != 8:
        ids = np.frombuffer(ids, dtype=f"<u{width}").astype("<i8").tobytes()
    return record[:split] + ids


def _block_hashes_py(parent: bytes, token_ids: Sequence[int], block_size: int,
                     extra_key: object = None, start: int = 0,
                     stop: int | None = None) -> list[bytes]:
    """Pure-Python reference of ``block_hashes`` (numpy conversion + hashlib)."""
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
    return _token_array(token_ids, lo, hi).tobytes()


def _token_array(token_ids: Sequence[int], lo: int, hi: int) -> np.ndarray:
    """Tokens ``lo..hi-1`` as a little-endian int64 array (lists, arrays or tensors)."""
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids[lo:hi], dtype="<i8")
    if isinstance(token_ids, list):  # fromiter beats asarray on Python lists
        return np.fromiter(token_ids[lo:hi], dtype="<i8", count=hi - lo)
    return np.asarray(token_ids[lo:hi], dtype="<i8")


# ------------------------------------------------------------------ native
_UNTRIED = object()
_native: ModuleType | None | object = _UNTRIED  # the extension, None (Python path), or untried
_native_error: str | None = None  # why the Python path is used
_node_api: object | None = None  # kvcached._tree_node's capsule (register_node_api)
_native_lock = threading.Lock()


def load_native() -> ModuleType | None:
    """The native extension, built (once, cached on disk) and loaded at the first
    call; None when the Python path is used, with one warning saying why."""
    global _native, _native_error
    with _native_lock:
        if _native is _UNTRIED:
            _native, _native_error = _native_build().try_import_extension(
                NATIVE_MODULE, NATIVE_SOURCE, "kvc_block_hash", "native block hashing",
                headers=[NATIVE_SOURCE.with_name("node_api.h")])
            if _native is not None and _node_api is not None:
                _native.set_node_api(_node_api)
        return _native  # type: ignore[return-value]


def register_node_api(capsule: object) -> None:
    """kvcached.core.tree's native node type, for ``chain_memo``'s walk to read its
    nodes directly instead of through a Python call per block."""
    global _node_api
    with _native_lock:
        _node_api = capsule
        if isinstance(_native, ModuleType):
            _native.set_node_api(capsule)


def native_error() -> str | None:
    """Why the Python path is used (None while native hashing is used or untried)."""
    return _native_error


def _native_build() -> ModuleType:
    """``kvcached.copy.native_build``; loaded by path when this module was too
    (as the cross-process tests do), so the kvcached package (and torch) stays
    unimported."""
    if __name__ == "kvcached.core.hashing":
        from kvcached.copy import native_build
        return native_build
    name = "_kvcached_native_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "copy" / "native_build.py")
        if spec is None or spec.loader is None:
            raise ImportError("cannot find kvcached/copy/native_build.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name]
