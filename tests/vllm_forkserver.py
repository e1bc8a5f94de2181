"""A fork server for the vLLM runs of the tests: one process imports vLLM
(9 of the ~14 seconds a small run takes here) and forks a child for each run
of ``tests/vllm_app.py``; the child is that run's process, as if started
fresh: its own pid, stdout and stderr files, environment and working
directory, and it ends as the interpreter's exit would (threads joined, atexit
handlers: vLLM's and kvcached's shutdown), without tearing the modules down
(``_exit``). Forking a process that imported torch is what
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _bench_util import Forked, fork_start  # noqa: E402  (the client's half)

APP = Path(__file__).with_name("vllm_app.py")
START_DEADLINE_S = 300


# ------------------------------------------------------------------- server
def serve(path: str) -> None:
    sys.path.insert(0, str(APP.parent))
    import gc

    # what every run imports: vLLM, its entry point, the tests' model class;
    # vLLM's OpenAI server (0.3 s more)
    import vllm.entrypoints.openai.api_server  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm_app  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    # what was imported stays out of every child's garbage collections (each
    # would walk it, and copy its pages): Python's advice for a pre-fork server
    gc.collect()
    gc.freeze()
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
    """One run, in the forked child. A run of ``vllm_app`` or of a script ends
    as the interpreter's exit would, but for tearing down the modules: threads
    joined, atexit handlers run (vLLM's and kvcached's shutdown), unreachable
    objects collected, output flushed; then ``os._exit``. Tearing down vLLM's,
    torch's and transformers' modules frees every object the server imported,
    each one written in the child (a page copied): 2-5 s a run here, for
    nothing a test sees. A module (vLLM's OpenAI server) exits in full."""
    os.setpgid(0, 0)  # the run's own process group, as a Popen'd process's children
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and name == req["stdout"]:
            os.dup2(1, 2)  # one file for both, as stderr=STDOUT
            continue
        new = os.open(name, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    code = 0
    try:
        if req.get("module"):  # as `python -m MODULE ARGV...` would run it
            import runpy
            sys.argv = [req["module"], *req["argv"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        elif req.get("script"):  # as `python SCRIPT ARGV...` would run it
            import runpy
            sys.argv = [req["script"], *req["argv"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(req["script"])))
            runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.argv = [str(APP), *req["argv"]]
            import vllm_app
            vllm_app.run(*req["argv"])
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    if req.get("module"):
        # vLLM's OpenAI server exits as it would for a user. Once it is gone,
        # its multiprocessing resource tracker removes what shared memory its
        # SIGKILLed engine left, as kvcached's janitor does; the restart test
        # asserts the janitor did, which holds while the server takes its
        # teardown's seconds to exit (so it did before it was forked here)
        sys.exit(code)
    _exit(code)


def _exit(code: int) -> None:
    """What ``Py_FinalizeEx`` does before tearing the modules down, in its order."""
    import atexit
    import gc
    try:
        threading._shutdown()  # non-daemon threads joined, as at exit
        atexit._run_exitfuncs()
        gc.collect()  # what an exit would free: cycles (and their __del__) collected
    except BaseException:
        traceback.print_exc()
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


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
        # in the server's directory: gone with it, also when this process is
        # killed before the block ends (the server removes its directory then)
        with tempfile.TemporaryDirectory(prefix="run-", dir=self._dir) as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            child = fork_start(self.path, argv, env, out, err, script=script)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired([script or str(APP), *argv], timeout) from None
            return subprocess.CompletedProcess([script or str(APP), *argv], code,
                                               Path(out).read_text(errors="replace"),
                                               Path(err).read_text(errors="replace"))

    def start(self, module: str, argv: list[str], env: dict, log: str) -> Forked:
        """``python -m module argv...`` in a forked child, its stdout and stderr
        in ``log``, in a session of its own; returns at once (as ``Popen``)."""
        self._start()
        return fork_start(self.path, argv, env, log, log, module=module)

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
