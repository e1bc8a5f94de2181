"""The binary frames of kvcached.transfer.protocol: a swap or noop Task and the
successful Done of one. Layout, round trips, the one-encoding rule, and every
malformed frame refused with a ProtocolError that names the problem (and the
task id when the header could be read)."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
from helpers import binary_done_frame, binary_task_frame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.memory.kvevent import STAMP_ARG
from kvcached.transfer import protocol as P
from kvcached.transfer.protocol import (
    BINARY_TASK_KINDS,
    INT32_MAX,
    INT64_MAX,
    MAX_RANK,
    MAX_SECONDS,
    MAX_STAMPS,
    MAX_TIME,
    PROTOCOL_VERSION,
    Done,
    Limits,
    ProtocolError,
    Task,
    decode,
    encode,
)

FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BOUNDED = Limits(num_device_blocks=10, num_host_blocks=20)
SWAP_OUT, SWAP_IN, NOOP = 1, 2, 3  # kind codes
NAN, INF = float("nan"), float("inf")


def rejects(raw: bytes, limits: Limits | None = BOUNDED, match: str | None = None,
            task_id: int | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        decode(raw, limits)
    assert info.value.task_id == task_id, (info.value, info.value.task_id)
    return info.value


# --------------------------------------------------------------------------- layout

def test_task_frame_layout():
    """The byte layout the module docstring documents (other readers rely on it)."""
    raw = encode(Task(5, "swap_in", [1, 19], [2, 9], {STAMP_ARG: [[7, 3], [8, 0]]}), BOUNDED)
    assert raw == (bytes([0xC1, PROTOCOL_VERSION, 1, SWAP_IN]) + struct.pack("<IqII", 2, 5, 2, 2)
                   + struct.pack("<4q", 7, 3, 8, 0) + struct.pack("<4i", 1, 19, 2, 9))
    assert encode(Task(6, "noop")) == bytes([0xC1, PROTOCOL_VERSION, 1, NOOP]) + struct.pack(
        "<IqII", 0, 6, 0, 0)
    assert raw == binary_task_frame(5, SWAP_IN, [1, 19], [2, 9], [(7, 3), (8, 0)])


def test_done_frame_layout():
    raw = encode(Done(5, 3, True, "", 2, 0.25, {"bytes": 128, "finished": 99.5}))
    assert raw == bytes([0xC1, PROTOCOL_VERSION, 2, 0]) + struct.pack(
        "<Iqqqdd", 3, 5, 2, 128, 0.25, 99.5)
    assert len(raw) == P.DONE_FRAME.size == 48
    assert raw == binary_done_frame(5, 3, 2, 128, 0.25, 99.5)


def test_byte_zero_is_never_a_msgpack_first_byte():
    """0xC1 is the one byte msgpack never uses, so byte 0 tells the formats apart."""
    with pytest.raises(msgpack.exceptions.FormatError):
        msgpack.unpackb(b"\xc1")
    for msg in (P.Shutdown("x"), P.Heartbeat("c", 1, 1.0, {}), Task(1, "lookup", args={"keys": []}),
                Done(1, 0, False, "boom"), Done(1, 0, True, "", 1, 0.1, {"bytes": 1})):
        assert encode(msg)[0] != 0xC1, msg


# --------------------------------------------------------------------------- one encoding

def test_swap_and_noop_tasks_are_binary_and_only_binary():
    for kind in BINARY_TASK_KINDS:
        task = Task(3, kind, [1], [2])
        raw = encode(task, BOUNDED)
        assert raw[0] == 0xC1 and decode(raw, BOUNDED) == task
        as_msgpack = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "task", "task_id": 3,
                                    "task_kind": kind, "src": [1], "dst": [2], "args": {}})
        err = rejects(as_msgpack, match="travel as binary frames", task_id=3)
        assert err.kind == "task"


def test_done_format_follows_its_shape():
    """Binary exactly when ok, no error and a result of bytes (int) and finished (float)."""
    binary = Done(4, 1, True, "", 1, 0.5, {"bytes": 64, "finished": 2.0})
    assert encode(binary)[0] == 0xC1 and P.binary_done_shape(binary)
    for other in (Done(4, 1, False, "boom", 0, 0.5, {"bytes": 64, "finished": 2.0}),
                  Done(4, 1, True, "", 1, 0.5, {"bytes": 64}),
                  Done(4, 1, True, "", 1, 0.5, {"bytes": 64, "finished": 2}),  # int: msgpack
                  Done(4, 1, True, "", 1, 0.5, {"bytes": 64, "finished": 2.0, "x": 1})):
        raw = encode(other)
        assert raw[0] != 0xC1 and decode(raw) == other, other
    as_msgpack = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "done", "task_id": 4, "rank": 1,
                                "ok": True, "error": "", "blocks_done": 1, "elapsed_s": 0.5,
                                "result": {"bytes": 64, "finished": 2.0}})
    rejects(as_msgpack, match="travels as a binary frame", task_id=4)


def test_binary_task_args_hold_only_the_stamps():
    with pytest.raises(ProtocolError, match="may hold only 'kv_event'") as info:
        encode(Task(8, "swap_out", [1], [2], {"prio": 1}))
    assert info.value.task_id == 8
    for bad in ([], [[1]], [[1, 2, 3]], [[-1, 0]], [[1, True]], [[1, 2.0]], "x",
                [[0, 0]] * (MAX_STAMPS + 1), [[INT64_MAX + 1, 0]]):
        with pytest.raises(ProtocolError, match="kv_event"):
            encode(Task(8, "swap_in", [1], [2], {STAMP_ARG: bad}))


def test_ids_must_fit_int32():
    assert decode(encode(Task(1, "swap_out", [INT32_MAX], [0]))).src == [INT32_MAX]
    with pytest.raises(ProtocolError, match="int32"):
        encode(Task(1, "swap_out", [INT32_MAX + 1], [0]))
    with pytest.raises(ProtocolError, match="int32"):
        encode(Task(1, "noop", [], [1 << 40]))


# --------------------------------------------------------------------------- round trips

stamps = st.lists(st.tuples(st.integers(0, INT64_MAX), st.integers(0, INT64_MAX)).map(list),
                  min_size=1, max_size=4)


@st.composite
def binary_tasks(draw) -> Task:
    kind = draw(st.sampled_from(BINARY_TASK_KINDS))
    args = draw(st.just({}) | stamps.map(lambda s: {STAMP_ARG: s}))
    task_id = draw(st.integers(0, INT64_MAX))
    if kind == "noop":
        ids = st.lists(st.integers(0, INT32_MAX), max_size=5)
        return Task(task_id, kind, draw(ids), draw(ids), args)
    n = draw(st.integers(0, 6))
    dev = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    host = draw(st.lists(st.integers(0, 19), min_size=n, max_size=n))
    return Task(task_id, kind, *((dev, host) if kind == "swap_out" else (host, dev)), args)


binary_dones = st.builds(
    lambda task_id, rank, blocks, elapsed, nbytes, finished: Done(
        task_id, rank, True, "", blocks, elapsed, {"bytes": nbytes, "finished": finished}),
    st.integers(0, INT64_MAX), st.integers(0, MAX_RANK), st.integers(0, INT64_MAX),
    st.floats(0.0, MAX_SECONDS), st.integers(0, INT64_MAX), st.floats(0.0, MAX_TIME))


@FUZZ
@given(binary_tasks() | binary_dones)
def test_property_roundtrip(msg):
    raw = encode(msg, BOUNDED)
    assert raw[0] == 0xC1
    got = decode(raw, BOUNDED)
    assert got == msg and type(got) is type(msg)
    assert all(type(x) is int for x in [*getattr(got, "src", ()), *getattr(got, "dst", ())])
    assert decode(bytearray(raw), BOUNDED) == msg and decode(memoryview(raw), BOUNDED) == msg


@FUZZ
@given(binary_tasks() | binary_dones, st.data())
def test_mutated_frames_are_refused_or_the_one_encoding(msg, data):
    """Any change to a valid frame is refused with a ProtocolError, or decodes to a
    message whose encoding is exactly the mutated bytes (there is one encoding)."""
    raw = bytearray(encode(msg, BOUNDED))
    how = data.draw(st.sampled_from(["flip", "cut", "grow"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[at]))
    elif how == "cut":
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=16))
    try:
        got = decode(bytes(raw), BOUNDED)
    except ProtocolError:
        return
    assert how == "flip", "a cut or grown frame was accepted"
    assert encode(got, BOUNDED) == bytes(raw)


@FUZZ
@given(st.binary(max_size=120))
def test_random_binary_frames_only_raise_protocol_error(tail):
    for raw in (b"\xc1" + tail, b"\xc1" + bytes([PROTOCOL_VERSION]) + tail,
                b"\xc1" + bytes([PROTOCOL_VERSION, 1]) + tail,
                b"\xc1" + bytes([PROTOCOL_VERSION, 2]) + tail):
        try:
            msg = decode(raw, BOUNDED)
        except ProtocolError:
            continue
        assert encode(msg, BOUNDED) == raw


# --------------------------------------------------------------------------- malformed frames

GOOD_TASK = binary_task_frame(42, SWAP_OUT, [3], [4])

# (name, frame, task id the error carries, words the error holds)
BAD_TASKS = [
    ("preamble only", b"\xc1\x02", None, "preamble"),
    ("wrong version", binary_task_frame(42, SWAP_OUT, [3], [4], version=PROTOCOL_VERSION + 1),
     None, "version mismatch"),
    ("version 0", binary_task_frame(42, SWAP_OUT, [3], [4], version=0), None, "version mismatch"),
    ("unknown message type", binary_task_frame(42, SWAP_OUT, [3], [4], mtype=9), None,
     "unknown binary message type"),
    ("header cut", GOOD_TASK[:20], None, "shorter than its 24-byte header"),
    ("ids cut", GOOD_TASK[:-1], 42, "header declares 32"),
    ("trailing byte", GOOD_TASK + b"\x00", 42, "header declares 32"),
    ("trailing id", GOOD_TASK + b"\x00" * 4, 42, "header declares 32"),
    ("unknown kind", binary_task_frame(42, 9, [3], [4]), 42, "unknown binary task kind"),
    ("kind 0", binary_task_frame(42, 0, [3], [4]), 42, "unknown binary task kind"),
    ("negative task id", binary_task_frame(-1, SWAP_OUT, [3], [4]), None, "task_id"),
    ("device id == num_device_blocks", binary_task_frame(42, SWAP_OUT, [10], [4]), 42,
     "device block id 10 >= num_device_blocks=10"),
    ("host id == num_host_blocks", binary_task_frame(42, SWAP_OUT, [3], [20]), 42,
     "host block id 20 >= num_host_blocks=20"),
    ("swap_in host src out of range", binary_task_frame(42, SWAP_IN, [25], [0]), 42,
     "host block id 25"),
    ("swap_in device dst out of range", binary_task_frame(42, SWAP_IN, [0], [INT32_MAX]), 42,
     "device block id"),
    ("negative src id", binary_task_frame(42, SWAP_OUT, [-1], [4]), 42, r"src\[0\]: block id -1"),
    ("negative dst id", binary_task_frame(42, SWAP_IN, [1, 2], [3, -7]), 42,
     r"dst\[1\]: block id -7"),
    ("negative noop id", binary_task_frame(42, NOOP, [], [-5]), 42, "block id -5"),
    ("length mismatch", binary_task_frame(42, SWAP_OUT, [0, 1], [2]), 42,
     "src has 2 ids but dst has 1"),
    ("huge src count", binary_task_frame(42, SWAP_OUT, [3], [4], counts=(0, 0xFFFFFFFF, 1)),
     42, "exceed max_ids"),
    ("huge dst count", binary_task_frame(42, SWAP_OUT, [3], [4], counts=(0, 1, 70000)),
     42, "exceed max_ids"),
    ("huge stamp count", binary_task_frame(42, SWAP_OUT, [3], [4], counts=(0xFFFFFFFF, 1, 1)),
     42, "exceed"),
    ("negative stamp", binary_task_frame(42, SWAP_OUT, [3], [4], [(-1, 0)]), 42,
     "negative epoch or generation"),
]

BAD_DONES = [
    ("done cut", binary_done_frame(9)[:-1], 9, "a done is 48"),
    ("done header cut", binary_done_frame(9)[:12], None, "a done is 48"),
    ("done trailing byte", binary_done_frame(9) + b"\x00", 9, "a done is 48"),
    ("done wrong version", binary_done_frame(9, version=PROTOCOL_VERSION + 1), None,
     "version mismatch"),
    ("done nonzero byte 3", binary_done_frame(9, pad=1), 9, "byte 3"),
    ("done negative task id", binary_done_frame(-9), None, "task_id"),
    ("done rank too big", binary_done_frame(9, rank=MAX_RANK + 1), 9, "done.rank"),
    ("done negative blocks", binary_done_frame(9, blocks_done=-1), 9, "blocks_done"),
    ("done negative bytes", binary_done_frame(9, nbytes=-64), 9, "bytes"),
    ("done NaN elapsed", binary_done_frame(9, elapsed_s=NAN), 9, "elapsed_s"),
    ("done inf elapsed", binary_done_frame(9, elapsed_s=INF), 9, "elapsed_s"),
    ("done negative elapsed", binary_done_frame(9, elapsed_s=-0.5), 9, "elapsed_s"),
    ("done huge elapsed", binary_done_frame(9, elapsed_s=MAX_SECONDS * 2), 9, "elapsed_s"),
    ("done NaN finished", binary_done_frame(9, finished=NAN), 9, "finished"),
    ("done -inf finished", binary_done_frame(9, finished=-INF), 9, "finished"),
    ("done finished past MAX_TIME", binary_done_frame(9, finished=MAX_TIME * 2), 9, "finished"),
]


def test_the_good_frames_of_the_tables_decode():
    """The tables' bad frames are each one change away from these (a typo would test nothing)."""
    assert decode(GOOD_TASK, BOUNDED) == Task(42, "swap_out", [3], [4])
    assert decode(binary_done_frame(9), BOUNDED) == Done(9, 0, True, "", 1, 0.001,
                                                         {"bytes": 64, "finished": 1.0})


@pytest.mark.parametrize("name,raw,task_id,words", BAD_TASKS + BAD_DONES,
                         ids=[row[0] for row in BAD_TASKS + BAD_DONES])
def test_malformed_binary_frame_refused(name, raw, task_id, words):
    err = rejects(raw, BOUNDED, match=words, task_id=task_id)
    if task_id is not None:
        assert err.kind in ("task", "done")


def test_every_truncation_of_a_valid_frame_is_refused():
    frames = [encode(Task(7, "swap_in", [1, 2, 3], [4, 5, 6], {STAMP_ARG: [[1, 2]]}), BOUNDED),
              encode(Done(7, 1, True, "", 3, 0.1, {"bytes": 1, "finished": 2.0}))]
    for raw in frames:
        for n in range(len(raw)):
            with pytest.raises(ProtocolError):
                decode(raw[:n], BOUNDED)


def test_limits_bound_binary_frames():
    small = Limits(max_ids=4, num_device_blocks=10, num_host_blocks=20)
    task = Task(1, "swap_out", [0] * 5, [1] * 5)
    with pytest.raises(ProtocolError, match="exceed max_ids=4"):
        encode(task, small)
    rejects(encode(task, BOUNDED), small, match="exceed max_ids=4", task_id=1)
    raw = encode(task, BOUNDED)
    rejects(raw, Limits(max_frame_bytes=len(raw) - 1), match="exceeds max_frame_bytes")
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes"):
        encode(task, Limits(max_frame_bytes=len(raw) - 1))
    # Without block counts (before the handshake) any int32 id passes.
    assert decode(encode(Task(1, "swap_out", [INT32_MAX], [INT32_MAX]))).dst == [INT32_MAX]


@pytest.mark.parametrize("value", [NAN, INF, -INF, -1.0, MAX_SECONDS * 2])
def test_encode_refuses_what_decode_refuses(value):
    with pytest.raises(ProtocolError, match="elapsed_s") as info:
        encode(Done(3, 0, True, "", 1, value, {"bytes": 1, "finished": 1.0}))
    assert info.value.task_id == 3
    finished = MAX_TIME * 2 if value == MAX_SECONDS * 2 else value
    with pytest.raises(ProtocolError, match="finished"):
        encode(Done(3, 0, True, "", 1, 0.5, {"bytes": 1, "finished": finished}))
    for bad in (dict(rank=MAX_RANK + 1), dict(rank=True), dict(blocks_done=-1),
                dict(task_id=-3), dict(task_id=INT64_MAX + 1)):
        fields = {"task_id": 3, "rank": 0, "blocks_done": 1, **bad}
        with pytest.raises(ProtocolError):
            encode(Done(fields["task_id"], fields["rank"], True, "", fields["blocks_done"], 0.5,
                        {"bytes": 1, "finished": 1.0}))
    with pytest.raises(ProtocolError, match="bytes"):
        encode(Done(3, 0, True, "", 1, 0.5, {"bytes": -1, "finished": 1.0}))
    assert math.isfinite(decode(encode(Done(3, 0, True, "", 1, 0, {"bytes": 0, "finished": 0.0})))
                         .elapsed_s)


def outcome(raw, limits: Limits):
    try:
        return decode(raw, limits)
    except ProtocolError as e:
        return ("refused", e.task_id)


some_ints = st.sampled_from([-1, 0, 1, 5, 9, 10, 19, 20, 25])
some_floats = st.sampled_from([NAN, INF, -INF, -1.0, -0.0, 0.0, 0.5, MAX_SECONDS,
                               MAX_SECONDS * 2, MAX_TIME, MAX_TIME * 2])


@settings(FUZZ, max_examples=300)
@given(st.sampled_from([1, 2]), st.integers(0, 4), st.integers(0, 1), st.sampled_from(
    [-1, 0, 7, INT64_MAX]), st.integers(0, 2), st.integers(0, 2), some_ints, some_ints,
    st.integers(0, 1), st.sampled_from([0, MAX_RANK, MAX_RANK + 1]), some_floats, some_floats,
    st.sampled_from([None, Limits(), BOUNDED]))
def test_the_one_read_path_agrees_with_the_general_checks(mtype, code, nstamps, task_id, nsrc,
                                                          ndst, a, b, pad, rank, x, y, limits):
    """decode reads a 32-byte task or a 48-byte done of a ``bytes`` frame in one
    struct read; any other buffer takes the general checks. Both decide alike."""
    if mtype == 1:  # 32 bytes whatever the header says
        raw = struct.pack("<BBBBIqIIii", 0xC1, PROTOCOL_VERSION, 1, code, nstamps, task_id,
                          nsrc, ndst, a, b)
    else:
        raw = struct.pack("<BBBBIqqqdd", 0xC1, PROTOCOL_VERSION, 2, pad, rank, task_id, a, b,
                          x, y)
    fast, general = outcome(raw, limits), outcome(bytearray(raw), limits)
    assert repr(fast) == repr(general)
