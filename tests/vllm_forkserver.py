"""A fork server for the vLLM runs of the tests: one process imports vLLM
(9 of the ~14 seconds a small run takes here) and forks a child for each run
of ``tests/vllm_app.py``; the child is that run's process, as if started
fresh: its own pid, stdout and stderr files, environment and working
directory, and it ends through the interpreter's normal exit (atexit handlers,
vLLM's and kvcached's shutdown). Forking a process that imported torch is what
PyTorch's DataLoader and vLLM's own workers do.

    server:  python tests/vllm_forkserver.py SOCKET     (prints "ready")
    client:  ForkServer().run(argv, env, timeout) -> subprocess.CompletedProcess
             ForkServer().run(argv, env, timeout, script=PATH): ``python PATH argv...``

A child runs ``tests/vllm_app.py`` or, given ``script``, any script as
``python SCRIPT ARGV`` would (``runpy``, ``__main__``): the benchmark
scripts' smoke runs go through it, and so do their own vLLM processes
(``--fork-server SOCKET``, ``scripts/_bench_util.run_child``): each of those
would import vLLM again.

The server answers a connection with the child's pid, then its exit status;
it exits when its stdin closes (the test session ended, or was killed),
removing the directory of its socket.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

APP = Path(__file__).with_name("vllm_app.py")
START_DEADLINE_S = 300


# ------------------------------------------------------------------- server
def serve(path: str) -> None:
    sys.path.insert(0, str(APP.parent))
    # what every run imports: vLLM, its entry point, the tests' model class
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm_app  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                if not sys.stdin.buffer.read1(1):
                    # the test session is gone (also when it was killed, and
                    # its close never ran): its directory goes with us
                    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                    return
                continue
            conn, _ = listener.accept()
            req = json.loads(_read_all(conn))
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [conn, *children.values()]:
                    other.close()
                _child(req)  # does not return
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _child(req: dict) -> None:
    """One run, in the forked child; leaves by SystemExit, so the interpreter
    exits as a fresh process running the app would."""
    os.setpgid(0, 0)  # the run's own process group, as a Popen'd process's children
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        new = os.open(name, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    code = 0
    try:
        if req.get("script"):  # as `python SCRIPT ARGV...` would run it
            import runpy
            sys.argv = [req["script"], *req["argv"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(req["script"])))
            runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.argv = [str(APP), *req["argv"]]
            import vllm_app
            vllm_app.run(*req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)


# ------------------------------------------------------------------- client
class ForkServer:
    """The test process's handle on one server, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="kvcached-vllm-fork-")
        self.path = os.path.join(self._dir, "sock")
        self.vllm_cache = os.path.join(self._dir, "vllm-cache")  # VLLM_CACHE_ROOT of the runs

    def _start(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            if os.path.exists(self.path):
                os.unlink(self.path)
            log = open(os.path.join(self._dir, "server.log"), "w")
            self._proc = subprocess.Popen([sys.executable, __file__, self.path],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log, start_new_session=True)
            ready = self._proc.stdout.readline()  # one line, or EOF if it died
            if ready.strip() != b"ready":
                self._proc.wait(timeout=START_DEADLINE_S)
                raise RuntimeError(f"the vLLM fork server did not start (rc "
                                   f"{self._proc.returncode}); see {log.name}:\n"
                                   + Path(log.name).read_text()[-3000:])

    def socket_path(self) -> str:
        """The server's socket, once it runs (what a script's ``--fork-server`` takes)."""
        self._start()
        return self.path

    def run(self, argv: list[str], env: dict, timeout: float,
            script: str | None = None) -> subprocess.CompletedProcess:
        """Run ``tests/vllm_app.py argv...`` (or ``script argv...``) in a forked
        child; like ``subprocess.run(..., capture_output=True, text=True, timeout=...)``."""
        self._start()
        with tempfile.TemporaryDirectory(prefix="kvcached-vllm-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            req = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": out, "stderr": err,
                   "script": script}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                conn.sendall(json.dumps(req).encode())
                conn.shutdown(socket.SHUT_WR)
                reader = conn.makefile("rb")
                pid = int(reader.readline())
                conn.settimeout(max(1.0, timeout))
                try:
                    line = reader.readline()
                except TimeoutError:
                    os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired([script or str(APP), *argv], timeout) from None
                reader.close()
            if not line:
                raise RuntimeError(f"the vLLM fork server died during run {pid}")
            return subprocess.CompletedProcess([script or str(APP), *argv], int(line),
                                               Path(out).read_text(errors="replace"),
                                               Path(err).read_text(errors="replace"))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # the server exits on EOF
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
