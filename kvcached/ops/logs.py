"""Logging for kvcached processes: one size-capped, rotated file per process.

Every line carries the process role and rank, so interleaved logs of a TP
group can be told apart; the level comes from ``KVCACHED_LOG_LEVEL``.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

MAX_BYTES = 10 * 2**20
BACKUPS = 3
FORMAT = "%(asctime)s %(levelname)s [%(role)s pid=%(process)d] %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def level_from_env(default: str = "INFO") -> int:
    name = os.environ.get("KVCACHED_LOG_LEVEL", default).upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


_handlers: dict[Path, logging.Handler] = {}


def setup_process_logging(log_dir: str | os.PathLike, role: str,
                          also_stderr: bool = False) -> Path:
    """Send the ``kvcached`` loggers of this process to ``log_dir/<role>.log``
    (idempotent per file; undo with :func:`stop_process_logging`)."""
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"{role}.log"
    if file in _handlers:
        return file
    handler = logging.handlers.RotatingFileHandler(file, maxBytes=MAX_BYTES,
                                                   backupCount=BACKUPS)
    _handlers[file] = handler
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter(role))
    root = logging.getLogger("kvcached")
    root.setLevel(level_from_env())
    root.addHandler(handler)
    if also_stderr:
        err = logging.StreamHandler()
        err.setFormatter(logging.Formatter(FORMAT))
        err.addFilter(_RoleFilter(role))
        root.addHandler(err)
    return file


def stop_process_logging(file: Path) -> None:
    """Detach and close the handler :func:`setup_process_logging` added for ``file``."""
    handler = _handlers.pop(Path(file), None)
    if handler is not None:
        logging.getLogger("kvcached").removeHandler(handler)
        handler.close()
