"""Logging for kvcached processes: one size-capped, rotated file per process.

Every line carries the process role and rank, so interleaved logs of a TP
group can be told apart; the level comes from ``KVCACHED_LOG_LEVEL``.

Repeated warnings and errors are rate-limited per message template: a
worker restart window once wrote one WARNING per failed swap (1.1 MB of log
for 10 kills). Within ``REPEAT_WINDOW_S`` the first ``REPEAT_BURST`` records
of a template are written; the rest are counted and reported in one line
when the window ends (or the log closes).
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import os
import threading
import time
from pathlib import Path

MAX_BYTES = 10 * 2**20
BACKUPS = 3
FORMAT = "%(asctime)s %(levelname)s [%(role)s pid=%(process)d] %(name)s: %(message)s"
REPEAT_WINDOW_S = 10.0
REPEAT_BURST = 5


class _RoleFilter(logging.Filter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


class RepeatLimiter(logging.Filter):
    """Let through the first ``burst`` WARNING+ records of each message template per
    ``window_s``; count the rest and write one line with the count when the
    window is over (checked on every record, and by :meth:`flush`)."""

    def __init__(self, handler: logging.Handler, window_s: float = REPEAT_WINDOW_S,
                 burst: int = REPEAT_BURST):
        super().__init__()
        self.handler = handler
        self.window_s = window_s
        self.burst = burst
        self._lock = threading.Lock()
        # (logger, level, template) -> [window start, records in it, suppressed]
        self._seen: dict[tuple, list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "kvcached_summary", False):
            return True
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            due = self._expired(record.created)
            entry = self._seen.get(key)
            if entry is None:
                entry = self._seen[key] = [record.created, 0, 0]
            entry[1] += 1
            passed = entry[1] <= self.burst
            if not passed:
                entry[2] += 1
        self._report(due)
        return passed

    def flush(self, now: float | None = None) -> None:
        """Report every suppressed count now (the log is closing)."""
        with self._lock:
            due = self._expired(time.time() if now is None else now, everything=True)
        self._report(due)

    def _expired(self, now: float, everything: bool = False) -> list[tuple]:
        """Take the windows that are over (with the lock held)."""
        due = []
        for key, (start, _, suppressed) in list(self._seen.items()):
            if everything or now - start >= self.window_s:
                del self._seen[key]
                if suppressed:
                    due.append((key, suppressed, now - start))
        return due

    def _report(self, due: list[tuple]) -> None:
        for (name, level, template), n, span in due:
            span = min(span, self.window_s)
            summary = logging.LogRecord(
                name, level, __file__, 0,
                "the previous message repeated %d more times in %.0fs (not logged): %s",
                (n, span, template), None)
            summary.kvcached_summary = True
            self.handler.handle(summary)


def level_from_env(default: str = "INFO") -> int:
    name = os.environ.get("KVCACHED_LOG_LEVEL", default).upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


_handlers: dict[Path, list[logging.Handler]] = {}  # per log file: its handlers


def setup_process_logging(log_dir: str | os.PathLike, role: str,
                          also_stderr: bool = False, errors_to_stderr: bool = False) -> Path:
    """Send the ``kvcached`` loggers of this process to ``log_dir/<role>.log``
    (idempotent per file; undo with :func:`stop_process_logging`), and to
    stderr too: every record (``also_stderr``) or errors only
    (``errors_to_stderr``: an engine's, whose stderr its operator keeps, while
    a temporary run dir and its logs go when the engine stops)."""
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"{role}.log"
    if file in _handlers:
        return file
    handler = logging.handlers.RotatingFileHandler(file, maxBytes=MAX_BYTES,
                                                   backupCount=BACKUPS)
    _handlers[file] = [handler]
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter(role))
    limiter = RepeatLimiter(handler)
    handler.addFilter(limiter)
    atexit.register(limiter.flush)  # a worker's counts get written when it exits too
    root = logging.getLogger("kvcached")
    root.setLevel(level_from_env())
    root.addHandler(handler)
    if also_stderr or errors_to_stderr:
        err = logging.StreamHandler()
        err.setLevel(logging.NOTSET if also_stderr else logging.ERROR)
        err.setFormatter(logging.Formatter(FORMAT))
        err.addFilter(_RoleFilter(role))
        err.addFilter(RepeatLimiter(err))
        root.addHandler(err)
        _handlers[file].append(err)
    return file


def stop_process_logging(file: Path) -> None:
    """Detach and close the handler :func:`setup_process_logging` added for ``file``."""
    for handler in _handlers.pop(Path(file), []):
        for f in handler.filters:
            if isinstance(f, RepeatLimiter):
                f.flush()
        logging.getLogger("kvcached").removeHandler(handler)
        handler.close()
