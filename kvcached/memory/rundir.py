"""Run directories: where a run's sockets, descriptors, config and logs live.

A run directory kvcached creates itself (no ``run_dir`` configured) carries
an ``engine.pid`` file; the next start (or ``kvcached cleanup``) removes such
directories whose engine died without closing, so a crashed engine leaves
nothing behind for long. Every run directory of a running engine also holds
``engine.json`` (``{"pid": ...}``), which the control client reads to tell a
dead engine from a busy one.

This module imports nothing heavy: the control client uses it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "kvcached-"
PID_FILE = "engine.pid"  # in run directories kvcached created (temporary ones)
ENGINE_FILE = "engine.json"  # {"pid": engine pid}: in every run directory in use


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` runs (also when it belongs to another user); a
    zombie (exited, not reaped yet: an engine vLLM killed, say) does not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: it exists


def engine_pid(run_dir: str | os.PathLike) -> int | None:
    """The pid of the engine that uses ``run_dir`` (None if no file names one)."""
    path = Path(run_dir)
    try:
        return int(json.loads((path / ENGINE_FILE).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return int((path / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: a reader (or a process mapping it)
    sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_engine_file(run_dir: str | os.PathLike) -> None:
    """Record this process as the engine of ``run_dir`` (atomically: a reader never
    sees half a file)."""
    path = Path(run_dir) / ENGINE_FILE
    tmp = path.with_name(f".{ENGINE_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid()}))
    os.replace(tmp, path)


def create_run_dir(configured: str) -> tuple[Path, bool]:
    """Return (run dir, created by us); mode 0700 so only this user reaches its sockets."""
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        if path.stat().st_uid != os.getuid():  # another user's sockets and descriptors
            raise PermissionError(f"run dir {path} belongs to another user (uid "
                                  f"{path.stat().st_uid}); choose a run_dir of your own")
        own = False
    else:
        path = Path(tempfile.mkdtemp(prefix=PREFIX))
        (path / PID_FILE).write_text(str(os.getpid()))
        own = True
    os.chmod(path, 0o700)
    return path, own


def mark_temporary(run_dir: str | os.PathLike, pid: int | None = None,
                   replace: bool = True) -> None:
    """Mark ``run_dir`` as a temporary run directory of engine ``pid`` (this
    process): ``engine.pid`` names it, so that a later start (or ``kvcached
    cleanup``, or the engine's janitor) removes the directory once that pid is
    gone. ``replace=False`` leaves a mark that is already there."""
    path = Path(run_dir) / PID_FILE
    pid = os.getpid() if pid is None else pid
    if not replace:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(str(pid))
        return
    tmp = path.with_name(f".{PID_FILE}.{os.getpid()}")
    tmp.write_text(str(pid))
    os.replace(tmp, path)


def stale_run_dirs(parent: str | None = None) -> list[tuple[Path, int]]:
    """Temp run directories (ours: they hold ``engine.pid``) whose engine pid is gone."""
    out = []
    for d in sorted(Path(parent or tempfile.gettempdir()).glob(PREFIX + "*")):
        try:
            pid = int((d / PID_FILE).read_text())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            out.append((d, pid))
    return out


def cleanup_stale_run_dirs(parent: str | None = None, dry_run: bool = False) -> list[Path]:
    """Remove temp run directories whose engine pid is dead; returns them
    (``dry_run``: only lists them)."""
    removed = []
    for d, pid in stale_run_dirs(parent):
        if not dry_run:
            shutil.rmtree(d, ignore_errors=True)
            logger.info("removed stale run dir %s (engine pid %d is gone)", d, pid)
        removed.append(d)
    return removed
