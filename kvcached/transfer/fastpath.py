"""Native fast paths of the swap task wire (``kvcached/transfer/native/swap_wire.c``,
compiled at install into ``kvcached.transfer._swap_wire`` by setup.py).

Worker side:

``swap_server(engine, rank, limits, max_blocks)`` returns ``serve(raw) ->
bytes | None``: for a Task frame of the common shape (a swap or noop of at
most ``max_blocks`` blocks, the ids in range) it copies the blocks and
returns the Done frame to send, byte-identical to what the Python path
(``Worker.execute`` + ``protocol.encode_done``) sends; for any other frame
it returns None, having touched nothing, and the Python path handles it.
A small swap then costs the worker one native call instead of a msgpack
decode, a task object and an encode in Python: less than half the worker's
CPU time per task (docs/benchmarks.md, transfer).

``swap_server`` returns None, and every task takes the Python path, when
the engine is not the CPU copy engine (the CUDA engine, or no engine).

Coordinator side: ``done_parser(limits)`` returns ``parse(raw)``, which gives
a Done frame's fields exactly as ``protocol.done_fields`` does, reading the
common frame natively and handing any other to ``done_fields``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvcached.transfer import _swap_wire  # built at install (setup.py): swap_wire.c
from kvcached.transfer import protocol as P


def swap_server(engine, rank: int, limits: P.Limits,
                max_blocks: int) -> Callable[[bytes], bytes | None] | None:
    """``serve(raw)`` for ``engine`` (a ``CpuCopyEngine``), or None (see above).

    The ids a served task may name are bounded by both the protocol limits and
    the engine's pools; anything else is left to the Python path, which words
    the error. ``serve`` keeps ``engine`` alive (the C side uses its pointers).
    """
    native_handles = getattr(engine, "native_handles", None)
    if native_handles is None:
        return None
    engine_addr, copy_fn = native_handles()
    device = min(engine.num_device_blocks, _bound(limits.num_device_blocks))
    host = min(engine.num_host_blocks, _bound(limits.num_host_blocks))
    return _swap_wire.server(engine, engine_addr, copy_fn, rank, engine.bytes_per_block,
                             max_blocks, wire_limits(limits, device, host))


def done_parser(limits: P.Limits) -> Callable[[bytes], tuple | None]:
    """``parse(raw)``: the coordinator's reading of a Done frame, as
    ``protocol.done_fields(raw, limits)`` gives it: natively for the frames the
    native reader takes, by ``done_fields`` for every other frame."""
    python = functools.partial(P.done_fields, limits=limits)
    native = _swap_wire.done_parser(wire_limits(limits))

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
