"""SharedLedger: the bytes a file store holds, one number shared by its writers.

Several processes write one store directory: the TP ranks of an engine, and
several engines (a fleet on one node). Each knows only the objects it wrote
or read, so none can enforce the size cap from what it knows. The total is
kept in a small file next to the objects and is read and written only under
an exclusive ``flock`` of that file; a writer renames its object into place,
adds its size and evicts under the same lock, so the total and the files
never disagree for long and the cap holds for every writer together.

A writer killed between its rename and its update leaves the total short by
that object; a recount of the directory (every open does one, under the
lock) puts it right. ``flock`` locks are released by the kernel when their
holder dies, so a crashed writer never blocks the others; a live holder that
stops (SIGSTOP) makes the others' writes fail after ``timeout_s`` instead of
hanging the engine.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_SIZE = 8  # the total: unsigned 64-bit little-endian at offset 0


class SharedLedger:
    """An integer in ``path``, shared across processes under ``flock``."""

    def __init__(self, path: str | os.PathLike, timeout_s: float = 10.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s
        # O_CLOEXEC: a child process must not inherit (and so share) the lock.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # flock excludes other open files, not other threads on this one.
        self._threads = threading.Lock()

    @contextmanager
    def locked(self, deadline: float | None = None) -> Iterator[SharedLedger]:
        """Hold the ledger exclusively (this process' threads and other processes).
        Raises TimeoutError naming the file when another holder keeps it past
        ``deadline`` (a ``time.monotonic()`` value; default ``timeout_s`` from now)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        if not self._threads.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{self.path}: another thread held the ledger for "
                               f"{self.timeout_s:.0f}s")
        try:
            self._flock(deadline)
            try:
                yield self
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def _flock(self, deadline: float) -> None:
        """LOCK_EX with a deadline (flock itself has none): short polls, backing off."""
        pause = 0.0002
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.path}: another process held the ledger "
                                       f"for {self.timeout_s:.0f}s") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.01)

    def read(self) -> int:
        """The total (0 for a new ledger). Unlocked reads may be a moment stale."""
        return int.from_bytes(os.pread(self._fd, _SIZE, 0).ljust(_SIZE, b"\0"), "little")

    def write(self, total: int) -> None:
        """Set the total (hold ``locked()``); one 8-byte write, never torn in practice."""
        os.pwrite(self._fd, max(0, int(total)).to_bytes(_SIZE, "little"), 0)

    def close(self) -> None:
        """Close the file (the lock goes with it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
