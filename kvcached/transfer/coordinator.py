"""WorkerTransfer: the engine-side coordinator of one worker process per TP rank.

One thread owns the ROUTER socket: the IO thread (ZeroMQ sockets are not
thread-safe). ``submit`` queues the task and wakes it (a pipe), so the
engine's thread never encodes, sends or waits on a socket: vLLM's scheduler
pays a queue append and one write. The IO thread sends, reads the answers,
completes the handles (a waiter sleeps on its handle's lock), and keeps
heartbeats, liveness, deadlines and restarts. A task goes to every rank; it
completes only when every rank has answered or been declared lost (the
barrier), and it is ok only if every rank is ok.

A worker is lost when its process exits (seen through ``Popen.poll``), when
it is silent for ``worker_timeout_s``, or when it leaves a task unanswered
past ``task_timeout_s``. Every task in flight on it then fails with
``lost=True`` (WorkerLost), the process is killed so that no late copy can
land in a block that was rolled back, and it is restarted with backoff
(``kvcached.transfer.supervisor``, the rule ``kvcached launch`` follows too).
A rank that crashes ``max_worker_restarts`` times in a row (a worker ready
for ``worker_stable_s`` starts the count over) gives up: ``healthy`` turns
False and the manager switches its CPU tier off, until
``restart_workers`` (``kvcached ctl restart-workers``) brings it back.

Runtime changes (``update_weights``, ``attach_storage``, ``detach_storage``)
are written to ``run_dir/config.json`` before the ranks are told, so a
restarted worker comes back serving the current weights and storage.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvcached.config import CacheConfig
from kvcached.memory.rundir import write_engine_file
from kvcached.tasks import Task, TaskHandle, TaskResult, merge_results
from kvcached.transfer import protocol as P
from kvcached.transfer.base import Transfer
from kvcached.transfer.endpoints import coordinator_endpoint, socket_files
from kvcached.transfer.peers import PeerTracker
from kvcached.transfer.runconfig import CREDENTIALS_FILE, write_run_config
from kvcached.transfer.supervisor import (
    backoff_s,
    count_crash,
    kill_pid,
    may_restart,
    spawn_worker,
    stop_process,
)

logger = logging.getLogger(__name__)

# Liveness checks (Popen.poll per worker), task deadlines, restarts and
# heartbeats run at most this often, not on every wake-up of the IO thread.
CHORES_S = 0.005
CLOSE_LINGER_MS = 200
# At close, how long the told-to-leave workers get to read our last words and
# disconnect before the socket closes under them (see kvcached.transfer.peers).
CLOSE_GRACE_S = 1.0
RESTART_BASE_S, RESTART_CAP_S = 0.2, 5.0  # backoff of a crashed rank's restart
# What a worker shows before its first heartbeat (then the heartbeat's info):
# every entry of stats()["workers"] has the same keys from the start.
INFO_DEFAULTS = {"queues": {}, "paused": False, "done": 0, "failed": 0, "fast": 0,
                 "storage": {}}
# Control ops that change the config a (re)started worker must serve.
RUNTIME_OPS = frozenset({"update_weights", "attach_storage", "detach_storage"})
# Plain ints: the IntFlag members of pyzmq cost an enum operation per use.
_POLLIN, _SNDMORE, _EVENTS, _RCVMORE = (int(f) for f in (zmq.POLLIN, zmq.SNDMORE, zmq.EVENTS,
                                                         zmq.RCVMORE))


@dataclass
class _WorkerState:
    rank: int
    proc: subprocess.Popen | None = None
    pid: int = 0
    state: str = "starting"  # starting | ready | lost | failed (no more restarts)
    lost_reason: str = ""
    last_seen: float = 0.0
    restarts: int = 0  # since the engine started
    crashes: int = 0  # consecutive (kvcached.transfer.supervisor)
    ready_at: float = 0.0
    restart_at: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # Its first heartbeat since the hello arrived: the worker sends it once it
    # has attached the KV planes, the host pool and storage. Tasks go to a
    # ready worker before that (they wait in its socket); start() waits for
    # it, so an engine's first tasks do not wait for the attach.
    attached: bool = False

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def serving(self) -> bool:
        return self.ready and self.attached


@dataclass
class _Inflight:
    handle: TaskHandle
    pending: set[int]
    t0: float
    deadline: float
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lost: bool = False


class WorkerTransfer(Transfer):
    """Fans tasks out to the rank workers and completes them at the barrier."""

    def __init__(self, cfg: CacheConfig, run_dir):
        super().__init__()
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.workers = [_WorkerState(r) for r in range(cfg.tp_size)]
        self.limits = P.Limits(num_device_blocks=cfg.num_gpu_blocks,
                               num_host_blocks=max(cfg.num_cpu_blocks, 1))
        self._ctx = zmq.Context.instance()
        self._idents = [f"rank-{w.rank}".encode() for w in self.workers]
        self._rank_by_ident = {ident: rank for rank, ident in enumerate(self._idents)}
        self._all_ranks = frozenset(w.rank for w in self.workers)
        # deque.append / popleft are atomic: the queue between the submitting
        # threads and the IO thread, without Queue's lock and condition.
        self._outbox: collections.deque[TaskHandle] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._inflight: dict[int, _Inflight] = {}
        self._ready_cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._healthy = True
        self._stamper = None
        if cfg.device == "cuda":
            from kvcached.memory.kvevent import EventStamper
            self._stamper = EventStamper(self.run_dir, cfg.tp_size)
        self._paused = False  # pause/sleep: tasks are held here, in order, until resume
        self._held: list[TaskHandle] = []
        self._hb_seq = 0
        # Work other threads hand the IO thread (restarting ranks): it owns the
        # worker states as it owns the socket.
        self._calls: collections.deque[Callable[[], None]] = collections.deque()

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind, spawn the workers (unless launched separately), wait for every hello."""
        write_run_config(self.run_dir, self.cfg)  # without a storage password
        write_engine_file(self.run_dir)
        endpoint = coordinator_endpoint(self.cfg, self.run_dir)
        if len(endpoint) > 100:
            raise ValueError(f"run_dir {str(self.run_dir)!r} is too long for an ipc socket "
                             "path (~100 characters); choose a shorter run_dir")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a drop
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank takes its name back
        # No send high-water mark: with one, a hung (e.g. stopped) worker's full
        # queue would block the sending thread, the engine's scheduler included,
        # forever. Unbounded, the queue grows only until that worker is declared
        # lost (worker_timeout_s) and killed, which drops its queue.
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.bind(endpoint)
        self._peers = PeerTracker(self._router)  # before any worker can connect
        self._router_fd = self._router.getsockopt(zmq.FD)  # readable: look at EVENTS
        self._thread = threading.Thread(target=self._io_loop, name="kvcached-coordinator",
                                        daemon=True)
        self._thread.start()
        if self.cfg.spawn_workers:
            for w in self.workers:
                self._spawn(w)
        self._wait_all_ready(self.cfg.worker_start_timeout_s)

    def _wait_all_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._ready_cv:
            while not all(w.serving for w in self.workers):
                left = deadline - time.monotonic()
                dead = [w.rank for w in self.workers if w.state == "failed"]
                if left <= 0 or dead:
                    missing = [w.rank for w in self.workers if not w.serving]
                    reasons = "; ".join(
                        f"rank {w.rank}: {w.lost_reason or ('no hello' if not w.ready else 'not attached')}"
                        for w in self.workers if not w.serving)
                    self.close()
                    raise TimeoutError(
                        f"transfer workers for ranks {missing} did not come up within "
                        f"{timeout_s:.0f}s ({reasons}); see logs in {self.log_dir}")
                self._ready_cv.wait(min(left, 0.1))

    def close(self) -> None:
        """Shutdown every worker (terminate, wait, kill) and fail what is in flight."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for w in self.workers:
            stop_process(w.proc, grace_s=3.0)
        for h in self._drain_outbox() + self._held:  # nothing is left waiting
            h.complete(TaskResult(h.task.task_id, False, "transfer closed"))
        self._held.clear()
        for inf in self._inflight.values():
            inf.handle.complete(TaskResult(inf.handle.task.task_id, False, "transfer closed"))
        self._inflight.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for path in socket_files(self.run_dir):
            path.unlink(missing_ok=True)
        (self.run_dir / CREDENTIALS_FILE).unlink(missing_ok=True)

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg.log_dir or self.run_dir / "logs")

    @property
    def healthy(self) -> bool:
        return self._healthy

    # ------------------------------------------------------------ submitting
    def submit(self, task: Task) -> TaskHandle:
        handle = self.new_handle(task)
        if self._stamper is not None:  # CUDA: each rank's KV event generation (kvevent)
            self._stamper.stamp(task)
        if self._stop.is_set():
            handle.complete(TaskResult(task.task_id, False, "transfer closed"))
            return handle
        down = [w.rank for w in self.workers if not w.ready]
        if down:  # fail fast: the manager rolls back and serves without this move
            handle.complete(TaskResult(task.task_id, False, f"ranks {down} are not ready",
                                       lost=True))
            return handle
        self._outbox.append(handle)
        if self._stop.is_set():  # closed meanwhile: close() may have drained already
            for h in self._drain_outbox():
                h.complete(TaskResult(h.task.task_id, False, "transfer closed"))
        else:
            self._wake()
        return handle

    def flush(self, timeout_s: float) -> bool:
        """Wait, the GIL released, until the IO thread took every task submitted
        so far off the outbox (sent it), or ``timeout_s`` passed. A caller
        about to keep the GIL busy (vLLM's forward, right after the step's
        in-step load was submitted) lets the IO thread send first: it would
        otherwise get the GIL at the next switch interval (5 ms)."""
        deadline = time.monotonic() + timeout_s
        while self._outbox:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.00002)
        return True

    def new_handle(self, task: Task) -> TaskHandle:
        task.task_id = next(self._ids)
        return TaskHandle(task, self.completed)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _drain_outbox(self) -> list[TaskHandle]:
        out = []
        while self._outbox:
            out.append(self._outbox.popleft())
        return out

    # ------------------------------------------------------------- IO thread
    def _io_loop(self) -> None:
        last_hb = next_chores = 0.0
        interval = self.cfg.heartbeat_interval_s
        idle_s = max(0.001, interval / 2)
        try:
            while not self._stop.is_set():
                ready = self._io_wait([self._wake_r, self._router_fd], idle_s)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                while self._calls:
                    self._calls.popleft()()
                self._pump()
                now = time.monotonic()
                if now < next_chores:
                    continue  # liveness and deadlines: every few ms, not per frame
                next_chores = now + CHORES_S
                if now - last_hb > interval:
                    self._send_heartbeats()
                    last_hb = now
                self._check_liveness(now)
                self._peers.update()
        except Exception:
            logger.exception("coordinator IO thread died; failing all tasks")
            self._healthy = False
        finally:
            for w in self.workers:
                if w.ready:
                    self._send(w.rank, P.Shutdown("engine closing").encode())
            # The last words (Shutdown, a refusal) reach a worker only if it
            # reads them before the connection goes: wait for the workers to
            # leave, never long enough to hang a closing engine.
            self._peers.wait_all_gone(CLOSE_GRACE_S)
            self._peers.close()
            self._router.close(linger=CLOSE_LINGER_MS)

    @staticmethod
    def _io_wait(fds: list[int], timeout: float) -> list[int]:
        """The IO thread's sleep (a method: tests stall it)."""
        return select.select(fds, [], [], timeout)[0]

    def _pump(self) -> None:
        """Send what waits (held tasks first once resumed, then the outbox, in
        order), then handle every message that arrived. Reading last leaves the
        socket's (edge-triggered) fd armed for the next sleep."""
        if self._held and not self._paused:
            held, self._held = self._held, []
            for h in held:
                self._send_task(h)
        self._take_outbox()
        self._recv_all()

    def _take_outbox(self) -> None:
        while self._outbox:
            h = self._outbox.popleft()
            if self._paused and h.task.kind != "control":
                self._held.append(h)
            else:
                self._send_task(h)

    def _recv_all(self) -> None:
        """Handle every message waiting on the ROUTER (EVENTS is cheaper than a poll)."""
        router = self._router
        while router.getsockopt(_EVENTS) & _POLLIN:
            frames = [router.recv(), router.recv()]  # a ROUTER message: identity + >= 1 frame
            while router.getsockopt(_RCVMORE):
                frames.append(router.recv())
            self._on_frames(frames)

    def _send(self, rank: int, payload: bytes) -> bool:
        try:
            # Two plain sends: send_multipart type-checks each frame in Python.
            self._router.send(self._idents[rank], _SNDMORE)
            self._router.send(payload)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone
            self._lose(rank, f"send failed: {e}")
            return False

    def _send_task(self, h: TaskHandle) -> None:
        t = h.task
        now = time.monotonic()
        inf = _Inflight(h, set(self._all_ranks), now, now + self.cfg.task_timeout_s)
        self._inflight[t.task_id] = inf
        try:
            payload = P.encode(P.Task(t.task_id, t.kind, t.src, t.dst, t.args), self.limits)
        except P.ProtocolError as e:  # e.g. an id outside the pools: never sent
            self._inflight.pop(t.task_id)
            h.complete(TaskResult(t.task_id, False, f"invalid task: {e}"))
            return
        for w in self.workers:
            if not w.ready:
                self._rank_answered(inf, w.rank, False, f"rank {w.rank} not ready", lost=True)
            else:
                self._send(w.rank, payload)

    def _send_heartbeats(self) -> None:
        self._hb_seq += 1
        hb = P.Heartbeat("coordinator", self._hb_seq, time.time(), {}).encode()
        for w in self.workers:
            if w.ready:
                self._send(w.rank, hb)

    # -------------------------------------------------------------- receiving
    def _on_frames(self, frames: list[bytes]) -> None:
        ident = frames[0] if frames else b""
        rank = self._rank_by_ident.get(ident)
        if len(frames) != 2 or rank is None:
            logger.warning("coordinator: dropping a frame from unknown peer %r", ident[:32])
            self._reply_error(ident, "expected [identity rank-<r>, one message frame]")
            return
        w = self.workers[rank]
        try:
            msg = P.decode(frames[1], self.limits)
        except P.ProtocolError as e:
            logger.warning("coordinator: bad frame from rank %d: %s", rank, e)
            self._reply_error(ident, str(e))
            return
        w.last_seen = time.monotonic()
        if type(msg) is P.Done:
            self._on_done(rank, msg.task_id, msg.rank, msg.ok, msg.error, msg.result,
                          msg.elapsed_s)
        elif isinstance(msg, P.Hello):
            self._on_hello(w, msg)
        elif isinstance(msg, P.Heartbeat):
            w.info = msg.info
            if w.ready and not w.attached:
                w.attached = True
                with self._ready_cv:
                    self._ready_cv.notify_all()
        elif isinstance(msg, P.ErrorReply):
            logger.warning("coordinator: rank %d says %s", rank, msg.error)

    def _on_done(self, rank: int, task_id: int, said_rank: int, ok: bool, error: str,
                 result: dict[str, Any], elapsed_s: float) -> None:
        inf = self._inflight.get(task_id)
        if inf is not None and said_rank == rank:  # a late or misaddressed answer is ignored
            self._rank_answered(inf, rank, ok, error, result=result, elapsed=elapsed_s)

    def _reply_error(self, ident: bytes, error: str) -> None:
        try:
            self._router.send_multipart([ident, P.ErrorReply(P.clip(error)).encode()])
        except zmq.ZMQError:
            pass

    def _on_hello(self, w: _WorkerState, msg: P.Hello) -> None:
        problem = self._check_hello(msg)
        self._send(w.rank, P.Ready(ok=not problem, error=problem).encode())
        if problem:
            logger.error("coordinator: refused rank %d: %s", w.rank, problem)
            w.state, w.lost_reason, w.restart_at = "failed", problem, None
            stop_process(w.proc, grace_s=1.0)
            with self._ready_cv:
                self._ready_cv.notify_all()
            return
        if w.ready and msg.pid != w.pid:  # restarted before we noticed the old one die
            self._lose(w.rank, f"replaced by pid {msg.pid}")
        w.pid, w.state, w.lost_reason = msg.pid, "ready", ""
        w.attached = False  # until its first heartbeat
        w.ready_at = time.monotonic()
        logger.info("coordinator: rank %d ready (pid %d, restart %d)", w.rank, msg.pid,
                    msg.restarts)
        with self._ready_cv:
            self._ready_cv.notify_all()

    def _check_hello(self, msg: P.Hello) -> str:
        mine = self.cfg.layout.digest
        if msg.protocol != P.PROTOCOL_VERSION:
            return f"protocol {msg.protocol} != coordinator protocol {P.PROTOCOL_VERSION}"
        if msg.layout_digest != mine:
            return (f"layout digest mismatch: worker has {msg.layout_digest}, engine has "
                    f"{mine}; start both from the same config")
        if (msg.num_device_blocks, msg.num_host_blocks) != (self.cfg.num_gpu_blocks,
                                                            self.cfg.num_cpu_blocks):
            return (f"block counts differ: worker has {msg.num_device_blocks} GPU / "
                    f"{msg.num_host_blocks} CPU, engine has {self.cfg.num_gpu_blocks} / "
                    f"{self.cfg.num_cpu_blocks}")
        return ""

    def _rank_answered(self, inf: _Inflight, rank: int, ok: bool, error: str,
                       result: dict | None = None, elapsed: float = 0.0,
                       lost: bool = False) -> None:
        if rank not in inf.pending:
            return
        inf.pending.discard(rank)
        inf.per_rank[rank] = {"ok": ok, "error": error, "elapsed_s": elapsed,
                              **(result or {})}
        if not ok:
            inf.errors.append(f"rank {rank}: {error}")
            inf.lost |= lost
        if not inf.pending:
            self._complete(inf)

    def _complete(self, inf: _Inflight) -> None:
        t = inf.handle.task
        self._inflight.pop(t.task_id, None)
        ok = not inf.errors
        inf.handle.complete(TaskResult(
            t.task_id, ok, "; ".join(inf.errors), lost=inf.lost,
            elapsed_s=time.monotonic() - inf.t0, blocks_done=len(t.src or t.dst) if ok else 0,
            per_rank=inf.per_rank, result=merge_results(inf.per_rank)))

    # -------------------------------------------------------------- liveness
    def _check_liveness(self, now: float) -> None:
        for w in self.workers:
            alive = w.proc is None or w.proc.poll() is None
            if w.state in ("ready", "starting") and not alive:
                self._lose(w.rank, f"process exited with code {w.proc.returncode}")
            elif w.ready and now - w.last_seen > self.cfg.worker_timeout_s:
                self._lose(w.rank, f"silent for {now - w.last_seen:.1f}s")
            elif w.state == "lost" and w.restart_at is not None and now >= w.restart_at:
                w.restart_at = None
                self._spawn(w)
        for inf in list(self._inflight.values()):
            if now > inf.deadline:
                for rank in list(inf.pending):
                    self._lose(rank, f"task {inf.handle.task.task_id} "
                                     f"({inf.handle.task.kind}) unanswered after "
                                     f"{self.cfg.task_timeout_s}s")

    def _lose(self, rank: int, reason: str) -> None:
        w = self.workers[rank]
        if w.state in ("lost", "failed"):
            return
        logger.error("coordinator: rank %d lost: %s%s", rank, reason,
                     last_words(self.log_dir / f"worker-rank{rank}.stderr"))
        w.state, w.lost_reason = "lost", reason
        # Kill it before failing its tasks: no late copy may land in a block
        # the manager is about to roll back and hand out again. A worker we did
        # not spawn (`kvcached launch`) is killed by pid; its launcher restarts it.
        if w.proc is not None:
            stop_process(w.proc, grace_s=0.0)
        elif w.pid:
            kill_pid(w.pid)
        for inf in list(self._inflight.values()):
            self._rank_answered(inf, rank, False, f"worker lost: {reason}", lost=True)
        if not self.cfg.spawn_workers:
            return  # `kvcached launch` restarts it; its hello makes it ready again
        now = time.monotonic()
        ran = now - w.ready_at if w.ready_at else 0.0
        w.crashes = count_crash(w.crashes, ran, True, self.cfg.worker_stable_s)
        if may_restart(w.crashes, self.cfg.max_worker_restarts):
            w.restart_at = now + backoff_s(w.crashes, RESTART_BASE_S, RESTART_CAP_S)
            w.restarts += 1
        else:
            w.state = "failed"
            self._healthy = False
            logger.error("coordinator: rank %d gave up after %d crashes in a row; the CPU "
                         "tier goes off and the engine serves GPU-only (`kvcached ctl "
                         "restart-workers` brings it back)", rank, w.crashes)
        with self._ready_cv:
            self._ready_cv.notify_all()

    def _spawn(self, w: _WorkerState) -> None:
        # A session of its own: a Ctrl-C meant for the engine is the engine's
        # to act on (it stops its workers at close); a worker outlives a dead
        # engine by at most half a heartbeat interval (it watches the pid).
        w.proc = spawn_worker(w.rank, self.run_dir, self.log_dir, "--engine-pid",
                              str(os.getpid()), "--restarts", str(w.restarts),
                              new_session=True)
        w.last_seen = time.monotonic()
        w.state, w.ready_at = "starting", 0.0  # a crash before ready counts as instant
        logger.info("coordinator: spawned rank %d as pid %d", w.rank, w.proc.pid)

    # ----------------------------------------------------------------- stats
    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        # While paused, what waits in the outbox is held too: the IO thread
        # moves it to _held on its next wake-up.
        held = len(self._held) + (len(self._outbox) if self._paused else 0)
        return {"paused": self._paused, "held": held, "workers": [
            {**INFO_DEFAULTS, **w.info, "rank": w.rank, "pid": w.pid, "state": w.state,
             "restarts": w.restarts, "crashes": w.crashes, "lost_reason": w.lost_reason,
             "last_seen_s": round(now - w.last_seen, 3),
             "ready_s": round(now - w.ready_at, 3) if w.ready_at else 0.0}
            for w in self.workers],
            "inflight": len(self._inflight), "healthy": self._healthy}

    def control(self, op: str, args: dict[str, Any] | None = None,
                timeout_s: float = 30.0) -> dict[str, Any]:
        """Apply ``op`` on every rank; on timeout the answer names the silent ranks."""
        if op in ("pause", "sleep"):
            self._paused = True  # from now on new tasks wait here, in order
        before = self.cfg
        if op in RUNTIME_OPS:  # written first: a rank restarting meanwhile reads it
            self._write_config(_runtime_config(self.cfg, op, args or {}))
        h = self.submit(Task("control", [], [], {"op": op, **(args or {}),
                                                 "timeout_s": timeout_s}))
        if not h.wait(timeout_s + 1.0):
            return {"ok": False, "op": op, "error": f"no answer within {timeout_s}s",
                    "ranks": {}, "silent_ranks": list(range(len(self.workers)))}
        res = h.result
        if op in RUNTIME_OPS and not res.ok and not res.lost:
            self._write_config(before)  # the engine keeps the old one (it raises)
        if op in ("resume", "wakeup"):
            # A rank lost meanwhile restarts fresh (awake, unpaused): resume anyway.
            self._paused = False
            self._wake()  # the IO thread sends what was held
        return {"ok": res.ok, "op": op, "error": res.error, "lost": res.lost,
                "silent_ranks": [], "ranks": dict(res.per_rank)}

    def _write_config(self, cfg: CacheConfig) -> None:
        """``cfg`` becomes what (re)started workers load: ``run_dir/config.json``,
        replaced atomically (a worker never reads half a file), its storage
        password in ``credentials.json`` (kvcached.transfer.runconfig)."""
        write_run_config(self.run_dir, cfg)
        self.cfg = cfg

    def restart_workers(self, timeout_s: float) -> dict[str, Any]:
        """Restart the ranks that gave up (their crash count starts over) and wait
        until every rank is ready; then the transfer is healthy again."""
        if not self.cfg.spawn_workers:
            raise RuntimeError("the workers are run by `kvcached launch` (spawn_workers = "
                               "false): restart that service instead")
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the coordinator has stopped; restart the engine")
        restarted: list[int] = []

        def restart() -> None:  # on the IO thread, which owns the worker states
            for w in self.workers:
                if w.state == "failed":
                    w.crashes, w.restart_at = 0, None
                    w.restarts += 1
                    self._spawn(w)
                    restarted.append(w.rank)
        self._calls.append(restart)
        self._wake()
        if not self.wait_ready(timeout_s):
            down = [w.rank for w in self.workers if not w.ready]
            raise TimeoutError(f"ranks {down} did not come back within {timeout_s:.0f}s; "
                               f"see the logs in {self.log_dir}")
        self._healthy = True
        if restarted:
            logger.warning("coordinator: ranks %s restarted on request", restarted)
        return {"changed": bool(restarted), "restarted": restarted}

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every rank is ready and attached again (e.g. after a restart)."""
        deadline = time.monotonic() + timeout_s
        with self._ready_cv:
            while not all(w.serving for w in self.workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ready_cv.wait(min(left, 0.1))
        return True


def last_words(path: Path, lines: int = 8, max_bytes: int = 4096) -> str:
    """The end of a worker's stderr (a traceback, a fatal signal's report), for
    the engine's log: the run dir holding the file may be gone by the time
    anyone looks (a temporary one goes when the engine stops). "" if empty."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "; its stderr ends:\n  " + "\n  ".join(tail) if tail else ""


def _runtime_config(cfg: CacheConfig, op: str, args: dict[str, Any]) -> CacheConfig:
    """``cfg`` after the runtime change ``op`` (one of RUNTIME_OPS)."""
    if op == "update_weights":
        return cfg.replace(weight_version=str(args.get("version", "")))
    if op == "attach_storage":
        return cfg.replace(storage_backend=args.get("backend"), storage_url=args.get("url", ""))
    return cfg.replace(storage_backend=None)
