"""Redis backend against real redis-server processes on 127.0.0.1 (random ports)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest_storage import (  # noqa: E402
    LAYOUT,
    NO_REDIS_REASON,
    REDIS_CLI,
    REDIS_SERVER,
    RedisServer,
    check_damaged,
    check_namespace_isolation,
    check_partial_batch,
    check_restart,
    check_wrong_layout,
    make_hashes,
    make_pool,
    make_store,
    redis_cluster,
    wait_until,
)

from kvcached.storage import HEADER_SIZE, open_backend  # noqa: E402
from kvcached.storage.base import OVERSIZE  # noqa: E402

redis = pytest.importorskip("redis", reason="the 'redis' package is not installed "
                            "(pip install 'kvcached[redis]')")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)

FAST = dict(socket_timeout_s=0.5, connect_timeout_s=0.3, breaker_threshold=2,
            breaker_cooldown_s=0.2)


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


def _backend(url, **kw):
    return open_backend("redis", url, **{**FAST, **kw})


def _raw(srv):
    return redis.Redis(host="127.0.0.1", port=srv.port)


def test_redis_restart_scenario(server):
    # Small chunks so the 48 blocks travel in several pipelines.
    check_restart(lambda: _backend(server.url, chunk_bytes=1 << 20))


def test_redis_raw_api_and_prefix(server):
    be = _backend(server.url)
    raw = _raw(server)
    raw.set("someone-else", b"keep me")
    assert be.put_from(["ns/a", "ns/b"], [b"hello", [b"wor", b"ld"]]) == [True, True]
    assert be.exists(["ns/a", "ns/b", "ns/c"]) == [True, True, False]
    assert raw.get("kvcached/ns/b") == b"world"
    bufs = [bytearray(5), [bytearray(2), bytearray(3)], bytearray(1)]
    assert be.get_into(["ns/a", "ns/b", "ns/c"], bufs) == [5, 5, -1]
    assert bytes(bufs[0]) == b"hello" and bytes(bufs[1][0] + bufs[1][1]) == b"world"
    assert be.get_into(["ns/a"], [bytearray(2)]) == [OVERSIZE]  # larger than the buffer: not read
    be.delete(["ns/a"])
    assert be.exists(["ns/a", "ns/b"]) == [False, True]
    be.clear()
    assert be.exists(["ns/b"]) == [False]
    assert raw.get("someone-else") == b"keep me"  # clear() only touches our prefix
    assert be.healthy() and be.stats()["cluster"] is False
    be.close()


def test_redis_partial_batch(server):
    check_partial_batch(make_store(_backend(server.url)))


def test_redis_namespace_isolation(server):
    check_namespace_isolation(_backend(server.url))


def test_redis_wrong_layout_is_a_miss(server):
    check_wrong_layout(_backend(server.url))


def test_redis_overwritten_value_is_a_counted_miss(server):
    raw = _raw(server)

    def flip(key):
        v = bytearray(raw.get("kvcached/" + key))
        v[HEADER_SIZE + 12345] ^= 0x01
        raw.set("kvcached/" + key, bytes(v))

    check_damaged(make_store(_backend(server.url)), flip, "miss_checksum_mismatch")


def test_redis_truncated_value_is_a_miss(server):
    raw = _raw(server)

    def truncate(key):
        v = raw.get("kvcached/" + key)
        raw.set("kvcached/" + key, v[:HEADER_SIZE + 100])

    check_damaged(make_store(_backend(server.url)), truncate, "miss_short_read")


def test_redis_failed_puts_are_never_visible(tmp_path):
    # A server out of memory refuses writes per key: those keys must stay absent.
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        raw = _raw(srv)
        raw.config_set("maxmemory", 3 * LAYOUT.block_bytes + 2_000_000)
        raw.config_set("maxmemory-policy", "noeviction")
        bs = make_store(_backend(srv.url))
        n = 40
        pool, hashes = make_pool(n), make_hashes(n)
        ok = bs.store(hashes, pool, list(range(n)))
        assert not all(ok) and any(ok)
        present = bs.backend.exists(bs.keys(hashes))
        assert present == ok
        assert bs.backend.stats()["key_errors"] == ok.count(False)
    finally:
        srv.stop()


def test_redis_killed_mid_run_misses_then_recovers(server):
    bs = make_store(_backend(server.url))
    n = 16
    pool, hashes = make_pool(n), make_hashes(n)
    assert all(bs.store(hashes, pool, list(range(n))))
    server.kill()
    # Everything is a miss or a failed put, never an exception.
    assert bs.lookup(hashes) == 0
    assert bs.load(hashes, torch.zeros_like(pool), list(range(n))) == 0
    assert bs.store(hashes, pool, list(range(n))) == [False] * n
    assert not bs.healthy()
    st = bs.backend.stats()
    assert st["breaker_opens"] >= 1 and st["errors"] >= 2 and st["fast_fails"] >= 1
    assert st["breaker_state"] in ("open", "half_open")
    # Server back on the same port (empty: no persistence): the breaker's probe closes it.
    server.start()
    wait_until(lambda: bs.store(hashes[:1], pool, [0]) == [True], 10,
               "breaker to close after the server came back")
    assert bs.backend.stats()["breaker_state"] == "closed" and bs.healthy()
    assert all(bs.store(hashes, pool, list(range(n))))
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(n))) == n and torch.equal(out, pool)


def test_redis_dead_at_open_is_not_an_error(tmp_path):
    srv = RedisServer(tmp_path)  # port picked, server not started
    bs = make_store(_backend(srv.url))
    pool, hashes = make_pool(2), make_hashes(2)
    assert bs.store(hashes, pool, [0, 1]) == [False, False]
    assert bs.lookup(hashes) == 0
    srv.start()
    try:
        wait_until(lambda: bs.store(hashes, pool, [0, 1]) == [True, True], 10,
                   "first successful store")
        assert bs.lookup(hashes) == 2
    finally:
        srv.stop()


def test_redis_frozen_server_times_out(server):
    be = _backend(server.url, socket_timeout_s=0.2)
    assert be.put_from(["ns/a"], [b"x"]) == [True]
    server.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert be.get_into(["ns/a"], [bytearray(1)]) == [-1]
        assert time.monotonic() - t0 < 2.0
        assert be.stats()["timeouts"] == 1
    finally:
        server.proc.send_signal(signal.SIGCONT)


@pytest.mark.skipif(REDIS_CLI is None, reason="redis-cli is not installed")
def test_redis_cluster_cross_slot_batches(tmp_path):
    with redis_cluster(tmp_path) as nodes:
        url = nodes[1].url  # any node will do: the client discovers the others
        check_restart(lambda: _backend(url, chunk_bytes=1 << 20))
        be = _backend(url)
        assert be.healthy() and be.stats()["cluster"] is True
        bs = make_store(be)
        check_partial_batch(bs)
        keys = [f"ns/k{i}" for i in range(50)]  # spread over many slots
        assert all(be.put_from(keys, [f"v{i}".encode() for i in range(50)]))
        assert all(be.exists(keys))
        be.clear()
        assert not any(be.exists(keys))
        assert bs.lookup(make_hashes(48, seed=1)) == 0
        be.close()


def test_frozen_storage_never_delays_swaps(server, tmp_path):
    """Storage tasks have a lane of their own in the transfer worker: while a
    lookup hangs on a frozen server, swaps between the tiers complete."""
    from conftest import tiny_config

    from kvcached import CacheManager
    from kvcached.tasks import Task
    cfg = tiny_config(run_dir=str(tmp_path / "run"), storage_backend="redis",
                      storage_url=server.url, transfer_mode="workers",
                      num_gpu_blocks=8, num_cpu_blocks=8)
    with CacheManager(cfg) as mgr:
        server.proc.send_signal(signal.SIGSTOP)
        try:
            lookup = mgr.submit(Task("lookup", [], [], {"keys": ["ab" * 32]}))
            swap = mgr.submit(Task("swap_out", [0, 1], [0, 1]))
            assert swap.wait(5.0) and swap.result.ok, swap.result
            assert not lookup.done()  # still waiting on the frozen server
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert lookup.wait(30)
