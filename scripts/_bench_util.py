"""Small helpers shared by the benchmark scripts (not part of the package).

Each benchmark prints human progress on stderr and ends with one JSON line on
stdout, so ``tail -1`` of its output is machine-readable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def percentile(samples, q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no samples."""
    if not len(samples):
        return 0.0
    s = sorted(samples)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def log(msg: str) -> None:
    """Progress for humans, on stderr so that stdout stays one JSON line."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Progress:
    """Rate-limited progress lines for long loops."""

    def __init__(self, what: str, total: int, every_s: float = 5.0):
        self.what, self.total, self.every_s = what, total, every_s
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, *_ignored) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log(f"{self.what}: {done}/{self.total} ({done / (now - self.t0):.0f}/s)")


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` by path (scripts/ is not a package)."""
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_kvc_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def short_tmp_dir(prefix: str):
    """A temp dir under /tmp: ipc:// socket paths must stay under ~100 characters."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def result_file():
    """Where a benchmark's child writes its result (a file: vLLM's processes
    share the child's stdout), removed with its directory however the child
    ends."""
    d = Path(tempfile.mkdtemp(prefix="kvcached-bench-result-"))
    try:
        yield d / "result.json"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def rounded(obj, digits: int = 3):
    """Round floats inside nested dicts/lists for a readable JSON line."""
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return round(obj, digits) if isinstance(obj, float) else obj


def emit(result: dict) -> None:
    """The final machine-readable line."""
    print(json.dumps(rounded(result)), flush=True)


def run_child(script: str, argv: list[str], env: dict, timeout: float,
              fork_server: str | None = None) -> int:
    """``python script argv...`` with ``env``, its stdout and stderr on this
    process's stderr (vLLM's processes write to stdout at any moment: results
    travel in files); its exit code. With ``fork_server`` (the socket of the
    tests' fork server, ``tests/vllm_forkserver.py``, a process that imported
    vLLM once) the child is forked by that server instead of started, and
    imports nothing again: the tests' smoke runs of the benchmarks pass
    ``--fork-server`` (vLLM's import is ~9 s of each process here). Raises
    ``subprocess.TimeoutExpired`` (the child killed) as ``subprocess.run``."""
    if fork_server is None:
        return subprocess.run([sys.executable, script, *argv], stdout=sys.stderr,
                              timeout=timeout, env=env).returncode
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-child-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = fork_start(fork_server, argv, env, out, err, script=os.path.abspath(script))
        try:
            return child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            raise
        finally:
            for path in (out, err):  # the child's output, as a started child's would be
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        shutil.copyfileobj(f, sys.stderr)
            sys.stderr.flush()


def fork_start(server: str, argv: list[str], env: dict, stdout: str, stderr: str,
               script: str | None = None, module: str | None = None) -> Forked:
    """Ask the fork server at socket ``server`` (``tests/vllm_forkserver.py``)
    for a child running ``python script argv...`` or ``python -m module
    argv...`` (neither: ``tests/vllm_app.py argv...``), with ``env``, this
    process's working directory, its stdout and stderr in those files (the
    same path for both: one file, as ``stderr=STDOUT``), in a process group of
    its own; returns at once."""
    req = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr,
           "script": script, "module": module}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server)
        conn.sendall(json.dumps(req).encode())
        conn.shutdown(socket.SHUT_WR)
        reader = conn.makefile("rb")
        return Forked(int(reader.readline()), conn, reader)
    except BaseException:
        conn.close()
        raise


class Forked:
    """A child of the fork server, as much of ``subprocess.Popen`` as the
    scripts and tests use: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal`` (the server answers its exit status when it ends)."""

    def __init__(self, pid: int, conn: socket.socket, reader) -> None:
        self.pid, self.returncode = pid, None
        self._conn, self._reader = conn, reader

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], 0)
            if ready:
                self._done(self._reader.readline())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = self._reader.readline()
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout) from None
            self._done(line)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def _done(self, line: bytes) -> None:
        self._reader.close()
        self._conn.close()
        if not line:
            raise RuntimeError(f"the fork server died during its child {self.pid}")
        self.returncode = int(line)
