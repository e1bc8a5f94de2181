"""Native fast paths of the swap task wire (``kvcached/transfer/native/swap_wire.c``).

Worker side:

``swap_server(engine, rank, limits, max_blocks)`` returns ``serve(raw) ->
bytes | None``: for a Task frame of the common shape (a swap or noop of at
most ``max_blocks`` blocks, the ids in range) it copies the blocks and
returns the Done frame to send, byte-identical to what the Python path
(``Worker.execute`` + ``protocol.encode_done``) sends; for any other frame
it returns None, having touched nothing, and the Python path handles it.
At TP=4 this took a worker's user CPU per 1-block task from 73-91 to 29-31
us, 0.39 us of it this call (warm); docs/benchmarks.md has the numbers.

``swap_server`` returns None, and the worker stays on the Python path, when
the engine is not the native CPU copy engine (the CUDA engine, the torch
fallback), when ``KVCACHED_NO_NATIVE`` is set, or when the extension cannot
be built (one warning, saying why).

Coordinator side: ``done_parser(limits)`` returns ``parse(raw)``, which gives
a Done frame's fields exactly as ``protocol.done_fields`` does, reading the
common frame natively and handing any other to ``done_fields``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from kvcached.transfer import protocol as P

NATIVE_SOURCE = Path(__file__).resolve().parent / "native" / "swap_wire.c"
NATIVE_MODULE = "kvcached._swap_wire"  # PyInit__swap_wire in swap_wire.c

_UNTRIED = object()
_native: ModuleType | None | object = _UNTRIED
_native_error: str | None = None
_lock = threading.Lock()


def load_native() -> ModuleType | None:
    """The extension, built (once, cached on disk) and loaded at the first call;
    None when the Python path is used, with one warning saying why."""
    global _native, _native_error
    with _lock:
        if _native is _UNTRIED:
            from kvcached.copy import native_build
            _native, _native_error = native_build.try_import_extension(
                NATIVE_MODULE, NATIVE_SOURCE, "kvc_swap_wire", "native swap fast path")
        return _native  # type: ignore[return-value]


def native_error() -> str | None:
    """Why the Python path is used (None while the extension is used or untried)."""
    return _native_error


def swap_server(engine, rank: int, limits: P.Limits,
                max_blocks: int) -> Callable[[bytes], bytes | None] | None:
    """``serve(raw)`` for ``engine`` (a native ``CpuCopyEngine``), or None (see above).

    The ids a served task may name are bounded by both the protocol limits and
    the engine's pools; anything else is left to the Python path, which words
    the error. ``serve`` keeps ``engine`` alive (the C side uses its pointers).
    """
    handles = getattr(engine, "native_handles", lambda: None)()
    mod = load_native() if handles is not None else None
    if mod is None:
        return None
    engine_addr, copy_fn = handles
    device = min(engine.num_device_blocks, _bound(limits.num_device_blocks))
    host = min(engine.num_host_blocks, _bound(limits.num_host_blocks))
    return mod.server(engine, engine_addr, copy_fn, rank, engine.bytes_per_block, max_blocks,
                      wire_limits(limits, device, host))


def done_parser(limits: P.Limits) -> Callable[[bytes], tuple | None]:
    """``parse(raw)``: the coordinator's reading of a Done frame, as
    ``protocol.done_fields(raw, limits)`` gives it, natively where it can."""
    mod = load_native()
    python = functools.partial(P.done_fields, limits=limits)
    if mod is None:
        return python
    native = mod.done_parser(wire_limits(limits))

    def parse(raw: bytes) -> tuple | None:
        fields = native(raw)
        return fields if fields is not None else python(raw)

    return parse


def wire_limits(limits: P.Limits, device: int | None = None,
                host: int | None = None) -> tuple[int, ...]:
    """``limits`` as the C side takes them (exclusive id bounds, int64)."""
    return (P.PROTOCOL_VERSION, limits.max_frame_bytes, limits.max_ids, limits.max_str,
            limits.max_map, _bound(limits.num_device_blocks if device is None else device),
            _bound(limits.num_host_blocks if host is None else host))


def _bound(limit: int | None) -> int:
    return P.INT64_MAX if limit is None else limit
