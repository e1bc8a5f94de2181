"""The wire protocol between the coordinator, the transfer workers and ``kvcached ctl``.

Transport (not this module's business, stated here so the format is whole):
the coordinator binds a ZMQ ROUTER; each worker connects a DEALER with identity
``rank-<r>``; the ROUTER side prepends/strips that identity frame. The control
socket used by the CLI is REQ/REP (or DEALER/ROUTER) with the same payloads.

Payload: every message is ONE frame holding ONE msgpack map (str keys)::

    {"v": 1, "kind": "<kind>", <field>: <value>, ...}

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
    store     src host ids, dst empty, args["keys"]: one str per block
    load      dst host ids, src empty, args["keys"]: one str per block
    lookup    src and dst empty, args["keys"]: list of str
    control   src and dst empty, args["op"] in CONTROL_OPS plus that op's args
    noop      anything (latency benchmarks); ids only type-checked

Hostile frames: a frame longer than ``Limits.max_frame_bytes`` is rejected
before unpacking, and msgpack is unpacked with length limits on every string,
binary, array and map, so a small frame cannot declare a huge allocation.
Every problem raises :class:`ProtocolError` (a ``ValueError``); a receiver
answers it with an :class:`ErrorReply` and keeps running.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1

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

TASK_KINDS = frozenset({"swap_out", "swap_in", "store", "load", "lookup", "control", "noop"})
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
        _to_wire(self, limits or DEFAULT_LIMITS)


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
    if kind in ("swap_out", "swap_in"):
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
# Quick checks for the two messages of every task (task and done, one per
# rank each way). They pass only the plain common case, in one pass with no
# call per field; anything else (False) takes the full checks above, which
# decide every rejection and word every error.

_NO_BOUND = INT64_MAX + 1
_QUICK_TASK_KINDS = frozenset({"swap_out", "swap_in", "noop"})


def _bounds(kind: str, limits: Limits) -> tuple[int, int]:
    """Exclusive upper bounds of (src, dst) ids for a quick task kind."""
    if kind == "noop":
        return _NO_BOUND, _NO_BOUND
    dev = _NO_BOUND if limits.num_device_blocks is None else limits.num_device_blocks
    host = _NO_BOUND if limits.num_host_blocks is None else limits.num_host_blocks
    return (dev, host) if kind == "swap_out" else (host, dev)


def _ids_within(ids: list, bound: int) -> bool:
    if len(ids) == 1:  # the common one-block task, without building sets
        return type(ids[0]) is int and 0 <= ids[0] < bound
    return not ids or (set(map(type, ids)) == _INT_ONLY and min(ids) >= 0 and max(ids) < bound)


_INT_ONLY = frozenset({int})


def _quick_task(wire: dict[str, Any], limits: Limits) -> bool:
    """A swap or noop with equal-length id lists and no args."""
    task_id, kind, src, dst, args = (wire["task_id"], wire["task_kind"], wire["src"],
                                     wire["dst"], wire["args"])
    if (type(task_id) is not int or not 0 <= task_id <= INT64_MAX
            or type(kind) is not str or kind not in _QUICK_TASK_KINDS
            or type(args) is not dict or args or type(src) is not list
            or type(dst) is not list or len(src) != len(dst) or len(src) > limits.max_ids):
        return False
    src_bound, dst_bound = _bounds(kind, limits)
    return _ids_within(src, src_bound) and _ids_within(dst, dst_bound)


_PLAIN_RESULT = frozenset({int, float, bool})


def _quick_done(wire: dict[str, Any], limits: Limits) -> bool:
    """Ints in range, a float elapsed time in range, a short error and a flat result
    map of short keys and numbers (finite floats)."""
    task_id, rank, blocks = wire["task_id"], wire["rank"], wire["blocks_done"]
    error, result, elapsed = wire["error"], wire["result"], wire["elapsed_s"]
    if (type(task_id) is not int or type(rank) is not int or type(blocks) is not int
            or type(wire["ok"]) is not bool or type(error) is not str
            or type(elapsed) is not float or not 0.0 <= elapsed <= MAX_SECONDS
            or type(result) is not dict
            or len(error) > limits.max_str >> 2 or len(result) > limits.max_map
            or min(task_id, rank, blocks) < 0 or max(task_id, blocks) > INT64_MAX
            or rank > MAX_RANK):
        return False
    short = limits.max_str >> 2
    for key, value in result.items():
        kind = type(value)
        if (type(key) is not str or len(key) > short or kind not in _PLAIN_RESULT
                or (kind is int and not INT64_MIN <= value <= INT64_MAX)
                or (kind is float and not math.isfinite(value))):
            return False
    return True


_QUICK: dict[type, Callable[[dict[str, Any], Limits], bool]] = {
    Task: _quick_task, Done: _quick_done}


# ---------------------------------------------------------------------------
# encode / decode


def _to_wire(msg: Message, limits: Limits) -> dict[str, Any]:
    quick = _QUICK.get(type(msg))
    if quick is not None:
        wire = {"v": PROTOCOL_VERSION, "kind": msg.KIND}
        for attr, key, _, _ in msg._SPEC:
            wire[key] = getattr(msg, attr)
        if quick(wire, limits):
            return wire
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
    into one msgpack frame. Raises :class:`ProtocolError` if the receiver would reject it."""
    if not isinstance(msg, Message):
        raise ProtocolError(f"cannot encode {_type_name(msg)}: not a protocol message")
    limits = limits or DEFAULT_LIMITS
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


def _unpack(raw: Any, limits: Limits) -> Any:
    try:
        size = len(raw) if type(raw) is bytes else memoryview(raw).nbytes
    except TypeError:
        raise ProtocolError(f"frame must be bytes-like, got {_type_name(raw)}") from None
    if size > limits.max_frame_bytes:
        # Checked before unpacking so an oversize frame costs nothing to refuse.
        raise ProtocolError(
            f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    try:
        # unpackb has no max_buffer_size (that is the streaming Unpacker's); the
        # frame-size check above plays that role for a one-shot buffer.
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


def quick_wire(raw: bytes, cls: type[Message], limits: Limits) -> dict[str, Any] | None:
    """The wire map of ``raw`` when it is a ``cls`` message (Task or Done) of the
    common shape that the quick check accepts; None otherwise, and then
    :func:`decode` says what the frame is or what is wrong with it. The hot
    loops (a worker's swaps, the coordinator's dones) use the map as it is,
    without building a message object: only checks that ``decode`` also makes
    pass here, so both accept exactly the same frames on this path."""
    try:
        obj = _unpack(raw, limits)
    except ProtocolError:
        return None
    if (type(obj) is dict and obj.get("kind") == cls.KIND and type(obj.get("v")) is int
            and obj["v"] == PROTOCOL_VERSION and len(obj) == len(cls._KEYS)
            and obj.keys() <= cls._KEYS and _QUICK[cls](obj, limits)):
        return obj
    return None


def done_fields(raw: bytes, limits: Limits) -> tuple | None:
    """``(task_id, rank, ok, error, result, elapsed_s)`` of a Done frame that
    :func:`quick_wire` takes; None otherwise (then :func:`decode` decides). The
    coordinator's hot path (``fastpath.done_parser`` reads the same natively)."""
    w = quick_wire(raw, Done, limits)
    if w is None:
        return None
    return w["task_id"], w["rank"], w["ok"], w["error"], w["result"], w["elapsed_s"]


def encode_task(task_id: int, kind: str, src: list[int], dst: list[int],
                args: dict[str, Any], limits: Limits | None = None) -> bytes:
    """``Task(task_id, kind, src, dst, args).encode(limits)``, the same bytes, without
    the message object when the quick check passes (the coordinator's hot path)."""
    wire = {"v": PROTOCOL_VERSION, "kind": Task.KIND, "task_id": task_id, "task_kind": kind,
            "src": src, "dst": dst, "args": args}
    return _pack_quick(Task, wire, limits, lambda: Task(task_id, kind, src, dst, args))


def encode_done(task_id: int, rank: int, blocks_done: int, elapsed_s: float,
                result: dict[str, Any], limits: Limits | None = None) -> bytes:
    """``Done(task_id, rank, True, "", blocks_done, elapsed_s, result).encode(limits)``,
    the same bytes, without the message object when the quick check passes."""
    wire = {"v": PROTOCOL_VERSION, "kind": Done.KIND, "task_id": task_id, "rank": rank,
            "ok": True, "error": "", "blocks_done": blocks_done, "elapsed_s": elapsed_s,
            "result": result}
    return _pack_quick(Done, wire, limits,
                       lambda: Done(task_id, rank, True, "", blocks_done, elapsed_s, result))


def _pack_quick(cls: type[Message], wire: dict[str, Any], limits: Limits | None,
                message: Callable[[], Message]) -> bytes:
    """Pack ``wire`` (in the order ``_to_wire`` builds it) if the quick check takes
    it; otherwise the full :func:`encode` of ``message()`` decides (or raises)."""
    limits = limits or DEFAULT_LIMITS
    if _QUICK[cls](wire, limits):
        raw = msgpack.packb(wire, use_bin_type=True)
        if len(raw) <= limits.max_frame_bytes:
            return raw
    return encode(message(), limits)


def decode(raw: bytes, limits: Limits | None = None) -> Message:
    """Decode and validate one frame; raises :class:`ProtocolError` on anything wrong.

    ``limits`` (default :data:`DEFAULT_LIMITS`) bounds the frame, lists, strings
    and, when set, the block ids of tasks.
    """
    limits = limits or DEFAULT_LIMITS
    obj = _unpack(raw, limits)
    cls = _check_header(obj)
    task_id = obj.get("task_id")
    # Only an id a Done could carry back (an answer must itself be valid).
    task_id = task_id if type(task_id) is int and 0 <= task_id <= INT64_MAX else None
    if len(obj) != len(cls._KEYS) or not obj.keys() <= cls._KEYS:
        _check_keys_exact(obj, cls, task_id)
    try:
        quick = _QUICK.get(cls)
        if quick is not None and quick(obj, limits):
            return cls(*[obj[key] for _, key, _, _ in cls._SPEC])
        msg = cls(*[check(obj[key], where, limits) for _, key, where, check in cls._SPEC])
        _check_ranges(msg)
        if cls is Task:
            _check_task(msg, limits)
    except ProtocolError as exc:
        exc.kind, exc.task_id = cls.KIND, task_id
        raise
    return msg


__all__ = [
    "CONTROL_OPS", "DEFAULT_LIMITS", "MAX_NESTING", "MAX_PID", "MAX_RANK", "MAX_SECONDS",
    "MAX_TIME", "MESSAGE_KINDS", "MIN_TIMEOUT_S", "PROTOCOL_VERSION",
    "TASK_KINDS", "CtlReply", "CtlRequest", "Done", "ErrorReply", "Heartbeat", "Hello",
    "Limits", "Message", "ProtocolError", "Ready", "Shutdown", "Task", "clip", "decode",
    "done_fields", "encode", "encode_done", "encode_task", "quick_wire",
]
