"""Run directories: where a run's sockets, descriptors, config and logs live.

A run directory kvcached creates itself (no ``run_dir`` configured) carries
an ``engine.pid`` file; the next start removes such directories whose engine
died without closing, so a crashed engine leaves nothing behind for long.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvcached.memory.shm import pid_alive

logger = logging.getLogger(__name__)

PREFIX = "kvcached-"
PID_FILE = "engine.pid"


def create_run_dir(configured: str) -> tuple[Path, bool]:
    """Return (run dir, created by us); mode 0700 so only this user reaches its sockets."""
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        own = False
    else:
        path = Path(tempfile.mkdtemp(prefix=PREFIX))
        (path / PID_FILE).write_text(str(os.getpid()))
        own = True
    os.chmod(path, 0o700)
    return path, own


def cleanup_stale_run_dirs(parent: str | None = None) -> list[Path]:
    """Remove temp run directories whose engine pid is dead."""
    removed = []
    for d in Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            pid = int((d / PID_FILE).read_text())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            logger.info("removed stale run dir %s (engine pid %d is gone)", d, pid)
    return removed
