"""Operations: the control socket, KV events, metrics and `kvcached launch`.

The first part drives ControlServer, KVEventPublisher and MetricsServer over
real sockets with fake managers. The second part is a real deployment: a
`kvcached launch` process runs the workers (tp=2), this test process is the
engine (CacheManager with spawn_workers = false), and the tests drive it
through `kvcached ctl` / `kvcached status`, scrape its metrics and subscribe
to its KV events. Every wait polls with a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner
from conftest import toks
from helpers import metric, pid_alive, scrape, wait_for

from kvcached.ops.cli import main
from kvcached.ops.ctlserver import ControlServer, request
from kvcached.ops.events import KVEventPublisher, check_endpoint, decode_event
from kvcached.transfer import protocol as P
from kvcached.transfer.endpoints import control_endpoint


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return sorted(out)


def cli(*args) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


class Recorder:
    """A fake manager for the control server."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.calls = []

    def pause(self):
        self.calls.append("pause")
        return {"changed": True, "when": time.time(), "deep": {"a": {"b": {"c": {"d": [1]}}}}}

    def status(self):
        return {"paused": False}


# ------------------------------------------------------------ control socket
@pytest.fixture
def ctl_server(tmp_path):
    mgr = Recorder(tmp_path)
    server = ControlServer(mgr).start()
    yield mgr, server
    server.close()


def raw_exchange(run_dir, frames: list[bytes], socket_type=zmq.DEALER) -> list[bytes]:
    sock = zmq.Context.instance().socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint(run_dir))
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply from the control server"
        return sock.recv_multipart()
    finally:
        sock.close()


def test_control_server_answers_bad_frames_and_keeps_serving(ctl_server):
    mgr, server = ctl_server
    d = mgr.run_dir
    hello = P.Hello(0, 1, P.PROTOCOL_VERSION, "x", 1, 1).encode()
    cases = [
        ([b"", b"\x9f\x01 not msgpack"], "not a valid msgpack frame"),
        ([b"", b"\xc1 not binary"], "binary frame has v=32"),
        ([b"", P.Task(1, "noop").encode()], "takes 'ctl' messages, got 'task'"),
        ([b"", msgpack.packb({"v": 99, "kind": "ctl"})], "protocol version mismatch"),
        ([b"", b"one", b"two"], "expected one msgpack frame"),
        ([b"", hello], "takes 'ctl' messages, got 'hello'"),
        ([P.CtlRequest("pause").encode()], None),  # a DEALER without a delimiter works
    ]
    for frames, error in cases:
        reply = P.decode(raw_exchange(d, frames)[-1])
        if error is None:
            assert isinstance(reply, P.CtlReply) and reply.ok
        else:
            assert isinstance(reply, P.ErrorReply) and error in reply.detail + reply.error
    reply = P.decode(raw_exchange(d, [P.CtlRequest("reboot").encode()], zmq.REQ)[-1])
    assert not reply.ok and "unknown op 'reboot'" in reply.error
    # Still serving, and deep results arrive (too-deep parts as JSON text).
    result = request(d, "pause", timeout_s=5)
    assert result["changed"] is True and result["deep"]["a"]["b"]["c"] == {"d": "[1]"}
    assert mgr.calls == ["pause", "pause"]


def test_control_socket_is_private_and_removed_on_close(tmp_path):
    server = ControlServer(Recorder(tmp_path)).start()
    path = tmp_path / "ctl.sock"
    assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
    server.close()
    assert not path.exists()


# ----------------------------------------------------------------- KV events
def subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket, timeout: float = 5.0):
    return decode_event(sub.recv_multipart()) if sub.poll(int(timeout * 1000)) else None


def join(sub: zmq.Socket, probe, timeout: float = 10.0):
    """PUB/SUB subscriptions arrive late: call ``probe`` until an event gets through."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe()
        ev = receive(sub, 0.1)
        if ev is not None:
            return ev
    raise AssertionError("the subscriber never received an event")


def test_kv_events_have_increasing_sequence_numbers(tmp_path):
    endpoint = f"ipc://{tmp_path}/ev.sock"
    with KVEventPublisher(endpoint, source="engine-a") as pub:
        sub = subscribe(endpoint)
        first = join(sub, lambda: pub.publish("cleared", "storage", []))
        while (ev := receive(sub, 0.05)) is not None:  # the other probes
            first = ev
        pub.publish("stored", "gpu", [b"\x01" * 16, b"\x02" * 16])
        pub.publish("removed", "cpu", [b"\x03" * 16])
        got = [receive(sub), receive(sub)]
        sub.close()
    assert [e.seq for e in got] == [first.seq + 1, first.seq + 2]
    assert (got[0].kind, got[0].tier, got[0].block_hashes) == \
        ("stored", "gpu", [b"\x01" * 16, b"\x02" * 16])
    assert (got[1].kind, got[1].tier, got[1].source) == ("removed", "cpu", "engine-a")
    assert got[0].topic == b"kvcached" and got[0].ts > 0


def test_kv_events_drop_when_far_behind_and_leave_a_gap(tmp_path):
    pub = KVEventPublisher(f"ipc://{tmp_path}/ev.sock", max_pending=2)  # not started
    for i in range(4):
        pub.publish("stored", "gpu", [bytes([i])])
    assert pub.dropped == 2
    pub.close()  # nothing may hang on a publisher that never started
    pub.publish("stored", "gpu", [b"x"])  # after close: ignored, no error


def test_kv_event_arguments_and_endpoints_are_checked(tmp_path):
    pub = KVEventPublisher(f"ipc://{tmp_path}/ev.sock")
    with pytest.raises(ValueError, match="kind must be one of"):
        pub.publish("evicted", "gpu", [])
    for ok in ("ipc:///tmp/x", "tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:1"):
        check_endpoint(ok)
    for bad in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557"):
        with pytest.raises(ValueError, match="other machines"):
            check_endpoint(bad)
    check_endpoint("tcp://0.0.0.0:5557", allow_remote=True)
    with pytest.raises(ValueError, match="use ipc://PATH"):
        check_endpoint("udp://127.0.0.1:1")
    with pytest.raises(ValueError, match="3 frames"):
        decode_event([b"t", b"x"])


# ------------------------------------------------------------------- metrics
def test_metrics_from_a_fake_manager():
    from test_cli import STATUS

    from kvcached.ops.metrics import MetricsServer

    class Fake:
        fail = False

        def status(self):
            if self.fail:
                raise RuntimeError("boom")
            return STATUS

    fake = Fake()
    with MetricsServer(fake) as server:
        text = scrape(server.url)
        assert metric(text, "kvcached_up") == 1.0
        assert metric(text, "kvcached_paused") == 1.0
        assert metric(text, "kvcached_hit_rate", tier="cpu") == 0.15
        assert metric(text, "kvcached_blocks_moved_total", direction="gpu_to_cpu") == 20
        assert metric(text, "kvcached_bytes_moved_total", direction="gpu_to_cpu") == 3 * 2**20
        assert metric(text, "kvcached_tasks_total", kind="swap_out", outcome="failed") == 1
        assert metric(text, "kvcached_task_latency_quantile_seconds", kind="swap_out",
                      quantile="0.99") == 0.0045
        assert metric(text, "kvcached_queue_depth", rank="0", lane="out") == 3
        assert metric(text, "kvcached_worker_up", rank="1") == 0
        assert metric(text, "kvcached_worker_restarts_total", rank="1") == 2
        assert metric(text, "kvcached_storage_errors_total", kind="store_failed") == 2
        assert metric(text, "kvcached_tier_blocks", tier="gpu", state="free") == 24
        assert metric(text, "kvcached_eviction_policy", policy="adaptive") == 1
        assert metric(text, "kvcached_ghost_entries", tier="gpu") == 300
        assert metric(text, "kvcached_ghost_bytes", tier="gpu") == 1024
        assert metric(text, "kvcached_policy_hits_total", tier="gpu") == 90
        assert metric(text, "kvcached_ghost_hits_total", tier="gpu") == 10
        assert metric(text, "kvcached_ghost_hit_share", tier="gpu") == 0.1
        fake.fail = True
        assert metric(scrape(server.url), "kvcached_up") == 0.0
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(server.url.replace("/metrics", "/nope"), timeout=5)


def test_metrics_without_prometheus_client_names_the_extra(monkeypatch):
    from kvcached.ops.metrics import MetricsServer
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(RuntimeError, match=r"pip install 'kvcached\[metrics\]'"):
        MetricsServer(object())


# ------------------------------------------------------------------ launcher
def test_launcher_backoff_is_bounded_and_resets():
    from kvcached.config import CacheConfig
    from kvcached.ops.launcher import Launcher
    cfg = CacheConfig.load(num_gpu_blocks=8, num_cpu_blocks=0, storage_backend="none")
    la = Launcher(cfg, "c.toml", "/tmp/x", max_restarts=5, base_backoff_s=0.2,
                  max_backoff_s=1.0, stable_s=30.0)
    r = la.ranks[0]
    r.proc = type("P", (), {"pid": 1})()
    delays = []
    for _ in range(5):  # crash right after start, five times
        la._on_exit(r, 1, now=r.started_at + 1.0)
        delays.append(round(r.restart_at - (r.started_at + 1.0), 3))
    assert delays == [0.4, 0.8, 1.0, 1.0, 1.0] and not la._stop.is_set()
    la._on_exit(r, 0, now=r.started_at + 1.0)  # a clean exit resets the count
    assert r.crashes == 0 and r.restart_at == pytest.approx(r.started_at + 1.2)
    for _ in range(6):
        la._on_exit(r, 1, now=r.started_at + 1.0)
    assert la._stop.is_set() and "rank 0 crashed 6 times in a row" in la.stop_reason


# ================================================= a real launched deployment
OPS_CONFIG = dict(
    num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32", tp_size=2,
    num_gpu_blocks=8, num_cpu_blocks=8, storage_backend="none", transfer_mode="workers",
    spawn_workers=False,
    create_cache=True, heartbeat_interval_s=0.1, worker_timeout_s=3.0, engine_timeout_s=4.0,
    task_timeout_s=10.0, worker_start_timeout_s=20.0,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_toml(path: Path, values: dict) -> None:
    def fmt(v):
        return str(v).lower() if isinstance(v, bool) else repr(v).replace("'", '"')
    path.write_text("".join(f"{k} = {fmt(v)}\n" for k, v in values.items()))


class Deployment:
    """`kvcached launch` (the workers) + a CacheManager in this process (the engine)."""

    def __init__(self):
        # A short path: ipc socket paths are limited to ~100 characters.
        self.root = Path(tempfile.mkdtemp(prefix="kvops-"))
        self.run_dir = self.root / "run"
        self.events = f"ipc://{self.root}/events.sock"
        self.port = free_port()
        self.config = self.root / "kvcached.toml"
        write_toml(self.config, {**OPS_CONFIG, "run_dir": str(self.run_dir),
                                 "metrics_port": self.port, "kv_events_endpoint": self.events})
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "kvcached", "launch", "--config", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.root / "launcher.err", "wb"))
        self.mgr = None
        self.sub = subscribe(self.events)  # before the engine binds: ipc reconnects

    def start_engine(self):
        from kvcached import CacheConfig, CacheManager
        try:
            self.mgr = CacheManager(CacheConfig.load(self.config)).start()
        except TimeoutError as e:  # say why the launched workers did not come up
            log = self.run_dir / "logs" / "worker-rank0.log"
            tail = log.read_text()[-2000:] if log.exists() else "(no worker log)"
            raise AssertionError(f"{e}\nworker rank 0 log:\n{tail}") from None
        return self.mgr

    def planes(self, rank: int):
        from kvcached.memory.kvshare import attach_kv_cache
        return attach_kv_cache(self.run_dir, rank)

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.mgr.stats().workers]

    def close(self):
        self.sub.close()
        if self.mgr is not None:
            self.mgr.close()  # first: its workers must not be lost under it
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(15)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def dep():
    d = Deployment()
    try:
        d.start_engine()
        yield d
    finally:
        d.close()


def fill(dep: Deployment, block: int, salt: int) -> None:
    for rank in range(2):
        for p, plane in enumerate(dep.planes(rank)):
            plane[block].fill_(salt * 100 + rank * 10 + p)


def holds(dep: Deployment, block: int, salt: int) -> bool:
    return all(bool((plane[block] == salt * 100 + rank * 10 + p).all())
               for rank in range(2) for p, plane in enumerate(dep.planes(rank)))


def cache_prompt(dep: Deployment, rid: str, prompt: list[int], salt: int) -> list[int]:
    """Allocate, 'compute' (fill every full block with known bytes), commit, free."""
    mgr = dep.mgr
    a = mgr.allocate(rid, prompt)
    a.wait(10)
    full = len(prompt) // mgr.block_size
    for i, b in enumerate(a.block_ids[:full]):
        fill(dep, b, salt + i)
    mgr.commit(rid, prompt, len(prompt))
    mgr.free(rid)
    return a.block_ids[:full]


def evict_all(dep: Deployment, rid: str = "filler") -> None:
    """A request as large as the GPU tier: every idle cached block leaves the GPU."""
    dep.mgr.allocate(rid, toks(*range(900, 907), tail=1))
    dep.mgr.free(rid)


def worker_done(dep: Deployment) -> list[int]:
    """Tasks each rank has finished, from its last heartbeat."""
    return [w.get("done", 0) for w in dep.mgr.stats().workers]


def settled_done(dep: Deployment, window: float = 0.4, timeout: float = 10.0) -> list[int]:
    """``worker_done`` once it has not changed for ``window`` s (several heartbeats)."""
    deadline = time.monotonic() + timeout
    last, since = worker_done(dep), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        cur = worker_done(dep)
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= window:
            return cur
    raise AssertionError(f"worker task counts kept changing for {timeout}s")


def worker_logs(dep: Deployment) -> str:
    """The end of every rank's log, for failure messages."""
    out = []
    for log in sorted((dep.run_dir / "logs").glob("worker-rank*.log")):
        out.append(f"--- {log.name}:\n{log.read_text()[-1500:]}")
    return "\n".join(out)


def test_launched_workers_serve_the_engine(dep):
    pids = dep.worker_pids()
    assert sorted(pids) == children_of(dep.launcher.pid)
    for rank, pid in enumerate(pids):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[cmd.index(b"--rank") + 1] == str(rank).encode()
        assert b"--engine-pid" not in cmd and b"--config" in cmd
    # A round trip through the host pools of both ranks keeps every byte.
    prompt = toks(1, 2, tail=1)
    cache_prompt(dep, "w1", prompt, salt=5)
    evict_all(dep)
    a = dep.mgr.allocate("w2", prompt)
    a.wait(10)
    assert a.hit.cpu_tokens == 8, worker_logs(dep)
    assert all(holds(dep, b, 5 + i) for i, b in enumerate(a.block_ids[:2]))
    dep.mgr.free("w2")
    assert dep.worker_pids() == pids and [w["state"] for w in dep.mgr.stats().workers] == \
        ["ready", "ready"], worker_logs(dep)


def test_pause_holds_queued_tasks_and_resume_runs_them_exactly_once(dep):
    mgr, rd = dep.mgr, dep.run_dir
    prompts = {name: toks(10 * k + 1, 10 * k + 2, tail=1)
               for k, name in enumerate(("p1", "p2", "p3"), start=1)}
    salts = {"p1": 10, "p2": 20, "p3": 30}
    for name, prompt in prompts.items():
        cache_prompt(dep, name, prompt, salt=salts[name])
    evict_all(dep)  # p1..p3 now live in the CPU tier only
    before = mgr.stats().transfers.get("swap_in", {}).get("done", 0)

    # In flight: rank 1 is stopped, so the swap-in of p1 waits for it.
    victim = dep.worker_pids()[1]
    os.kill(victim, signal.SIGSTOP)
    try:
        a1 = mgr.allocate("r1", prompts["p1"])
        assert a1.hit.cpu_tokens == 8 and not a1.ready
        paused = threading.Thread(target=cli, args=("ctl", "pause", "--run-dir", rd))
        paused.start()
        wait_for(lambda: mgr.transfer.paused, 5, "the pause to begin")
        assert paused.is_alive(), "pause answered before the in-flight task finished"
        # While the ranks drain, status is answered (the manager lock is free).
        st = request(rd, "status", timeout_s=3)
        assert st["paused"] and paused.is_alive()
    finally:
        os.kill(victim, signal.SIGCONT)
    paused.join(15)
    assert not paused.is_alive()
    assert a1.ready  # pause waited for the task in flight
    a1.wait(1)
    assert all(holds(dep, b, 10 + i) for i, b in enumerate(a1.block_ids[:2]))
    mgr.free("r1")

    # While paused, a CPU hit is a miss: nothing is planned that would wait for
    # resume, so wait() does not block until resume.
    done0 = settled_done(dep)
    for name in ("p2", "p3"):
        a = mgr.allocate(name, prompts[name])
        assert a.ready and a.hit.cpu_tokens == 0 and a.num_cached_tokens == 0
        a.wait(0)  # returns at once
        mgr.free(name)  # never computed: nothing to commit
    # Tasks that do reach a paused coordinator are held, in order, not run.
    from kvcached.tasks import Task
    held = [mgr.transfer.submit(Task("noop", [], [])) for _ in range(2)]
    st = request(rd, "status", timeout_s=5)
    assert st["paused"] and st["transfer"]["held"] == 2
    text = cli("status", "--run-dir", rd)
    assert "kvcached: PAUSED" in text and "coordinator: 2 tasks held" in text
    assert all(str(pid) in text for pid in dep.worker_pids())
    time.sleep(0.5)  # the point is that nothing happens: give it the chance to
    assert not any(h.done() for h in held) and worker_done(dep) == done0

    cli("ctl", "resume", "--run-dir", rd)
    assert all(h.wait(10) and h.result.ok for h in held)
    for name, salt in (("p2", 20), ("p3", 30)):  # resumed: CPU hits again
        a = mgr.allocate(name, prompts[name])
        a.wait(10)
        assert a.hit.cpu_tokens == 8
        assert all(holds(dep, b, salt + i) for i, b in enumerate(a.block_ids[:2]))
        mgr.free(name)
    # Exactly once: the two held tasks, the resume and the two swap-ins on every
    # rank, and no more.
    assert settled_done(dep) == [d + 5 for d in done0]
    sw = mgr.stats().transfers["swap_in"]
    assert sw["done"] - before == 3 and sw["failed"] == 0
    mgr.check_invariants()


def test_sleep_and_wakeup_round_trip_keeps_cpu_blocks_intact(dep):
    from kvcached import CacheAsleep
    mgr, rd = dep.mgr, dep.run_dir
    prompt = toks(51, 52, 53, tail=1)
    cache_prompt(dep, "s1", prompt, salt=50)
    evict_all(dep)  # its blocks are now on CPU only
    assert "sleep: ok (changed)" in cli("ctl", "sleep", "--run-dir", rd)
    assert "no change" in cli("ctl", "sleep", "--run-dir", rd)
    with pytest.raises(CacheAsleep):
        mgr.allocate("s2", prompt)
    assert "kvcached: ASLEEP" in cli("status", "--run-dir", rd)
    assert "wakeup: ok (changed)" in cli("ctl", "wakeup", "--run-dir", rd)
    a = mgr.allocate("s2", prompt)
    a.wait(10)
    assert a.hit.cpu_tokens == 12
    assert all(holds(dep, b, 50 + i) for i, b in enumerate(a.block_ids[:3]))
    mgr.free("s2")
    mgr.check_invariants()


def test_sleep_releasing_the_host_pool_empties_the_cpu_tier(dep):
    mgr, rd = dep.mgr, dep.run_dir
    prompt = toks(61, 62, tail=1)
    cache_prompt(dep, "h1", prompt, salt=60)
    evict_all(dep)
    cli("ctl", "sleep", "--release-host-pool", "--run-dir", rd)
    assert mgr.stats().tiers["cpu"].used == 0
    cli("ctl", "wakeup", "--run-dir", rd)
    a = mgr.allocate("h2", prompt)
    assert a.num_cached_tokens == 0
    mgr.free("h2")
    # The re-created host pool works: a round trip through it keeps the bytes.
    cache_prompt(dep, "h3", prompt, salt=70)
    evict_all(dep)
    a = mgr.allocate("h4", prompt)
    a.wait(10)
    assert a.hit.cpu_tokens == 8 and all(holds(dep, b, 70 + i)
                                         for i, b in enumerate(a.block_ids[:2]))
    mgr.free("h4")
    mgr.check_invariants()


def test_update_weights_isolates_old_kv(dep):
    mgr, rd = dep.mgr, dep.run_dir
    prompt = toks(71, 72, tail=1)
    cache_prompt(dep, "u1", prompt, salt=80)
    a = mgr.allocate("u2", prompt)
    assert a.num_cached_tokens == 8
    mgr.free("u2")
    assert "weights v2" in cli("ctl", "update-weights", "--version", "v2", "--run-dir", rd)
    assert "no change" in cli("ctl", "update-weights", "--version", "v2", "--run-dir", rd)
    a = mgr.allocate("u3", prompt)
    assert a.num_cached_tokens == 0 and a.hit.gpu_tokens == a.hit.cpu_tokens == 0
    mgr.free("u3")
    assert "weights v2" in cli("status", "--run-dir", rd)


def test_metrics_endpoint_is_scraped(dep):
    mgr = dep.mgr
    prompt = toks(81, 82, tail=1)
    cache_prompt(dep, "m1", prompt, salt=90)
    evict_all(dep)
    a = mgr.allocate("m2", prompt)  # a CPU hit
    a.wait(10)
    mgr.free("m2")
    text = scrape(f"http://127.0.0.1:{dep.port}/metrics")
    st = mgr.stats()
    assert metric(text, "kvcached_up") == 1.0
    assert metric(text, "kvcached_hit_tokens_total", tier="cpu") == st.hit_tokens["cpu"] > 0
    assert metric(text, "kvcached_blocks_moved_total", direction="gpu_to_cpu") == \
        st.transfers["swap_out"]["blocks"] > 0
    assert metric(text, "kvcached_worker_up", rank="1") == 1.0
    assert metric(text, "kvcached_queue_depth", rank="0", lane="out") == 0
    with pytest.raises(OSError):  # loopback only
        host = socket.gethostbyname(socket.gethostname())
        if host.startswith("127."):
            raise OSError("no non-loopback address to test with")
        urllib.request.urlopen(f"http://{host}:{dep.port}/metrics", timeout=2)


def test_kv_events_follow_the_tiers(dep):
    from kvcached.core.hashing import block_hashes
    mgr, sub = dep.mgr, dep.sub
    n = iter(range(10**6))
    join(sub, lambda: cache_prompt(dep, f"warm{next(n)}", toks(95, 96, tail=1), salt=95))
    while receive(sub, 0.2) is not None:
        pass
    prompt = toks(91, 92, tail=1)
    hashes = block_hashes(mgr._ns, prompt, mgr.block_size)[:2]
    cache_prompt(dep, "e1", prompt, salt=99)
    evict_all(dep, "e-filler")
    events = []
    while (ev := receive(sub, 0.5)) is not None:
        events.append(ev)
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    stored = {(e.tier, h) for e in events if e.kind == "stored" for h in e.block_hashes}
    removed = {(e.tier, h) for e in events if e.kind == "removed" for h in e.block_hashes}
    for h in hashes:
        assert ("gpu", h) in stored and ("cpu", h) in stored and ("gpu", h) in removed


def test_launcher_restarts_a_killed_worker_and_stops_cleanly_on_sigterm(dep):
    mgr = dep.mgr
    old = dep.worker_pids()
    os.kill(old[0], signal.SIGKILL)
    wait_for(lambda: (ch := children_of(dep.launcher.pid)) and len(ch) == 2
             and old[0] not in ch, 10, "the launcher to restart rank 0")
    wait_for(lambda: (w := mgr.stats().workers[0])["state"] == "ready"
             and w["pid"] != old[0], 30, "the new rank 0 to say hello")
    a = mgr.allocate("k1", toks(111, 112, tail=1))  # serving with the new worker
    mgr.free("k1")
    pids = children_of(dep.launcher.pid)
    assert old[1] in pids
    dep.launcher.send_signal(signal.SIGTERM)
    assert dep.launcher.wait(15) == 0
    assert not [p for p in pids if pid_alive(p)], "workers outlived the launcher"
    err = (dep.root / "launcher.err").read_text()
    assert "restarting" in err and "SIGTERM" in err
    assert a.block_ids
