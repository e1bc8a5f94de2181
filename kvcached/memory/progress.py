"""The step progress channel: how far a load inside the engine's step has come.

A load that runs inside a forward pass (vLLM: a CPU-tier hit loaded in the
step that computes the rest of the prompt) is copied by the rank's transfer
worker layer by layer, and the engine's worker waits for each layer just
before its attention reads it. Asking the transfer worker over a socket
would cost a round trip per layer; instead it publishes its progress in a
small file in the run dir, ``step-rank<r>.progress``, mapped by both::

    word 0  magic (MAGIC)
    word 1  pid of the transfer worker writing it (0: none yet)
    word 2  state: task_id << 20 | layers done << 1 | failed
    word 3  the last task the engine gave up on, plus one (0: none)
    word 4  how many layer events follow (0: none, the CPU)
    then    on CUDA, one 64-byte IPC handle per layer: the events the transfer
            worker records on its copy stream after each layer's copy

Each word is one aligned 8-byte store or load, so a reader never sees half
of one; the state is one word so that (task, layers, failed) change
together. On the CPU a layer counts as done once its bytes landed (the copy
engine fences its streaming stores; x86 keeps stores in order). On CUDA it
counts once its copy was enqueued and its layer event recorded after it:
the engine then makes its compute stream wait on that event (a wait on an
event not yet recorded would wait on nothing, hence the word first). One
writer (the rank's transfer worker, one copy at a time on its ``step``
lane), one reader (the engine's worker for that rank).

Task ids only grow (the coordinator's counter), so a state naming an older
task is stale (an earlier load), and one naming a newer task means the
awaited one will never run (its worker lost it): the reader gives up at once.
A writer pid that is gone means the same, whatever the state says. For the
same reason giving up on a task gives up on every earlier one: each was
waited for, landed or given up, in its own step, and a writer running late
must copy none of them.

Giving up must be final: the engine reports the load's blocks as failed and
vLLM computes them again, so no copy of that task may write them afterwards,
not even a layer already being copied when the engine gave up. The writer
copies (or, on CUDA, enqueues) and publishes each layer holding the *gate*,
a lock on word 3 (an OFD lock: per open file, released by the kernel when
its holder dies), and checks word 3 under it; the reader sets word 3 under
the same lock (``cancel``). Once ``cancel`` returned True no layer of the
task is in flight on the CPU and none will start.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvcached.memory.rundir import write_atomic

MAGIC = 0x31504554534B564B  # "KVKSTEP1", little-endian
SIZE = 64  # the words; the layer events' handles follow
HANDLE_BYTES = 64  # a CUDA IPC event handle
LAYER_BITS = 19  # layers per task: at most 2**19 - 1
MAX_LAYERS = (1 << LAYER_BITS) - 1
TASK_SHIFT = LAYER_BITS + 1
MAX_TASK_ID = (1 << (64 - TASK_SHIFT)) - 1
MAX_PAUSE_S = 0.0001  # a reader's longest sleep between looks
GATE_WAIT_S = 1.0  # the writer's wait for the gate (the reader holds it for microseconds)
_GATE = (24, 8)  # the gate locks word 3's bytes (offset, length)


class Cancelled(RuntimeError):
    """The engine gave up on the task: copy nothing more of it."""


def progress_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """``<run_dir>/step-rank<rank>.progress``."""
    return Path(run_dir) / f"step-rank{int(rank)}.progress"


def pack(task_id: int, layers: int, failed: bool = False) -> int:
    """One state word (see the module docstring)."""
    if not 0 <= task_id <= MAX_TASK_ID or not 0 <= layers <= MAX_LAYERS:
        raise ValueError(f"task {task_id}, {layers} layers do not fit a progress word")
    return task_id << TASK_SHIFT | layers << 1 | int(bool(failed))


def unpack(word: int) -> tuple[int, int, bool]:
    """(task_id, layers done, failed) of a state word."""
    return word >> TASK_SHIFT, (word >> 1) & MAX_LAYERS, bool(word & 1)


@dataclass(frozen=True, slots=True)
class Wait:
    """How a wait for layers of a task ended: ``ok``, or why not (``failed``: the
    copy failed; ``lost``: it will never run, or its writer is gone;
    ``timeout``: the deadline passed)."""

    outcome: str
    layers: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


class StepProgress:
    """One rank's progress channel, mapped (see the module docstring)."""

    def __init__(self, path: Path, file, mm: mmap.mmap):
        self.path = path
        self._file = file  # kept open: the gate is a lock on it
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        if self._words[0] != MAGIC:
            self.close()
            raise ValueError(f"{path} is not a step progress file (bad magic)")
        n = int(self._words[4])
        file.seek(SIZE)
        raw = file.read(n * HANDLE_BYTES)
        if len(raw) != n * HANDLE_BYTES:
            self.close()
            raise ValueError(f"step progress file {path} names {n} layer events but holds "
                             f"{len(raw) // HANDLE_BYTES}")
        #: the layer events' IPC handles (CUDA; empty on the CPU)
        self.event_handles = [raw[i:i + HANDLE_BYTES] for i in range(0, len(raw), HANDLE_BYTES)]

    @classmethod
    def create(cls, path: str | os.PathLike, event_handles=()) -> StepProgress:
        """A fresh channel (no writer, no task), replacing any old file atomically:
        a writer still mapping the old one publishes where nobody reads.
        ``event_handles``: on CUDA, each layer's event's IPC handle."""
        path = Path(path)
        handles = [bytes(h) for h in event_handles]
        if any(len(h) != HANDLE_BYTES for h in handles):
            raise ValueError(f"a layer event's IPC handle has {HANDLE_BYTES} bytes")
        header = struct.pack("<5Q", MAGIC, 0, 0, 0, len(handles))
        write_atomic(path, header.ljust(SIZE, b"\0") + b"".join(handles))
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike) -> StepProgress:
        """Map an existing channel; FileNotFoundError if there is none."""
        path = Path(path)
        f = open(path, "r+b")
        try:
            if os.fstat(f.fileno()).st_size < SIZE:
                raise ValueError(f"step progress file {path} is shorter than {SIZE} bytes")
            mm = mmap.mmap(f.fileno(), SIZE)
        except BaseException:
            f.close()
            raise
        return cls(path, f, mm)

    # ------------------------------------------------------------ the writer
    def attach_writer(self, pid: int | None = None) -> None:
        """The transfer worker ``pid`` (this process) writes from now on."""
        self._words[1] = os.getpid() if pid is None else int(pid)

    def publish(self, task_id: int, layers: int, failed: bool = False) -> None:
        """Layers ``0..layers-1`` of ``task_id`` landed (or the copy failed)."""
        self._words[2] = pack(task_id, layers, failed)

    @contextmanager
    def layer_gate(self, task_id: int):
        """Hold the gate while one layer of ``task_id`` is copied (on CUDA: enqueued
        and its event recorded) and published; Cancelled, before anything is
        copied, when the engine gave up on the task."""
        if not self._lock(time.monotonic() + GATE_WAIT_S):
            raise TimeoutError(f"{self.path}: the engine held the step gate for "
                               f"{GATE_WAIT_S}s (it holds it for microseconds)")
        try:
            if task_id < self._words[3]:
                raise Cancelled(f"the engine gave up on task {task_id}")
            yield
        finally:
            self._unlock()

    # ------------------------------------------------------------ the reader
    def state(self) -> tuple[int, int, bool]:
        return unpack(int(self._words[2]))

    def writer_pid(self) -> int:
        return int(self._words[1])

    def writer_alive(self) -> bool:
        """Whether a writer attached and still runs (a zombie copies nothing more)."""
        pid = self.writer_pid()
        return bool(pid) and _alive(pid)

    def cancel(self, task_id: int, deadline: float) -> bool:
        """Give up on ``task_id``: once this returns True, no layer of it is being
        copied and none will be (its blocks may be computed again). False: the
        writer held the gate, inside a layer, until ``time.monotonic()`` passed
        ``deadline`` (it is stuck there: only its death ends that layer)."""
        if not self._lock(deadline):
            return False
        try:
            self._words[3] = max(int(self._words[3]), task_id + 1)
        finally:
            self._unlock()
        return True

    def wait(self, task_id: int, layers: int, deadline: float,
             alive=None) -> Wait:
        """Wait until layers ``0..layers-1`` of ``task_id`` landed, the copy failed
        or can no longer come, or ``time.monotonic()`` passes ``deadline``.
        ``alive(pid)`` says whether a writer pid still runs (default: the OS).
        Polls, sleeping 20 us, doubling up to ``MAX_PAUSE_S``, between looks:
        the writer needs the cores more than the reader, on a small machine,
        and a layer lands at most that long before it is seen."""
        alive = alive or _alive
        pause, checked = 0.00002, 0.0
        while True:
            task, done, failed = unpack(int(self._words[2]))
            if task == task_id:
                if failed:
                    return Wait("failed", done)
                if done >= layers:
                    return Wait("ok", done)
            elif task > task_id:
                return Wait("lost")  # a later task ran: this one never will
            now = time.monotonic()
            if now >= deadline:
                return Wait("timeout", done if task == task_id else 0)
            if now - checked > 0.002:  # the writer's liveness, every 2 ms
                checked = now
                pid = self.writer_pid()
                if pid and not alive(pid):
                    return Wait("lost", done if task == task_id else 0)
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, MAX_PAUSE_S)

    # ------------------------------------------------------------- the gate
    def _lock(self, deadline: float) -> bool:
        """Take the gate (polling: an OFD lock's blocking wait has no deadline)."""
        pause = 0.00002
        while True:
            try:
                fcntl.fcntl(self._file, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
                return True
            except (BlockingIOError, PermissionError):
                pass  # EAGAIN / EACCES: the other side holds it
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.001)

    def _unlock(self) -> None:
        fcntl.fcntl(self._file, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK))

    def close(self) -> None:
        self._words.release()
        self._mm.close()
        self._file.close()  # releases the gate if held


def _flock(kind: int) -> bytes:
    """A ``struct flock`` over the gate's bytes (l_pid 0, as OFD locks require)."""
    return struct.pack("@hhqqi4x", kind, os.SEEK_SET, *_GATE, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (killed, not yet reaped by its parent) copies nothing more
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
