"""How a transfer worker process is started, stopped, and restarted after a
crash: one rule for the engine's coordinator (spawned workers) and for
``kvcached launch`` (``ops/launcher.py``); each watches its own processes.

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

import ctypes
import os
import signal
import subprocess
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


def spawn_worker(rank: int, run_dir, log_dir: Path, *args: str,
                 detach_from: int | None = None, new_session: bool = False
                 ) -> subprocess.Popen:
    """Start rank ``rank``'s worker (``args``: more options), its stderr appended
    to ``log_dir/worker-rank{rank}.stderr``. ``new_session``: the worker runs
    in a session of its own, so a terminal's Ctrl-C (or a signal to the
    engine's process group) reaches the process that supervises it only, which
    stops it in order, rather than killing it mid-task and having it restarted.
    ``detach_from``: the pid of a supervising process; a session of its own
    too, and SIGTERM from the kernel if that process dies."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"worker-rank{rank}.stderr", "ab") as err:
        return subprocess.Popen(
            worker_command(rank, run_dir, *args), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, env=worker_env(),
            start_new_session=new_session or detach_from is not None,
            preexec_fn=_die_with(detach_from) if detach_from is not None else None)


def stop_process(proc: subprocess.Popen | None, grace_s: float) -> None:
    """terminate -> wait ``grace_s`` -> kill; a zero grace kills at once."""
    if proc is None or proc.poll() is not None:
        return
    try:
        if grace_s > 0:
            proc.terminate()
            try:
                proc.wait(timeout=grace_s)
                return
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait(timeout=5.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def kill_pid(pid: int) -> None:
    """SIGKILL a process this one did not start (a worker of ``kvcached launch``)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int):
    """A preexec_fn: the child gets SIGTERM when ``parent_pid`` dies (Linux only)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)

    return set_pdeathsig
