"""Hostile input to a transfer worker and to the coordinator, over real processes and sockets.

The worker test plays coordinator itself: it creates the run directory, the KV
planes and the host pool as the manager does, binds the ROUTER, handshakes
with a real ``kvcached worker`` process and then feeds it bad frames. Every bad
frame must be answered (an ErrorReply, or a failed Done when its task id could
be read), the worker must keep serving, and not one byte of shared memory may
change. The coordinator test does the same against a running CacheManager from
sockets that are not its workers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import tiny_config, toks
from helpers import binary_done_frame, binary_task_frame

from kvcached import CacheManager
from kvcached.memory import shm
from kvcached.memory.hostpool import HostPool
from kvcached.memory.kvshare import allocate_kv_cache, release_kv_cache
from kvcached.transfer import protocol as P
from kvcached.transfer.endpoints import CONFIG_FILE, coordinator_endpoint

NUM_GPU, NUM_CPU = 8, 4
NAN, INF = float("nan"), float("inf")
SWAP_OUT, SWAP_IN, NOOP = 1, 2, 3  # binary kind codes
# The worker must not give up on us while we think: the engine timeout is long.
WORKER_CFG = dict(transfer_mode="workers", num_gpu_blocks=NUM_GPU, num_cpu_blocks=NUM_CPU,
                  num_layers=2, heartbeat_interval_s=0.2, worker_timeout_s=3.0,
                  engine_timeout_s=60.0, task_timeout_s=10.0)
REPLY_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0  # a cold worker imports torch


@pytest.fixture
def short_dir():
    """ipc:// paths must stay under ~100 chars: pytest's tmp_path can be longer."""
    d = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def worker_cmd(run_dir: Path, engine_pid: int) -> list[str]:
    return [sys.executable, "-m", "kvcached", "worker", "--rank", "0", "--run-dir",
            str(run_dir), "--engine-pid", str(engine_pid)]


def recv_reply(sock: zmq.Socket, timeout: float = REPLY_TIMEOUT_S, router: bool = True):
    """The next non-heartbeat message (decoded), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000)):
            break
        frames = sock.recv_multipart()
        msg = P.decode(frames[-1])
        if router:
            assert frames[0] == b"rank-0", frames[0]
        if not isinstance(msg, P.Heartbeat):
            return msg
    return None


def wire(kind: str, **fields) -> bytes:
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": kind, **fields}, use_bin_type=True)


def task(task_id, task_kind, src=(), dst=(), args=None, **extra) -> bytes:
    return wire("task", task_id=task_id, task_kind=task_kind, src=list(src), dst=list(dst),
                args=args or {}, **extra)


def deep(n: int):
    value: object = 1
    for _ in range(n):
        value = [value]
    return value


# (name, frame, task id of the failed Done it may get instead of an ErrorReply)
BAD_FRAMES = [
    ("random bytes", np.random.default_rng(0).bytes(256), None),
    ("empty frame", b"", None),
    ("msgpack array", msgpack.packb([1, 2, 3]), None),
    ("msgpack string", msgpack.packb("task"), None),
    ("trailing bytes", wire("shutdown", reason="x") + b"\x00", None),
    ("no version", msgpack.packb({"kind": "shutdown", "reason": ""}), None),
    ("wrong version", msgpack.packb({"v": 99, "kind": "shutdown", "reason": ""}), None),
    ("no kind", msgpack.packb({"v": P.PROTOCOL_VERSION}), None),
    ("unknown kind", wire("teleport", task_id=1), None),
    ("kind not a str", msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": 7}), None),
    ("int map keys", msgpack.packb({1: 1, 2: 2}), None),
    ("oversize frame", b"\x91" + b"\x00" * (9 << 20), None),
    ("too many ids", binary_task_frame(30, SWAP_OUT, range(70000), range(70000)), 30),
    ("task_id not an int", task("thirty-one", "lookup", args={"keys": []}), None),
    ("unknown task kind", task(32, "teleport"), 32),
    ("src not a list", wire("task", task_id=33, task_kind="store", src="abc", dst=[],
                            args={"keys": ["k"]}), 33),
    ("bool block id", task(34, "store", [True], args={"keys": ["k"]}), 34),
    ("float block id", task(35, "store", [1.0], args={"keys": ["k"]}), 35),
    ("negative block id", binary_task_frame(36, SWAP_OUT, [-1], [0]), 36),
    ("id beyond int64", task(37, "load", [], [2**64 - 1], args={"keys": ["k"]}), 37),
    ("missing field", wire("task", task_id=38, task_kind="lookup", src=[], dst=[]), 38),
    ("unknown field", task(39, "lookup", args={"keys": []}, extra_field=1), 39),
    ("args not a map", wire("task", task_id=40, task_kind="lookup", src=[], dst=[], args=[1]),
     40),
    ("args nested too deep", task(41, "lookup", args={"keys": [], "x": deep(6)}), 41),
    ("device id == num_gpu_blocks", binary_task_frame(42, SWAP_OUT, [NUM_GPU], [0]), 42),
    ("host id == num_cpu_blocks", binary_task_frame(43, SWAP_OUT, [0], [NUM_CPU]), 43),
    ("host src out of range", binary_task_frame(44, SWAP_IN, [NUM_CPU + 5], [0]), 44),
    ("device dst out of range", binary_task_frame(45, SWAP_IN, [0], [2**31 - 1]), 45),
    ("length mismatch", binary_task_frame(46, SWAP_OUT, [0, 1], [0]), 46),
    ("duplicate host destinations", binary_task_frame(47, SWAP_OUT, [0, 1], [2, 2]), 47),
    ("duplicate device destinations", binary_task_frame(48, SWAP_IN, [0, 1], [3, 3]), 48),
    ("unknown control op", task(49, "control", args={"op": "self_destruct"}), 49),
    ("control op not a str", task(50, "control", args={"op": ["pause"]}), 50),
    ("store without keys", task(51, "store", [0]), 51),
    ("heartbeat wrong types", wire("heartbeat", sender=1, seq="x", time=0.0, info={}), None),
    # Non-finite and extreme numbers, in every numeric field a worker receives.
    ("negative task id", task(-1, "lookup", args={"keys": []}), None),
    ("task id beyond int64", task(2**64 - 1, "lookup", args={"keys": []}), None),
    ("NaN control timeout", task(52, "control", args={"op": "pause", "timeout_s": NAN}), 52),
    ("inf control timeout", task(53, "control", args={"op": "pause", "timeout_s": INF}), 53),
    ("inf load deadline", task(54, "load", [], [0], args={"keys": ["k"], "deadline_s": INF}),
     54),
    ("negative load deadline", task(55, "load", [], [0],
                                    args={"keys": ["k"], "deadline_s": -1.0}), 55),
    ("huge load deadline", task(56, "load", [], [0],
                                args={"keys": ["k"], "deadline_s": 1e308}), 56),
    ("NaN in args", task(57, "lookup", args={"keys": [], "x": NAN}), 57),
    ("-inf deep in args", task(58, "store", [0], args={"keys": ["k"], "x": [1, {"y": -INF}]}),
     58),
    ("heartbeat NaN time", wire("heartbeat", sender="c", seq=1, time=NAN, info={}), None),
    ("heartbeat inf time", wire("heartbeat", sender="c", seq=1, time=INF, info={}), None),
    ("heartbeat negative seq", wire("heartbeat", sender="c", seq=-1, time=1.0, info={}), None),
    ("heartbeat NaN in info", wire("heartbeat", sender="c", seq=1, time=1.0,
                                   info={"q": NAN}), None),
    ("done with NaN elapsed", wire("done", task_id=59, rank=0, ok=True, error="",
                                   blocks_done=0, elapsed_s=NAN, result={}), 59),
    # Binary frames: every one a swap or noop task, one thing wrong with it.
    ("binary wrong version", binary_task_frame(61, SWAP_OUT, [0], [0],
                                               version=P.PROTOCOL_VERSION + 1), None),
    ("binary unknown message type", binary_task_frame(62, SWAP_OUT, [0], [0], mtype=7), None),
    ("binary preamble only", b"\xc1", None),
    ("binary header cut", binary_task_frame(63, SWAP_OUT, [0], [0])[:20], None),
    ("binary ids cut", binary_task_frame(64, SWAP_OUT, [0], [0])[:-2], 64),
    ("binary trailing bytes", binary_task_frame(65, NOOP, [], []) + b"\x00" * 3, 65),
    ("binary unknown kind", binary_task_frame(66, 77, [0], [0]), 66),
    ("binary negative task id", binary_task_frame(-66, NOOP, [], []), None),
    ("binary huge declared count", binary_task_frame(67, SWAP_IN, [0], [0],
                                                     counts=(0, 0xFFFFFFFF, 1)), 67),
    ("binary huge stamp count", binary_task_frame(68, SWAP_IN, [0], [0],
                                                  counts=(0xFFFFFF, 1, 1)), 68),
    ("binary negative stamp", binary_task_frame(69, SWAP_OUT, [0], [0], [(-1, 5)]), 69),
    ("msgpack swap task", task(70, "swap_out", [0], [0]), 70),
    ("msgpack noop task", task(71, "noop"), 71),
]


def test_bad_frame_table_is_what_it_says():
    """The table's frames really are malformed (a typo would test nothing)."""
    limits = P.Limits(num_device_blocks=NUM_GPU, num_host_blocks=NUM_CPU)
    for name, frame, task_id in BAD_FRAMES:
        if name.startswith("duplicate"):
            P.decode(frame, limits)  # valid on the wire: the copy engine refuses it
            continue
        with pytest.raises(P.ProtocolError) as info:
            P.decode(frame, limits)
        assert info.value.task_id == task_id, (name, info.value)


class FakeCoordinator:
    """The engine side of one worker: shared memory, the ROUTER, the handshake."""

    def __init__(self, run_dir: Path, **overrides):
        self.run_dir = run_dir
        self.cfg = tiny_config(**{**WORKER_CFG, **overrides}, run_dir=str(run_dir))
        (run_dir / CONFIG_FILE).write_text(json.dumps(self.cfg.to_dict()))
        layout = self.cfg.layout
        self.planes = allocate_kv_cache(layout, NUM_GPU, 0, run_dir)
        self.pool = HostPool.create(run_dir, 0, NUM_CPU, layout.block_bytes)
        gen = torch.Generator().manual_seed(1)
        for p in self.planes:  # recognisable bytes everywhere, so any write shows
            p.view(torch.uint8).copy_(torch.randint(0, 256, p.view(torch.uint8).shape,
                                                    generator=gen, dtype=torch.uint8))
        self.pool.tensor.copy_(torch.randint(0, 256, self.pool.tensor.shape, generator=gen,
                                             dtype=torch.uint8))
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(coordinator_endpoint(self.cfg, run_dir))
        self.proc: subprocess.Popen | None = None

    def start_worker(self) -> None:
        self.proc = subprocess.Popen(worker_cmd(self.run_dir, os.getpid()),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        hello = recv_reply(self.router, START_TIMEOUT_S)
        assert isinstance(hello, P.Hello), f"expected hello, got {hello!r}"
        assert hello.layout_digest == self.cfg.layout.digest and hello.pid == self.proc.pid
        self.send(P.Ready().encode())

    def send(self, frame: bytes) -> None:
        self.router.send_multipart([b"rank-0", frame])

    def request(self, frame: bytes):
        self.send(frame)
        return recv_reply(self.router)

    def segments(self) -> dict[str, bytes]:
        """Every byte of this run's shared memory files (planes with padding, host pool)."""
        pattern = f"{shm.PREFIX}{os.getpid()}-{shm.run_id(self.run_dir)}-*"
        return {p.name: p.read_bytes() for p in sorted(shm.shm_dir().glob(pattern))}

    def close(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None and not self.router.closed:
                self.send(P.Shutdown("test done").encode())
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            if self.proc is not None and self.proc.stderr:
                self.proc.stderr.close()
            self.router.close()
            self.ctx.term()
            self.pool.remove()
            self.planes = None
            release_kv_cache(self.run_dir, 0)


@pytest.fixture
def coordinator(short_dir):
    fake = FakeCoordinator(short_dir)
    try:
        yield fake
    finally:
        fake.close()
    assert not list(shm.shm_dir().glob(f"{shm.PREFIX}{os.getpid()}-{shm.run_id(short_dir)}-*"))


def test_worker_answers_every_bad_frame_and_keeps_serving(coordinator):
    c = coordinator
    c.start_worker()
    done = c.request(P.Task(1, "noop").encode())
    assert isinstance(done, P.Done) and done.ok and done.task_id == 1
    before = c.segments()
    assert len(before) == 2  # the KV planes' segment and the host pool

    for name, frame, task_id in BAD_FRAMES:
        reply = c.request(frame)
        if task_id is not None:  # a task whose id could be read: its failed Done
            assert isinstance(reply, P.Done) and reply.task_id == task_id, (name, reply)
            assert not reply.ok and reply.error, (name, reply)
        else:
            assert isinstance(reply, P.ErrorReply), (name, reply)
            assert reply.error and reply.detail, (name, reply)
        assert c.proc.poll() is None, f"worker died on {name!r}"
    # Failed tasks whose id could be read are answered as such: nobody waits on them.
    dup = c.request(binary_task_frame(60, SWAP_OUT, [0, 1], [1, 1]))
    assert isinstance(dup, P.Done) and not dup.ok and "host" in dup.error

    assert c.segments() == before, "a rejected frame changed shared memory"
    done = c.request(P.Task(61, "noop").encode())
    assert isinstance(done, P.Done) and done.ok
    # A valid swap still moves exactly the bytes it names.
    done = c.request(P.Task(62, "swap_out", [3], [1]).encode())
    assert isinstance(done, P.Done) and done.ok, done
    offsets, host = c.cfg.layout.host_offsets, c.pool.tensor
    for p, off in zip(c.planes, offsets):
        nb = p[3].numel() * p.element_size()
        assert torch.equal(host[1, off:off + nb], p[3].contiguous().view(torch.uint8).flatten())
    after = c.segments()
    changed = [k for k in before if before[k] != after[k]]
    assert changed == [c.pool.name]


def test_worker_without_engine_exits_by_itself(short_dir):
    cfg = tiny_config(**WORKER_CFG, run_dir=str(short_dir))
    (short_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    t0 = time.monotonic()
    proc = subprocess.Popen(worker_cmd(short_dir, gone.pid), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proc.wait(timeout=START_TIMEOUT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    # Its first loop iteration notices the dead engine: startup cost only.
    assert time.monotonic() - t0 < 30
    log = (short_dir / "logs" / "worker-rank0.log").read_text()
    assert f"engine pid {gone.pid} is gone" in log


def test_worker_whose_coordinator_vanishes_exits_within_engine_timeout(short_dir):
    """The engine process lives on but its socket is gone (a hung or half-dead
    engine). A DEALER with IMMEDIATE blocks forever sending to no peer, so the
    worker's next heartbeat or Done must not wait on it: it exits once nothing
    could be delivered for engine_timeout_s."""
    c = FakeCoordinator(short_dir, engine_timeout_s=1.0, heartbeat_interval_s=0.05)
    try:
        c.start_worker()
        assert isinstance(c.request(P.Task(1, "noop").encode()), P.Done)
        c.send(P.Task(2, "swap_out", [0], [0]).encode())
        c.router.close()  # the Done of task 2 and every heartbeat now have no peer
        t0 = time.monotonic()
        assert c.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 1.0 + 3.0  # engine_timeout_s, and a margin
    finally:
        c.close()
    log = (short_dir / "logs" / "worker-rank0.log").read_text()
    assert "the engine" in log.splitlines()[-1], log.splitlines()[-1]


# ------------------------------------------------------------- coordinator
COORD_GARBAGE = [
    np.random.default_rng(1).bytes(100),
    b"",
    msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": "teleport"}),
    P.Hello(rank=9, pid=1, protocol=P.PROTOCOL_VERSION, layout_digest="x",
            num_device_blocks=1, num_host_blocks=1).encode(),
    P.Done(1, 9, ok=True).encode(),
    binary_done_frame(1, elapsed_s=NAN),
    P.Done(1, 0, True, "", 1, 0.1, {"bytes": 64, "finished": 1.0}).encode(),
]


def test_coordinator_rejects_strangers_and_keeps_serving(short_dir):
    cfg = tiny_config(transfer_mode="workers", tp_size=1, num_gpu_blocks=8, num_cpu_blocks=8,
                      heartbeat_interval_s=0.2, worker_timeout_s=3.0, engine_timeout_s=10.0,
                      worker_start_timeout_s=START_TIMEOUT_S, run_dir=str(short_dir / "run"))
    ctx = zmq.Context()
    socks = []
    with CacheManager(cfg) as mgr:
        worker_pid = mgr.stats().workers[0]["pid"]
        endpoint = coordinator_endpoint(cfg, mgr.run_dir)
        try:
            # rank-9 is out of range; b"" gets a ROUTER-made identity. Never rank-0:
            # that would take over the real worker's connection.
            for ident in (b"rank-9", b"", b"rank-x", b"rank--1", b"worker"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if ident:
                    sock.setsockopt(zmq.IDENTITY, ident)
                sock.connect(endpoint)
                socks.append(sock)
                for frame in COORD_GARBAGE:
                    sock.send(frame)
                    reply = recv_reply(sock, router=False)
                    assert isinstance(reply, P.ErrorReply), (ident, frame[:20], reply)
                sock.send_multipart([b"two", b"frames"])
                assert isinstance(recv_reply(sock, router=False), P.ErrorReply)
        finally:
            for sock in socks:
                sock.close()
            ctx.term()

        # The real worker is untouched and the manager serves, swaps included.
        serve(mgr, "a", toks(1, 2, 3, tail=1))
        serve(mgr, "b", toks(4, 5, 6, 7, 8, 9, tail=1))  # pushes "1".."3" to the CPU
        a = serve(mgr, "c", toks(1, 2, 3, tail=1))
        assert a.hit.cpu_tokens > 0 and a.num_cached_tokens == 12
        st = mgr.stats()
        assert st.transfers["swap_out"]["done"] >= 1 and st.transfers["swap_in"]["done"] == 1
        assert [(w["state"], w["pid"], w["restarts"]) for w in st.workers] == [
            ("ready", worker_pid, 0)]
        mgr.check_invariants()


def serve(mgr, rid, tokens):
    a = mgr.allocate(rid, tokens)
    a.wait(timeout=REPLY_TIMEOUT_S)
    mgr.commit(rid, tokens, len(tokens))
    mgr.free(rid)
    return a


# ----------------------------------------- bad numbers from the coordinator's own rank
def dealer_recv(sock: zmq.Socket, timeout: float = REPLY_TIMEOUT_S):
    """The next message that is not a heartbeat, on a worker's DEALER."""
    return recv_reply(sock, timeout, router=False)


def test_coordinator_refuses_bad_numbers_from_its_own_rank_and_keeps_serving(short_dir):
    """A connected rank (not a stranger) sends Done, Heartbeat and Hello frames
    with NaN, infinite and out-of-range numbers: each is answered with an
    error, the task stays open, the rank stays ready, and a valid Done then
    completes the task."""
    import threading

    from kvcached.tasks import Task
    cfg = tiny_config(transfer_mode="workers", tp_size=1, num_gpu_blocks=8, num_cpu_blocks=8,
                      spawn_workers=False, heartbeat_interval_s=0.2, worker_timeout_s=10.0,
                      engine_timeout_s=20.0, worker_start_timeout_s=30.0,
                      run_dir=str(short_dir / "run"))
    # The pid the fake rank reports: a lost rank is killed by pid, never this test.
    stand_in = subprocess.Popen(["sleep", "120"])
    mgr = CacheManager(cfg)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"rank-0")
    starter = threading.Thread(target=mgr.start)
    try:
        starter.start()
        sock.connect(coordinator_endpoint(cfg, short_dir / "run"))
        sock.send(P.Hello(rank=0, pid=stand_in.pid, protocol=P.PROTOCOL_VERSION,
                          layout_digest=cfg.layout.digest, num_device_blocks=8,
                          num_host_blocks=8).encode())
        ready = dealer_recv(sock)
        assert isinstance(ready, P.Ready) and ready.ok, ready
        # as a worker does once it attached: start() returns on it
        sock.send(P.Heartbeat("rank-0", 1, time.time(), {}).encode())
        starter.join(30)
        assert not starter.is_alive(), "start() did not return after the rank's heartbeat"
        h = mgr.transfer.submit(Task("noop", [], []))
        sent = dealer_recv(sock)
        assert isinstance(sent, P.Task) and sent.task_id == h.task.task_id
        tid = sent.task_id
        done = dict(task_id=tid, rank=0, ok=True, error="", blocks_done=0, elapsed_s=0.1,
                    result={})
        hello = dict(rank=0, pid=stand_in.pid, protocol=P.PROTOCOL_VERSION,
                     layout_digest=cfg.layout.digest,
                     num_device_blocks=8, num_host_blocks=8, restarts=0)
        bad = [wire("done", **{**done, "elapsed_s": v}) for v in (NAN, INF, -1.0, 1e308)]
        bad += [wire("done", **{**done, "rank": v}) for v in (-1, 70000)]
        bad += [wire("done", **{**done, "blocks_done": -5}),
                wire("done", **{**done, "result": {"bytes": NAN}}),
                wire("done", **{**done, "task_id": -tid})]
        bad += [wire("heartbeat", sender="rank-0", seq=1, time=v, info={})
                for v in (NAN, -INF, 1e300)]
        bad += [wire("heartbeat", sender="rank-0", seq=1, time=1.0, info={"x": [INF]})]
        bad += [wire("hello", **{**hello, k: v})
                for k, v in (("rank", -1), ("pid", 0), ("pid", 2**40), ("restarts", -1))]
        # Binary dones of the task: each number out of range, or the frame broken.
        bad += [binary_done_frame(tid, **{k: v}) for k, v in (
            ("elapsed_s", NAN), ("elapsed_s", INF), ("elapsed_s", -1.0), ("finished", NAN),
            ("finished", -INF), ("rank", 70000), ("blocks_done", -1), ("nbytes", -1),
            ("pad", 1), ("version", P.PROTOCOL_VERSION + 1))]
        bad += [binary_done_frame(tid)[:-1], binary_done_frame(tid) + b"\x00",
                wire("done", **{**done, "result": {"bytes": 0, "finished": 1.0}})]
        for frame in bad:
            sock.send(frame)
            reply = dealer_recv(sock)
            assert isinstance(reply, P.ErrorReply), (frame, reply)
            assert not h.done() and mgr.stats().workers[0]["state"] == "ready"
        sock.send(P.Done(tid, 0, True, "", 0, 0.1, {"bytes": 0, "finished": 1.0}).encode())
        assert h.wait(10) and h.result.ok
        assert h.result.per_rank[0]["finished"] == 1.0  # the binary done's numbers arrived
        assert mgr.stats().workers[0]["state"] == "ready"
    finally:
        sock.close()
        starter.join(30)
        mgr.close()
        stand_in.kill()
        stand_in.wait()
        ctx.term()
