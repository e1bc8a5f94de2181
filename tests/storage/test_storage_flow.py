"""The storage tier end to end through the manager: write-through on commit,
lookup + load on a miss, restarts, faults, weight-version isolation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from kvcached import CacheManager, TransferFailed
from kvcached.memory.kvshare import attach_kv_cache

BS = 16
PROMPT = [(i * 7919) % 32000 for i in range(768)]  # 48 blocks of 16 tokens


def storage_cfg(tmp_path: Path, name: str, **kw):
    base = dict(run_dir=str(tmp_path / name), block_size=BS, num_gpu_blocks=64,
                num_cpu_blocks=64, num_layers=2, num_kv_heads=2, head_dim=8,
                storage_backend="file", storage_url=str(tmp_path / "store"),
                storage_load_policy="wait_complete")
    return tiny_config(**{**base, **kw})


def pattern(rank: int, block_index: int, plane: int) -> float:
    return float(rank * 10_000 + block_index * 10 + plane)


def compute_and_store(cfg, prompt=PROMPT) -> dict:
    """First engine life: compute the prompt (fill its KV), commit, close."""
    with CacheManager(cfg) as mgr:
        planes = [attach_kv_cache(mgr.run_dir, r) for r in range(cfg.tp_size)]
        a = mgr.allocate("first", prompt)
        for i, b in enumerate(a.block_ids):
            for r in range(cfg.tp_size):
                for p, plane in enumerate(planes[r]):
                    plane[b].fill_(pattern(r, i, p))
        mgr.commit("first", prompt, len(prompt))
        mgr.free("first")
    return mgr.stats().storage  # close() waited for the write-through


def check_bytes(mgr, a, n_blocks: int, tp: int = 1) -> None:
    planes = [attach_kv_cache(mgr.run_dir, r) for r in range(tp)]
    for i in range(n_blocks):
        for r in range(tp):
            for p, plane in enumerate(planes[r]):
                assert bool((plane[a.block_ids[i]] == pattern(r, i, p)).all()), (i, r, p)


def test_restart_hits_from_storage_with_every_byte(tmp_path):
    stored = compute_and_store(storage_cfg(tmp_path, "a"))
    assert stored["stored"] == 48
    # A new engine: GPU and CPU tiers are empty, storage is not.
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:
        a = mgr.allocate("again", PROMPT)
        assert a.hit.storage_tokens == 752  # all but the last block (its last token is computed)
        a.wait(timeout=30)
        assert a.num_cached_tokens >= 700
        check_bytes(mgr, a, 47)
        mgr.check_invariants()
        mgr.commit("again", PROMPT, len(PROMPT))
        mgr.free("again")
        mgr.check_invariants()


def test_restart_through_worker_processes_tp2(tmp_path):
    cfg = dict(transfer_mode="workers", tp_size=2, heartbeat_interval_s=0.1,
               worker_timeout_s=2.0, task_timeout_s=10.0)
    compute_and_store(storage_cfg(tmp_path, "a", **cfg))
    with CacheManager(storage_cfg(tmp_path, "b", **cfg)) as mgr:
        a = mgr.allocate("again", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 752 and a.hit.storage_tokens == 752
        check_bytes(mgr, a, 47, tp=2)


def test_corrupt_object_cuts_the_load_to_the_prefix_before_it(tmp_path):
    cfg = storage_cfg(tmp_path, "a")
    compute_and_store(cfg)
    from kvcached.core.hashing import block_hashes, namespace_hash
    h = block_hashes(namespace_hash(cfg.model_id, cfg.weight_version), PROMPT, BS)[20]
    files = [f for f in (tmp_path / "store").rglob("*") if f.is_file() and h.hex() in str(f)]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-1] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:
        a = mgr.allocate("again", PROMPT)
        a.wait(timeout=30)  # a short load is not an error: the rest is recomputed
        assert a.num_cached_tokens == 20 * BS and a.hit.storage_tokens == 20 * BS
        check_bytes(mgr, a, 20)
        mgr.check_invariants()
        mgr.commit("again", PROMPT, len(PROMPT))  # recomputed blocks are stored again
        mgr.free("again")
    with CacheManager(storage_cfg(tmp_path, "c")) as mgr:
        a = mgr.allocate("third", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 752


def test_backend_down_means_recompute_not_errors(tmp_path):
    compute_and_store(storage_cfg(tmp_path, "a"))
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:
        (tmp_path / "store").rename(tmp_path / "store-away")  # the storage vanished
        a = mgr.allocate("again", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 0  # a miss, not an error
        mgr.commit("again", PROMPT, len(PROMPT))
        mgr.free("again")
        mgr.check_invariants()


def test_failed_put_is_never_visible(tmp_path, monkeypatch):
    from kvcached.storage import file as file_backend
    cfg = storage_cfg(tmp_path, "a")

    def broken_put(self, keys, buffers):
        return [False] * len(keys)

    monkeypatch.setattr(file_backend.FileBackend, "put_from", broken_put)
    stored = compute_and_store(cfg)
    assert stored.get("stored", 0) == 0 and stored["store_failed"] == 48
    monkeypatch.undo()
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:
        a = mgr.allocate("again", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 0


def test_weight_version_isolation_in_storage(tmp_path):
    compute_and_store(storage_cfg(tmp_path, "a"))
    with CacheManager(storage_cfg(tmp_path, "b", weight_version="1")) as mgr:
        a = mgr.allocate("new-weights", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 0
    with CacheManager(storage_cfg(tmp_path, "c")) as mgr:
        mgr.update_weights("1")
        a = mgr.allocate("updated", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 0


def test_a_request_across_update_weights_stores_under_its_own_version_or_not_at_all(tmp_path):
    """Its blocks are hashed under the old version: those computed before the
    switch land in the old version's namespace (in flight or not), those
    after are not stored; the new version's namespace gets none of them."""
    store = tmp_path / "store"
    with CacheManager(storage_cfg(tmp_path, "a")) as mgr:
        mgr.allocate("across", PROMPT)
        mgr.commit("across", PROMPT, 24 * BS)  # written through (in flight)
        mgr.update_weights("1")
        mgr.commit("across", PROMPT, len(PROMPT))
        mgr.free("across")
        storage = mgr.stats().storage
    assert storage["stored"] == 24 and storage["write_skipped_version"] == 24, storage
    objects = {d.name: sum(1 for f in d.rglob("*") if f.is_file())
               for d in store.iterdir() if d.is_dir()}
    assert objects == {"kvcached-test@0": 24}, objects  # none under version 1
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:  # the old weights
        a = mgr.allocate("old", PROMPT)
        a.wait(timeout=30)
        assert a.hit.storage_tokens == 24 * BS
    with CacheManager(storage_cfg(tmp_path, "c", weight_version="1")) as mgr:
        a = mgr.allocate("new", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 0


def test_cpu_eviction_keeps_stored_blocks_findable(tmp_path):
    cfg = storage_cfg(tmp_path, "a", num_gpu_blocks=52, num_cpu_blocks=52)
    with CacheManager(cfg) as mgr:
        a = mgr.allocate("p1", PROMPT)
        mgr.commit("p1", PROMPT, len(PROMPT))
        mgr.free("p1")
        other = [t + 1 for t in PROMPT]
        for i in range(2):  # push p1's blocks out of GPU and CPU
            mgr.allocate(f"o{i}", other)
            mgr.commit(f"o{i}", other, len(other))
            mgr.free(f"o{i}")
            other = [t + 1 for t in other]
        mgr.check_invariants()
        a = mgr.allocate("p1-again", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 752
        assert a.hit.storage_tokens > 0
        mgr.check_invariants()


def test_load_failing_on_a_rank_rolls_back(tmp_path, monkeypatch):
    compute_and_store(storage_cfg(tmp_path, "a"))
    from kvcached.transfer.executor import RankExecutor

    def boom(self, task, hashes):
        raise OSError("disk on fire")

    monkeypatch.setattr(RankExecutor, "_load", boom)
    with CacheManager(storage_cfg(tmp_path, "b")) as mgr:
        a = mgr.allocate("again", PROMPT)
        with pytest.raises(TransferFailed, match="disk on fire"):
            a.wait(timeout=30)
        assert a.num_cached_tokens == 0
        mgr.check_invariants()
        mgr.commit("again", PROMPT, len(PROMPT))
        mgr.free("again")
        mgr.check_invariants()
        assert torch.is_tensor(attach_kv_cache(mgr.run_dir, 0)[0])


@pytest.mark.parametrize("mode", ["inprocess", "workers"])
def test_attach_and_detach_storage_at_run_time(tmp_path, mode):
    compute_and_store(storage_cfg(tmp_path, "a"))
    cfg = storage_cfg(tmp_path, "b", storage_backend="none", transfer_mode=mode,
                      heartbeat_interval_s=0.1)
    with CacheManager(cfg) as mgr:
        a = mgr.allocate("before", PROMPT)
        assert a.num_cached_tokens == 0  # no storage attached yet
        mgr.free("before")
        res = mgr.attach_storage("file", str(tmp_path / "store"))
        assert res["changed"] and not mgr.attach_storage("file", str(tmp_path / "store"))["changed"]
        a = mgr.allocate("attached", PROMPT)
        a.wait(timeout=30)
        assert a.num_cached_tokens == 752
        mgr.free("attached")
        assert mgr.detach_storage()["changed"]
        assert not any(n.in_storage for n in mgr.snapshot().nodes.values())
        mgr.check_invariants()
        with pytest.raises(ValueError, match="storage_backend"):
            mgr.attach_storage("floppy", "")


def test_restart_hits_from_redis(tmp_path):
    import shutil
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install_services.sh installs it)")
    from conftest_storage import RedisServer
    srv = RedisServer(tmp_path).start()
    try:
        kw = dict(storage_backend="redis", storage_url=srv.url)
        assert compute_and_store(storage_cfg(tmp_path, "a", **kw))["stored"] == 48
        with CacheManager(storage_cfg(tmp_path, "b", **kw)) as mgr:
            a = mgr.allocate("again", PROMPT)
            a.wait(timeout=30)
            assert a.num_cached_tokens == 752 and a.hit.storage_tokens == 752
            check_bytes(mgr, a, 47)
    finally:
        srv.stop()


def test_reads_never_wait_behind_a_stuck_write(tmp_path):
    """A worker reads storage (lookups, loads) on a lane of its own: a write
    that cannot finish (another writer holds the file store's ledger) does not
    turn the next request's storage hit into a miss, and lands once it can."""
    import fcntl

    # room in both tiers for the stuck write's blocks and the load's
    cfg = dict(transfer_mode="workers", tp_size=1, heartbeat_interval_s=0.1,
               worker_timeout_s=5.0, task_timeout_s=30.0, num_gpu_blocks=128,
               num_cpu_blocks=128)
    compute_and_store(storage_cfg(tmp_path, "a", **cfg))
    other = [(i * 104729 + 11) % 32000 for i in range(768)]  # 48 blocks nobody stored
    with CacheManager(storage_cfg(tmp_path, "b", **cfg)) as mgr:
        ledgers = [open(p, "rb") for p in (tmp_path / "store").glob(".usage*")]
        assert ledgers, "the file store keeps its ledger next to the objects"
        for f in ledgers:  # writes now wait for the ledger (up to its 10 s timeout)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            a = mgr.allocate("writer", other)
            a.wait(timeout=30)
            mgr.commit("writer", other, len(other))  # its write-through is stuck
            mgr.free("writer")
            b = mgr.allocate("again", PROMPT)  # a lookup, then a load, after the write
            assert b.hit.storage_tokens == 752
            b.wait(timeout=30)
            assert b.num_cached_tokens == 752
            check_bytes(mgr, b, 47)
            assert mgr.stats().storage.get("stored", 0) == 0  # the write still waits
        finally:
            for f in ledgers:
                f.close()  # releases the flock
        mgr.commit("again", PROMPT, len(PROMPT))
        mgr.free("again")
    # close() waited for the write: the writer's 48 blocks, and the one block
    # "again" computed
    assert mgr.stats().storage["stored"] == 49
