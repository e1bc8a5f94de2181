"""Shared helpers for the storage tests: servers with deadlines, data, scenarios.

Imported by tests/test_storage*.py (not a pytest conftest: tests/conftest.py
belongs to the rest of the suite). Servers listen on 127.0.0.1 only, on free
ports, and every wait polls a condition until a deadline.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvcached.layout import KVLayout
from kvcached.storage import BlockStore, storage_namespace

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16,
                  dtype="float32")  # the default layout: 128 KiB per block
NS = storage_namespace("kvcached-demo", "0")
VENV_BIN = Path(sys.executable).parent


# ------------------------------------------------------------------ waiting
def wait_until(pred: Callable[[], object], timeout: float, what: str,
               interval: float = 0.02):
    """Poll ``pred`` until it returns a truthy value; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port(with_bus: bool = False) -> int:
    """A free TCP port on 127.0.0.1 (and port+10000 free too when ``with_bus``)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port < 55000 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    """preexec_fn: the server gets SIGKILL if the test process dies (no orphans)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def stop_process(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL; never leaves a zombie."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


# ------------------------------------------------------------------ data
def make_pool(n: int, seed: int = 0, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """A host pool ``[n, block_bytes]`` of random bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8, generator=g)


def make_hashes(n: int, seed: int = 0) -> list[bytes]:
    """``n`` distinct 16-byte block hashes."""
    import hashlib

    return [hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def make_store(backend, namespace: str = NS, layout: KVLayout = LAYOUT, rank: int = 0,
               tp: int = 1) -> BlockStore:
    """A BlockStore over ``backend`` for the test layout."""
    return BlockStore(backend, layout.digest, rank, tp, namespace)


# ------------------------------------------------------------------ scenarios
def check_restart(open_backend: Callable, n: int = 48) -> None:
    """Store ``n`` blocks, drop the client, reopen, lookup and load every byte back."""
    pool = make_pool(n, seed=1)
    hashes = make_hashes(n, seed=1)
    bs = make_store(open_backend())
    assert all(bs.store(hashes, pool, list(range(n))))
    bs.close()
    del bs
    bs2 = make_store(open_backend())
    try:
        assert bs2.lookup(hashes) == n
        out = torch.zeros_like(pool)
        ids = list(reversed(range(n)))  # land them in other host blocks
        assert bs2.load(hashes, out, ids) == n
        assert torch.equal(out[ids], pool)
    finally:
        bs2.close()


def check_partial_batch(bs: BlockStore, n: int = 8, hole: int = 3) -> None:
    """A deleted middle object cuts lookup and load to the prefix before it."""
    pool = make_pool(n, seed=2)
    hashes = make_hashes(n, seed=2)
    assert all(bs.store(hashes, pool, list(range(n))))
    bs.delete([hashes[hole]])
    assert bs.lookup(hashes) == hole
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(n))) == hole
    assert torch.equal(out[:hole], pool[:hole])
    assert bs.stats()["load_misses"] >= 1


def check_namespace_isolation(backend) -> None:
    """Another weight version (namespace) never sees the objects of this one."""
    n = 4
    pool, hashes = make_pool(n, seed=3), make_hashes(n, seed=3)
    v0 = make_store(backend, storage_namespace("kvcached-demo", "0"))
    v1 = make_store(backend, storage_namespace("kvcached-demo", "1"))
    assert all(v0.store(hashes, pool, list(range(n))))
    assert v1.lookup(hashes) == 0
    assert v1.load(hashes, torch.zeros_like(pool), list(range(n))) == 0
    v0.set_namespace(storage_namespace("kvcached-demo", "1"))
    assert v0.lookup(hashes) == 0
    v0.set_namespace(storage_namespace("kvcached-demo", "0"))
    assert v0.lookup(hashes) == n


def check_wrong_layout(backend) -> None:
    """Objects written under another layout digest are misses for this one."""
    n = 3
    pool, hashes = make_pool(n, seed=4), make_hashes(n, seed=4)
    writer = BlockStore(backend, "0123456789abcdef", 0, 1, NS)
    assert all(writer.store(hashes, pool, list(range(n))))
    reader = make_store(backend)
    assert reader.lookup(hashes) == n  # present, but not ours to use
    assert reader.load(hashes, torch.zeros_like(pool), list(range(n))) == 0
    assert reader.stats()["miss_layout_mismatch"] == 1


def check_damaged(bs: BlockStore, damage: Callable[[str], None], reason: str,
                  n: int = 4, at: int = 1) -> None:
    """Damage object ``at`` with ``damage(key)``: load stops there, counter ``reason``."""
    pool, hashes = make_pool(n, seed=5), make_hashes(n, seed=5)
    assert all(bs.store(hashes, pool, list(range(n))))
    damage(bs.keys([hashes[at]])[0])
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(n))) == at
    assert torch.equal(out[:at], pool[:at])
    stats = bs.stats()
    assert stats[reason] == 1, stats
    # A damaged object is deleted so the block can be stored again.
    assert all(bs.store(hashes, pool, list(range(n))))
    assert bs.load(hashes, torch.zeros_like(pool), list(range(n))) == n


# ------------------------------------------------------------------ redis
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS_REASON = ("redis-server is not installed (scripts/install_services.sh "
                   "installs it: apt-get install redis-server)")


def redis_ping(port: int) -> bool:
    """True when a Redis server answers PING on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1 with persistence off."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False):
        self.workdir = Path(workdir)
        self.port = port or free_port(with_bus=cluster)
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until it answers PING."""
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes",
                     "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        wait_until(lambda: self.proc.poll() is not None or redis_ping(self.port), timeout,
                   f"redis-server on port {self.port}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {self.port} exited "
                               f"(code {self.proc.returncode})")
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        """Terminate (fixture teardown)."""
        stop_process(self.proc)


@contextlib.contextmanager
def redis_cluster(workdir: Path, nodes: int = 3, timeout: float = 30.0):
    """A ``nodes``-primary Redis Cluster on 127.0.0.1; yields the servers."""
    servers = [RedisServer(workdir, cluster=True) for _ in range(nodes)]
    try:
        for s in servers:
            s.start()
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout)
        wait_until(lambda: all(_cluster_ok(s.port) for s in servers), timeout,
                   "redis cluster_state:ok on every node", interval=0.1)
        yield servers
    finally:
        for s in servers:
            s.stop()


def _cluster_ok(port: int) -> bool:
    r = subprocess.run([REDIS_CLI, "-p", str(port), "cluster", "info"],
                       capture_output=True, text=True, timeout=5)
    return "cluster_state:ok" in r.stdout


# ------------------------------------------------------------------ mooncake
def mooncake_binary(name: str) -> str | None:
    """Path of a binary shipped by the mooncake wheel (venv bin or PATH)."""
    cand = VENV_BIN / name
    return str(cand) if cand.exists() else shutil.which(name)


def mooncake_unavailable() -> str | None:
    """Why the Mooncake servers cannot run here (None: they can, in a private
    network namespace)."""
    if importlib.util.find_spec("mooncake") is None:
        return ("mooncake-transfer-engine-non-cuda is not installed "
                "(scripts/install_services.sh installs it)")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not import ({e}); apt-get install libibverbs1"
    if not (mooncake_binary("mooncake_master") and mooncake_binary("mooncake_client")):
        return "mooncake_master / mooncake_client binaries not found next to the interpreter"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare (util-linux) and ip (iproute2) for a private network namespace"
    r = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a private network namespace (unshare -n: {r.stderr.strip()}); " \
               "run as root"
    return None


class MooncakeServers:
    """``mooncake_master`` plus one storage node (``mooncake_client``) on 127.0.0.1.

    Only start these inside a private network namespace: the transfer engine
    binds every interface.
    """

    def __init__(self, workdir: Path, segment: str = "256MB"):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.segment = segment
        self.master: subprocess.Popen | None = None
        self.node: subprocess.Popen | None = None
        self.env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_master(self, timeout: float = 60.0) -> None:
        """Start the master and wait until its RPC port accepts connections."""
        log = open(self.workdir / f"master-{time.monotonic_ns()}.log", "w")
        self.master = subprocess.Popen(
            [mooncake_binary("mooncake_master"), f"--rpc_port={self.port}",
             "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}",
             "--metrics_host=127.0.0.1", "--enable_metric_reporting=false",
             "--logtostderr"], stdout=log, stderr=subprocess.STDOUT, env=self.env,
            preexec_fn=die_with_parent)
        log.close()
        wait_until(lambda: self.master.poll() is not None or port_open(self.port), timeout,
                   "mooncake_master")
        if self.master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {self.master.returncode}")

    def start_node(self, timeout: float = 60.0) -> None:
        """Start the storage node that contributes the memory segment."""
        port = free_port()
        log_path = self.workdir / f"node-{port}.log"
        log = open(log_path, "w")
        self.node = subprocess.Popen(
            [mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={port}",
             f"--master_server_address={self.url}", "--metadata_server=P2PHANDSHAKE",
             f"--global_segment_size={self.segment}", "--protocol=tcp", "--logtostderr"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=die_with_parent)
        log.close()
        # A full suite's machine has started one in 16 s: the deadline is an
        # upper bound, the port opening ends the wait
        try:
            wait_until(lambda: self.node.poll() is not None or port_open(port), timeout,
                       "mooncake_client storage node")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; its log ends:\n{log_path.read_text()[-2000:]}") from None
        if self.node.poll() is not None:
            raise RuntimeError(f"mooncake_client exited with {self.node.returncode}")

    def kill_master(self) -> None:
        """SIGKILL the master: every object is lost."""
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait(5)

    def stop(self) -> None:
        """Stop node and master."""
        stop_process(self.node)
        stop_process(self.master)
