"""The engine's KV event: how a CUDA copy is ordered after the model's use of its blocks.

The contract (docs/architecture.md, "Ordering"): rank r's model runner makes
one :class:`KVEvent` (``KVEvent(run_dir, rank)``), exports it with its planes
(``export_kv_cache(planes, rank, run_dir, event=kv_event)``) and calls
``kv_event.record(stream)`` on its compute stream after every forward pass,
before it commits the blocks that pass wrote or frees blocks it read
(``mgr.commit`` / ``mgr.free``). Every CUDA copy of that rank then waits on
the event's latest record (``cudaStreamWaitEvent``, no host blocking): a
swap-out never reads KV still being written, a swap-in never overwrites a
block a kernel still reads.

What kvcached enforces: each record bumps a generation counter in a small
shared file next to the descriptor (``kv-event-rank<r>.clock``: a random
epoch naming this event, then the generation). The engine process stamps
every copy task with each rank's (epoch, generation) as it submits it
(:class:`EventStamper`); the worker checks, before it enqueues the wait, that
it holds the event of that epoch (re-opening it when the engine exported a new
one) and that its counter has reached the stamp; a swap-out stamped with
generation 0 (the engine never recorded) fails, as does any copy whose worker
holds no event or another event. A failed check fails the task before any
copy: the blocks are never marked copied.

The generation is bumped after the record call returns, and a task is
stamped after that in the engine process and checked before the wait in the
worker: the wait can only see that record or a later one.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
import threading
import weakref
from pathlib import Path

from kvcached.memory.rundir import write_atomic

logger = logging.getLogger(__name__)

CLOCK_BYTES = 16  # epoch (u64), generation (u64): one 8-byte aligned store each
STAMP_ARG = "kv_event"  # the task argument: [[epoch, generation] per rank]
# Kinds whose copies read device blocks the model wrote: generation 0 means the
# engine never recorded after a forward, so nothing orders them.
READS_MODEL_WRITES = ("swap_out", "store")
ORDERED_KINDS = ("swap_out", "swap_in", "swap_in_layers", "store", "load")

# IPC handle (hex) -> event exported by this process: CUDA cannot open a
# process's own IPC event handles, so in-process copies use the event itself.
_LOCAL: dict[str, weakref.ref] = {}
_LOCAL_LOCK = threading.Lock()


class OrderingError(RuntimeError):
    """A copy could not be ordered after the engine's use of its blocks; nothing moved."""


def clock_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """``<run_dir>/kv-event-rank<rank>.clock``."""
    return Path(run_dir) / f"kv-event-rank{int(rank)}.clock"


class EventClock:
    """The (epoch, generation) pair of one KV event, in a shared 16-byte file.

    One writer (the rank's model runner) bumps the generation; any process
    reads it. A new event gets a new file (a new inode) and a new epoch, so a
    reader still mapping the old file sees the old epoch, never a mix.
    """

    def __init__(self, path: Path, mm: mmap.mmap, inode: int):
        self.path = path
        self.inode = inode
        self._mm = mm
        self._words = memoryview(mm).cast("Q")  # aligned 8-byte loads and stores
        self.epoch = int(self._words[0])

    @classmethod
    def create(cls, path: str | os.PathLike) -> EventClock:
        """A fresh clock (new random epoch, generation 0), replacing any old file atomically."""
        path = Path(path)
        epoch = secrets.randbits(62) | 1  # never 0: 0 means "no event" in a stamp
        write_atomic(path, struct.pack("<QQ", epoch, 0), mode=0o644)
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike) -> EventClock:
        """Map an existing clock; FileNotFoundError if there is none."""
        path = Path(path)
        with open(path, "r+b") as f:
            st = os.fstat(f.fileno())
            if st.st_size < CLOCK_BYTES:
                raise ValueError(f"KV event clock {path} is shorter than {CLOCK_BYTES} bytes")
            mm = mmap.mmap(f.fileno(), CLOCK_BYTES)
        return cls(path, mm, st.st_ino)

    @property
    def generation(self) -> int:
        return int(self._words[1])

    def bump(self) -> int:
        """Count one more record (the single writer only); returns the new generation."""
        g = int(self._words[1]) + 1
        self._words[1] = g
        return g

    def replaced(self) -> bool:
        """Whether the file at ``path`` is no longer the one this clock maps."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return True

    def close(self) -> None:
        self._words.release()
        self._mm.close()


class KVEvent:
    """The event rank ``rank``'s model runner records after each forward pass.

    ``event``: by default a new ``torch.cuda.Event(interprocess=True)`` on the
    current device (timing off, as interprocess events require); anything
    with ``record(stream)`` and ``ipc_handle()`` will do.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, event=None):
        if event is None:
            import torch
            event = torch.cuda.Event(interprocess=True, enable_timing=False)
        self.event = event
        self.rank = int(rank)
        self.run_dir = Path(run_dir)
        self.clock = EventClock.create(clock_path(run_dir, rank))
        self._ipc_handle = bytes(event.ipc_handle())  # also creates a lazy torch event
        remember_local_event(self._ipc_handle.hex(), event)

    @property
    def epoch(self) -> int:
        return self.clock.epoch

    @property
    def generation(self) -> int:
        return self.clock.generation

    def record(self, stream=None) -> int:
        """Record on ``stream`` (default: the current stream) after a forward pass,
        then count it; returns the new generation. Call it before committing or
        freeing the blocks that pass wrote or read."""
        if stream is None:
            self.event.record()
        else:
            self.event.record(stream)
        return self.clock.bump()

    def descriptor_fields(self) -> dict:
        """What ``export_kv_cache`` writes into the rank's descriptor for this event."""
        return {"event_ipc_handle": self._ipc_handle.hex(), "event_epoch": self.epoch,
                "event_clock": self.clock.path.name, "event_pid": os.getpid()}


def event_handle(event) -> int:
    """The raw cudaEvent_t of a torch.cuda.Event (``cuda_event``), or an int as is."""
    raw = getattr(event, "cuda_event", event)
    return int(raw)


def remember_local_event(ipc_handle_hex: str, event) -> None:
    """Note that this process exported ``event`` under ``ipc_handle_hex``."""
    with _LOCAL_LOCK:
        _LOCAL[ipc_handle_hex] = weakref.ref(event)


def local_event(ipc_handle_hex: str) -> int | None:
    """The raw handle of the event this process exported under ``ipc_handle_hex``,
    or None if it exported none (or it is gone)."""
    with _LOCAL_LOCK:
        ref = _LOCAL.get(ipc_handle_hex)
    event = ref() if ref is not None else None
    return None if event is None else event_handle(event)


class EventStamper:
    """The engine-side half: stamps each copy task with every rank's (epoch, generation).

    Clocks are mapped once and re-mapped when a rank exports a new event (a new
    file). A rank without a clock (no KVEvent exported) stamps ``[0, 0]``: its
    worker checks nothing for it, as before this contract.
    """

    def __init__(self, run_dir: str | os.PathLike, tp_size: int):
        self.run_dir = Path(run_dir)
        self.tp_size = int(tp_size)
        self._clocks: list[EventClock | None] = [None] * self.tp_size
        self._lock = threading.Lock()  # submitting threads share the mapped clocks

    def stamps(self) -> list[list[int]] | None:
        """``[[epoch, generation], ...]`` per rank, or None when no rank has a clock."""
        with self._lock:
            return self._stamps()

    def _stamps(self) -> list[list[int]] | None:
        out, any_clock = [], False
        for r in range(self.tp_size):
            clock = self._clock(r)
            if clock is None:
                out.append([0, 0])
            else:
                any_clock = True
                out.append([clock.epoch, clock.generation])
        return out if any_clock else None

    def stamp(self, task) -> None:
        """Add the stamp to ``task.args`` if the task copies to or from the device."""
        if task.kind in ORDERED_KINDS and (task.kind in ("swap_out", "swap_in", "swap_in_layers")
                                           or task.args.get("device_ids")):
            stamps = self.stamps()
            if stamps is not None:
                task.args[STAMP_ARG] = stamps

    def _clock(self, rank: int) -> EventClock | None:
        clock = self._clocks[rank]
        if clock is not None and not clock.replaced():
            return clock
        if clock is not None:
            clock.close()
            self._clocks[rank] = None
        try:
            self._clocks[rank] = EventClock.open(clock_path(self.run_dir, rank))
        except FileNotFoundError:
            return None
        return self._clocks[rank]

    def close(self) -> None:
        with self._lock:
            for c in self._clocks:
                if c is not None:
                    c.close()
            self._clocks = [None] * self.tp_size


def check_stamp(task_kind: str, stamp, rank: int, clock: EventClock | None,
                has_event: bool) -> None:
    """The worker-side check of one task's stamp for ``rank``; OrderingError if it fails.

    ``clock``/``has_event``: the clock and whether the event of the
    descriptor the worker attached to is open. The caller re-opens both when
    the epochs differ and calls again (see ``RankExecutor``).
    """
    try:
        epoch, gen = (int(x) for x in stamp[rank])
    except (TypeError, ValueError, IndexError):
        raise OrderingError(f"rank {rank}: malformed {STAMP_ARG} stamp {stamp!r}") from None
    if epoch == 0:
        return  # the engine exported no KVEvent for this rank: nothing to check
    if clock is None or not has_event:
        raise OrderingError(
            f"rank {rank}: the {task_kind} is ordered after KV event {epoch:#x} (generation "
            f"{gen}) but this worker holds no KV event: the rank's descriptor names none")
    if clock.epoch != epoch:
        raise OrderingError(
            f"rank {rank}: the {task_kind} is ordered after KV event {epoch:#x} but this "
            f"worker holds event {clock.epoch:#x}: the engine exported another event")
    if clock.generation < gen:
        raise OrderingError(
            f"rank {rank}: KV event {epoch:#x} is at generation {clock.generation} here but "
            f"the engine stamped {gen}: the clock file {clock.path} is not the engine's")
    if gen == 0 and task_kind in READS_MODEL_WRITES:
        raise OrderingError(
            f"rank {rank}: a {task_kind} of blocks the model wrote, but KV event {epoch:#x} "
            "was never recorded: record it after each forward pass, before committing "
            "the blocks (kv_event.record(stream); see docs/architecture.md, Ordering)")
