"""``kvcached cleanup``: remove what dead engines left behind.

An engine killed with SIGKILL leaves its shared-memory segments (KV planes
and host pools: gigabytes in production), its temporary run directory and
its sockets until the next engine starts. This removes them at once, and
only those whose engine pid is gone: a live engine's files are never
touched. Segments carry their owner's pid in their name; temporary run
directories carry ``engine.pid``; a configured run directory (``--run-dir``)
carries ``engine.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from kvcached.memory.rundir import (
    ENGINE_FILE,
    PID_FILE,
    cleanup_stale_run_dirs,
    engine_pid,
    pid_alive,
)

logger = logging.getLogger(__name__)

# What a dead engine leaves in a configured run directory (its logs stay; its
# config.json too, for `kvcached launch`, but not the storage password).
RUN_DIR_LEFTOVERS = ("ctl.sock", "coord.sock", ENGINE_FILE, PID_FILE, "credentials.json")


def cleanup_leftovers(dry_run: bool = False, run_dirs: Iterable[str] = ()) -> list[str]:
    """Remove (``dry_run``: list) dead engines' segments, temp run dirs and the
    sockets of the configured ``run_dirs``; returns one line per item."""
    from kvcached.memory import shm
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} shm segment {shm.shm_dir() / name}"
             for name in shm.cleanup_stale_segments(dry_run=dry_run)]
    lines += [f"{verb} run dir {d}" for d in cleanup_stale_run_dirs(dry_run=dry_run)]
    for run_dir in run_dirs:
        lines += _clean_run_dir(Path(run_dir), dry_run, verb)
    return lines or ["nothing to clean: no leftovers of dead engines"]


def _clean_run_dir(run_dir: Path, dry_run: bool, verb: str) -> list[str]:
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    pid = engine_pid(run_dir)
    if pid is None:
        return [f"left {run_dir}: no {ENGINE_FILE} names its engine"]
    if pid_alive(pid):
        return [f"left {run_dir}: its engine pid {pid} is running"]
    out = []
    for name in RUN_DIR_LEFTOVERS:
        path = run_dir / name
        if path.exists() or path.is_symlink():
            if not dry_run:
                path.unlink(missing_ok=True)
            out.append(f"{verb} {path} (engine pid {pid} is gone)")
    return out
