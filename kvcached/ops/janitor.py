"""The janitor: removes what an engine process leaves behind when it dies
without closing kvcached.

vLLM's OpenAI server stops on SIGINT or SIGTERM by killing its engine-core
process tree with SIGKILL at once (its ``--shutdown-timeout`` is 0 by
default: ``vllm.v1.utils.shutdown`` -> ``kill_process_tree``), before the
engine core reaches the connector's ``shutdown``. Every kvcached process in
that tree (the manager in the engine core, the transfer workers) dies
without a word, so nothing of kvcached can clean up from inside it: the CPU
tier stayed in ``/dev/shm`` and the run directory in ``/tmp``.

So the engine starts a janitor outside its process tree (a second fork,
in a session of its own: neither the tree kill nor a terminal's Ctrl-C
reaches it). It waits for the engine's pid to end (a pidfd: no polling,
no pid reuse), then

- waits a moment for the engine's transfer workers (``--engine-pid <pid>``)
  to notice and exit, and SIGKILLs any left;
- removes the engine's shared-memory segments (``kvcached-<pid>-*``);
- removes the run directory if it is a temporary one this engine marked
  (``engine.pid`` names it), else only the engine's sockets and
  ``engine.json`` in it (logs stay), as ``kvcached cleanup --run-dir`` does;

and exits. What it removed goes to ``<log_dir>/janitor.log`` (gone with a
temporary run directory). SIGINT and SIGHUP are ignored; SIGTERM (a
service manager stopping the whole group) leaves it waiting
``TERM_GRACE_S`` more for the engine. If the janitor is SIGKILLed too, the
next start (or ``kvcached cleanup``) removes what is left, and says so.

It imports nothing heavy (no torch): it starts in a few tens of ms.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TERM_GRACE_S = 30.0  # after SIGTERM, how long it still waits for the engine to go
WORKER_GRACE_S = 5.0  # how long the engine's workers get to exit on their own
POLL_S = 0.5  # without a pidfd: how often the engine's pid is looked at
START_TIMEOUT_S = 30.0


def watch(engine_pid: int, run_dir: str | os.PathLike, log_dir: str | os.PathLike) -> int | None:
    """Start the janitor of ``engine_pid`` (this process, usually); returns its pid,
    or None if it did not start (a warning is logged: the next start sweeps)."""
    import logging

    from kvcached.transfer.supervisor import worker_env
    logger = logging.getLogger(__name__)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-P", "-m", "kvcached.ops.janitor", "--pid", str(engine_pid),
           "--run-dir", str(run_dir)]
    try:
        with open(Path(log_dir) / "janitor.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=log, env=worker_env(), start_new_session=True)
        # the first process prints the janitor's pid and exits; the janitor
        # closed its copy of stdout, so this reads to the end
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        return int(out.split()[-1]) if proc.returncode == 0 and out.split() else None
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        logger.warning("kvcached: the janitor did not start (%s); if this engine dies "
                       "without closing, the next start or `kvcached cleanup` removes "
                       "what it left", e)
        return None


# ------------------------------------------------------------------ waiting
def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (its start time): tells a pid from its reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wait_gone(pid: int, pidfd: int | None, started: str | None, give_up) -> bool:
    """Wait until ``pid`` has exited; False if ``give_up()`` said stop first."""
    while not give_up():
        if pidfd is not None:
            ready, _, _ = select.select([pidfd], [], [], POLL_S)
            if ready:
                return True
        else:
            now = _start_time(pid)
            if now is None or now != started:
                return True
            time.sleep(POLL_S)
    return False


# ----------------------------------------------------------------- cleaning
def workers_of(engine_pid: int) -> list[int]:
    """Pids of live kvcached transfer workers spawned for ``engine_pid``."""
    want = f"\0--engine-pid\0{engine_pid}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"\0kvcached\0worker\0" in cmd and want in cmd + b"\0":
            out.append(int(entry))
    return out


def clean(engine_pid: int, run_dir: Path, worker_grace_s: float = WORKER_GRACE_S) -> list[str]:
    """Remove what dead ``engine_pid`` left; one line per thing removed."""
    from kvcached.memory.rundir import PID_FILE
    from kvcached.memory.rundir import engine_pid as engine_pid_of
    from kvcached.ops.cleanup import RUN_DIR_LEFTOVERS
    lines = []
    deadline = time.monotonic() + worker_grace_s
    while workers_of(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in workers_of(engine_pid):
        try:
            os.kill(pid, signal.SIGKILL)
            lines.append(f"killed transfer worker pid {pid}")
        except ProcessLookupError:
            pass
    shm_dir = Path(os.environ.get("KVCACHED_SHM_DIR", "/dev/shm"))
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        names = []
    for name in names:
        if name.startswith(f"kvcached-{engine_pid}-"):
            try:
                (shm_dir / name).unlink()
                lines.append(f"removed shm segment {shm_dir / name}")
            except FileNotFoundError:
                pass
    try:
        marked = int((run_dir / PID_FILE).read_text())
    except (OSError, ValueError):
        marked = None
    if marked == engine_pid:  # a temporary run dir of this engine
        shutil.rmtree(run_dir, ignore_errors=True)
        lines.append(f"removed run dir {run_dir}")
    elif engine_pid_of(run_dir) == engine_pid:  # configured: its sockets, engine.json
        for name in RUN_DIR_LEFTOVERS:  # (its logs stay), as `kvcached cleanup` does
            path = run_dir / name
            if path.exists() or path.is_symlink():
                path.unlink(missing_ok=True)
                lines.append(f"removed {path}")
    return lines


# --------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m kvcached.ops.janitor")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    a = p.parse_args(argv)
    started, pidfd = _start_time(a.pid), _pidfd(a.pid)  # the engine waits for us: alive
    if started is None:
        return 1
    child = os.fork()
    if child:  # out of the engine's process tree: its parent is gone at once
        print(child, flush=True)
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the engine reads our parent's stdout to its end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    term: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: term.append(time.monotonic()))
    if not wait_gone(a.pid, pidfd, started,
                     lambda: bool(term) and time.monotonic() - term[0] > TERM_GRACE_S):
        _log(f"engine pid {a.pid} still runs {TERM_GRACE_S:.0f}s after SIGTERM: leaving")
        return 0
    lines = clean(a.pid, Path(a.run_dir))
    _log(f"engine pid {a.pid} is gone: " + ("; ".join(lines) if lines else "nothing left"))
    return 0


def _log(msg: str) -> None:
    try:
        print(time.strftime("%Y-%m-%d %H:%M:%S") + f" INFO [janitor pid={os.getpid()}] {msg}",
              file=sys.stderr, flush=True)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
