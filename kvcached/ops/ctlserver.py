"""The engine's control socket: what ``kvcached ctl`` and ``kvcached status`` talk to.

Server (engine side): :class:`ControlServer` runs one thread that owns a
ROUTER socket at ``control_endpoint(run_dir)`` (``ipc://<run_dir>/ctl.sock``;
the run directory is mode 0700, so only its user can connect). A request is
one :class:`~kvcached.transfer.protocol.CtlRequest` frame; the answer is one
``CtlReply`` frame. Requests that decode badly (the protocol checks every
field, numbers included: a NaN timeout is refused there) get an
``ErrorReply``; any other error while handling one request is logged and
answered, and the server keeps serving: a dead control thread would leave
an engine that can never be woken.

The manager's control calls block (``pause`` waits for in-flight transfers,
and those wait on the coordinator's IO thread), so they run on a small pool
of op threads, never on this socket's thread and never on the coordinator's.
``status`` and ``ping`` have a thread of their own: they are answered while
a pause drains or a sleep waits for running requests.
Op threads hand their replies back through a queue and a wake-up pipe; the
socket thread alone sends. Every request has a deadline (its ``timeout_s``):
when it passes, the client gets an error naming the op, and a late result is
dropped.

Client side: :func:`request` sends one request and waits, with a deadline,
for its reply. Before it sends, it reads the engine's pid from the run
directory (``engine.json``): a dead engine is reported at once, not after a
timeout. Errors say what to check. The client imports neither torch nor
numpy (``kvcached status`` starts in a fraction of a second).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from kvcached.memory.rundir import ENGINE_FILE, engine_pid, pid_alive, write_engine_file
from kvcached.transfer import protocol as P
from kvcached.transfer.endpoints import control_endpoint

logger = logging.getLogger(__name__)

SOCKET_NAME = "ctl.sock"
MAX_PENDING = 16  # requests in progress at once; more get a "busy" error
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.05, 3600.0
CLIENT_GRACE_S = 2.0  # the client waits this much longer than the server's deadline
ERROR_BACKOFF_S = 0.05  # after an unexpected error in the socket loop: never spin


class ControlUnavailable(RuntimeError):
    """No engine to talk to: the run directory or its control socket is missing."""


class ControlError(RuntimeError):
    """The engine answered with an error (the message is the engine's)."""


def _op_table() -> dict[str, Callable[[Any, dict[str, Any]], Any]]:
    return {
        "pause": lambda m, a: m.pause(),
        "resume": lambda m, a: m.resume(),
        "sleep": lambda m, a: m.sleep(**_sleep_kwargs(a)),
        "wakeup": lambda m, a: m.wakeup(),
        "update_weights": lambda m, a: m.update_weights(_version(a)),
        "restart_workers": lambda m, a: m.restart_workers(),
        "status": lambda m, a: m.status(),
        "ping": lambda m, a: {"pid": os.getpid()},
    }


OPS = _op_table()
READ_ONLY_OPS = frozenset({"status", "ping"})  # never queued behind a blocking op


def _sleep_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """``sleep``'s arguments; a drain's timeout is a checked duration (the protocol
    checks every ``*_s`` arg), 60 s when not given."""
    kwargs: dict[str, Any] = {"release_host_pool": bool(args.get("release_host_pool"))}
    if args.get("drain"):
        kwargs.update(drain=True, drain_timeout_s=float(args.get("drain_timeout_s", 60.0)))
    return kwargs


def _version(args: dict[str, Any]) -> str:
    version = args.get("version")
    if not isinstance(version, str) or not version:
        raise ValueError("update_weights needs args['version'], a non-empty string")
    return version


# ---------------------------------------------------------------- server
class ControlServer:
    """Serves control requests for ``manager`` on its run directory's control socket."""

    def __init__(self, manager, endpoint: str | None = None, op_threads: int = 2):
        self.manager = manager
        self.endpoint = endpoint or control_endpoint(manager.run_dir)
        self._op_threads = op_threads
        self._replies: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
        self._pending: dict[int, tuple[list[bytes], float, str]] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: Exception | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._read_pool: ThreadPoolExecutor | None = None
        self._wake_r = self._wake_w = -1

    @property
    def socket_path(self) -> Path | None:
        """The ipc socket file, or None for another transport."""
        return Path(self.endpoint[len("ipc://"):]) if self.endpoint.startswith("ipc://") else None

    def start(self, timeout_s: float = 5.0) -> ControlServer:
        """Bind the socket on the server thread; returns once bound (or raises)."""
        path = self.socket_path
        if path is not None and len(str(path)) > 100:
            raise ValueError(f"control socket path {str(path)!r} is too long for an ipc "
                             "socket (~100 characters); choose a shorter run_dir")
        self._wake_r, self._wake_w = os.pipe()
        self._pool = ThreadPoolExecutor(self._op_threads, thread_name_prefix="kvcached-ctl-op")
        self._read_pool = ThreadPoolExecutor(1, thread_name_prefix="kvcached-ctl-status")
        self._thread = threading.Thread(target=self._run, name="kvcached-ctl", daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout_s) or self._bind_error is not None:
            self.close()
            raise RuntimeError(f"cannot serve the control socket {self.endpoint}: "
                               f"{self._bind_error or 'bind timed out'}")
        if path is not None:  # lets a client tell a dead engine from a busy one
            write_engine_file(path.parent)
        logger.info("control socket at %s", self.endpoint)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving; requests still running get no reply (clients time out)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for pool in (self._pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        path = self.socket_path
        if path is not None and self._bind_error is None:
            path.unlink(missing_ok=True)

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # closed: the server is stopping anyway

    # ---------------------------------------------------------- socket thread
    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
            if self.socket_path is not None:
                os.chmod(self.socket_path, 0o600)
        except (zmq.ZMQError, OSError) as e:
            self._bind_error = e
            sock.close()
            self._bound.set()
            return
        self._bound.set()
        try:
            self._loop(sock)
        except Exception:  # keep the engine serving; `kvcached ctl` then times out
            logger.exception("control socket thread died")
        finally:
            sock.close(linger=0)

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._step(sock, poller)
            except Exception:  # log and serve on: see the module docstring
                logger.exception("control socket: unexpected error; still serving")
                self._stop.wait(ERROR_BACKOFF_S)

    def _step(self, sock: zmq.Socket, poller: zmq.Poller) -> None:
        events = dict(poller.poll(timeout=self._poll_ms()))
        if self._wake_r in events:
            os.read(self._wake_r, 4096)
        self._send_replies(sock)
        if sock in events:
            while sock.poll(0):
                frames = sock.recv_multipart()
                try:
                    self._on_frames(sock, frames)
                except Exception as e:  # this request fails; the next one is served
                    logger.exception("control socket: handling a request failed")
                    _send(sock, _split_envelope(frames)[0], P.ErrorReply(
                        "internal error", P.clip(f"{type(e).__name__}: {e}")).encode())
        self._expire(sock, time.monotonic())

    def _poll_ms(self) -> int:
        """Sleep until the nearest request deadline (at most 200 ms)."""
        if not self._pending:
            return 200
        left = min(d for _, d, _ in self._pending.values()) - time.monotonic()
        return max(0, min(200, int(left * 1000) + 1))

    def _on_frames(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        envelope, body = _split_envelope(frames)
        if len(body) != 1:
            _send(sock, envelope, P.ErrorReply(
                "bad request", f"expected one msgpack frame after the envelope, "
                               f"got {len(body)}").encode())
            return
        try:
            msg = P.decode(body[0])
        except P.ProtocolError as e:
            logger.warning("control socket: bad frame: %s", e)
            _send(sock, envelope, P.ErrorReply.from_exception(e).encode())
            return
        if not isinstance(msg, P.CtlRequest):
            _send(sock, envelope, P.ErrorReply(
                "bad request", f"the control socket takes 'ctl' messages, got {msg.KIND!r}"
            ).encode())
            return
        self._dispatch(sock, envelope, msg)

    def _dispatch(self, sock: zmq.Socket, envelope: list[bytes], req: P.CtlRequest) -> None:
        fn = OPS.get(req.op)
        if fn is None:
            _send(sock, envelope, _reply_error(f"unknown op {req.op!r}; allowed: {sorted(OPS)}"))
            return
        if len(self._pending) >= MAX_PENDING:
            _send(sock, envelope, _reply_error(
                f"busy: {len(self._pending)} control requests in progress; retry later"))
            return
        job = next(self._ids)
        timeout = min(max(req.timeout_s, MIN_TIMEOUT_S), MAX_TIMEOUT_S)
        self._pending[job] = (envelope, time.monotonic() + timeout, req.op)
        pool = self._read_pool if req.op in READ_ONLY_OPS else self._pool
        pool.submit(self._run_op, job, fn, req)

    def _send_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                job, payload = self._replies.get_nowait()
            except queue.Empty:
                return
            entry = self._pending.pop(job, None)
            if entry is not None:  # None: its deadline passed and the client was told
                _send(sock, entry[0], payload)

    def _expire(self, sock: zmq.Socket, now: float) -> None:
        for job, (envelope, deadline, op) in list(self._pending.items()):
            if now >= deadline:
                del self._pending[job]
                logger.warning("control op %s passed its deadline; the client was told", op)
                _send(sock, envelope, _reply_error(
                    f"{op} did not finish before its deadline; it may still complete "
                    "(check `kvcached status`), or retry with a longer --timeout",
                    timeout=True))

    # --------------------------------------------------------------- op thread
    def _run_op(self, job: int, fn, req: P.CtlRequest) -> None:
        try:
            result = fn(self.manager, req.args)
            payload = _reply_ok(req.op, result)
        except TimeoutError as e:  # names the silent ranks
            payload = _reply_error(f"{req.op}: {e}", timeout=True)
        except Exception as e:  # the client gets it; the engine keeps serving
            logger.warning("control op %s failed: %s", req.op, e)
            payload = _reply_error(f"{req.op} failed: {type(e).__name__}: {e}")
        self._replies.put((job, payload))
        self._wake()


def _split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """ROUTER frames -> (routing envelope incl. the empty delimiter, body)."""
    for i, frame in enumerate(frames[1:], start=1):
        if not frame:
            return frames[:i + 1], frames[i + 1:]
    return frames[:1], frames[1:]  # a DEALER that sent no delimiter


def _send(sock: zmq.Socket, envelope: list[bytes], payload: bytes) -> None:
    try:
        sock.send_multipart([*envelope, payload])
    except zmq.ZMQError as e:  # the client went away; nothing to do
        logger.debug("control reply not sent: %s", e)


def _reply_ok(op: str, result: Any) -> bytes:
    body = wire_safe(result) if isinstance(result, dict) else {"value": wire_safe(result)}
    try:
        return P.CtlReply(ok=True, result=body).encode()
    except P.ProtocolError as e:
        return _reply_error(f"{op}: the result could not be sent: {e}")


def _reply_error(error: str, timeout: bool = False) -> bytes:
    return P.CtlReply(ok=False, result={"timeout": timeout}, error=P.clip(error)).encode()


# --------------------------------------------------------- making it sendable
def wire_safe(value: Any, depth: int = -1) -> Any:
    """``value`` as protocol-map content: plain types, str keys, bounded nesting.

    Containers deeper than the protocol allows become JSON strings, objects
    become dicts (dataclasses, ``to_dict()``) or their ``str``.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, float):  # the protocol refuses NaN and infinities
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or value is None or isinstance(value, bytes):
        return value
    if isinstance(value, int):
        return value if P.INT64_MIN <= value <= P.INT64_MAX else str(value)
    if isinstance(value, str):
        return P.clip(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if depth >= P.MAX_NESTING:
            return P.clip(json.dumps(value, default=str))
        if isinstance(value, dict):
            return {P.clip(str(k)): wire_safe(v, depth + 1) for k, v in value.items()}
        return [wire_safe(v, depth + 1) for v in value]
    if hasattr(value, "item"):  # numpy / torch scalars
        return wire_safe(value.item(), depth)
    return P.clip(str(value))


# ---------------------------------------------------------------- client
def socket_path(run_dir: str | os.PathLike) -> Path:
    """Where the engine of ``run_dir`` serves its control socket."""
    return Path(run_dir) / SOCKET_NAME


def request(run_dir: str | os.PathLike, op: str, args: dict[str, Any] | None = None,
            timeout_s: float = 30.0) -> dict[str, Any]:
    """Ask the engine of ``run_dir`` to apply ``op``; returns its result.

    Raises ControlUnavailable (no engine there), TimeoutError (no answer in
    time) or ControlError (the engine's error, e.g. the ranks that did not answer).
    """
    path = _check_socket(run_dir)
    frame = P.CtlRequest(op, args or {}, float(timeout_s)).encode()  # checks timeout_s
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control_endpoint(run_dir))
        sock.send_multipart([b"", frame])
        wait_s = timeout_s + min(CLIENT_GRACE_S, 0.5 + timeout_s)
        if not sock.poll(int(wait_s * 1000)):
            raise TimeoutError(f"no answer from the engine's control socket {path} within "
                               f"{wait_s:.0f}s: is the engine alive? (a busy engine may "
                               "need a longer --timeout)")
        return _parse_reply(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def _check_socket(run_dir: str | os.PathLike) -> Path:
    if not Path(run_dir).is_dir():
        raise ControlUnavailable(
            f"run directory {run_dir} does not exist: is the engine running, and is this "
            "its run_dir? (set --run-dir or KVCACHED_RUN_DIR)")
    pid = engine_pid(run_dir)
    if pid is not None and not pid_alive(pid):  # fail now, not after a timeout
        raise ControlUnavailable(
            f"engine pid {pid} is not running (run dir {run_dir}, from its {ENGINE_FILE}); "
            "`kvcached cleanup` removes what a dead engine left behind")
    path = socket_path(run_dir)
    if not path.exists():
        raise ControlUnavailable(
            f"no control socket {path}: is the engine running with this run_dir "
            "(and control_socket = true)?")
    return path


def _parse_reply(frames: list[bytes]) -> dict[str, Any]:
    try:
        msg = P.decode(frames[-1])
    except P.ProtocolError as e:
        raise ControlError(f"the engine sent an unreadable reply: {e}") from None
    if isinstance(msg, P.ErrorReply):
        raise ControlError(f"the engine rejected the request: {msg.error}: {msg.detail}")
    if not isinstance(msg, P.CtlReply):
        raise ControlError(f"the engine sent a {msg.KIND!r} message instead of a reply")
    if not msg.ok:
        if msg.result.get("timeout"):
            raise TimeoutError(msg.error)
        raise ControlError(msg.error)
    return msg.result
