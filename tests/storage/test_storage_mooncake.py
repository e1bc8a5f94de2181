"""Mooncake backend against a real mooncake_master and storage node.

Mooncake's transfer engine binds sockets on every interface, so these tests
never run in the caller's network namespace: the one test collected normally,
``test_mooncake_suite_in_private_netns``, re-runs this file under
``unshare -n`` (a private namespace with only loopback up), where the
``KVCACHED_MOONCAKE_NETNS`` environment variable turns on the real tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest_storage import (  # noqa: E402
    MooncakeServers,
    check_damaged,
    check_namespace_isolation,
    check_partial_batch,
    check_restart,
    check_wrong_layout,
    make_hashes,
    make_pool,
    make_store,
    mooncake_unavailable,
    wait_until,
)

from kvcached.storage import HEADER_SIZE, open_backend  # noqa: E402

IN_NETNS = os.environ.get("KVCACHED_MOONCAKE_NETNS") == "1"
NETNS_ENV = "KVCACHED_MOONCAKE_NETNS"


# ---------------------------------------------------------------- outer run
def test_mooncake_suite_in_private_netns():
    """Run the real Mooncake tests in a private network namespace."""
    why = mooncake_unavailable()
    if why:
        pytest.skip(why)
    env = {**os.environ, NETNS_ENV: "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "GLOG_minloglevel": "2"}
    inner = ('ip link set lo up && exec "$0" -m pytest -q -p no:cacheprovider '
             '-o addopts="" -o python_functions="netns_test_*" --durations=5 "$1"')
    # Own process group, so a timeout kills the servers it started as well.
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", inner, sys.executable, __file__],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    try:
        out, err = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mooncake suite timed out:\n{out[-6000:]}\n{err[-3000:]}")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    tail = r.stdout[-8000:] + "\n" + r.stderr[-3000:]
    print(tail)
    assert r.returncode == 0, f"mooncake suite failed (rc {r.returncode}):\n{tail}"
    assert " passed" in r.stdout and " skipped" not in r.stdout, tail


# ---------------------------------------------------------------- inner run
# Named netns_test_*: collected only by the inner run (-o python_functions=netns_test_*).
FAST = dict(breaker_threshold=2, breaker_cooldown_s=0.3, op_timeout_s=2.0)


def _start_servers(workdir) -> MooncakeServers:
    if not IN_NETNS:
        pytest.skip("Mooncake servers only start inside a private network namespace")
    s = MooncakeServers(workdir)
    try:
        s.start_master()
        s.start_node()
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture
def servers(tmp_path):
    """Servers of one test (the ones that kill the master)."""
    s = _start_servers(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def shared_servers(tmp_path_factory):
    """Servers shared by the tests that leave them running (startup/teardown ~2 s)."""
    s = _start_servers(tmp_path_factory.mktemp("mooncake"))
    yield s
    s.stop()


def _backend(url, **kw):
    return open_backend("mooncake", url, **{**FAST, **kw})


def _ready(be) -> None:
    """Wait until the storage node's segment is mounted (a put succeeds)."""
    wait_until(lambda: be.put_from(["ready/probe"], [b"x"]) == [True], 20,
               "mooncake segment to accept puts")
    be.delete(["ready/probe"])


@pytest.fixture(scope="module")
def shared_backend(shared_servers):
    be = _backend(shared_servers.url)
    _ready(be)
    yield be
    be.close()


@pytest.fixture
def backend(shared_backend):
    """The shared client, emptied before each test."""
    shared_backend.clear()
    return shared_backend


def netns_test_mooncake_restart_scenario(backend, shared_servers):
    check_restart(lambda: _backend(shared_servers.url))


def netns_test_mooncake_raw_api(backend):
    be = backend
    assert be.put_from(["ns/a", "ns/b"], [b"hello", [b"wor", b"ld"]]) == [True, True]
    assert be.exists(["ns/a", "ns/b", "ns/c"]) == [True, True, False]
    a, b = bytearray(8), [bytearray(2), bytearray(3)]
    assert be.get_into(["ns/a", "ns/b", "ns/c"], [a, b, bytearray(4)]) == [5, 5, -1]
    assert bytes(a[:5]) == b"hello" and bytes(b[0] + b[1]) == b"world"
    # put never overwrites: the first value stays (fine for content-addressed blocks).
    assert be.put_from(["ns/a"], [b"HELLO"]) == [True]
    assert be.get_into(["ns/a"], [a]) == [5] and bytes(a[:5]) == b"hello"
    be.delete(["ns/a"])  # just read (leased): delete still works (force)
    assert be.exists(["ns/a", "ns/b"]) == [False, True]
    be.clear()
    assert be.exists(["ns/b"]) == [False]
    st = be.stats()
    assert st["kind"] == "mooncake" and st["connected"] and be.healthy()


def netns_test_mooncake_partial_batch(backend):
    check_partial_batch(make_store(backend))


def netns_test_mooncake_namespace_isolation(backend):
    check_namespace_isolation(backend)


def netns_test_mooncake_wrong_layout_is_a_miss(backend):
    check_wrong_layout(backend)


def _read_raw(be, key: str, size: int) -> bytearray:
    buf = bytearray(size)
    assert be.get_into([key], [buf]) == [size]
    return buf


def netns_test_mooncake_overwritten_object_is_a_counted_miss(backend):
    size = HEADER_SIZE + make_pool(1).shape[1]

    def flip(key):
        v = _read_raw(backend, key, size)
        v[HEADER_SIZE + 999] ^= 0x08
        assert backend.upsert_from([key], [v]) == [True]

    check_damaged(make_store(backend), flip, "miss_checksum_mismatch")


def netns_test_mooncake_truncated_object_is_a_miss(backend):
    size = HEADER_SIZE + make_pool(1).shape[1]

    def truncate(key):
        v = _read_raw(backend, key, size)
        backend.delete([key])
        assert backend.put_from([key], [v[:HEADER_SIZE + 100]]) == [True]

    check_damaged(make_store(backend), truncate, "miss_short_read")


def netns_test_mooncake_master_restart_misses_then_recovers(servers):
    be = _backend(servers.url)
    _ready(be)
    bs = make_store(be)
    n = 8
    pool, hashes = make_pool(n), make_hashes(n)
    assert all(bs.store(hashes, pool, list(range(n))))
    servers.kill_master()
    # Misses and failed puts, no exception; the breaker opens and then fails fast.
    assert bs.lookup(hashes) == 0
    assert bs.load(hashes, torch.zeros_like(pool), list(range(n))) == 0
    assert bs.store(hashes, pool, list(range(n))) == [False] * n
    st = be.stats()
    assert st["breaker_opens"] >= 1 and st["fast_fails"] >= 1, st
    assert not be.healthy()
    servers.start_master()
    wait_until(lambda: bs.store(hashes[:1], pool, [0]) == [True], 30,
               "store to succeed after the master restart")
    assert be.stats()["breaker_state"] == "closed"
    # A restarted master has lost every object: only what was stored since is there.
    assert bs.lookup(hashes) == 1
    assert all(bs.store(hashes, pool, list(range(n))))
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(n))) == n and torch.equal(out, pool)
    be.close()


def netns_test_mooncake_master_down_at_open(tmp_path):
    if not IN_NETNS:
        pytest.skip("Mooncake servers only start inside a private network namespace")
    srv = MooncakeServers(tmp_path)  # nothing started yet
    try:
        be = _backend(srv.url)  # must not raise or block
        bs = make_store(be)
        pool, hashes = make_pool(2), make_hashes(2)
        assert bs.store(hashes, pool, [0, 1]) == [False, False]
        assert bs.lookup(hashes) == 0
        srv.start_master()
        srv.start_node()
        wait_until(lambda: bs.store(hashes, pool, [0, 1]) == [True, True], 30,
                   "first successful store")
        assert bs.lookup(hashes) == 2
        be.close()
    finally:
        srv.stop()



def netns_test_manager_restart_hits_from_mooncake(servers, tmp_path):
    """The restart scenario through CacheManager with worker processes."""
    from test_storage_flow import PROMPT, check_bytes, compute_and_store, storage_cfg

    from kvcached import CacheManager
    _ready(_backend(servers.url))
    kw = dict(storage_backend="mooncake", storage_url=servers.url, transfer_mode="workers",
              heartbeat_interval_s=0.1, worker_timeout_s=5.0, task_timeout_s=20.0)
    assert compute_and_store(storage_cfg(tmp_path, "a", **kw))["stored"] == 48
    with CacheManager(storage_cfg(tmp_path, "b", **kw)) as mgr:
        a = mgr.allocate("again", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 752 and a.hit.storage_tokens == 752
        check_bytes(mgr, a, 47)
