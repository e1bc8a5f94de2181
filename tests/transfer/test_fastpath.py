"""The worker's native swap fast path (kvcached/transfer/native/swap_wire.c, built at
install into kvcached.transfer._swap_wire, used through kvcached.transfer.fastpath).

Its contract: it takes exactly the Task frames that ``protocol.quick_wire``
takes (with at most 64 ids per list), copies exactly what the Python path
would, answers with the bytes ``protocol.encode_done`` would send, and
declines (None) anything else without touching memory.
"""

from __future__ import annotations

import gc
import struct
import weakref
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference.cpu_copy import ReferenceCpuCopy

from kvcached.copy.cpu import CpuCopyEngine
from kvcached.transfer import _swap_wire, fastpath
from kvcached.transfer import protocol as P

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
COUNT = st.integers(0, (1 << 63) - 1)  # task ids and block counts (protocol ranges)
RANK = st.integers(0, P.MAX_RANK)
SECONDS = st.floats(0.0, P.MAX_SECONDS)
FAST_MAX_IDS = 64
N_DEV, N_HOST = 12, 10
LIMITS = P.Limits(num_device_blocks=N_DEV, num_host_blocks=N_HOST)


@pytest.fixture(scope="module")
def wire():
    """The extension (built at install: there is no build to skip)."""
    return _swap_wire


def parse(wire, raw: bytes, limits: P.Limits = LIMITS):
    return wire.parse_task(raw, fastpath.wire_limits(limits))


def quick(raw: bytes, limits: P.Limits = LIMITS):
    """What the Python path takes, as parse_task's tuple (None: not taken)."""
    w = P.quick_wire(raw, P.Task, limits)
    if w is None or len(w["src"]) > FAST_MAX_IDS:
        return None
    return (w["task_id"], w["task_kind"], w["src"], w["dst"])


def make_engine(threads: int = 1):
    planes = [torch.randn(N_DEV, 2, 8), torch.randn(N_DEV, 16)]
    host = torch.zeros(N_HOST, 128, dtype=torch.uint8)
    return CpuCopyEngine(planes, host, [0, 64], threads=threads)


# ------------------------------------------------------------------- Done
@settings(max_examples=400, deadline=None)
@given(task_id=COUNT, rank=RANK, blocks=st.integers(0, 1 << 33),
       elapsed=SECONDS, nbytes=INT64, finished=st.floats(allow_nan=False, allow_infinity=False))
def test_done_is_byte_identical_to_encode_done(wire, task_id, rank, blocks, elapsed, nbytes,
                                                finished):
    ours = wire.pack_done(P.PROTOCOL_VERSION, task_id, rank, blocks, elapsed, nbytes, finished)
    ref = P.encode_done(task_id, rank, blocks, elapsed, {"bytes": nbytes, "finished": finished})
    assert ours == ref


# ------------------------------------------------------------------ parse
ids = st.lists(st.integers(0, N_DEV - 1), max_size=FAST_MAX_IDS)


@settings(max_examples=300, deadline=None)
@given(task_id=COUNT, kind=st.sampled_from(["swap_out", "swap_in", "noop"]), data=st.data())
def test_every_quick_task_frame_is_taken(wire, task_id, kind, data):
    n = data.draw(st.integers(0, FAST_MAX_IDS))
    bound = {"swap_out": (N_DEV, N_HOST), "swap_in": (N_HOST, N_DEV),
             "noop": (1 << 63, 1 << 63)}[kind]
    src = data.draw(st.lists(st.integers(0, bound[0] - 1), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, bound[1] - 1), min_size=n, max_size=n))
    raw = P.encode_task(task_id, kind, src, dst, {}, LIMITS)
    assert parse(wire, raw) == (task_id, kind, src, dst) == quick(raw)


def _frames():
    """Task frames, mostly valid, then mutated at the byte level."""
    base = st.builds(
        lambda tid, kind, src, dst: P.encode_task(tid, kind, src, dst[:len(src)] +
                                                  [0] * (len(src) - len(dst)), {}, None),
        COUNT, st.sampled_from(["swap_out", "swap_in", "noop"]), ids, ids)

    def mutate(raw: bytes, data) -> bytes:
        op = data.draw(st.sampled_from(["keep", "flip", "insert", "delete", "truncate",
                                        "append"]))
        if op == "keep" or not raw:
            return raw
        i = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1:]
        if op == "insert":
            return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i:]
        if op == "delete":
            return raw[:i] + raw[i + 1:]
        if op == "truncate":
            return raw[:i]
        return raw + b"\x00"
    return base, mutate


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parse_takes_exactly_what_quick_wire_takes(wire, data):
    base, mutate = _frames()
    raw = mutate(data.draw(base), data)
    assert parse(wire, raw) == quick(raw)


def _pack_raw(entries: list[tuple[bytes, bytes]], header: bytes | None = None) -> bytes:
    """A map frame from already-packed (key, value) pairs, in the given order."""
    head = header if header is not None else bytes([0x80 | len(entries)])
    return head + b"".join(k + v for k, v in entries)


def _p(x) -> bytes:
    return msgpack.packb(x, use_bin_type=True)


def _entries(**override) -> list[tuple[bytes, bytes]]:
    fields = {"v": _p(P.PROTOCOL_VERSION), "kind": _p("task"), "task_id": _p(5),
              "task_kind": _p("swap_out"), "src": _p([1]), "dst": _p([2]), "args": _p({})}
    fields.update(override)
    return [(_p(k), v) for k, v in fields.items()]


CRAFTED = {
    # Encodings msgpack-python never writes but reads all the same: taken.
    "uint64 task_id": (_pack_raw(_entries(task_id=b"\xcf" + struct.pack(">Q", 5))), True),
    "int8 id": (_pack_raw(_entries(src=b"\x91\xd0\x01")), True),
    "str8 key": (_pack_raw([(b"\xd9\x01v", _p(1))] + _entries()[1:]), True),
    "map16 header": (_pack_raw(_entries(), header=b"\xde\x00\x07"), True),
    "array16 ids": (_pack_raw(_entries(src=b"\xdc\x00\x01\x01")), True),
    "empty map16 args": (_pack_raw(_entries(args=b"\xde\x00\x00")), True),
    "keys reordered": (_pack_raw(_entries()[::-1]), True),
    # Not a quick Task: declined by both.
    "task_id above int64": (_pack_raw(_entries(task_id=b"\xcf" + b"\xff" * 8)), False),
    "bool id": (_pack_raw(_entries(src=b"\x91\xc3")), False),
    "float id": (_pack_raw(_entries(src=_p([1.0]))), False),
    "negative id": (_pack_raw(_entries(src=_p([-1]))), False),
    "id at the bound": (_pack_raw(_entries(src=_p([N_DEV]))), False),
    "bin key": (_pack_raw([(b"\xc4\x01v", _p(1))] + _entries()[1:]), False),
    "repeated key": (_pack_raw(_entries()[:6] + [_entries()[0]]), False),
    "args not empty": (_pack_raw(_entries(args=_p({"a": 1}))), False),
    "version 2": (_pack_raw(_entries(v=_p(2))), False),
    "bool version": (_pack_raw(_entries(v=b"\xc3")), False),
    "kind done": (_pack_raw(_entries(kind=_p("done"))), False),
    "store task": (_pack_raw(_entries(task_kind=_p("store"))), False),
    "lengths differ": (_pack_raw(_entries(dst=_p([2, 3]))), False),
    "trailing byte": (_pack_raw(_entries()) + b"\xc0", False),
    "eighth key": (_pack_raw(_entries() + [(_p("x"), _p(1))]), False),
    "not a map": (_p([1, 2, 3]), False),
    "empty": (b"", False),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_frames(wire, name):
    raw, taken = CRAFTED[name]
    assert (parse(wire, raw) is not None) is taken
    assert parse(wire, raw) == quick(raw)


def test_noop_ids_up_to_int64_max_and_long_lists_go_to_python(wire):
    raw = P.encode_task(1, "noop", [P.INT64_MAX], [0], {}, None)
    assert parse(wire, raw) == (1, "noop", [P.INT64_MAX], [0]) == quick(raw)
    long = P.encode_task(2, "noop", list(range(FAST_MAX_IDS + 1)),
                         list(range(FAST_MAX_IDS + 1)), {}, None)
    assert P.quick_wire(long, P.Task, LIMITS) is not None  # Python takes it
    assert parse(wire, long) is None
    small = P.Limits(max_ids=3, num_device_blocks=N_DEV, num_host_blocks=N_HOST)
    four = P.encode_task(3, "swap_out", [0, 1, 2, 3], [0, 1, 2, 3], {}, None)
    assert parse(wire, four, small) is None and quick(four, small) is None
    assert parse(wire, four, P.Limits(max_frame_bytes=len(four) - 1)) is None


# ------------------------------------------------------------------ serve
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.flatten().view(torch.uint8)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_serve_copies_what_the_reference_copies(wire, data):
    engine = make_engine()
    serve = fastpath.swap_server(engine, 3, LIMITS, 8)
    twin = ReferenceCpuCopy([p.clone() for p in engine.planes], engine.host_pool.clone(),
                            engine.host_offsets)
    kind = data.draw(st.sampled_from(["swap_out", "swap_in"]))
    n = data.draw(st.integers(1, 8))
    dev = data.draw(st.lists(st.integers(0, N_DEV - 1), min_size=n, max_size=n, unique=True))
    host = data.draw(st.lists(st.integers(0, N_HOST - 1), min_size=n, max_size=n,
                              unique=True))
    engine.host_pool.random_(0, 255)
    twin.host_pool.copy_(engine.host_pool)
    src, dst = (dev, host) if kind == "swap_out" else (host, dev)
    done = serve(P.encode_task(41, kind, src, dst, {}, LIMITS))
    getattr(twin, kind)(src, dst)
    assert torch.equal(engine.host_pool, twin.host_pool)
    assert all(torch.equal(_bytes(a), _bytes(b))  # random host bytes may be NaNs as floats
               for a, b in zip(engine.planes, twin.planes, strict=True))
    msg = P.decode(done, LIMITS)
    assert (msg.task_id, msg.rank, msg.ok, msg.blocks_done) == (41, 3, True, n)
    assert msg.result["bytes"] == n * engine.bytes_per_block
    assert 0 <= msg.elapsed_s < 1 and msg.result["finished"] > 0
    assert done == P.encode_done(41, 3, n, msg.elapsed_s, msg.result)


def test_serve_declines_and_touches_nothing(wire):
    engine = make_engine()
    # The protocol allows more blocks than this engine has: those ids are the
    # Python path's to refuse (with an error naming them).
    wide = P.Limits(num_device_blocks=100, num_host_blocks=100)
    serve = fastpath.swap_server(engine, 0, wide, 8)
    before = [t.clone() for t in (*engine.planes, engine.host_pool)]
    declined = [
        P.encode_task(1, "swap_out", [N_DEV], [0], {}, wide),        # past the engine
        P.encode_task(2, "swap_in", [N_HOST], [0], {}, wide),
        P.encode_task(3, "swap_out", [0, 1], [4, 4], {}, wide),       # same destination
        P.encode_task(4, "swap_out", list(range(9)), list(range(9)), {}, wide),  # > 8 blocks
        P.encode_task(5, "store", [0], [], {"keys": ["00"]}, wide),
        P.Done(6, 0, True).encode(),
        b"\xff\x00junk",
    ]
    for raw in declined:
        assert serve(raw) is None, raw
    assert serve(bytearray(P.encode_task(7, "noop", [], [], {}, wide))) is None
    after = (*engine.planes, engine.host_pool)
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(before, after, strict=True))
    done = P.decode(serve(P.encode_task(8, "noop", [], [], {}, wide)))
    assert (done.task_id, done.ok, done.blocks_done, done.result["bytes"]) == (8, True, 0, 0)


def test_serve_keeps_its_engine_alive(wire):
    engine = make_engine()
    serve = fastpath.swap_server(engine, 0, LIMITS, 8)
    gone = weakref.ref(engine)
    host = engine.host_pool
    del engine
    gc.collect()
    assert gone() is not None  # the C side still uses its pointers
    assert serve(P.encode_task(1, "swap_out", [2], [3], {}, LIMITS)) is not None
    assert torch.equal(host[3, :64].view(torch.float32), gone().planes[0][2].flatten())
    del serve
    gc.collect()
    assert gone() is None


def test_no_server_without_the_cpu_copy_engine(wire):
    """The CUDA engine (no native_handles) and a rank without a host pool (no
    engine) get no server: every task of theirs takes the Python path."""
    from kvcached.copy.cuda import CudaCopyEngine  # importing builds nothing
    assert not hasattr(CudaCopyEngine, "native_handles")
    assert fastpath.swap_server(None, 0, LIMITS, 8) is None
    assert fastpath.swap_server(object(), 0, LIMITS, 8) is None
    assert fastpath.swap_server(make_engine(), 0, LIMITS, 8) is not None


def test_the_extension_is_built_at_install(wire):
    """swap_wire.c is compiled by setup.py next to fastpath.py; nothing is
    compiled at run time."""
    assert Path(wire.__file__).parent == Path(fastpath.__file__).parent
    assert wire.__name__ == "kvcached.transfer._swap_wire"


def test_server_arguments_are_checked(wire):
    engine = make_engine()
    limits = fastpath.wire_limits(LIMITS)
    with pytest.raises(ValueError, match="copy engine"):
        wire.server(engine, 0, 0, 0, 1, 1, limits)
    with pytest.raises(TypeError, match="7 arguments"):
        wire.server(engine)
    with pytest.raises(TypeError, match="limits must be a tuple"):
        wire.server(engine, 1, 1, 0, 1, 1, limits[:6])
    with pytest.raises(OverflowError):
        wire.done_parser((1 << 64, *limits[1:]))
    with pytest.raises(TypeError):
        wire.parse_task("not bytes", limits)


def test_task_frames_beyond_string_or_map_limits_are_declined(wire):
    raw = P.encode_task(1, "swap_out", [1], [2], {}, LIMITS)
    for small in (P.Limits(max_str=4), P.Limits(max_map=6)):  # "task_kind" / 7 keys
        assert quick(raw, small) is None and parse(wire, raw, small) is None
    assert parse(wire, raw, P.Limits(max_str=9, max_map=7)) == quick(raw) is not None


# ------------------------------------------------------------ Done, read
results = st.dictionaries(st.text(st.characters(max_codepoint=127), max_size=8),
                          st.one_of(INT64, st.floats(allow_nan=False, allow_infinity=False),
                                    st.booleans()),
                          max_size=6)


def native_done(wire, raw: bytes, limits: P.Limits = LIMITS):
    return wire.done_parser(fastpath.wire_limits(limits))(raw)


@settings(max_examples=300, deadline=None)
@given(task_id=COUNT, rank=RANK, ok=st.booleans(),
       error=st.text(st.characters(max_codepoint=127), max_size=40), blocks=COUNT,
       elapsed=SECONDS, result=results)
def test_every_ascii_done_frame_is_read_as_done_fields_reads_it(wire, task_id, rank, ok, error,
                                                                blocks, elapsed, result):
    raw = P.Done(task_id, rank, ok, error, blocks, elapsed, result).encode(LIMITS)
    want = P.done_fields(raw, LIMITS)
    assert want == (task_id, rank, ok, error, result, elapsed)
    assert native_done(wire, raw) == want
    assert fastpath.done_parser(LIMITS)(raw) == want


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_done_reader_takes_nothing_done_fields_does_not(wire, data):
    base = st.builds(lambda *a: P.Done(*a).encode(LIMITS), COUNT, RANK, st.booleans(),
                     st.text(st.characters(max_codepoint=127), max_size=12), COUNT,
                     SECONDS, results)
    _, mutate = _frames()
    raw = mutate(data.draw(base), data)
    want = P.done_fields(raw, LIMITS)
    got = native_done(wire, raw)
    # Native: a subset, with the same fields (repr: a mutation may make a NaN).
    assert got is None or repr(got) == repr(want)
    assert repr(fastpath.done_parser(LIMITS)(raw)) == repr(want)  # and it falls back


def _done_entries(**override) -> list[tuple[bytes, bytes]]:
    fields = {"v": _p(P.PROTOCOL_VERSION), "kind": _p("done"), "task_id": _p(9),
              "rank": _p(1), "ok": _p(True), "error": _p(""), "blocks_done": _p(1),
              "elapsed_s": _p(0.5), "result": _p({"bytes": 64})}
    fields.update(override)
    return [(_p(k), v) for k, v in fields.items()]


DONE_CRAFTED = {
    # (frame, native reads it, done_fields takes it)
    "canonical": (_pack_raw(_done_entries()), True, True),
    "float32 elapsed": (_pack_raw(_done_entries(elapsed_s=b"\xca" + struct.pack(">f", 0.5))),
                        True, True),
    "keys reordered": (_pack_raw(_done_entries()[::-1]), True, True),
    "repeated result key": (_pack_raw(_done_entries(result=b"\x82\xa1a\x01\xa1a\x02")),
                            True, True),
    # Numbers out of their protocol ranges: neither reader takes them.
    "NaN in result": (_pack_raw(_done_entries(result=_p({"a": float("nan")}))), False, False),
    "-inf in result": (_pack_raw(_done_entries(result=_p({"a": float("-inf")}))), False, False),
    "NaN elapsed": (_pack_raw(_done_entries(elapsed_s=_p(float("nan")))), False, False),
    "inf elapsed": (_pack_raw(_done_entries(elapsed_s=_p(float("inf")))), False, False),
    "negative elapsed": (_pack_raw(_done_entries(elapsed_s=_p(-0.5))), False, False),
    "elapsed past MAX_SECONDS": (_pack_raw(_done_entries(elapsed_s=_p(P.MAX_SECONDS * 2))),
                                 False, False),
    "elapsed of MAX_SECONDS": (_pack_raw(_done_entries(elapsed_s=_p(P.MAX_SECONDS))),
                               True, True),
    "negative task id": (_pack_raw(_done_entries(task_id=_p(-9))), False, False),
    "negative rank": (_pack_raw(_done_entries(rank=_p(-1))), False, False),
    "rank of MAX_RANK": (_pack_raw(_done_entries(rank=_p(P.MAX_RANK))), True, True),
    "rank past MAX_RANK": (_pack_raw(_done_entries(rank=_p(P.MAX_RANK + 1))), False, False),
    "negative blocks_done": (_pack_raw(_done_entries(blocks_done=_p(-1))), False, False),
    "non-ASCII error": (_pack_raw(_done_entries(error=_p("dé"))), False, True),
    "non-ASCII result key": (_pack_raw(_done_entries(result=_p({"é": 1}))), False, True),
    "int elapsed": (_pack_raw(_done_entries(elapsed_s=_p(1))), False, False),
    "int ok": (_pack_raw(_done_entries(ok=_p(1))), False, False),
    "nested result": (_pack_raw(_done_entries(result=_p({"a": [1]}))), False, False),
    "str result value": (_pack_raw(_done_entries(result=_p({"a": "x"}))), False, False),
    "error too long": (_pack_raw(_done_entries(error=_p("x" * (LIMITS.max_str // 4 + 1)))),
                       False, False),
    "result key above int64": (_pack_raw(_done_entries(result=b"\x81\xa1a\xcf" + b"\xff" * 8)),
                               False, False),
    "repeated key": (_pack_raw(_done_entries()[:8] + [_done_entries()[0]]), False, False),
    "kind task": (_pack_raw(_done_entries(kind=_p("task"))), False, False),
    "trailing byte": (_pack_raw(_done_entries()) + b"\x00", False, False),
}


@pytest.mark.parametrize("name", list(DONE_CRAFTED))
def test_crafted_done_frames(wire, name):
    raw, native_reads, python_takes = DONE_CRAFTED[name]
    want = P.done_fields(raw, LIMITS)
    assert (want is not None) is python_takes
    assert repr(native_done(wire, raw)) == repr(want if native_reads else None)
    assert repr(fastpath.done_parser(LIMITS)(raw)) == repr(want)


def test_task_frames_with_a_negative_task_id_are_declined(wire):
    raw = P.encode_task(5, "swap_in", [1], [2], {}, LIMITS)
    assert parse(wire, raw) == quick(raw) == (5, "swap_in", [1], [2])
    bad = raw.replace(_p("task_id") + _p(5), _p("task_id") + _p(-5))
    assert bad != raw and parse(wire, bad) is None and quick(bad) is None


def test_done_frames_beyond_map_or_string_limits_are_declined(wire):
    raw = _pack_raw(_done_entries(result=_p({"a": 1, "b": 2, "c": 3})))
    for small in (P.Limits(max_map=8), P.Limits(max_map=9, max_str=10)):
        assert P.done_fields(raw, small) is None and native_done(wire, raw, small) is None
    assert native_done(wire, raw, P.Limits(max_map=9, max_str=44)) == P.done_fields(raw, LIMITS)
