"""The wire protocol between the coordinator, the transfer workers and ``kvcached ctl``.

Transport (not this module's business, stated here so the format is whole):
the coordinator binds a ZMQ ROUTER; each worker connects a DEALER with identity
``rank-<r>``; the ROUTER side prepends/strips that identity frame. The control
socket used by the CLI is REQ/REP (or DEALER/ROUTER) with the same payloads.

Payload: every message is ONE frame, in one of two formats; byte 0 tells
them apart. Each message has exactly one of them (decode refuses the other):

- binary (byte 0 is 0xC1, a byte msgpack never uses): a swap or noop
  ``task``, and the ``done`` of a task that succeeded with a result of exactly
  ``bytes`` (int) and ``finished`` (float), what a swap or a noop returns.
  These are the messages every rank gets and answers for every swap, so they
  are read with one struct unpack and no per-field checks or maps;
- msgpack: everything else (hello, ready, heartbeat, store / load / lookup /
  control tasks, failed dones and dones with other results, error, shutdown,
  ctl, ctl_reply).

Binary frames, little-endian, every field fixed-size::

    task  offset  0  u8   0xC1
                  1  u8   protocol version (PROTOCOL_VERSION)
                  2  u8   1 (task)
                  3  u8   kind: 1 swap_out, 2 swap_in, 3 noop, 4 swap_in_layers
                  4  u32  S, stamp pairs (0, or one per rank: args["kv_event"])
                  8  i64  task_id
                 16  u32  N, src ids
                 20  u32  M, dst ids
                 24  S x (i64 epoch, i64 generation)
                 24 + 16 S   N x i32 src ids, then M x i32 dst ids
          length exactly 24 + 16 S + 4 (N + M)

    done  offset  0  u8   0xC1
                  1  u8   protocol version
                  2  u8   2 (done)
                  3  u8   0
                  4  u32  rank
                  8  i64  task_id
                 16  i64  blocks_done
                 24  i64  result["bytes"]
                 32  f64  elapsed_s
                 40  f64  result["finished"] (time.monotonic() of the rank)
          length exactly 48

A binary task carries no other args than the KV event stamps (encode refuses
others); its ids obey the task rules below, fit an int32, and number at most
``Limits.max_ids`` each way; stamps are non-negative. A binary done is
``ok=True, error=""`` with ``bytes >= 0`` and ``finished`` in [0, MAX_TIME].
Every range below holds for binary fields too.

Msgpack frames hold ONE msgpack map (str keys)::

    {"v": 2, "kind": "<kind>", <field>: <value>, ...}

``v`` is :data:`PROTOCOL_VERSION`; a different version is rejected, not guessed
at. ``kind`` picks the message class; the map must then hold exactly that
class's fields (a missing or an unknown key is an error, so both sides notice
drift instead of silently dropping data). Field types on the wire:

    int    msgpack int, within int64 and the field's range (below); a bool is NOT an int
    float  msgpack float or int (decoded as float), finite, within the field's range
    bool   msgpack true/false
    str    msgpack str (UTF-8), at most ``Limits.max_str`` bytes
    ids    array of ints, each 0 <= id < bound, at most ``Limits.max_ids`` long
    map    map with str keys whose values are int, float, str, bool, nil, bin,
           or arrays/maps of those, nested at most 4 containers deep below the map;
           every float in it finite (NaN and infinities are refused everywhere)

Numeric ranges (checked by decode and encode alike, so a hostile or buggy
peer never gets a NaN, an infinity or a negative count past validation)::

    hello      rank 0..MAX_RANK, pid 1..MAX_PID, protocol, block counts,
               restarts >= 0
    task       task_id >= 0
    done       task_id >= 0, rank 0..MAX_RANK, blocks_done >= 0,
               elapsed_s in [0, MAX_SECONDS]
    heartbeat  seq >= 0, time in [0, MAX_TIME] (seconds since the epoch)
    ctl        timeout_s in [MIN_TIMEOUT_S, MAX_SECONDS]

and in the args of a task or a ctl request, every key ending in ``_s`` (a
duration: control ``timeout_s``, load ``deadline_s``, ctl
``drain_timeout_s``) is a number in [0, MAX_SECONDS].

Kinds (direction; fields)::

    hello      worker -> coord   rank:int pid:int protocol:int layout_digest:str
                                 num_device_blocks:int num_host_blocks:int restarts:int
    ready      coord -> worker   ok:bool error:str
    task       coord -> worker   task_id:int task_kind:str src:ids dst:ids args:map
    done       worker -> coord   task_id:int rank:int ok:bool error:str blocks_done:int
                                 elapsed_s:float result:map
    heartbeat  both ways         sender:str seq:int time:float info:map
    error      reply to a frame that could not be decoded; error:str detail:str
    shutdown   coord -> worker   reason:str
    ctl        CLI -> coord      op:str args:map timeout_s:float
    ctl_reply  coord -> CLI      ok:bool result:map error:str

``task_kind`` is :attr:`Task.kind` (the wire key differs because ``kind`` names
the message). Task kinds and their ids (device ids are bounded by
``Limits.num_device_blocks``, host ids by ``Limits.num_host_blocks``)::

    swap_out  src device ids -> dst host ids (same length)
    swap_in   src host ids -> dst device ids (same length)
    swap_in_layers  as swap_in, copied layer by layer, each layer published in the
              rank's step progress channel as it lands (kvcached.memory.progress):
              a load inside the engine's step (vLLM: a CPU-tier hit)
    store     src host ids, dst empty, args["keys"]: one str per block
    load      dst host ids, src empty, args["keys"]: one str per block
    lookup    src and dst empty, args["keys"]: list of str
    control   src and dst empty, args["op"] in CONTROL_OPS plus that op's args
    noop      any ids (latency benchmarks, barriers), args at most the stamps

Hostile frames: a frame longer than ``Limits.max_frame_bytes`` is rejected
before parsing; a binary frame's length must be exactly what its header
declares, and msgpack is unpacked with length limits on every string,
binary, array and map, so a small frame cannot declare a huge allocation.
Every problem raises :class:`ProtocolError` (a ``ValueError``); a receiver
answers it with an :class:`ErrorReply` and keeps running.
"""

from __future__ import annotations

import array
import dataclasses
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from kvcached.memory.kvevent import STAMP_ARG

PROTOCOL_VERSION = 2  # 2: swap tasks and their dones travel as binary frames

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Containers allowed below an args/result/info map (the map itself not counted).
MAX_NESTING = 4
# Numeric ranges (see the module docstring). A rank beyond any real TP size,
# a duration of more than ~11 days or a time past the year 5000 is a bug or
# an attack, never data.
MAX_RANK = 65535
MAX_PID = (1 << 31) - 1
MAX_SECONDS = 1e6
MIN_TIMEOUT_S = 0.001
MAX_TIME = 1e11

TASK_KINDS = frozenset({"swap_out", "swap_in", "swap_in_layers", "store", "load", "lookup",
                        "control", "noop"})
CONTROL_OPS = frozenset({
    "pause", "resume", "sleep", "wakeup", "update_weights", "status",
    "attach_storage", "detach_storage",
})


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol.

    ``kind`` and ``task_id`` are filled in when the frame got far enough to
    show them, so a worker can still fail the right task instead of leaving
    the coordinator's barrier waiting.
    """

    def __init__(self, message: str, *, kind: str | None = None, task_id: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.task_id = task_id


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds applied when encoding and decoding (hostile-frame protection).

    ``num_device_blocks`` / ``num_host_blocks`` bound block ids in tasks;
    ``None`` leaves them unchecked (e.g. before the handshake).
    """

    max_frame_bytes: int = 8 << 20
    max_ids: int = 65536
    num_device_blocks: int | None = None
    num_host_blocks: int | None = None
    max_str: int = 4096
    max_map: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_ids", "max_str", "max_map"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Limits.{name}={value!r}: must be a positive int")
        for name in ("num_device_blocks", "num_host_blocks"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"Limits.{name}={value!r}: must be None or an int >= 0")


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------------------
# Field checkers: (value, where, limits) -> the value to keep, or ProtocolError.
# They serve both directions, so a sender finds its own bug with a traceback
# instead of the receiver answering "error".


def _type_name(value: Any) -> str:
    return type(value).__name__


def _fail(where: str, expected: str, value: Any) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"{where}: expected {expected}, got {_type_name(value)} {shown}")


def _check_int(value: Any, where: str, limits: Limits) -> int:
    if type(value) is not int:  # `is`, not isinstance: bool must not pass
        raise _fail(where, "int", value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ProtocolError(f"{where}: {value} is outside int64")
    return value


def _check_bool(value: Any, where: str, limits: Limits) -> bool:
    if type(value) is not bool:
        raise _fail(where, "bool", value)
    return value


def _check_float(value: Any, where: str, limits: Limits) -> float:
    kind = type(value)
    if kind is float:
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: {value} is not a finite number")
        return value
    if kind is int and INT64_MIN <= value <= INT64_MAX:
        return float(value)
    raise _fail(where, "float (or int)", value)


def _check_range(value: float, where: str, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ProtocolError(f"{where}: {value} is out of range [{lo}, {hi}]")


def _str_fits(text: str, max_bytes: int) -> bool:
    n = len(text)
    # A char is at most 4 UTF-8 bytes, so short strings skip the encode.
    return n <= max_bytes >> 2 or (
        n <= max_bytes and len(text.encode("utf-8", "surrogatepass")) <= max_bytes)


def _check_str(value: Any, where: str, limits: Limits) -> str:
    if type(value) is not str:
        raise _fail(where, "str", value)
    if not _str_fits(value, limits.max_str):
        raise ProtocolError(
            f"{where}: string of {len(value)} chars exceeds max_str={limits.max_str} bytes")
    return value


def _check_ids(value: Any, where: str, limits: Limits) -> list[int]:
    """Block ids: a list of ints in [0, int64 max]; kind-specific bounds come later."""
    if type(value) not in (list, tuple):
        raise _fail(where, "list of int", value)
    if len(value) > limits.max_ids:
        raise ProtocolError(f"{where}: {len(value)} ids exceed max_ids={limits.max_ids}")
    if not value:
        return []
    # map/set/min/max run in C: ~3 ms for 64k ids instead of a Python loop.
    if set(map(type, value)) != {int}:
        bad = next(i for i, x in enumerate(value) if type(x) is not int)
        raise _fail(f"{where}[{bad}]", "int block id", value[bad])
    if min(value) < 0 or max(value) > INT64_MAX:
        bad = next(i for i, x in enumerate(value) if not 0 <= x <= INT64_MAX)
        raise ProtocolError(f"{where}[{bad}]: block id {value[bad]} is out of range")
    return value if type(value) is list else list(value)


_SCALARS = (int, float, str, bool, bytes, type(None))


def _check_value(value: Any, where: str, depth: int, limits: Limits) -> Any:
    """One value inside an args/result/info map; returns it with tuples as lists."""
    kind = type(value)
    if kind is int:
        return _check_int(value, where, limits)
    if kind is str:
        return _check_str(value, where, limits)
    if kind is float:
        return _check_float(value, where, limits)
    if kind in (bool, bytes) or value is None:
        return value
    if kind in (list, tuple, dict):
        if depth >= MAX_NESTING:
            raise ProtocolError(f"{where}: nested deeper than {MAX_NESTING} containers")
        if kind is dict:
            return _check_dict(value, where, depth + 1, limits)
        return _check_list(value, where, depth + 1, limits)
    raise _fail(where, "int, float, str, bool, None, bytes, list or dict", value)


def _check_list(value: list | tuple, where: str, depth: int, limits: Limits) -> list:
    if len(value) > limits.max_ids:
        raise ProtocolError(f"{where}: {len(value)} items exceed max_ids={limits.max_ids}")
    types = set(map(type, value))
    # Fast paths for the common homogeneous lists (keys, ids).
    if types <= {str} and (not value or max(map(len, value)) <= limits.max_str >> 2):
        return list(value)
    if types <= {int} and (not value or INT64_MIN <= min(value) and max(value) <= INT64_MAX):
        return list(value)
    return [_check_value(x, f"{where}[{i}]", depth, limits) for i, x in enumerate(value)]


_PLAIN = frozenset({bool, bytes, type(None)})  # map values kept as they are


def _check_dict(value: dict, where: str, depth: int, limits: Limits) -> dict:
    if len(value) > limits.max_map:
        raise ProtocolError(f"{where}: {len(value)} entries exceed max_map={limits.max_map}")
    short = limits.max_str >> 2  # a str this short always fits (see _str_fits)
    out = {}
    for key, item in value.items():
        # Inline fast path for short keys and scalar values (every map on the task
        # path); anything else, and every error, goes through the full checks.
        kind = type(item)
        if type(key) is str and len(key) <= short and (
                kind in _PLAIN or (kind is int and INT64_MIN <= item <= INT64_MAX)
                or (kind is float and math.isfinite(item))
                or (kind is str and len(item) <= short)):
            out[key] = item
            continue
        if type(key) is not str:
            raise _fail(f"{where} key", "str", key)
        _check_str(key, f"{where} key", limits)
        out[key] = _check_value(item, f"{where}[{key!r}]", depth, limits)
    return out


def _check_map(value: Any, where: str, limits: Limits) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail(where, "map", value)
    return _check_dict(value, where, 0, limits)


Checker = Callable[[Any, str, Limits], Any]
_CHECKERS: dict[str, Checker] = {
    "int": _check_int,
    "bool": _check_bool,
    "float": _check_float,
    "str": _check_str,
    "list[int]": _check_ids,
    "dict[str, Any]": _check_map,
}


# ---------------------------------------------------------------------------
# Messages


class Message:
    """Base of every message. ``KIND`` is the wire ``kind``; fields are the dataclass's."""

    __slots__ = ()
    KIND: ClassVar[str]
    # (attribute, wire key, "where" prefix for errors, checker), built once per class.
    _SPEC: ClassVar[tuple[tuple[str, str, str, Checker], ...]]
    _KEYS: ClassVar[frozenset[str]]
    # Numeric fields with a range: attribute -> (lo, hi), both inclusive.
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {}
    # (attribute, "where" prefix, lo, hi), built once per class from RANGES.
    _RANGE_SPEC: ClassVar[tuple[tuple[str, str, float, float], ...]]

    def encode(self, limits: Limits | None = None) -> bytes:
        """Shorthand for :func:`encode` (validates, then packs)."""
        return encode(self, limits)

    def validate(self, limits: Limits | None = None) -> None:
        """Raise :class:`ProtocolError` if this message could not be sent."""
        encode(self, limits)


_BY_KIND: dict[str, type[Message]] = {}


def _message(kind: str, /, **wire_names: str) -> Callable[[type], type]:
    """Register a dataclass as message ``kind``; ``wire_names`` renames attributes on the wire."""

    def register(cls: type) -> type:
        spec = []
        for f in dataclasses.fields(cls):
            key = wire_names.get(f.name, f.name)
            spec.append((f.name, key, f"{kind}.{key}", _CHECKERS[f.type]))
        cls.KIND = kind
        cls._SPEC = tuple(spec)
        cls._RANGE_SPEC = tuple((attr, f"{kind}.{wire_names.get(attr, attr)}", lo, hi)
                                for attr, (lo, hi) in cls.RANGES.items())
        cls._KEYS = frozenset({"v", "kind"} | {key for _, key, _, _ in spec})
        _BY_KIND[kind] = cls
        return cls

    return register


@_message("hello")
@dataclass(slots=True)
class Hello(Message):
    """Worker -> coordinator on connect: who it is and what memory layout it attached."""

    RANGES: ClassVar = {"rank": (0, MAX_RANK), "pid": (1, MAX_PID), "protocol": (0, INT64_MAX),
                        "num_device_blocks": (0, INT64_MAX), "num_host_blocks": (0, INT64_MAX),
                        "restarts": (0, INT64_MAX)}

    rank: int
    pid: int
    protocol: int
    layout_digest: str
    num_device_blocks: int
    num_host_blocks: int
    restarts: int = 0


@_message("ready")
@dataclass(slots=True)
class Ready(Message):
    """Coordinator -> worker answer to hello; ``ok=False`` refuses it (``error`` says why)."""

    ok: bool = True
    error: str = ""


@_message("task", kind="task_kind")
@dataclass(slots=True)
class Task(Message):
    """Coordinator -> worker: one transfer or control task (see the module docstring)."""

    RANGES: ClassVar = {"task_id": (0, INT64_MAX)}

    task_id: int
    kind: str
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)


@_message("done")
@dataclass(slots=True)
class Done(Message):
    """Worker -> coordinator: the rank finished a task (ok or not)."""

    RANGES: ClassVar = {"task_id": (0, INT64_MAX), "rank": (0, MAX_RANK),
                        "blocks_done": (0, INT64_MAX), "elapsed_s": (0.0, MAX_SECONDS)}

    task_id: int
    rank: int
    ok: bool = True
    error: str = ""
    blocks_done: int = 0
    elapsed_s: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)


@_message("heartbeat")
@dataclass(slots=True)
class Heartbeat(Message):
    """Liveness, both ways; ``info`` carries optional health numbers."""

    RANGES: ClassVar = {"seq": (0, INT64_MAX), "time": (0.0, MAX_TIME)}

    sender: str
    seq: int
    time: float
    info: dict[str, Any] = field(default_factory=dict)


@_message("error")
@dataclass(slots=True)
class ErrorReply(Message):
    """Reply to a frame that could not be decoded; the receiver keeps running."""

    error: str
    detail: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException, limits: Limits | None = None) -> ErrorReply:
        """Build a reply from ``exc``, clipped so that it always fits the limits."""
        max_str = (limits or DEFAULT_LIMITS).max_str
        return cls(clip(type(exc).__name__, max_str), clip(str(exc), max_str))


@_message("shutdown")
@dataclass(slots=True)
class Shutdown(Message):
    """Coordinator -> worker: exit cleanly."""

    reason: str = ""


@_message("ctl")
@dataclass(slots=True)
class CtlRequest(Message):
    """CLI -> coordinator control socket: apply ``op`` on every rank within ``timeout_s``."""

    RANGES: ClassVar = {"timeout_s": (MIN_TIMEOUT_S, MAX_SECONDS)}

    op: str
    args: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0


@_message("ctl_reply")
@dataclass(slots=True)
class CtlReply(Message):
    """Coordinator -> CLI: the outcome of a :class:`CtlRequest`."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


MESSAGE_KINDS = frozenset(_BY_KIND)


def clip(text: str, max_bytes: int = DEFAULT_LIMITS.max_str) -> str:
    """Cut ``text`` so that its UTF-8 form fits ``max_bytes`` (for error strings, tracebacks)."""
    if _str_fits(text, max_bytes):
        return text
    raw = text.encode("utf-8", "surrogatepass")[: max_bytes - 3]
    return raw.decode("utf-8", "ignore") + "..."


# ---------------------------------------------------------------------------
# Task semantics (beyond field types)


def _check_bound(ids: list[int], where: str, bound: int | None, tier: str) -> None:
    if bound is not None and ids and max(ids) >= bound:
        bad = next(x for x in ids if x >= bound)
        raise ProtocolError(f"{where}: {tier} block id {bad} >= num_{tier}_blocks={bound}")


def _check_keys(task: Task, count: int | None) -> None:
    keys = task.args.get("keys")
    if type(keys) not in (list, tuple) or not set(map(type, keys)) <= {str}:
        raise ProtocolError(f"task {task.kind}: args['keys'] must be a list of str")
    if count is not None and len(keys) != count:
        raise ProtocolError(
            f"task {task.kind}: {len(keys)} keys for {count} blocks (need one key per block)")


def _check_lengths(task: Task) -> None:
    """A lookup of several runs: ``lengths`` splits ``keys`` into them."""
    if "lengths" not in task.args:
        return
    lengths = task.args["lengths"]
    if (type(lengths) not in (list, tuple) or not all(type(n) is int and n >= 0 for n in lengths)
            or sum(lengths) != len(task.args["keys"])):
        raise ProtocolError(f"task lookup: args['lengths'] must be non-negative ints summing "
                            f"to the {len(task.args['keys'])} keys, got {lengths!r}")


def _check_empty(task: Task, *names: str) -> None:
    for name in names:
        if getattr(task, name):
            raise ProtocolError(f"task {task.kind}: {name} must be empty")


def _check_task(task: Task, limits: Limits) -> None:
    """Kind-specific rules: which ids are device/host, matching lengths, required args."""
    kind, dev, host = task.kind, limits.num_device_blocks, limits.num_host_blocks
    _check_durations(task.args, f"task {kind}: args")
    if kind not in TASK_KINDS:
        raise ProtocolError(f"task.task_kind: unknown task kind {kind!r}; "
                            f"expected one of {sorted(TASK_KINDS)}")
    if kind in ("swap_out", "swap_in", "swap_in_layers"):
        if len(task.src) != len(task.dst):
            raise ProtocolError(
                f"task {kind}: src has {len(task.src)} ids but dst has {len(task.dst)}")
        src_tier, dst_tier = ("device", "host") if kind == "swap_out" else ("host", "device")
        _check_bound(task.src, f"task {kind} src", dev if kind == "swap_out" else host, src_tier)
        _check_bound(task.dst, f"task {kind} dst", host if kind == "swap_out" else dev, dst_tier)
    elif kind == "store":
        _check_empty(task, "dst")
        _check_bound(task.src, "task store src", host, "host")
        _check_keys(task, len(task.src))
    elif kind == "load":
        _check_empty(task, "src")
        _check_bound(task.dst, "task load dst", host, "host")
        _check_keys(task, len(task.dst))
    elif kind == "lookup":
        _check_empty(task, "src", "dst")
        _check_keys(task, None)
        _check_lengths(task)
    elif kind == "control":
        _check_empty(task, "src", "dst")
        op = task.args.get("op")
        if type(op) is not str or op not in CONTROL_OPS:  # type first: a list is unhashable
            raise ProtocolError(f"task control: args['op']={op!r} is not one of "
                                f"{sorted(CONTROL_OPS)}")


def _check_durations(args: dict[str, Any], where: str) -> None:
    """Every ``*_s`` key of ``args`` is a duration: a number in [0, MAX_SECONDS]."""
    for name, value in args.items():
        if name.endswith("_s"):
            at = f"{where}[{name!r}]"
            if type(value) not in (int, float):  # bool is not a duration either
                raise _fail(at, "a number of seconds", value)
            _check_range(value, at, 0.0, MAX_SECONDS)


# ---------------------------------------------------------------------------
# Binary frames: a swap or noop task, and the successful Done of one. Every
# rank gets and answers each of these, so they skip msgpack, its per-field
# checks and any dict on the way: one struct read of the header, the ids
# straight from the frame.

BINARY_MAGIC = 0xC1  # a byte msgpack never uses: byte 0 tells the formats apart
BINARY_TASK, BINARY_DONE = 1, 2  # byte 2, the message type
BINARY_TASK_KINDS = ("swap_out", "swap_in", "noop", "swap_in_layers")  # kind code = index + 1
_KIND_CODE = {kind: code for code, kind in enumerate(BINARY_TASK_KINDS, 1)}
_KIND_OF = dict(enumerate(BINARY_TASK_KINDS, 1))
# magic, version, type, kind code, stamp pairs, task_id, src count, dst count
TASK_HEADER = struct.Struct("<BBBBIqII")
# magic, version, type, 0, rank, task_id, blocks_done, bytes, elapsed_s, finished
DONE_FRAME = struct.Struct("<BBBBIqqqdd")
INT32_MAX = (1 << 31) - 1
MAX_STAMPS = MAX_RANK + 1  # one (epoch, generation) pair per rank
_NATIVE_LE = sys.byteorder == "little"


def _i32s(raw: Any, offset: int, count: int) -> list[int]:
    """``count`` little-endian int32s of ``raw`` from ``offset``."""
    if _NATIVE_LE:
        return memoryview(raw)[offset:offset + 4 * count].cast("i").tolist()
    return list(struct.unpack_from(f"<{count}i", raw, offset))


def _i32_bytes(ids: list[int]) -> bytes:
    out = array.array("i", ids)
    if not _NATIVE_LE:
        out.byteswap()
    return out.tobytes()


def binary_done_shape(msg: Done) -> bool:
    """Whether ``msg`` travels as a binary frame: ok, no error, and a result of
    exactly ``bytes`` (int) and ``finished`` (float), what a swap or noop returns.
    Every other Done (failed, storage, control) is msgpack."""
    result = msg.result
    return (msg.ok is True and msg.error == "" and type(result) is dict and len(result) == 2
            and type(result.get("bytes")) is int and type(result.get("finished")) is float)


def _task_ids(ids: Any, where: str, limits: Limits) -> list[int]:
    ids = _check_ids(ids, where, limits)
    if ids and max(ids) > INT32_MAX:
        bad = next(x for x in ids if x > INT32_MAX)
        raise ProtocolError(f"{where}: block id {bad} does not fit the binary frame's int32")
    return ids


def _task_stamps(kind: str, args: Any) -> list[int]:
    """The flat (epoch, generation, ...) int64s of ``args``, which may hold only the
    KV event stamps (kvcached.memory.kvevent)."""
    if type(args) is not dict:
        raise _fail(f"task {kind}: args", "map", args)
    if not args:
        return []
    if args.keys() != {STAMP_ARG}:
        raise ProtocolError(f"task {kind}: args may hold only {STAMP_ARG!r} (a binary frame "
                            f"has no other), got {sorted(map(repr, args))}")
    stamps = args[STAMP_ARG]
    where = f"task {kind}: args[{STAMP_ARG!r}]"
    if type(stamps) not in (list, tuple) or not 0 < len(stamps) <= MAX_STAMPS:
        raise _fail(where, f"a list of 1 to {MAX_STAMPS} [epoch, generation] pairs", stamps)
    flat = []
    for i, pair in enumerate(stamps):
        if (type(pair) not in (list, tuple) or len(pair) != 2
                or not all(type(x) is int and 0 <= x <= INT64_MAX for x in pair)):
            raise _fail(f"{where}[{i}]", "[epoch, generation] ints in [0, int64 max]", pair)
        flat += pair
    return flat


def _check_swap_ids(kind: str, src: list[int], dst: list[int], limits: Limits) -> None:
    """A swap's ids: equal lengths, each tier's ids below its block count."""
    if len(src) != len(dst):
        raise ProtocolError(f"task {kind}: src has {len(src)} ids but dst has {len(dst)}")
    dev, host = limits.num_device_blocks, limits.num_host_blocks
    src_tier, dst_tier = ("device", "host") if kind == "swap_out" else ("host", "device")
    _check_bound(src, f"task {kind} src", dev if kind == "swap_out" else host, src_tier)
    _check_bound(dst, f"task {kind} dst", host if kind == "swap_out" else dev, dst_tier)


def _id_bounds(kind: str, limits: Limits) -> tuple[int, int]:
    """Exclusive upper bounds of a binary task's (src, dst) ids."""
    if kind == "noop":
        return _NO_BOUND, _NO_BOUND
    dev, host = limits.num_device_blocks, limits.num_host_blocks
    dev = _NO_BOUND if dev is None else dev
    host = _NO_BOUND if host is None else host
    return (dev, host) if kind == "swap_out" else (host, dev)


_NO_BOUND = INT32_MAX + 1  # every int32 id fits
_ONE_BLOCK_TASK = struct.Struct("<BBBBIqIIii")  # a one-block task frame, whole


def _ids_fit(ids: Any, bound: int) -> bool:
    """``ids`` is a list of ints in [0, bound) (the common case, in C calls)."""
    if type(ids) is not list:
        return False
    if len(ids) == 1:
        return type(ids[0]) is int and 0 <= ids[0] < bound
    return not ids or (set(map(type, ids)) == _INT_ONLY and min(ids) >= 0 and max(ids) < bound)


_INT_ONLY = {int}


def _encode_binary_task(task: Task, limits: Limits) -> bytes:
    kind, task_id, src, dst, args = task.kind, task.task_id, task.src, task.dst, task.args
    src_bound, dst_bound = _id_bounds(kind, limits)
    if (type(task_id) is int and 0 <= task_id <= INT64_MAX and type(args) is dict and not args
            and type(src) is list and type(dst) is list
            and (kind == "noop" or len(src) == len(dst)) and len(src) <= limits.max_ids
            and len(dst) <= limits.max_ids and _ids_fit(src, min(src_bound, _NO_BOUND))
            and _ids_fit(dst, min(dst_bound, _NO_BOUND))):
        # The common task, checked in one pass; anything else (stamps included)
        # takes the checks below, which also word every refusal.
        if len(src) == 1 and len(dst) == 1:
            raw = _ONE_BLOCK_TASK.pack(BINARY_MAGIC, PROTOCOL_VERSION, BINARY_TASK,
                                       _KIND_CODE[kind], 0, task_id, 1, 1, src[0], dst[0])
        else:
            raw = TASK_HEADER.pack(BINARY_MAGIC, PROTOCOL_VERSION, BINARY_TASK,
                                   _KIND_CODE[kind], 0, task_id, len(src),
                                   len(dst)) + _i32_bytes(src + dst)
        stamps = ()
    else:
        try:
            task_id = _check_int(task_id, "task.task_id", limits)
            _check_range(task_id, "task.task_id", 0, INT64_MAX)
            src = _task_ids(src, "task.src", limits)
            dst = _task_ids(dst, "task.dst", limits)
            if kind != "noop":
                _check_swap_ids(kind, src, dst, limits)
            stamps = _task_stamps(kind, args)
        except ProtocolError as exc:
            exc.kind = Task.KIND
            exc.task_id = task_id if type(task_id) is int and 0 <= task_id <= INT64_MAX else None
            raise
        raw = b"".join((
            TASK_HEADER.pack(BINARY_MAGIC, PROTOCOL_VERSION, BINARY_TASK, _KIND_CODE[kind],
                             len(stamps) >> 1, task_id, len(src), len(dst)),
            struct.pack(f"<{len(stamps)}q", *stamps), _i32_bytes(src + dst)))
    if len(raw) > limits.max_frame_bytes:
        raise ProtocolError(f"task: encoded frame of {len(raw)} bytes exceeds "
                            f"max_frame_bytes={limits.max_frame_bytes}", kind=Task.KIND,
                            task_id=task_id)
    return raw


def encode_done(task_id: int, rank: int, blocks_done: int, elapsed_s: float, nbytes: int,
                finished: float) -> bytes:
    """The binary frame of ``Done(task_id, rank, True, "", blocks_done, elapsed_s,
    {"bytes": nbytes, "finished": finished})``: what :func:`encode` gives for that
    message (it calls this), without the message object, for a worker that
    answers every swap with one. Raises :class:`ProtocolError` as encode does."""
    if (type(task_id) is int and type(rank) is int and type(blocks_done) is int
            and type(elapsed_s) is float and type(nbytes) is int and type(finished) is float
            and 0 <= task_id <= INT64_MAX and 0 <= rank <= MAX_RANK
            and 0 <= blocks_done <= INT64_MAX and 0 <= nbytes <= INT64_MAX
            and 0.0 <= elapsed_s <= MAX_SECONDS and 0.0 <= finished <= MAX_TIME):
        return DONE_FRAME.pack(BINARY_MAGIC, PROTOCOL_VERSION, BINARY_DONE, 0, rank, task_id,
                               blocks_done, nbytes, elapsed_s, finished)
    # The checks that word the refusal (an int elapsed_s passes, as a float).
    try:
        for value, where, lo, hi, check in (
                (task_id, "done.task_id", 0, INT64_MAX, _check_int),
                (rank, "done.rank", 0, MAX_RANK, _check_int),
                (blocks_done, "done.blocks_done", 0, INT64_MAX, _check_int),
                (elapsed_s, "done.elapsed_s", 0.0, MAX_SECONDS, _check_float),
                (nbytes, "done.result['bytes']", 0, INT64_MAX, _check_int),
                (finished, "done.result['finished']", 0.0, MAX_TIME, _check_float)):
            _check_range(check(value, where, DEFAULT_LIMITS), where, lo, hi)
    except ProtocolError as exc:
        exc.kind = Done.KIND
        exc.task_id = task_id if type(task_id) is int and 0 <= task_id <= INT64_MAX else None
        raise
    return DONE_FRAME.pack(BINARY_MAGIC, PROTOCOL_VERSION, BINARY_DONE, 0, rank, task_id,
                           blocks_done, nbytes, float(elapsed_s), float(finished))


def _decode_binary(raw: bytes, limits: Limits) -> Task | Done:
    """One binary frame (``raw[0] == BINARY_MAGIC``); see the module docstring."""
    size = len(raw)
    if size < 4:
        raise ProtocolError(f"binary frame of {size} bytes is shorter than its 4-byte preamble")
    version, mtype = raw[1], raw[2]
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version mismatch: binary frame has v={version}, this "
                            f"side speaks v={PROTOCOL_VERSION}; upgrade both sides together")
    if mtype == BINARY_TASK:
        return _decode_binary_task(raw, size, limits)
    if mtype == BINARY_DONE:
        return _decode_binary_done(raw, size)
    raise ProtocolError(f"unknown binary message type {mtype}; expected {BINARY_TASK} (task) "
                        f"or {BINARY_DONE} (done)")


def _decode_binary_task(raw: bytes, size: int, limits: Limits) -> Task:
    head = TASK_HEADER.size
    src: list[int] = []
    dst: list[int] = []
    if size < head:
        raise ProtocolError(f"binary task: frame of {size} bytes is shorter than its "
                            f"{head}-byte header", kind=Task.KIND)
    _, _, _, code, nstamps, task_id, nsrc, ndst = TASK_HEADER.unpack_from(raw)
    kind = _KIND_OF.get(code)
    if kind is not None and task_id >= 0:
        src_bound, dst_bound = _id_bounds(kind, limits)
        ids_at = head + 16 * nstamps
        if (nsrc <= limits.max_ids and ndst <= limits.max_ids and nstamps <= MAX_STAMPS
                and size == ids_at + 4 * (nsrc + ndst)):
            ids = _i32s(raw, ids_at, nsrc + ndst)
            src, dst = ids[:nsrc], ids[nsrc:]
            ok = (nsrc == ndst or kind == "noop") and (not ids or min(ids) >= 0) and (
                not src or max(src) < src_bound) and (not dst or max(dst) < dst_bound)
            if ok and not nstamps:
                return Task(task_id, kind, src, dst, {})
            if ok:
                flat = struct.unpack_from(f"<{2 * nstamps}q", raw, head)
                if min(flat) >= 0:
                    return Task(task_id, kind, src, dst, {
                        STAMP_ARG: [list(flat[i:i + 2]) for i in range(0, len(flat), 2)]})
    # Refused: say why (the checks above, one at a time).
    tid = task_id if task_id >= 0 else None
    if kind is None:
        raise ProtocolError(f"task.task_kind: unknown binary task kind code {code}; expected "
                            f"one of {_KIND_CODE}", kind=Task.KIND, task_id=tid)
    if tid is None:
        raise ProtocolError(f"task.task_id: {task_id} is out of range [0, {INT64_MAX}]",
                            kind=Task.KIND)
    for name, count, bound, most in (("src ids", nsrc, "max_ids", limits.max_ids),
                                     ("dst ids", ndst, "max_ids", limits.max_ids),
                                     ("kv_event stamps", nstamps, "MAX_STAMPS", MAX_STAMPS)):
        if count > most:
            raise ProtocolError(f"task {kind}: {count} {name} exceed {bound}={most}",
                                kind=Task.KIND, task_id=tid)
    want = head + 16 * nstamps + 4 * (nsrc + ndst)
    if size != want:
        raise ProtocolError(f"binary task: frame of {size} bytes, its header declares {want}",
                            kind=Task.KIND, task_id=tid)
    for name, ids in (("src", src), ("dst", dst)):
        if ids and min(ids) < 0:
            bad = next(i for i, x in enumerate(ids) if x < 0)
            raise ProtocolError(f"task {kind} {name}[{bad}]: block id {ids[bad]} is out of range",
                                kind=Task.KIND, task_id=tid)
    try:
        if kind != "noop":
            _check_swap_ids(kind, src, dst, limits)
    except ProtocolError as exc:
        exc.kind, exc.task_id = Task.KIND, tid
        raise
    raise ProtocolError(f"task {kind}: args[{STAMP_ARG!r}] holds a negative epoch or "
                        "generation", kind=Task.KIND, task_id=tid)


def _decode_binary_done(raw: bytes, size: int) -> Done:
    if size != DONE_FRAME.size:
        tid = struct.unpack_from("<q", raw, 8)[0] if size >= 16 else -1
        raise ProtocolError(f"binary done: frame of {size} bytes, a done is {DONE_FRAME.size}",
                            kind=Done.KIND, task_id=tid if tid >= 0 else None)
    _, _, _, pad, rank, task_id, blocks, nbytes, elapsed, finished = DONE_FRAME.unpack_from(raw)
    # Chained comparisons: NaN fails every one of them.
    if (pad == 0 and task_id >= 0 and rank <= MAX_RANK and blocks >= 0 and nbytes >= 0
            and 0.0 <= elapsed <= MAX_SECONDS and 0.0 <= finished <= MAX_TIME):
        return Done(task_id, rank, True, "", blocks, elapsed,
                    {"bytes": nbytes, "finished": finished})
    tid = task_id if task_id >= 0 else None
    for where, value, lo, hi in (
            ("done byte 3", pad, 0, 0), ("done.task_id", task_id, 0, INT64_MAX),
            ("done.rank", rank, 0, MAX_RANK), ("done.blocks_done", blocks, 0, INT64_MAX),
            ("done.result['bytes']", nbytes, 0, INT64_MAX),
            ("done.elapsed_s", elapsed, 0.0, MAX_SECONDS),
            ("done.result['finished']", finished, 0.0, MAX_TIME)):
        if not lo <= value <= hi:
            raise ProtocolError(f"{where}: {value} is out of range [{lo}, {hi}]",
                                kind=Done.KIND, task_id=tid)
    raise AssertionError("unreachable: every check passed")  # pragma: no cover


# ---------------------------------------------------------------------------
# encode / decode


def _to_wire(msg: Message, limits: Limits) -> dict[str, Any]:
    wire = {"v": PROTOCOL_VERSION, "kind": msg.KIND}
    for attr, key, where, check in msg._SPEC:
        wire[key] = check(getattr(msg, attr), where, limits)
    _check_ranges(msg)
    if type(msg) is Task:
        _check_task(msg, limits)
    return wire


def _check_ranges(msg: Message) -> None:
    """Every numeric field within its declared range (after the type checks), and
    the durations in a ctl request's args (a task's: ``_check_task``)."""
    for attr, where, lo, hi in msg._RANGE_SPEC:
        _check_range(getattr(msg, attr), where, lo, hi)
    if type(msg) is CtlRequest:
        _check_durations(msg.args, "ctl.args")


def encode(msg: Message, limits: Limits | None = None) -> bytes:
    """Validate ``msg`` against ``limits`` (default: :data:`DEFAULT_LIMITS`) and pack it
    into one frame: a binary frame for a swap or noop Task and for a Done of
    :func:`binary_done_shape`, msgpack for everything else. Raises
    :class:`ProtocolError` if the receiver would reject it."""
    if not isinstance(msg, Message):
        raise ProtocolError(f"cannot encode {_type_name(msg)}: not a protocol message")
    limits = limits or DEFAULT_LIMITS
    cls = type(msg)
    if cls is Task and type(msg.kind) is str and msg.kind in _KIND_CODE:
        return _encode_binary_task(msg, limits)
    if cls is Done and binary_done_shape(msg):
        return encode_done(msg.task_id, msg.rank, msg.blocks_done, msg.elapsed_s,
                           msg.result["bytes"], msg.result["finished"])
    try:
        raw = msgpack.packb(_to_wire(msg, limits), use_bin_type=True)
    except ProtocolError as exc:
        exc.kind = msg.KIND
        exc.task_id = getattr(msg, "task_id", None)
        raise
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone surrogate in a str
        raise ProtocolError(f"{msg.KIND}: cannot pack: {exc}", kind=msg.KIND) from exc
    if len(raw) > limits.max_frame_bytes:
        raise ProtocolError(f"{msg.KIND}: encoded frame of {len(raw)} bytes exceeds "
                            f"max_frame_bytes={limits.max_frame_bytes}", kind=msg.KIND)
    return raw


def _unpack(raw: bytes, limits: Limits) -> Any:
    try:
        # unpackb has no max_buffer_size (that is the streaming Unpacker's); the
        # frame-size check in decode plays that role for a one-shot buffer.
        return msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True,
            max_str_len=limits.max_str, max_bin_len=limits.max_frame_bytes,
            max_array_len=limits.max_ids, max_map_len=limits.max_map, max_ext_len=0)
    except msgpack.StackError:
        raise ProtocolError("not a valid frame: msgpack nesting too deep") from None
    except msgpack.ExtraData:
        raise ProtocolError("not a valid frame: trailing bytes after the message") from None
    except Exception as exc:  # noqa: BLE001 - any failure of the parser means a bad frame
        raise ProtocolError(f"not a valid msgpack frame: {type(exc).__name__}: {exc}") from None


def _check_header(obj: Any) -> type[Message]:
    if type(obj) is not dict:
        raise ProtocolError(f"message must be a msgpack map, got {_type_name(obj)}")
    if "v" not in obj:
        raise ProtocolError("message has no protocol version field 'v'")
    version = obj["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version mismatch: frame has v={version!r}, "
                            f"this side speaks v={PROTOCOL_VERSION}; upgrade both sides together")
    kind = obj.get("kind")
    cls = _BY_KIND.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; expected one of {sorted(_BY_KIND)}")
    return cls


def _check_keys_exact(obj: dict, cls: type[Message], task_id: int | None) -> None:
    problems = []
    missing = cls._KEYS - obj.keys()
    if missing:
        problems.append(f"missing field(s) {sorted(missing)}")
    unknown = obj.keys() - cls._KEYS
    if unknown:
        problems.append(f"unknown field(s) [{', '.join(sorted(map(repr, unknown)))}]")
    raise ProtocolError(f"{cls.KIND}: {'; '.join(problems)}", kind=cls.KIND, task_id=task_id)


def decode(raw: bytes, limits: Limits | None = None) -> Message:
    """Decode and validate one frame, binary or msgpack (byte 0 tells); raises
    :class:`ProtocolError` on anything wrong.

    ``limits`` (default :data:`DEFAULT_LIMITS`) bounds the frame, lists, strings
    and, when set, the block ids of tasks. A msgpack frame of a message that
    travels binary (a swap or noop task, a Done of :func:`binary_done_shape`) is
    refused: each message has exactly one encoding.
    """
    limits = limits or DEFAULT_LIMITS
    size = len(raw) if type(raw) is bytes else -1
    # The frames of every swap, read first and in place: they pass exactly when
    # the full checks below would (anything else goes on to them, and they word
    # the refusal). A one-block task and a done cost one struct read each.
    if size == 48 and raw[0] == BINARY_MAGIC and size <= limits.max_frame_bytes:
        m, v, t, pad, rank, task_id, blocks, nbytes, elapsed, finished = DONE_FRAME.unpack_from(
            raw)
        if (v == PROTOCOL_VERSION and t == BINARY_DONE and pad == 0 and task_id >= 0
                and rank <= MAX_RANK and blocks >= 0 and nbytes >= 0
                and 0.0 <= elapsed <= MAX_SECONDS and 0.0 <= finished <= MAX_TIME):
            return Done(task_id, rank, True, "", blocks, elapsed,
                        {"bytes": nbytes, "finished": finished})
    elif size == 32 and raw[0] == BINARY_MAGIC and size <= limits.max_frame_bytes:
        m, v, t, code, nstamps, task_id, nsrc, ndst, s, d = _ONE_BLOCK_TASK.unpack_from(raw)
        if (v == PROTOCOL_VERSION and t == BINARY_TASK and nstamps == 0 and nsrc == 1
                and ndst == 1 and task_id >= 0 and s >= 0 and d >= 0):
            dev, host = limits.num_device_blocks, limits.num_host_blocks
            # the kind codes of BINARY_TASK_KINDS, spelled out (no lookup per task)
            if code == 1 and (dev is None or s < dev) and (host is None or d < host):
                return Task(task_id, "swap_out", [s], [d], {})
            if code == 2 and (host is None or s < host) and (dev is None or d < dev):
                return Task(task_id, "swap_in", [s], [d], {})
            if code == 3:
                return Task(task_id, "noop", [s], [d], {})
    if type(raw) is not bytes:
        try:
            view = memoryview(raw)
        except TypeError:
            raise ProtocolError(f"frame must be bytes-like, got {_type_name(raw)}") from None
        if view.nbytes > limits.max_frame_bytes:
            raise ProtocolError(
                f"frame of {view.nbytes} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
        raw = view.tobytes()
    if len(raw) > limits.max_frame_bytes:
        # Checked before parsing so an oversize frame costs nothing to refuse.
        raise ProtocolError(
            f"frame of {len(raw)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    if raw and raw[0] == BINARY_MAGIC:
        return _decode_binary(raw, limits)
    obj = _unpack(raw, limits)
    cls = _check_header(obj)
    task_id = obj.get("task_id")
    # Only an id a Done could carry back (an answer must itself be valid).
    task_id = task_id if type(task_id) is int and 0 <= task_id <= INT64_MAX else None
    if len(obj) != len(cls._KEYS) or not obj.keys() <= cls._KEYS:
        _check_keys_exact(obj, cls, task_id)
    if cls is Task and type(obj["task_kind"]) is str and obj["task_kind"] in _KIND_CODE:
        raise ProtocolError(f"task {obj['task_kind']}: swap and noop tasks travel as binary "
                            "frames, not msgpack", kind=Task.KIND, task_id=task_id)
    try:
        msg = cls(*[check(obj[key], where, limits) for _, key, where, check in cls._SPEC])
        _check_ranges(msg)
        if cls is Task:
            _check_task(msg, limits)
        elif cls is Done and binary_done_shape(msg):
            raise ProtocolError("done: a successful done whose result is bytes and finished "
                                "travels as a binary frame, not msgpack")
    except ProtocolError as exc:
        exc.kind, exc.task_id = cls.KIND, task_id
        raise
    return msg


__all__ = [
    "BINARY_DONE", "BINARY_MAGIC", "BINARY_TASK", "BINARY_TASK_KINDS", "CONTROL_OPS",
    "DEFAULT_LIMITS", "DONE_FRAME", "INT32_MAX", "MAX_NESTING", "MAX_PID", "MAX_RANK",
    "MAX_SECONDS", "MAX_STAMPS", "MAX_TIME", "MESSAGE_KINDS", "MIN_TIMEOUT_S",
    "PROTOCOL_VERSION", "TASK_HEADER", "TASK_KINDS", "CtlReply", "CtlRequest", "Done",
    "ErrorReply", "Heartbeat", "Hello", "Limits", "Message", "ProtocolError", "Ready",
    "Shutdown", "Task", "binary_done_shape", "clip", "decode", "encode", "encode_done",
]
