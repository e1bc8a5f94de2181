"""Tests for kvcached.transfer.protocol: round trips, hostile frames, real ZMQ sockets."""

from __future__ import annotations

import dataclasses
import math
import struct
import time

import msgpack
import pytest
import zmq
from helpers import binary_task_frame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.transfer import protocol
from kvcached.transfer.protocol import (
    CONTROL_OPS,
    INT64_MAX,
    INT64_MIN,
    MAX_NESTING,
    MAX_PID,
    MAX_RANK,
    MAX_SECONDS,
    MAX_TIME,
    MESSAGE_KINDS,
    MIN_TIMEOUT_S,
    PROTOCOL_VERSION,
    TASK_KINDS,
    CtlReply,
    CtlRequest,
    Done,
    ErrorReply,
    Heartbeat,
    Hello,
    Limits,
    Message,
    ProtocolError,
    Ready,
    Shutdown,
    Task,
    clip,
    decode,
    encode,
)

FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOUNDED = Limits(num_device_blocks=10, num_host_blocks=20)


# --------------------------------------------------------------------------- helpers

def roundtrip(msg: Message, limits: Limits | None = None) -> Message:
    return decode(encode(msg, limits), limits)


def assert_same(got: Message, want: Message) -> None:
    """Compare every field, including its type (a float field stays float, ids stay lists)."""
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a == b, f"{type(want).__name__}.{f.name}: {a!r} != {b!r}"
        assert type(a) is type(b) or (f.type == "float" and type(a) is float), f.name


def wire(msg: Message) -> dict:
    """The msgpack map of a message, for tampering with (a binary message's map is
    refused by decode whatever else is wrong with it)."""
    return {"v": PROTOCOL_VERSION, "kind": msg.KIND,
            **{key: getattr(msg, attr) for attr, key, _, _ in type(msg)._SPEC}}


def travels_binary(msg: Message) -> bool:
    return encode(msg)[0] == protocol.BINARY_MAGIC


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def rejects(raw: bytes, limits: Limits | None = None, match: str | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        decode(raw, limits)
    return info.value


# One message of every kind with no field left at its default.
SAMPLES: list[Message] = [
    Hello(rank=3, pid=4242, protocol=PROTOCOL_VERSION, layout_digest="ab12cd",
          num_device_blocks=1024, num_host_blocks=8192, restarts=2),
    Ready(ok=False, error="layout digest mismatch: engine ab12 != worker cd34"),
    Task(task_id=7, kind="swap_out", src=[0, 5, 9], dst=[19, 0, 3],
         args={"kv_event": [[5, 1], [0, 0]]}),
    Task(task_id=8, kind="swap_in", src=[1, 2], dst=[3, 4], args={}),
    Task(task_id=15, kind="swap_in_layers", src=[7, 2, 3], dst=[5, 6, 1],
         args={"kv_event": [[9, 4]]}),
    Task(task_id=9, kind="store", src=[4, 5], dst=[], args={"keys": ["ns/aa/0of2", "ns/bb/0of2"]}),
    Task(task_id=10, kind="load", src=[], dst=[6], args={"keys": ["ns/aa/0of2"], "policy": "best_effort"}),
    Task(task_id=11, kind="lookup", args={"keys": ["k1", "k2", "k3"]}),
    Task(task_id=14, kind="lookup", args={"keys": ["k1", "k2", "k3"], "lengths": [2, 0, 1]}),
    Task(task_id=12, kind="control", args={"op": "sleep", "release_host": True}),
    Task(task_id=13, kind="noop", src=[1], dst=[2, 3], args={}),
    Done(task_id=7, rank=1, ok=False, error="CUDA error", blocks_done=2, elapsed_s=0.25,
         result={"prefix": 2, "per_tier": {"gpu": [1, 2.5, None, True, "x", b"y"]}}),
    Done(task_id=8, rank=2, ok=True, error="", blocks_done=3, elapsed_s=0.5,
         result={"bytes": 192, "finished": 1234.5}),
    Heartbeat(sender="rank-0", seq=99, time=1712345678.125, info={"queue": 3, "rss_mb": 12.5}),
    ErrorReply(error="ProtocolError", detail="unknown message kind 'bogus'"),
    Shutdown(reason="engine exiting"),
    CtlRequest(op="update_weights", args={"version": "v2"}, timeout_s=12.5),
    CtlReply(ok=False, result={"ranks_missing": [2, 3]}, error="timed out after 12.5 s"),
]


# --------------------------------------------------------------------------- round trips

def test_samples_cover_every_kind():
    assert {type(m).KIND for m in SAMPLES} == MESSAGE_KINDS
    assert {m.kind for m in SAMPLES if isinstance(m, Task)} == TASK_KINDS


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: f"{m.KIND}-{getattr(m, 'kind', '')}")
def test_roundtrip_every_kind(msg):
    assert_same(roundtrip(msg, BOUNDED), msg)
    assert_same(decode(msg.encode()), msg)


def test_wire_format_is_a_flat_versioned_map():
    # The layout other implementations (and tcpdump readers) rely on (the binary
    # frames': test_wire.py).
    unpack = lambda msg: msgpack.unpackb(encode(msg), raw=False)  # noqa: E731
    assert unpack(Task(5, "store", [1], [], {"keys": ["k"]})) == {
        "v": PROTOCOL_VERSION, "kind": "task", "task_id": 5, "task_kind": "store",
        "src": [1], "dst": [], "args": {"keys": ["k"]}}
    assert unpack(Shutdown("bye")) == {"v": PROTOCOL_VERSION, "kind": "shutdown", "reason": "bye"}


def test_float_fields_accept_ints_and_decode_as_float():
    got = roundtrip(Heartbeat(sender="coord", seq=1, time=5))
    assert got.time == 5.0 and type(got.time) is float
    assert type(roundtrip(CtlRequest("status", timeout_s=3)).timeout_s) is float


def test_tuples_encode_as_lists():
    got = roundtrip(Task(1, "store", (1, 2), (), {"keys": ("a", "b"), "t": (1, ("a",))}))
    assert got.src == [1, 2] and got.args == {"keys": ["a", "b"], "t": [1, ["a"]]}
    got = roundtrip(Task(1, "swap_out", (1, 2), (3, 4), {"kv_event": ((1, 2),)}))
    assert got.src == [1, 2] and got.dst == [3, 4] and got.args == {"kv_event": [[1, 2]]}


def test_defaults_are_independent():
    a, b = Task(1, "noop"), Task(2, "noop")
    a.src.append(1)
    assert b.src == []


# --------------------------------------------------------------------------- property round trips

def simple_values(depth: int) -> st.SearchStrategy:
    scalars = (st.integers(-(1 << 63), INT64_MAX) | st.floats(allow_nan=False,
                                                             allow_infinity=False)
               | st.text(max_size=8) | st.booleans() | st.none() | st.binary(max_size=8))
    if depth == 0:
        return scalars
    inner = simple_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)


# Keys ending in "_s" are durations (checked numbers): random maps avoid them.
args_maps = st.dictionaries(st.text(max_size=6).filter(lambda k: not k.endswith("_s")),
                            simple_values(MAX_NESTING), max_size=4)
i64 = st.integers(-(1 << 63), INT64_MAX)
floats = st.floats()  # NaN and infinities too: encode must refuse them as decode does
# Numeric fields within their ranges (protocol.Message.RANGES), for valid messages.
counts = st.integers(0, INT64_MAX)
ranks = st.integers(0, MAX_RANK)
seconds = st.floats(0.0, MAX_SECONDS)
dev_ids = st.lists(st.integers(0, 9), max_size=6)
host_ids = st.lists(st.integers(0, 19), max_size=6)
keys = st.lists(st.text(max_size=10), max_size=6)


stamp_args = st.just({}) | st.lists(
    st.tuples(counts, counts).map(list), min_size=1, max_size=3).map(lambda s: {"kv_event": s})


@st.composite
def tasks(draw, kinds=tuple(sorted(TASK_KINDS))) -> Task:
    kind = draw(st.sampled_from(kinds))
    task_id = draw(counts)
    # A binary task (swap, noop) carries no args but the KV event stamps.
    args = draw(stamp_args if kind in protocol.BINARY_TASK_KINDS else args_maps)
    if kind in ("swap_out", "swap_in", "swap_in_layers"):
        n = draw(st.integers(0, 6))
        dev = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
        host = draw(st.lists(st.integers(0, 19), min_size=n, max_size=n))
        src, dst = (dev, host) if kind == "swap_out" else (host, dev)
        return Task(task_id, kind, src, dst, args)
    if kind in ("store", "load"):
        ids = draw(host_ids)
        args["keys"] = [f"k{i}" for i in range(len(ids))]
        return Task(task_id, kind, ids if kind == "store" else [], [] if kind == "store" else ids, args)
    if kind == "lookup":
        return Task(task_id, kind, args={**args, "keys": draw(keys)})
    if kind == "control":
        return Task(task_id, kind, args={**args, "op": draw(st.sampled_from(sorted(CONTROL_OPS)))})
    return Task(task_id, kind, draw(host_ids), draw(dev_ids), args)


text = st.text(max_size=30)
messages = st.one_of(
    st.builds(Hello, ranks, st.integers(1, MAX_PID), counts, text, counts, counts, counts),
    st.builds(Ready, st.booleans(), text),
    tasks(),
    st.builds(Done, counts, ranks, st.booleans(), text, counts, seconds, args_maps),
    st.builds(Heartbeat, text, counts, st.floats(0.0, MAX_TIME), args_maps),
    st.builds(ErrorReply, text, text),
    st.builds(Shutdown, text),
    st.builds(CtlRequest, text, args_maps, st.floats(MIN_TIMEOUT_S, MAX_SECONDS)),
    st.builds(CtlReply, st.booleans(), args_maps, text),
)


@FUZZ
@given(messages)
def test_property_roundtrip(msg):
    assert_same(roundtrip(msg, BOUNDED), msg)


# --------------------------------------------------------------------------- hostile input

def decodes_or_protocol_error(raw: bytes, limits: Limits | None = None) -> None:
    try:
        msg = decode(raw, limits)
    except ProtocolError:
        return
    assert isinstance(msg, Message)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(raw):
    decodes_or_protocol_error(raw)


@FUZZ
@given(st.sampled_from(SAMPLES), st.binary(max_size=40), st.integers(0, 400))
def test_corrupted_frames_only_raise_protocol_error(msg, junk, at):
    raw = encode(msg)
    at %= len(raw) + 1
    decodes_or_protocol_error(raw[:at] + junk + raw[at + len(junk):], BOUNDED)
    decodes_or_protocol_error(raw[:at], BOUNDED)


any_msgpack = st.recursive(
    st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=8)
    | st.booleans() | st.none() | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=8)


@settings(FUZZ, max_examples=60)
@given(st.dictionaries(st.sampled_from(["v", "kind", "task_id", "task_kind", "src", "dst",
                                        "args", "ok", "error", "rank", "x"]) | st.text(max_size=5),
                       any_msgpack, max_size=7),
       st.sampled_from(sorted(MESSAGE_KINDS) + ["bogus", 1]))
def test_random_maps_only_raise_protocol_error(fields, kind):
    decodes_or_protocol_error(pack({"v": PROTOCOL_VERSION, "kind": kind, **fields}), BOUNDED)


# Values of the wrong type for each declared field type; bool is never an int.
WRONG = {
    "int": [True, False, 1.0, "1", None, [1], {"a": 1}, b"1", 1 << 63, (1 << 64) - 1],
    "bool": [1, 0, "true", None, 1.0],
    "float": [True, "1.0", None, [1.0], b"x", (1 << 64) - 1],
    "str": [1, b"bytes", None, ["s"], True, "x" * 5000],
    "list[int]": [1, "1,2", None, {"0": 1}, [True], [1.5], [-1], ["1"], [None], [[1]],
                  [1 << 63], list(range(70000))],
    "dict[str, Any]": [[], "a", 1, None, True, {"deep": [[[[[1]]]]]}, {"k": (1 << 64) - 1},
                       {"k": "x" * 5000}, {1: 2}, {"k": {2: 3}}, {"k": msgpack.ExtType(1, b"")}],
}


def bad_frames(msg: Message):
    """(description, frame) pairs built from ``msg``, each of which must be rejected."""
    base, cls = wire(msg), type(msg)
    yield "unknown kind", pack({**base, "kind": "bogus"})
    yield "kind not a str", pack({**base, "kind": ["task"]})
    yield "version + 1", pack({**base, "v": PROTOCOL_VERSION + 1})
    yield "version True", pack({**base, "v": True})
    yield "no version", pack({k: v for k, v in base.items() if k != "v"})
    yield "extra field", pack({**base, "extra": 1})
    yield "bytes key", pack({**base, b"extra": 1})
    for _, key, _, check in cls._SPEC:
        yield f"missing {key}", pack({k: v for k, v in base.items() if k != key})
        field_type = next(t for t, c in protocol._CHECKERS.items() if c is check)
        for bad in WRONG[field_type]:
            yield f"{key}={bad!r:.40}", pack({**base, key: bad})


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: f"{m.KIND}-{getattr(m, 'kind', '')}")
def test_bad_fields_rejected(msg):
    # One test per sample rather than per frame: hundreds of cases, milliseconds each.
    accepted = []
    for what, raw in bad_frames(msg):
        try:
            decode(raw, BOUNDED)
        except ProtocolError:
            continue
        accepted.append(what)
    assert not accepted, f"accepted bad frames: {accepted}"


# Every int msgpack can carry (unbounded wire_ints would fail to pack, not to decode).
wire_ints = st.integers(-(1 << 63), (1 << 64) - 1)
not_int = (st.booleans() | st.floats() | st.text(max_size=4) | st.none() | st.binary(max_size=4)
           | st.lists(wire_ints, max_size=2) | st.integers(INT64_MAX + 1, (1 << 64) - 1))
bad_block_id = st.booleans() | st.floats() | st.text(max_size=4) | st.none() | st.integers(-(1 << 63), -1)
WRONG_VALUES = {
    "int": not_int,
    "bool": wire_ints | st.floats() | st.text(max_size=4) | st.none(),
    "float": st.booleans() | st.text(max_size=4) | st.none() | st.binary(max_size=4)
    | st.lists(st.floats(), max_size=2) | st.integers(INT64_MAX + 1, (1 << 64) - 1),
    "str": wire_ints | st.booleans() | st.binary(max_size=4) | st.none()
    | st.lists(st.text(max_size=3), max_size=2),
    "list[int]": wire_ints | st.text(max_size=4) | st.none()
    | st.tuples(st.lists(st.integers(0, 9), max_size=4), bad_block_id, st.integers(0, 4)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:]),
    "dict[str, Any]": wire_ints | st.text(max_size=4) | st.none() | st.lists(wire_ints, max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(INT64_MAX + 1, (1 << 64) - 1), min_size=1)
    | st.dictionaries(st.text(max_size=3), st.just([[[[[0]]]]]), min_size=1),
}


@st.composite
def tampered_frames(draw) -> bytes:
    """A valid message's map with one thing broken that decode must catch."""
    msg = draw(messages)
    base, cls = wire(msg), type(msg)
    how = draw(st.sampled_from(["type", "extra", "missing", "kind", "version"]))
    if how == "type":
        _, key, _, check = draw(st.sampled_from(cls._SPEC))
        field_type = next(t for t, c in protocol._CHECKERS.items() if c is check)
        base[key] = draw(WRONG_VALUES[field_type])
    elif how == "extra":
        base[draw(st.text(max_size=8).filter(lambda k: k not in cls._KEYS))] = draw(any_msgpack)
    elif how == "missing":
        del base[draw(st.sampled_from(sorted(cls._KEYS)))]
    elif how == "kind":
        base["kind"] = draw(st.text(max_size=8).filter(lambda k: k not in MESSAGE_KINDS) | not_int)
    else:
        base["v"] = draw(wire_ints.filter(lambda v: v != PROTOCOL_VERSION) | st.just(True)
                         | st.floats() | st.text(max_size=2))
    return pack(base)


@FUZZ
@given(tampered_frames())
def test_tampered_maps_rejected(raw):
    rejects(raw, BOUNDED)


# --------------------------------------------------------------------------- numbers
# Every numeric field of every kind, given non-finite and extreme values: a
# value is accepted exactly when it lies in the field's declared range, by
# encode and decode alike, and NaN / infinities never pass anywhere (a NaN
# timeout once killed the control thread at its use site).

NAN, INF = float("nan"), float("inf")
EXTREME_FLOATS = [NAN, INF, -INF, 1e308, -1e308, -0.0, 5e-324, -1.0, MAX_SECONDS,
                  MAX_SECONDS * 1.000001, MAX_TIME, MAX_TIME * 2, MIN_TIMEOUT_S / 2]
EXTREME_INTS = [-1, 0, 1, MAX_RANK, MAX_RANK + 1, MAX_PID, MAX_PID + 1, INT64_MAX, INT64_MIN]


def numeric_fields():
    """(sample, attribute, wire key, field type) for every int and float field of
    the msgpack samples (the binary frames': test_wire.py)."""
    for msg in SAMPLES:
        if travels_binary(msg):
            continue
        for attr, key, _, check in type(msg)._SPEC:
            if check in (protocol._check_int, protocol._check_float):
                yield msg, attr, key, "int" if check is protocol._check_int else "float"


def test_every_kind_with_a_numeric_field_declares_its_range():
    declared = {(type(m).KIND, attr) for m, attr, _, _ in numeric_fields()}
    ranged = {(type(m).KIND, attr) for m in SAMPLES for attr in type(m).RANGES}
    assert declared and declared == ranged, declared ^ ranged


@pytest.mark.parametrize("msg,attr,key,kind", list(numeric_fields()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_numeric_fields_accept_exactly_their_range(msg, attr, key, kind):
    lo, hi = type(msg).RANGES[attr]
    values = EXTREME_FLOATS + EXTREME_INTS if kind == "float" else EXTREME_INTS
    for value in values:
        want = math.isfinite(value) and lo <= value <= hi
        frame = pack({**wire(msg), key: value})
        try:
            got = getattr(decode(frame, BOUNDED), attr)
        except ProtocolError as e:
            assert not want, f"{msg.KIND}.{key}={value!r} refused: {e}"
            assert key in str(e), e  # the error names the field
        else:
            assert want, f"{msg.KIND}.{key}={value!r} accepted"
            assert got == value
        bad = dataclasses.replace(msg, **{attr: value})
        if want:
            assert_same(roundtrip(bad, BOUNDED), bad)
        else:
            with pytest.raises(ProtocolError):
                encode(bad, BOUNDED)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("msg", [m for m in SAMPLES if not travels_binary(m) and any(
    f.type == "dict[str, Any]" for f in dataclasses.fields(m))],
    ids=lambda m: f"{m.KIND}-{getattr(m, 'kind', '')}")
def test_non_finite_floats_refused_inside_maps(msg, value):
    f = next(f for f in dataclasses.fields(msg) if f.type == "dict[str, Any]")
    key = next(k for a, k, _, _ in type(msg)._SPEC if a == f.name)
    for where in ({"x": value}, {"x": [1, value]}, {"x": {"y": {"z": value}}}):
        rejects(pack({**wire(msg), key: {**getattr(msg, f.name), **where}}), BOUNDED,
                match="not a finite number")
        with pytest.raises(ProtocolError, match="not a finite number"):
            encode(dataclasses.replace(msg, **{f.name: {**getattr(msg, f.name), **where}}))


@pytest.mark.parametrize("kind,name,args", [
    ("control", "timeout_s", {"op": "pause"}),
    ("load", "deadline_s", {"keys": ["k"]}),
    ("ctl", "drain_timeout_s", {"drain": True}),
])
def test_durations_in_args_are_bounded(kind, name, args):
    def build(value):
        if kind == "ctl":
            return CtlRequest("sleep", {**args, name: value}, 5.0)
        return Task(1, kind, [], [0] if kind == "load" else [], {**args, name: value})

    for value in (NAN, INF, -INF, -1.0, MAX_SECONDS * 2, True, "1", None):
        frame = wire(build(0.0))
        frame["args"] = {**args, name: value}
        err = rejects(pack(frame), BOUNDED)
        assert name in str(err)
        with pytest.raises(ProtocolError):
            encode(build(value))
    for value in (0, 0.5, MAX_SECONDS):
        assert decode(build(value).encode(BOUNDED), BOUNDED).args[name] == value


def test_a_bad_task_id_is_not_echoed_back():
    """A worker answers a broken task with a failed Done for its id, so an id a
    Done could not carry (negative, beyond int64) must not be offered."""
    for task_id, want in ((5, 5), (-1, None), (INT64_MAX + 1, None)):
        err = rejects(pack({**wire(Task(1, "control", args={"op": "pause"})),
                            "task_id": task_id, "args": {"op": "bogus"}}))
        assert err.task_id == want


@FUZZ
@given(tasks(kinds=("store", "load", "lookup", "control")), st.data())
def test_oversize_and_out_of_range_ids_rejected(task, data):
    """msgpack tasks (the binary ones': test_wire.py)."""
    base = wire(task)
    if task.src or task.dst:
        # One id past its tier's bound (store and load ids are host ids).
        key = "src" if task.src else "dst"
        bad = data.draw(st.integers(BOUNDED.num_host_blocks, INT64_MAX))
        ids = list(base[key])
        ids[data.draw(st.integers(0, len(ids) - 1))] = bad
        rejects(pack({**base, key: ids}), BOUNDED)
    # A list one longer than max_ids, in any field or nested in args.
    small = Limits(max_ids=4, num_device_blocks=10, num_host_blocks=20)
    where = data.draw(st.sampled_from(["src", "dst", "args"]))
    value = [0] * 5 if where != "args" else {"x": [[0] * 5]}
    rejects(pack({**base, where: value}), small)


@FUZZ
@given(st.sampled_from([b"\xdc", b"\xdd", b"\xde", b"\xdf", b"\xd9", b"\xda", b"\xdb",
                        b"\xc4", b"\xc5", b"\xc6", b"\xc7", b"\xc8", b"\xc9"]),
       st.integers(70_000, 0xFFFFFFFF), st.binary(max_size=32), st.booleans())
def test_huge_declared_lengths_rejected(head, length, tail, nested):
    width = {0xdc: 2, 0xde: 2, 0xda: 2, 0xc5: 2, 0xc8: 2, 0xd9: 1, 0xc4: 1, 0xc7: 1}.get(head[0], 4)
    frame = head + (length % (1 << (8 * width))).to_bytes(width, "big") + tail
    if nested:
        frame = b"\x83" + pack("v") + pack(1) + pack("kind") + pack("task") + pack("src") + frame
    # Short lengths (1-byte headers) may be legal but the frame is truncated: still an error.
    rejects(frame, Limits(max_str=64, max_ids=64, max_map=64))


def test_error_messages_name_the_problem():
    base = wire(Task(4, "store", [1], [], {"keys": ["k"]}))
    assert "unknown message kind 'bogus'" in str(rejects(pack({**base, "kind": "bogus"})))
    assert "version mismatch" in str(rejects(pack({**base, "v": PROTOCOL_VERSION + 1})))
    assert "missing field(s) ['dst']" in str(rejects(pack({k: v for k, v in base.items() if k != "dst"})))
    assert "unknown field(s) ['zzz']" in str(rejects(pack({**base, "zzz": 0})))
    assert "task.task_id: expected int, got bool" in str(rejects(pack({**base, "task_id": True})))
    assert "task.src[0]: expected int block id, got bool" in str(rejects(pack({**base, "src": [True]})))
    assert "must be a msgpack map" in str(rejects(pack([1, 2])))
    assert "not a valid msgpack frame" in str(rejects(b"\x92\x01"))
    assert "preamble" in str(rejects(b"\xc1"))
    assert "trailing bytes" in str(rejects(encode(Shutdown()) + b"\x00"))


def test_error_carries_task_id_so_the_worker_can_fail_that_task():
    err = rejects(binary_task_frame(42, 1, [99], [2]), BOUNDED)
    assert (err.kind, err.task_id) == ("task", 42)
    assert "device block id 99 >= num_device_blocks=10" in str(err)
    err = rejects(pack({**wire(Task(43, "store", [1], [], {"keys": ["k"]})), "src": [99]}),
                  BOUNDED)
    assert (err.kind, err.task_id) == ("task", 43)
    assert "host block id 99 >= num_host_blocks=20" in str(err)


@pytest.mark.parametrize("task,match", [
    (Task(1, "swap_out", [10], [0]), "device block id 10"),
    (Task(1, "swap_out", [0], [20]), "host block id 20"),
    (Task(1, "swap_in", [20], [0]), "host block id 20"),
    (Task(1, "swap_in", [0], [10]), "device block id 10"),
    (Task(1, "swap_out", [0, 1], [2]), "src has 2 ids but dst has 1"),
    (Task(1, "swap_in", [0], []), "src has 1 ids but dst has 0"),
    (Task(1, "swap_out", [-1], [0]), "out of range"),
    (Task(1, "store", [20], [], {"keys": ["a"]}), "host block id 20"),
    (Task(1, "store", [1], [2], {"keys": ["a"]}), "dst must be empty"),
    (Task(1, "store", [1], [], {}), "keys"),
    (Task(1, "store", [1, 2], [], {"keys": ["a"]}), "1 keys for 2 blocks"),
    (Task(1, "load", [], [20], {"keys": ["a"]}), "host block id 20"),
    (Task(1, "load", [1], [2], {"keys": ["a"]}), "src must be empty"),
    (Task(1, "load", [], [2], {"keys": [1]}), "keys"),
    (Task(1, "lookup", [], [], {"keys": "abc"}), "keys"),
    (Task(1, "lookup", [1], [], {"keys": []}), "src must be empty"),
    (Task(1, "lookup", [], [], {"keys": ["a", "b"], "lengths": [1]}), "lengths"),
    (Task(1, "lookup", [], [], {"keys": ["a"], "lengths": [2, -1]}), "lengths"),
    (Task(1, "lookup", [], [], {"keys": ["a"], "lengths": "1"}), "lengths"),
    (Task(1, "control", [], [], {"op": "explode"}), "args\\['op'\\]"),
    (Task(1, "control", [], [], {"op": ["pause"]}), "args\\['op'\\]"),
    (Task(1, "control", [], [], {}), "args\\['op'\\]"),
    (Task(1, "evict", [], [], {}), "unknown task kind 'evict'"),
])
def test_task_rules(task, match):
    # The sender catches its own bug...
    with pytest.raises(ProtocolError, match=match):
        encode(task, BOUNDED)
    # ...and so does the receiver when the frame is built by hand.
    if task.kind in protocol.BINARY_TASK_KINDS:
        raw = binary_task_frame(task.task_id, protocol.BINARY_TASK_KINDS.index(task.kind) + 1,
                                task.src, task.dst)
    else:
        raw = pack({"v": PROTOCOL_VERSION, "kind": "task", "task_id": task.task_id,
                    "task_kind": task.kind, "src": list(task.src), "dst": list(task.dst),
                    "args": task.args})
    rejects(raw, BOUNDED, match=match)


def test_ids_bounds_are_unchecked_without_limits():
    assert roundtrip(Task(1, "swap_out", [10**9], [2**31 - 1])).dst == [2**31 - 1]
    assert roundtrip(Task(1, "store", [10**12], [], {"keys": ["k"]})).src == [10**12]
    assert roundtrip(Task(1, "swap_out", [9], [19]), BOUNDED).src == [9]


def test_oversize_lists_rejected():
    small = Limits(max_ids=8)
    ok = Task(1, "swap_out", list(range(8)), list(range(8)))
    assert roundtrip(ok, small).src == list(range(8))
    big = Task(1, "swap_out", list(range(9)), list(range(9)))
    with pytest.raises(ProtocolError, match="exceed max_ids=8"):
        encode(big, small)
    rejects(encode(big), small, match="exceed max_ids=8")
    store = Task(1, "store", list(range(9)), [], {"keys": ["k"] * 9})
    rejects(encode(store), small, match="max_array_len")
    rejects(pack({**wire(Task(1, "lookup", args={"keys": []})), "args": {"keys": ["k"] * 9}}), small)


def test_long_strings_rejected():
    limits = Limits(max_str=16)
    with pytest.raises(ProtocolError, match="max_str=16"):
        encode(Shutdown("x" * 17), limits)
    # Multi-byte characters count in bytes, as the receiver's msgpack limit does.
    with pytest.raises(ProtocolError, match="max_str=16"):
        encode(Shutdown("é" * 9), limits)
    assert roundtrip(Shutdown("é" * 8), limits).reason == "é" * 8
    rejects(encode(Shutdown("x" * 17)), limits, match="max_str_len")


def test_nesting_depth():
    def nested(depth):
        value = 1
        for _ in range(depth):
            value = [value]
        return value

    ok = Heartbeat("w", 1, 0.0, {"n": nested(MAX_NESTING)})
    assert roundtrip(ok).info == ok.info
    deep = Heartbeat("w", 1, 0.0, {"n": nested(MAX_NESTING + 1)})
    with pytest.raises(ProtocolError, match="nested deeper"):
        encode(deep)
    rejects(pack({**wire(ok), "info": deep.info}), match="nested deeper")
    rejects(b"\x91" * 100_000, match="nesting too deep")


def test_huge_declared_lengths_rejected_fast():
    heads = [
        b"\xdd" + struct.pack(">I", 0xFFFFFFFF),    # array32
        b"\xdf" + struct.pack(">I", 0xFFFFFFFF),    # map32
        b"\xdb" + struct.pack(">I", 0xFFFFFFFF),    # str32
        b"\xc6" + struct.pack(">I", 0xFFFFFFFF),    # bin32
        b"\xc9" + struct.pack(">I", 0xFFFFFFFF) + b"\x01",  # ext32
        b"\xdc" + struct.pack(">H", 0xFFFF),        # array16 (within max_ids, but short)
    ]
    # A map that starts like a task, then declares a huge value for "src".
    prefix = b"\x83" + pack("v") + pack(1) + pack("kind") + pack("task") + pack("src")
    start = time.perf_counter()
    for head in heads:
        rejects(head)
        rejects(head + b"\x00" * 16)
        # Nested: a valid-looking map whose "src" declares a huge array.
        rejects(prefix + head)
    assert time.perf_counter() - start < 1.0


def test_uint64_and_ext_types_rejected():
    base = wire(Task(1, "lookup", args={"keys": []}))
    rejects(pack({**base, "task_id": (1 << 64) - 1}), match="outside int64")
    rejects(pack({**base, "src": [(1 << 64) - 1]}), match="out of range")
    rejects(pack({**base, "args": {"t": msgpack.ExtType(1, b"x")}}))
    rejects(pack({**base, "args": {1: 2}}))


def test_frame_over_limit_rejected_without_unpacking(monkeypatch):
    def unpack_must_not_run(*args, **kwargs):
        raise AssertionError("unpackb called on an oversize frame")

    raw = encode(Shutdown("x" * 100))
    monkeypatch.setattr(protocol.msgpack, "unpackb", unpack_must_not_run)
    rejects(raw, Limits(max_frame_bytes=len(raw) - 1), match="exceeds max_frame_bytes")
    rejects(b"\x00" * (9 << 20), match="exceeds max_frame_bytes")


def test_encode_refuses_what_the_receiver_would_reject():
    with pytest.raises(ProtocolError, match="hello.rank: expected int, got bool"):
        encode(Hello(True, 1, 1, "d", 1, 1))
    with pytest.raises(ProtocolError, match="frame of"):
        encode(Shutdown("x" * 4000), Limits(max_frame_bytes=100))
    with pytest.raises(ProtocolError, match="cannot pack"):
        encode(Shutdown("\ud800"))
    with pytest.raises(ProtocolError, match="not a protocol message"):
        encode({"v": PROTOCOL_VERSION, "kind": "shutdown", "reason": ""})
    with pytest.raises(ProtocolError):
        Done(1, 0, ok="yes").validate()
    err = pytest.raises(ProtocolError, encode, Task(5, "swap_out", [1], [True])).value
    assert (err.kind, err.task_id) == ("task", 5)


def test_decode_accepts_bytes_like_and_rejects_other_types():
    for msg in (SAMPLES[0], SAMPLES[2]):  # msgpack, binary
        raw = encode(msg)
        assert_same(decode(bytearray(raw)), msg)
        assert_same(decode(memoryview(raw)), msg)
    with pytest.raises(ProtocolError, match="bytes-like"):
        decode("not bytes")
    with pytest.raises(ProtocolError, match="bytes-like"):
        decode(None)


def test_error_reply_from_exception_fits_the_limits():
    reply = ErrorReply.from_exception(ProtocolError("é" * 5000))
    assert reply.error == "ProtocolError"
    assert len(reply.detail.encode()) <= 4096 and reply.detail.endswith("...")
    assert_same(roundtrip(reply), reply)
    assert clip("short") == "short"


def test_limits_validate_themselves():
    for bad in [dict(max_ids=0), dict(max_str=-1), dict(max_frame_bytes=True),
                dict(num_device_blocks=-1), dict(num_host_blocks=1.5)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            Limits(**bad)
    assert Limits().max_frame_bytes == 8 << 20 and Limits().max_ids == 65536


# --------------------------------------------------------------------------- real sockets

def recv(sock: zmq.Socket, timeout_ms: int = 2000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no message within the deadline"
    return sock.recv_multipart()


def test_router_dealer_over_ipc(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        endpoint = f"ipc://{tmp_path}/coord.sock"
        router.bind(endpoint)
        dealer.setsockopt(zmq.IDENTITY, b"rank-0")
        dealer.connect(endpoint)
        limits = Limits(num_device_blocks=64, num_host_blocks=256)

        hello = Hello(0, 1234, PROTOCOL_VERSION, "digest-1", 64, 256, 0)
        dealer.send(encode(hello))
        ident, raw = recv(router)
        assert ident == b"rank-0"
        assert_same(decode(raw, limits), hello)

        sent = [Ready(True, ""), Task(1, "swap_out", [0, 63], [255, 0], {"kv_event": [[3, 4]]}),
                Heartbeat("coordinator", 1, time.time(), {})]
        for msg in sent:
            router.send_multipart([b"rank-0", encode(msg, limits)])
        for msg in sent:
            (raw,) = recv(dealer)
            assert_same(decode(raw, limits), msg)

        for done in (Done(1, 0, True, "", 2, 0.0012, {"bytes": 4096}),
                     Done(1, 0, True, "", 2, 0.0012, {"bytes": 4096, "finished": 5.0})):
            dealer.send(encode(done))
            ident, raw = recv(router)
            assert ident == b"rank-0"
            assert_same(decode(raw, limits), done)

        # A garbage frame gets an error reply and the worker side keeps going.
        router.send_multipart([b"rank-0", b"\xc1garbage"])
        (raw,) = recv(dealer)
        with pytest.raises(ProtocolError) as info:
            decode(raw, limits)
        dealer.send(encode(ErrorReply.from_exception(info.value)))
        ident, raw = recv(router)
        reply = decode(raw)
        assert isinstance(reply, ErrorReply) and "version mismatch" in reply.detail

        router.send_multipart([b"rank-0", encode(Shutdown("test over"))])
        (raw,) = recv(dealer)
        assert decode(raw) == Shutdown("test over")
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_control_socket_req_rep_over_ipc(tmp_path):
    ctx = zmq.Context()
    rep, req = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    try:
        endpoint = f"ipc://{tmp_path}/ctl.sock"
        rep.bind(endpoint)
        req.connect(endpoint)
        request = CtlRequest("pause", {"ranks": [0, 1]}, 5.0)
        req.send(encode(request))
        (raw,) = recv(rep)
        assert_same(decode(raw), request)
        reply = CtlReply(True, {"paused": [0, 1]}, "")
        rep.send(encode(reply))
        (raw,) = recv(req)
        assert_same(decode(raw), reply)
    finally:
        req.close(linger=0)
        rep.close(linger=0)
        ctx.term()
