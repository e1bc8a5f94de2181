"""The transfer worker: one process per TP rank, run as ``kvcached worker``.

Threads and sockets (each socket has exactly one owning thread):

    main thread   DEALER to the coordinator (identity ``rank-<r>``) + PULL of
                  finished-task reports; decodes, validates, routes tasks to
                  lanes, sends Done/Heartbeat, watches for the engine's death
    lane "out"    swap_out, in arrival order            (own PUSH socket)
    lane "in"     swap_in, in arrival order             (own PUSH socket)
    lane "step"   swap_in_layers (a load inside the engine's step: it never
                  queues behind the other swap-ins; on the CPU it runs on the
                  main thread when the lane is idle), in order (own PUSH socket)
    lane "load"   lookup / load (storage reads), in order (own PUSH socket)
    lane "store"  store (storage writes), in order      (own PUSH socket)
    lane "ctl"    control operations and noop           (own PUSH socket)

Storage has lanes of its own: a slow or frozen store server delays storage
tasks only, never the copies between the engine's blocks and the CPU tier.
Reads and writes are apart because a request waits for a read (its lookup
has a deadline of a scheduler step or two) and nobody waits for a write: a
write-through of a long prompt, or a write stuck on the store, must not turn
the next request's hit into a miss. The manager keeps the host blocks a
store reads busy until it finishes and loads only into free ones, so the
two lanes never touch the same block.

A bad frame gets an error reply and the worker keeps running; a failed copy
is a failed Done (copy engines check ids before touching memory). A fatal
failure (a sticky CUDA error: the process's context is broken for good) is a
failed Done too, and then the worker exits with ``EXIT_FATAL`` so that the
coordinator starts a fresh process. The worker also
exits when its engine is gone: the engine pid disappears, or, once
connected, nothing arrived from the coordinator for ``engine_timeout_s``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

import zmq

from kvcached.config import CacheConfig
from kvcached.storage.base import redact_url
from kvcached.transfer import protocol as P
from kvcached.transfer.control import WorkerControl
from kvcached.transfer.endpoints import CONFIG_FILE, ENGINE_FILE, coordinator_endpoint
from kvcached.transfer.executor import RankExecutor
from kvcached.transfer.lanes import LANE_OF, LANES
from kvcached.transfer.runconfig import read_run_config

logger = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0
EXIT_REFUSED = 3  # exit code when the coordinator refused our hello (the launcher reads it)
EXIT_FATAL = 4  # a task hit a fatal error (a broken CUDA context): restart me
FATAL_LINGER_MS = 1000  # at a fatal exit, the failed Done still gets this long to go out
FATAL_DRAIN_S = 2.0  # after a fatal error, lanes' Dones are forwarded for at most this long
INLINE_MAX_BLOCKS = 8  # swaps up to this size run on the socket thread (microseconds)
# Engine liveness, hello retries and heartbeats run at most this often, not once
# per message: a busy worker handles frames back to back.
CHORES_S = 0.01
LANE_JOIN_S = 5.0  # at exit, lanes finishing a copy get this long in all (they are daemons)
SEND_POLL_MS = 10  # a send with no room waits in slices this long, checking on the engine
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: pyzmq's IntFlag costs an enum operation per send
# What can change while the engine runs (update_weights, attach/detach_storage).
RUNTIME_FIELDS = ("weight_version", "storage_backend", "storage_url")


class EngineGone(Exception):
    """A frame could not be sent and the engine is gone: the worker exits."""


class Lane(threading.Thread):
    """Runs one kind of task strictly in order."""

    def __init__(self, name: str, worker: Worker):
        super().__init__(name=f"lane-{name}", daemon=True)
        self.lane = name
        self.worker = worker
        # each task (a protocol Task), None to stop
        self.tasks: queue.Queue[P.Task | None] = queue.Queue()
        self.busy = False
        # Tasks handed to this lane whose Done the socket thread has not yet
        # forwarded; only the socket thread changes it, so "0" is race-free
        # (a pause's wait_idle reads it, woken by each change).
        self.outstanding = 0

    def run(self) -> None:
        push = self.worker.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.worker.done_endpoint)
        try:
            while True:
                task = self.tasks.get()
                if task is None:
                    return
                self.busy = True
                try:
                    push.send_multipart([self.lane.encode(), self.worker.execute(task)])
                finally:
                    self.busy = False
        finally:
            push.close()


class Worker(WorkerControl):
    """One rank's transfer worker."""

    def __init__(self, cfg: CacheConfig, run_dir, rank: int, engine_pid: int | None,
                 restarts: int = 0):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.engine_pid = engine_pid
        self.restarts = restarts
        self.executor = RankExecutor(cfg, run_dir, rank, owner_pid=engine_pid)
        self.limits = P.Limits(num_device_blocks=cfg.num_gpu_blocks,
                               num_host_blocks=max(cfg.num_cpu_blocks, 1))
        self.ctx = zmq.Context.instance()
        self.done_endpoint = f"inproc://done-{rank}-{id(self)}"
        self.paused = False  # informational: the coordinator holds tasks while paused
        self._idle = threading.Condition()
        self.lanes = {name: Lane(name, self) for name in LANES}
        self._owed = 0  # sum of the lanes' outstanding: one check per message
        self.stop_reason = ""
        self._hb_seq = 0
        self._ready = False  # the coordinator accepted our hello and we attached
        self._last_rx = self._last_hello = self._last_hb = 0.0
        self.tasks_done = 0
        self.tasks_failed = 0
        self.tasks_fast = 0  # of tasks_done, those run inline on the socket thread
        self.fatal = ""  # set (by any thread) when a task failed fatally: exit soon
        # On CUDA a copy waits for the engine's KV event (up to a forward pass):
        # never on the socket thread, where heartbeats and the other direction
        # would wait with it.
        self._inline_copies = cfg.device != "cuda"
        self._fatal_at = 0.0

    # --------------------------------------------------------------- running
    def run(self) -> int:
        """Serve until told to stop or the engine is gone; returns an exit code."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank-{self.rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(coordinator_endpoint(self.cfg, self.run_dir))
        pull = self.ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(self.done_endpoint)
        for lane in self.lanes.values():
            lane.start()
        try:
            code = self._loop(sock, pull)
            if code == EXIT_FATAL:  # the failed Done is queued: let it reach the engine
                sock.setsockopt(zmq.LINGER, FATAL_LINGER_MS)
            return code
        finally:
            for lane in self.lanes.values():
                lane.tasks.put(None)
            deadline = time.monotonic() + LANE_JOIN_S  # one deadline for all lanes
            for lane in self.lanes.values():
                lane.join(timeout=max(0.0, deadline - time.monotonic()))
            sock.close()
            pull.close()
            try:
                self.executor.close()
            except Exception as e:  # the exit code says why we stop, not this
                logger.error("worker rank %d: closing its memory failed: %s", self.rank, e)
            logger.info("worker rank %d stopped: %s", self.rank, self.stop_reason)

    def _loop(self, sock: zmq.Socket, pull: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        timeout_ms = max(1, int(self.cfg.heartbeat_interval_s * 1000 / 2))
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        next_chores = 0.0
        errors = 0
        while True:
            # Exit once the lanes' Dones (the fatal one among them: they fail fast
            # now) were forwarded, or after FATAL_DRAIN_S whatever a lane is doing.
            if self.fatal and (not self._owed
                               or time.monotonic() - self._fatal_at > FATAL_DRAIN_S):
                self.stop_reason = f"fatal: {self.fatal}"
                logger.error("worker rank %d exits: %s", self.rank, self.stop_reason)
                return EXIT_FATAL
            try:
                now = time.monotonic()
                if now >= next_chores:
                    if self._chores(sock, now):
                        return 0
                    next_chores = now + CHORES_S
                if self._owed:
                    code = self._serve_both(poller, sock, pull, timeout_ms)
                else:
                    # Hot path: only the coordinator can send anything, and a
                    # blocking recv costs fewer syscalls than a poller (RCVTIMEO
                    # brings us back for the chores).
                    code = self._on_coordinator_frame(sock, sock.recv())
                if code is not None:
                    return code
                errors = 0
            except zmq.Again:  # RCVTIMEO: nothing arrived
                pass
            except EngineGone as e:
                self.stop_reason = str(e)
                return 0
            except zmq.ZMQError as e:  # back off: never spin on a broken socket
                errors += 1
                logger.error("worker rank %d socket error %s (retry %d)", self.rank, e, errors)
                time.sleep(min(0.01 * 2 ** errors, 2.0))

    def _serve_both(self, poller: zmq.Poller, sock: zmq.Socket, pull: zmq.Socket,
                    timeout_ms: int) -> int | None:
        """A lane owes a Done: wait on the coordinator and on the lanes' reports.
        One frame per ready socket: while more wait, the next poll returns at once."""
        for ready_sock, _ in poller.poll(timeout_ms):
            if ready_sock is pull:
                lane, done = pull.recv_multipart()
                self._send(sock, done)
                self._forwarded(lane.decode())
            else:
                code = self._on_coordinator_frame(sock, sock.recv())
                if code is not None:
                    return code
        return None

    def _send(self, sock: zmq.Socket, frame: bytes) -> None:
        """Send one frame to the coordinator, never blocking on a dead engine.

        With IMMEDIATE a DEALER whose peer went away blocks forever in send, and
        then no liveness check would run again. A frame that cannot go out at
        once (no peer, or the engine's queue is full) waits in short polls; the
        worker gives up (EngineGone) when the engine pid is gone or nothing
        could be delivered for engine_timeout_s."""
        try:
            sock.send(frame, _NOBLOCK)
            return
        except zmq.Again:
            pass
        since = time.monotonic()
        while True:
            if sock.poll(SEND_POLL_MS, zmq.POLLOUT):
                try:
                    sock.send(frame, _NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if not self._engine_alive():
                raise EngineGone(f"engine pid {self.engine_pid} is gone")
            if time.monotonic() - since > self.cfg.engine_timeout_s:
                raise EngineGone(f"could not send to the engine for {self.cfg.engine_timeout_s}s")

    def _chores(self, sock: zmq.Socket, now: float) -> bool:
        """Engine liveness, hello retries and heartbeats; True when the worker must exit."""
        if not self._engine_alive():
            self.stop_reason = f"engine pid {self.engine_pid} is gone"
            return True
        if self._ready and now - self._last_rx > self.cfg.engine_timeout_s:
            self.stop_reason = f"no word from the engine for {self.cfg.engine_timeout_s}s"
            return True
        if not self._ready and now - self._last_hello > HELLO_RETRY_S:
            try:  # IMMEDIATE + NOBLOCK: hellos never pile up while no engine listens
                sock.send(self._hello().encode(), zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._last_hello = now
        if self._ready and now - self._last_hb > self.cfg.heartbeat_interval_s:
            self._send(sock, self._heartbeat().encode())
            self._last_hb = now
        return False

    def _on_coordinator_frame(self, sock: zmq.Socket, raw: bytes) -> int | None:
        """Handle one frame; an exit code when the worker must stop."""
        self._last_rx = time.monotonic()
        verdict = self._on_frame(sock, raw)
        if verdict == "ready" and not self._ready:
            # Handshake first (a layout mismatch is named there), then attach;
            # tasks wait in the socket meanwhile.
            self._learn_engine_pid()
            self._adopt_runtime_config()
            self.open_executor(self.cfg.worker_start_timeout_s)
            self._ready = True
            # the first heartbeat tells the coordinator we attached: its start()
            # returns then, not before the tasks queued meanwhile could run
            self._send(sock, self._heartbeat().encode())
            self._last_hb = time.monotonic()
        elif verdict == "stop":
            return 0
        elif verdict == "refused":
            return EXIT_REFUSED
        return None

    def _on_frame(self, sock: zmq.Socket, raw: bytes) -> str:
        try:
            msg = P.decode(raw, self.limits)
        except P.ProtocolError as e:
            logger.warning("worker rank %d: bad frame: %s", self.rank, e)
            if e.task_id is not None:  # answer the task so nobody waits for it
                self._send(sock, P.Done(e.task_id, self.rank, ok=False,
                                        error=P.clip(str(e))).encode())
            else:
                self._send(sock, P.ErrorReply.from_exception(e).encode())
            return ""
        if type(msg) is P.Task:
            self._run_task(sock, msg)
        elif isinstance(msg, P.Ready):
            if not msg.ok:
                self.stop_reason = f"refused by the coordinator: {msg.error}"
                logger.error("worker rank %d %s", self.rank, self.stop_reason)
                return "refused"
            logger.info("worker rank %d ready", self.rank)
            return "ready"
        elif isinstance(msg, P.Shutdown):
            self.stop_reason = f"shutdown: {msg.reason}"
            return "stop"
        elif isinstance(msg, P.ErrorReply):
            logger.warning("worker rank %d: coordinator says %s", self.rank, msg.error)
        return ""

    # ------------------------------------------------------------- executing
    def _run_task(self, sock: zmq.Socket, task: P.Task) -> None:
        """Run a task here (small ones, see ``_inline_ok``) or queue it on its lane."""
        kind = task.kind
        lane = self.lanes[LANE_OF[kind]]
        if self._inline_ok(kind, len(task.src), lane) and (self._inline_copies or kind == "noop"):
            self.tasks_fast += 1
            self._send(sock, self.execute(task))  # no hand-offs
        else:
            lane.outstanding += 1
            self._owed += 1
            lane.tasks.put(task)

    def execute(self, task: P.Task) -> bytes:
        """Run one task (as decoded: the executor reads its kind, ids and args);
        returns the encoded Done to send back. Never raises."""
        t0 = time.perf_counter()
        task_id, kind = task.task_id, task.kind
        try:
            if kind == "control":
                result = self.control(task.args)
            else:
                result = self.executor.run(task)
            finished = time.monotonic()  # lets tests check per-lane order
            if len(result) == 1 and type(result.get("bytes")) is int:  # a swap's or a noop's
                frame = P.encode_done(task_id, self.rank, len(task.src or task.dst),
                                      time.perf_counter() - t0, result["bytes"], finished)
            else:
                result["finished"] = finished
                frame = P.encode(P.Done(task_id, self.rank, True, "", len(task.src or task.dst),
                                        time.perf_counter() - t0, result), self.limits)
            self.tasks_done += 1
            return frame
        except Exception as e:
            self.tasks_failed += 1
            logger.error("worker rank %d: %s task %d failed: %s", self.rank, kind, task_id, e)
            if getattr(e, "fatal", False):
                # Nothing of this task counts as copied (its Done fails), and no
                # later task can succeed in this process: the loop exits once
                # this Done is on its way, and the coordinator restarts us.
                if not self.fatal:
                    self._fatal_at = time.monotonic()
                    self.fatal = f"{type(e).__name__}: {e}"
            return P.Done(task_id, self.rank, ok=False, error=P.clip(f"{e}"),
                          elapsed_s=time.perf_counter() - t0).encode()

    @staticmethod
    def _inline_ok(kind: str, n_ids: int, lane: Lane) -> bool:
        """Small copies and noops run on the socket thread when their lane is idle:
        order within the lane is kept, and a small task's round trip skips the
        two thread hand-offs (a queue, then an inproc socket back, each waking
        another thread), which cost more than decoding, copying and answering
        it. Big copies and control go to lanes so heartbeats and the other
        direction keep flowing; but for a load inside the engine's step, whose
        forward waits for every layer of it (milliseconds: the other frames
        wait no longer than that)."""
        if kind == "noop":
            return True
        small = kind in ("swap_out", "swap_in") and n_ids <= INLINE_MAX_BLOCKS
        return (small or kind == "swap_in_layers") and lane.outstanding == 0

    def open_executor(self, timeout_s: float) -> None:
        """Attach to the rank's memory."""
        self.executor.open(timeout_s=timeout_s)

    def close_executor(self) -> None:
        """Detach (sleep); storage stays open."""
        self.executor.close(final=False)

    def _forwarded(self, lane: str) -> None:
        """A lane's Done went out to the coordinator (socket thread only)."""
        self.lanes[lane].outstanding -= 1
        self._owed -= 1
        with self._idle:
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the copy lanes finished every task they were sent and their
        Dones went out. Finished is not enough: each lane reports on its own
        socket, so a control's answer could overtake a copy's Done on the way
        to the coordinator, and a pause would return before that copy shows
        as done there."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while any(self.lanes[n].outstanding for n in ("out", "in", "step")):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def queue_depths(self) -> dict[str, int]:
        return {n: lane.tasks.qsize() + lane.busy for n, lane in self.lanes.items()}

    # --------------------------------------------------------------- helpers
    def _learn_engine_pid(self) -> None:
        """The engine owns (and names) the host pools: its pid comes from the command
        line (spawned workers) or the run dir (workers of `kvcached launch`)."""
        if self.engine_pid is not None:
            self.executor.owner_pid = self.engine_pid
            return
        try:
            pid = int(json.loads((self.run_dir / ENGINE_FILE).read_text())["pid"])
        except (OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"cannot read {ENGINE_FILE} in {self.run_dir}: {e}") from e
        self.executor.owner_pid = pid

    def _adopt_runtime_config(self) -> None:
        """Serve the engine's current weights and storage, not the start-up config's:
        the engine writes them to config.json before it tells the ranks of a
        change (update_weights, attach/detach_storage), so a worker restarted
        after one, or a `kvcached launch` worker started from a TOML file,
        comes back serving what the engine serves."""
        try:
            current = read_run_config(self.run_dir)
        except (OSError, ValueError):
            return  # no engine config (yet): ours is all there is
        changes = {k: current[k] for k in RUNTIME_FIELDS
                   if k in current and current[k] != getattr(self.cfg, k)}
        if not changes:
            return
        try:
            self.cfg = self.executor.cfg = self.cfg.replace(**changes)
        except ValueError as e:
            logger.error("worker rank %d: the engine's %s is not usable here: %s", self.rank,
                         CONFIG_FILE, e)
            return
        if "storage_url" in changes:
            changes["storage_url"] = redact_url(changes["storage_url"])
        logger.info("worker rank %d: serving the engine's current %s", self.rank, changes)

    def _engine_alive(self) -> bool:
        if self.engine_pid is None:
            return True
        try:
            os.kill(self.engine_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _hello(self) -> P.Hello:
        return P.Hello(rank=self.rank, pid=os.getpid(), protocol=P.PROTOCOL_VERSION,
                       layout_digest=self.cfg.layout.digest,
                       num_device_blocks=self.cfg.num_gpu_blocks,
                       num_host_blocks=self.cfg.num_cpu_blocks, restarts=self.restarts)

    def _heartbeat(self) -> P.Heartbeat:
        self._hb_seq += 1
        info = {"queues": self.queue_depths(), "paused": self.paused,
                "done": self.tasks_done, "failed": self.tasks_failed, "fast": self.tasks_fast,
                "storage": self.executor.storage_health()}
        return P.Heartbeat(sender=f"rank-{self.rank}", seq=self._hb_seq, time=time.time(),
                           info=info)


def run_worker(cfg: CacheConfig, run_dir, rank: int, engine_pid: int | None,
               restarts: int = 0) -> int:
    """Serve rank ``rank`` until the engine goes; the exit code. The caller
    (``kvcached worker``) has set up the process's logging."""
    logger.info("worker rank %d starting (pid %d, engine pid %s, restart %d)", rank,
                os.getpid(), engine_pid, restarts)
    try:
        _prepare(cfg)
        return Worker(cfg, run_dir, rank, engine_pid, restarts).run()
    except Exception:
        logger.exception("worker rank %d crashed", rank)
        return 1


def _prepare(cfg: CacheConfig) -> None:
    """Import torch and load the native pieces before the hello. Once the
    coordinator has accepted it, a worker must heartbeat within
    worker_timeout_s, and it sends nothing while it attaches; the package is
    imported lazily (the control client must not pay for torch), so without
    this the import would fall into that window."""
    import kvcached.memory.hostpool  # noqa: F401 (torch)
    import kvcached.memory.kvshare  # noqa: F401
    if cfg.device == "cpu" and cfg.num_cpu_blocks:
        import kvcached.copy.cpu  # noqa: F401 (loads the native copy engine)
