#!/usr/bin/env python
"""Benchmark the transfer path: CPU swap bandwidth and end-to-end task latency.

In one run:

(a) CPU swap bandwidth, all planes of the default layout, for 1, 16 and 256
    blocks next to a plain copy of the same bytes (``scripts/bench_copy_cpu.py``'s
    ``run()``, the real ``CpuCopyEngine``). Target: at 256 blocks the engine
    with the default ``copy_threads`` >= 0.9x a copy on as many threads.
(b) Task latency: a 1-block ``swap_out`` submitted through a real
    ``CacheManager(transfer_mode="workers")`` (``transfer.submit(Task(...))`` then
    ``handle.wait()``) for TP = 1, 2 and 4 worker processes, p50/p99; next to
    the raw ZeroMQ barrier round trip between the same kind of processes: a
    ROUTER sends the same bytes to N echo processes (DEALER, identity
    ``rank-<r>``) and waits for all N replies. Both run at once and are timed
    in alternating chunks of 100 calls, so that the ratio compares the two
    under the same load of this shared machine. Target: p50 at TP=4 <= 1.5x the
    raw barrier round trip. The layout is tiny (64 bytes per block) so the copy
    itself is negligible and the comparison is about the task machinery.
    Beside them, the hand-off floor: more echo processes, driven the way the
    coordinator is driven and with none of its code (a thread that owns their
    ROUTER, woken through a pipe, waking the caller through a lock). And the
    CPU each path spends per round trip (every thread's run time from
    /proc/<pid>/task/*/schedstat): this process, and the workers or echo
    processes. On a machine with fewer cores than threads in play, latency
    follows CPU, and CPU is far less noisy.

    python scripts/bench_transfer.py [--quick]

Progress goes to stderr; the last line on stdout is JSON ``{"bench": "transfer", ...}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from _bench_util import emit, load_script, log, percentile, short_tmp_dir

TP_SIZES = (1, 2, 4)
TARGET_COPY_RATIO = 0.9
TARGET_LATENCY_RATIO = 1.5
TINY = dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32",
            num_gpu_blocks=64, num_cpu_blocks=64, transfer_mode="workers",
            create_cache=True, storage_backend=None, worker_start_timeout_s=120.0,
            metrics_port=0)


# ---------------------------------------------------------------- (a) copy
def bench_copy(quick: bool) -> dict:
    """The copy benchmark's own result, trimmed to what this report needs."""
    log("CPU swap bandwidth (bench_copy_cpu.run)")
    res = load_script("bench_copy_cpu").run(quick=quick)
    rows = {}
    for n, row in res["results"].items():
        rows[n] = {name: v for name, v in row.items()
                   if name.startswith(("native", "torch", "memcpy"))}
    return {"planes": res["planes"], "plane_bytes": res["plane_bytes"],
            "copy_threads": res["copy_threads"], "blocks": rows,
            "ratio_vs_memcpy_256": res["ratio_vs_memcpy_256"],
            "ratio_native_memcpy_256": res["ratio_native_memcpy_256"],
            "target_ratio": TARGET_COPY_RATIO, "meets_target": res["meets_target"]}


# ------------------------------------------------------------ (b) latency
def task_payload() -> bytes:
    """The bytes of a 1-block swap_out task on the wire: the raw test sends the same."""
    from kvcached.transfer import protocol as P
    return P.Task(1, "swap_out", [0], [0]).encode()


def _time_tasks(transfer, kind: str, n: int, first: int) -> list[float]:
    """Microseconds of submit -> wait for ``n`` one-block ``kind`` tasks."""
    from kvcached.tasks import Task
    samples = []
    clock = time.perf_counter
    for i in range(first, first + n):
        ids = [i % 64] if kind == "swap_out" else []
        t0 = clock()
        h = transfer.submit(Task(kind, ids, list(ids)))
        if not h.wait(30):
            raise TimeoutError(f"{kind} task {h.task.task_id} did not finish within 30s")
        dt = clock() - t0
        if not h.result.ok:
            raise RuntimeError(f"{kind} task failed: {h.result.error}")
        samples.append(dt * 1e6)
        transfer.completed.clear()  # nobody reaps: keep the queue from growing
    return samples


class EchoFleet:
    """The raw baseline: a ROUTER and ``n`` echo processes (DEALER ``rank-<r>``)."""

    def __init__(self, n: int, payload: bytes, run_dir: Path):
        self.n, self.payload = n, payload
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a drop
        endpoint = f"ipc://{run_dir / 'echo.sock'}"
        self.router.bind(endpoint)
        self.idents = [f"rank-{r}".encode() for r in range(n)]
        self.procs = [subprocess.Popen([sys.executable, __file__, "--echo", endpoint,
                                        "--rank", str(r)]) for r in range(n)]
        _wait_connected(self.router, self.idents)

    def round_trips(self, n: int) -> list[float]:
        """Microseconds of one frame to every echo process and all replies back."""
        router, idents, payload = self.router, self.idents, self.payload
        clock = time.perf_counter
        samples = []
        for _ in range(n):
            t0 = clock()
            for ident in idents:
                router.send_multipart([ident, payload])
            for _ in idents:
                router.recv_multipart()
            samples.append((clock() - t0) * 1e6)
        return samples

    def close(self) -> None:
        for ident in self.idents:
            try:
                self.router.send_multipart([ident, b"stop"])
            except zmq.ZMQError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.router.close()
        self.ctx.term()


def _run_ns(pids: list[int]) -> int:
    """Nanoseconds on a CPU so far of every thread of ``pids`` (0 where the kernel
    keeps no schedstat)."""
    total = 0
    for pid in pids:
        tasks = Path(f"/proc/{pid}/task")
        for tid in tasks.iterdir() if tasks.is_dir() else ():
            try:
                total += int((tid / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):  # a thread that just ended
                pass
    return total


class CpuMeter:
    """CPU per call of one kind of round trip: this process's threads and the peers'."""

    def __init__(self, peers: list[int]):
        self.peers, self.own_ns, self.peers_ns, self.calls = peers, 0, 0, 0

    def measure(self, run: Callable[..., list[float]], *args) -> list[float]:
        """``run(*args)``'s samples, its CPU counted."""
        me = [os.getpid()]
        own, peers = _run_ns(me), _run_ns(self.peers)
        samples = run(*args)
        self.own_ns += _run_ns(me) - own
        self.peers_ns += _run_ns(self.peers) - peers
        self.calls += len(samples)
        return samples

    def per_call_us(self) -> dict[str, float]:
        n = max(self.calls, 1)
        return {"this_process": self.own_ns / n / 1e3, "peers": self.peers_ns / n / 1e3}


class HandoffFleet:
    """Echo processes behind an IO thread that owns their ROUTER, as the
    coordinator owns its: ``round_trips`` queues each frame, wakes the thread
    (a pipe) and sleeps on a lock the thread releases once every echo answered."""

    def __init__(self, fleet: EchoFleet):
        self.fleet = fleet
        self.procs = fleet.procs
        self._outbox: collections.deque[threading.Lock] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._io_loop, daemon=True)
        self._thread.start()

    def _io_loop(self) -> None:
        router, idents, payload = self.fleet.router, self.fleet.idents, self.fleet.payload
        fd = router.getsockopt(zmq.FD)
        # Plain ints, as the coordinator uses: pyzmq's IntFlag members cost an
        # enum operation per use.
        events, pollin, sndmore = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE)
        waiting, left = None, 0
        while not self._stop:
            if self._wake_r in select.select([self._wake_r, fd], [], [], 0.1)[0]:
                os.read(self._wake_r, 4096)
            while self._outbox:
                waiting, left = self._outbox.popleft(), len(idents)
                for ident in idents:
                    router.send(ident, sndmore)
                    router.send(payload)
            while router.getsockopt(events) & pollin:
                router.recv()  # identity
                router.recv()  # the echoed frame
                left -= 1
                if left == 0:
                    waiting.release()

    def round_trips(self, n: int) -> list[float]:
        """Microseconds of one frame handed to the IO thread until all replies are in."""
        clock = time.perf_counter
        samples = []
        for _ in range(n):
            done = threading.Lock()
            done.acquire()
            t0 = clock()
            self._outbox.append(done)
            os.write(self._wake_w, b"x")
            if not done.acquire(True, 30):
                raise TimeoutError("the hand-off fleet's echo processes did not answer in 30s")
            samples.append((clock() - t0) * 1e6)
        return samples

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.fleet.close()  # the IO thread is gone: this thread may use the socket now


def latency_at(tp: int, iters: int, warmup: int, payload: bytes, chunk: int = 100) -> dict:
    """Task, raw and hand-off round trips at ``tp`` ranks, measured in alternating
    chunks of ``chunk`` calls so that all see the same state of the machine."""
    from kvcached import CacheConfig, CacheManager
    with short_tmp_dir("kvbt-") as d, contextlib.ExitStack() as stack:
        fleet = EchoFleet(tp, payload, d)
        stack.callback(fleet.close)
        (d / "handoff").mkdir()
        handoff = HandoffFleet(EchoFleet(tp, payload, d / "handoff"))
        stack.callback(handoff.close)
        cfg = CacheConfig.load(**TINY, tp_size=tp, run_dir=str(d / "run"))
        t0 = time.perf_counter()
        mgr = stack.enter_context(CacheManager(cfg))
        log(f"TP={tp}: {tp} workers ready in {time.perf_counter() - t0:.1f}s")
        fleet.round_trips(warmup)
        handoff.round_trips(warmup)
        for kind in ("swap_out", "noop"):
            _time_tasks(mgr.transfer, kind, warmup, 0)
        samples: dict[str, list[float]] = {"raw": [], "handoff": [], "swap_out": [], "noop": []}
        cpu = {"raw": CpuMeter([p.pid for p in fleet.procs]),
               "handoff": CpuMeter([p.pid for p in handoff.procs]),
               "swap_out": CpuMeter([w.pid for w in mgr.transfer.workers])}
        for first in range(0, iters, chunk):
            n = min(chunk, iters - first)
            samples["raw"] += cpu["raw"].measure(fleet.round_trips, n)
            samples["handoff"] += cpu["handoff"].measure(handoff.round_trips, n)
            samples["swap_out"] += cpu["swap_out"].measure(_time_tasks, mgr.transfer,
                                                           "swap_out", n, first)
            samples["noop"] += _time_tasks(mgr.transfer, "noop", n, first)
    p50 = {k: percentile(v, 0.5) for k, v in samples.items()}
    p99 = {k: percentile(v, 0.99) for k, v in samples.items()}
    return {"task": {"p50_us": p50["swap_out"], "p99_us": p99["swap_out"],
                     "noop_p50_us": p50["noop"], "noop_p99_us": p99["noop"],
                     "cpu_us": cpu["swap_out"].per_call_us()},
            **{k: {"p50_us": p50[k], "p99_us": p99[k], "cpu_us": cpu[k].per_call_us()}
               for k in ("raw", "handoff")}}


def _wait_connected(router: zmq.Socket, idents: list[bytes], timeout_s: float = 60.0) -> None:
    """Ping each echo process until it answers (their startup is not part of the timing)."""
    deadline = time.monotonic() + timeout_s
    waiting = set(idents)
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"echo processes {sorted(waiting)} did not connect")
        for ident in list(waiting):
            try:
                router.send_multipart([ident, b"ping"])
            except zmq.ZMQError:  # EHOSTUNREACH: not connected yet
                continue
        while router.poll(100):
            waiting.discard(router.recv_multipart()[0])
    while router.poll(200):  # late duplicate pongs
        router.recv_multipart()


def echo_main(endpoint: str, rank: int) -> None:
    """Child process of the raw test: echo every frame until told to stop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    while True:
        frame = sock.recv()
        if frame == b"stop":
            break
        sock.send(frame)
    sock.close()
    ctx.term()


def bench_latency(quick: bool) -> dict:
    iters, warmup = (300, 30) if quick else (2000, 100)
    payload = task_payload()
    tasks, raw, handoff = {}, {}, {}
    for tp in TP_SIZES:
        res = latency_at(tp, iters, warmup, payload)
        tasks[str(tp)], raw[str(tp)], handoff[str(tp)] = res["task"], res["raw"], res["handoff"]
        log(f"TP={tp}: p50 task {res['task']['p50_us']:.0f} us, raw barrier "
            f"{res['raw']['p50_us']:.0f} us, hand-off floor {res['handoff']['p50_us']:.0f} us")
        for name, side, peers in (("task", "task", "workers"), ("raw", "raw", "echoes"),
                                  ("hand-off", "handoff", "echoes")):
            c = res[side]["cpu_us"]
            log(f"  CPU per round trip, {name}: {c['this_process']:.0f} us here + "
                f"{c['peers']:.0f} us in {peers}")
    top = str(TP_SIZES[-1])
    ratio = tasks[top]["p50_us"] / raw[top]["p50_us"]
    return {"iters": iters, "payload_bytes": len(payload), "task_swap_out_1_block": tasks,
            "raw_zmq_barrier": raw, "handoff_floor": handoff,
            f"ratio_p50_tp{top}_vs_raw": ratio,
            f"ratio_p50_tp{top}_handoff_floor_vs_raw": handoff[top]["p50_us"] / raw[top]["p50_us"],
            "target_ratio": TARGET_LATENCY_RATIO, "meets_target": ratio <= TARGET_LATENCY_RATIO}


# ------------------------------------------------------------------- main
def main() -> None:
    """Command line: (a) then (b), then the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    ap.add_argument("--echo", metavar="ENDPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo:
        echo_main(args.echo, args.rank)
        return
    t0 = time.perf_counter()
    copy = bench_copy(args.quick)
    latency = bench_latency(args.quick)
    emit({"bench": "transfer", "quick": args.quick, "cpu_copy": copy, "latency": latency,
          "total_s": time.perf_counter() - t0})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
