"""How a transfer worker process is started, and when it is restarted after a
crash: one rule for the engine's coordinator (spawned workers) and for
``kvcached launch``.

A worker runs this interpreter and this copy of kvcached: ``-P`` keeps the
worker's current directory off the front of ``sys.path`` (a kvcached checkout
there would stand in for the engine's copy, with another config schema), and
the directory this package was imported from goes first on ``PYTHONPATH``.

Crashes are counted per rank while they come back to back: a worker that
ran ``stable_s`` or longer before it crashed (or that exited cleanly) starts
the count over. So a rank that crashes now and then over a long life keeps
being restarted, and only a rank that cannot stay up gives up, after
``max_crashes`` consecutive crashes. Each restart waits a backoff that
doubles with the count, up to a cap.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# where this copy of kvcached was imported from (a checkout, or site-packages)
_HOME = str(Path(__file__).resolve().parents[2])

STABLE_S = 30.0  # a worker up this long before it crashed was healthy: the count restarts


def count_crash(crashes: int, ran_s: float, crashed: bool, stable_s: float = STABLE_S) -> int:
    """The rank's consecutive-crash count after its worker ran ``ran_s`` seconds and
    ended (``crashed``: not a clean exit)."""
    if not crashed or ran_s >= stable_s:
        crashes = 0
    return crashes + 1 if crashed else crashes


def may_restart(crashes: int, max_crashes: int | None) -> bool:
    """Whether a rank with ``crashes`` consecutive crashes is restarted again
    (``max_crashes`` None: always)."""
    return max_crashes is None or crashes <= max_crashes


def backoff_s(crashes: int, base_s: float, cap_s: float) -> float:
    """How long to wait before the restart: ``base_s`` after a clean exit, then
    doubling with each consecutive crash, at most ``cap_s``."""
    if crashes == 0:
        return base_s
    return min(base_s * 2 ** crashes, cap_s)


def worker_command(rank: int, run_dir, *args: str) -> list[str]:
    """The command line of rank ``rank``'s worker (``args``: more options)."""
    return [sys.executable, "-P", "-m", "kvcached", "worker", "--rank", str(rank),
            "--run-dir", str(run_dir), *args]


def worker_env() -> dict[str, str]:
    """This process' environment, with this copy of kvcached first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_HOME, env.get("PYTHONPATH")) if p)
    return env
