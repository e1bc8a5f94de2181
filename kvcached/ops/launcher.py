"""``kvcached launch``: run one transfer worker per rank as a supervised group.

For deployments that run the workers as their own service (a sidecar, a
systemd unit) instead of letting the engine spawn them: the engine's
CacheManager is configured with ``spawn_workers = false`` and waits for the
workers' hello; either side may start first. The launcher runs in the
foreground:

- it starts ``python -m kvcached worker --rank R --run-dir D --config FILE``
  for every rank (no ``--engine-pid``: a worker serves whichever engine binds
  the run directory, and exits ``engine_timeout_s`` after that engine went
  silent, or when the engine shuts it down);
- it restarts a worker that exited: soon after a clean exit (it then waits
  for the next engine), with an exponential backoff capped at
  ``max_backoff_s`` after a crash; ``max_restarts`` consecutive crashes of a
  rank stop the whole group with an error, so a service manager notices
  (the rule of ``kvcached.transfer.supervisor``, which the engine's own
  coordinator follows too);
- SIGINT or SIGTERM stops the group: terminate, wait, kill.

No orphans: the workers run in their own session (so a terminal's Ctrl-C
reaches the launcher only, which then stops them in order), and each is
told by the kernel (``PR_SET_PDEATHSIG``) to exit if the launcher dies
without cleaning up.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvcached.config import CacheConfig
from kvcached.transfer.supervisor import (
    STABLE_S,
    backoff_s,
    count_crash,
    may_restart,
    spawn_worker,
)
from kvcached.transfer.worker import EXIT_REFUSED

logger = logging.getLogger(__name__)


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    crashes: int = 0  # consecutive; reset once a worker ran stable_s or exited cleanly
    restart_at: float | None = None


class Launcher:
    """Starts, watches and stops the workers of every rank of one run directory."""

    def __init__(self, cfg: CacheConfig, config_path: str | os.PathLike | None, run_dir,
                 max_restarts: int | None = None, base_backoff_s: float = 0.2,
                 max_backoff_s: float = 10.0, stable_s: float = STABLE_S,
                 poll_s: float = 0.1, stop_grace_s: float = 5.0):
        self.cfg = cfg
        # None: the workers read the config the engine wrote (run_dir/config.json)
        self.config_path = Path(config_path).resolve() if config_path else None
        self.run_dir = Path(run_dir).resolve()
        self.max_restarts = max_restarts
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.poll_s = poll_s
        self.stop_grace_s = stop_grace_s
        self.ranks = [_Rank(r) for r in range(cfg.tp_size)]
        self.stop_reason = ""
        self._stop = threading.Event()
        self._failed = False

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg.log_dir or self.run_dir / "logs")

    # ------------------------------------------------------------- running
    def run(self) -> int:
        """Supervise until stopped; returns 0 after a requested stop, 1 if gave up."""
        from kvcached.memory.rundir import create_run_dir
        create_run_dir(str(self.run_dir))  # mode 0700: only this user reaches the sockets
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.spawn_workers:
            logger.warning("the config has spawn_workers = true; the engine using it would "
                           "spawn its own workers too: set spawn_workers = false for it")
        logger.info("launcher pid %d: %d rank(s), run_dir %s", os.getpid(), len(self.ranks),
                    self.run_dir)
        try:
            for r in self.ranks:
                self._spawn(r)
            while not self._stop.wait(self.poll_s):
                self._check(time.monotonic())
        finally:
            self.stop_all()
        logger.info("launcher stopped: %s", self.stop_reason)
        return 1 if self._failed else 0

    def request_stop(self, reason: str) -> None:
        """Ask ``run`` to stop the group (safe from a signal handler or another thread)."""
        if not self.stop_reason:
            self.stop_reason = reason
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM stop the group cleanly."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: self.request_stop(signal.Signals(s).name))

    def _check(self, now: float) -> None:
        for r in self.ranks:
            if r.restart_at is not None:
                if now >= r.restart_at:
                    r.restart_at = None
                    self._spawn(r)
            elif r.proc is not None and r.proc.poll() is not None:
                self._on_exit(r, r.proc.returncode, now)

    def _on_exit(self, r: _Rank, code: int, now: float) -> None:
        ran = now - r.started_at
        r.crashes = count_crash(r.crashes, ran, code != 0, self.stable_s)
        if not may_restart(r.crashes, self.max_restarts):
            self._failed = True
            self.request_stop(f"rank {r.rank} crashed {r.crashes} times in a row "
                              f"(last exit code {code}); see {self.log_dir}")
            logger.error("launcher: %s", self.stop_reason)
            return
        delay = self._backoff(r.crashes)
        r.restart_at = now + delay
        log = logger.info if code == 0 else logger.error
        log("launcher: rank %d (pid %d) exited with code %s after %.1fs%s; restarting in "
            "%.1fs", r.rank, r.proc.pid, code, ran,
            " (refused by the engine: does its config match?)" if code == EXIT_REFUSED else "",
            delay)

    def _backoff(self, crashes: int) -> float:
        return backoff_s(crashes, self.base_backoff_s, self.max_backoff_s)

    def _spawn(self, r: _Rank) -> None:
        if r.proc is not None:
            r.restarts += 1
        args = ["--restarts", str(r.restarts)]
        if self.config_path:
            args += ["--config", str(self.config_path)]
        r.proc = spawn_worker(r.rank, self.run_dir, self.log_dir, *args,
                              detach_from=os.getpid())
        r.started_at = time.monotonic()
        logger.info("launcher: rank %d started as pid %d (restart %d)", r.rank, r.proc.pid,
                    r.restarts)

    # ------------------------------------------------------------ stopping
    def stop_all(self) -> None:
        """terminate -> wait (stop_grace_s in all) -> kill, for every worker."""
        procs = [r.proc for r in self.ranks if r.proc is not None and r.proc.poll() is None]
        for p in procs:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("launcher: pid %d ignored SIGTERM; killing it", p.pid)
                _signal(p, signal.SIGKILL)
                p.wait(timeout=5.0)
        for r in self.ranks:
            r.restart_at = None


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _engine_config(run_dir: str | None) -> CacheConfig:
    from kvcached.transfer.endpoints import CONFIG_FILE
    if not run_dir:
        raise ValueError("launch needs --config, or --run-dir of a running engine (it reads "
                         f"the engine's {CONFIG_FILE} there)")
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in {run_dir}: start the engine (with "
                         "spawn_workers = false) first, or pass --config")
    from kvcached.transfer.runconfig import read_run_config
    cfg = CacheConfig.from_dict(read_run_config(run_dir), check_host_memory=False)
    return cfg.replace(run_dir=str(run_dir))


def launch(config_path: str | None, run_dir: str | None,
           max_restarts: int | None = None) -> int:
    """Entry point of ``kvcached launch``: load the config, log, supervise.
    Without ``config_path`` the config is the one the running engine wrote into
    its run directory (an engine that derives it, as vLLM's connector does)."""
    from kvcached.ops.logs import setup_process_logging
    if config_path is None:
        cfg = _engine_config(run_dir)
    else:
        cfg = CacheConfig.load(config_path, **({"run_dir": run_dir} if run_dir else {}))
    if not cfg.run_dir:
        raise ValueError("launch needs the run directory the engine uses: pass --run-dir, "
                         "set KVCACHED_RUN_DIR, or set run_dir in the config")
    launcher = Launcher(cfg, config_path, cfg.run_dir, max_restarts=max_restarts)
    setup_process_logging(launcher.log_dir, "launcher", also_stderr=True)
    launcher.install_signal_handlers()
    return launcher.run()
