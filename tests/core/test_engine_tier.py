"""The external GPU tier (what the vLLM connector drives): the engine owns its
KV planes and block ids, kvcached the CPU tier and storage. An "engine" here
allocates ordinary memory, moves it into shared memory in place and exports
it, as the connector's worker half does; real transfer worker processes copy.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvcached import CacheConfig, CacheManager
from kvcached.memory import kvshare
from kvcached.memory.shared_alloc import shared_empty

LAYOUT = dict(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
ENGINE_BLOCKS = 16


def engine_planes(run_dir, fused: bool, rank: int = 0) -> tuple[list[torch.Tensor], object]:
    """An engine's KV cache: one ordinary buffer viewed per plane (as vLLM's CPU
    build lays it out), moved into shared memory in place and exported."""
    per_plane = 2 * LAYOUT["head_dim"] if fused else LAYOUT["head_dim"]
    n_planes = LAYOUT["num_layers"] * (1 if fused else 2)
    shape = (ENGINE_BLOCKS, LAYOUT["num_kv_heads"], LAYOUT["block_size"], per_plane)
    buf, region = shared_empty((n_planes, *shape), torch.float32, f"test-engine-rank{rank}")
    planes = list(buf.unbind(0))
    kvshare.export_kv_cache(planes, rank, run_dir)
    return planes, region


def fill(planes, ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in planes:
        for i in ids:
            p[i].copy_(torch.rand(p[i].shape, generator=g))


def blocks(planes, ids: list[int]) -> list[torch.Tensor]:
    return [p[i].clone() for p in planes for i in ids]


def engine_hashes(tag: str, n: int) -> list[bytes]:
    """Chained block hashes, as an engine computes them."""
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{tag}/{i}".encode()).digest()
        out.append(parent)
    return out


def manager(tmp_path, name: str, fused: bool = True, **kw) -> CacheManager:
    cfg = CacheConfig.load(**LAYOUT, fused_kv=fused, num_gpu_blocks=ENGINE_BLOCKS,
                           num_cpu_blocks=kw.pop("num_cpu_blocks", 32), external_gpu_tier=True,
                           run_dir=str(tmp_path / name), model_id=kw.pop("model_id", "m"),
                           storage_backend=kw.pop("storage_backend", "none"), **kw)
    return CacheManager(cfg)


def save(mgr: CacheManager, batch) -> int:
    """Save and wait: how many blocks were copied."""
    s = mgr.engine_save(batch)
    if s is None:
        return 0
    assert s.handle.wait(30), "a save did not complete"
    return mgr.engine_finish_save(s)


def load(mgr: CacheManager, creq, start: int, stop: int, ids: list[int]) -> list[int]:
    plan = mgr.engine_load(creq, start, stop, ids)
    handles = [mgr.submit(t) for t in plan.tasks]
    for h in handles:
        assert h.wait(30), "a load did not complete"
    return mgr.engine_finish_load(plan, [h.result for h in handles])


def lookup(mgr, creq, limit: int) -> tuple[int, int]:
    """(CPU-tier blocks, storage blocks after them), as the connector asks: the
    CPU prefix at once, then storage's answer to a lookup task."""
    n_cpu, moving = mgr.engine_cpu_prefix(creq, limit)
    assert not moving
    if n_cpu == limit or not mgr.storage_lookup_wanted(n_cpu, limit):
        return n_cpu, 0
    handle = mgr.engine_storage_lookups([(creq, n_cpu, limit)])
    assert handle.wait(30) and handle.result.ok, handle.result
    return n_cpu, int(handle.result.result["prefixes"][0])


@pytest.fixture
def engine(tmp_path):
    """(planes, manager) of a started engine; closed at teardown."""
    made = []

    def make(name="run", fused=True, **kw):
        run = tmp_path / name
        run.mkdir()
        planes, region = engine_planes(run, fused)
        mgr = manager(tmp_path, name, fused, **kw).start()
        made.append((mgr, region))
        return planes, mgr

    yield make
    for mgr, _ in made:
        mgr.close()


@pytest.mark.parametrize("fused", [True, False])
def test_save_then_load_into_other_engine_blocks(engine, fused):
    planes, mgr = engine(fused=fused)
    hashes = engine_hashes("a", 5)
    fill(planes, [0, 1, 2, 3, 4], seed=1)
    want = blocks(planes, [0, 1, 2, 3, 4])
    saver = mgr.engine_request(hashes)
    assert save(mgr, [(saver, 5, [0, 1, 2, 3, 4])]) == 5
    mgr.engine_release(saver)
    for p in planes:
        p.zero_()

    reader = mgr.engine_request(hashes)
    assert lookup(mgr, reader, 5) == (5, 0)
    assert lookup(mgr, reader, 3) == (3, 0)  # never past the limit
    ids = [9, 7, 11, 8, 10]
    assert load(mgr, reader, 0, 5, ids) == []
    assert all(torch.equal(a, b) for a, b in zip(blocks(planes, ids), want, strict=True))


def test_a_load_starts_where_the_engine_hit_ends(engine):
    planes, mgr = engine()
    hashes = engine_hashes("a", 4)
    fill(planes, [0, 1, 2, 3], seed=2)
    want = blocks(planes, [2, 3])
    save(mgr, [(mgr.engine_request(hashes), 4, [0, 1, 2, 3])])
    for p in planes:
        p.zero_()
    reader = mgr.engine_request(hashes)
    # The engine holds blocks 0-1 itself (ids 5, 6); kvcached brings 2-3 only.
    assert load(mgr, reader, 2, 4, [5, 6, 12, 13]) == []
    assert all(torch.equal(a, b) for a, b in zip(blocks(planes, [12, 13]), want, strict=True))
    assert not any(p[5].any() or p[6].any() for p in planes)


def test_saving_twice_copies_once(engine):
    planes, mgr = engine()
    hashes = engine_hashes("a", 3)
    assert save(mgr, [(mgr.engine_request(hashes), 3, [0, 1, 2])]) == 3
    assert save(mgr, [(mgr.engine_request(hashes), 3, [3, 4, 5])]) == 0
    longer = engine_hashes("a", 5)  # the same conversation, two blocks on
    assert save(mgr, [(mgr.engine_request(longer), 5, [0, 1, 2, 6, 7])]) == 2


def test_storage_serves_a_new_engine(engine, tmp_path):
    store = str(tmp_path / "store")
    planes, mgr = engine("one", storage_backend="file", storage_url=store)
    hashes = engine_hashes("s", 4)
    fill(planes, [0, 1, 2, 3], seed=3)
    want = blocks(planes, [0, 1, 2, 3])
    save(mgr, [(mgr.engine_request(hashes), 4, [0, 1, 2, 3])])
    mgr.planner.wait_background(30)
    mgr.close()

    planes2, mgr2 = engine("two", storage_backend="file", storage_url=store)
    reader = mgr2.engine_request(hashes)
    assert lookup(mgr2, reader, 4) == (0, 4)
    assert load(mgr2, reader, 0, 4, [3, 2, 1, 0]) == []
    assert all(torch.equal(a, b)
               for a, b in zip(blocks(planes2, [3, 2, 1, 0]), want, strict=True))
    assert mgr2.stats().to_dict()["tiers"]["cpu"]["cached"] == 4  # landed in the CPU tier too


def test_another_model_never_sees_the_kv(engine, tmp_path):
    store = str(tmp_path / "store")
    _, mgr = engine("one", storage_backend="file", storage_url=store, model_id="model-a")
    hashes = engine_hashes("x", 3)
    save(mgr, [(mgr.engine_request(hashes), 3, [0, 1, 2])])
    mgr.planner.wait_background(30)
    _, other = engine("two", storage_backend="file", storage_url=store, model_id="model-b")
    assert lookup(other, other.engine_request(hashes), 3) == (0, 0)


def test_a_request_across_update_weights_saves_nothing_to_the_new_version(engine, tmp_path):
    """The connector's path: a request hashed under the old version saves its
    later blocks into the CPU tier, but none goes to storage (the new
    version's namespace); one made after the switch is stored there."""
    store = str(tmp_path / "store")
    _, mgr = engine("one", storage_backend="file", storage_url=store)
    old, new = engine_hashes("w", 4), engine_hashes("v", 2)
    creq = mgr.engine_request(old)
    assert save(mgr, [(creq, 2, [0, 1])]) == 2  # written through under version 0
    mgr.update_weights("1")
    assert save(mgr, [(creq, 4, [0, 1, 2, 3])]) == 2
    mgr.engine_release(creq)
    fresh = mgr.engine_request(new)
    assert save(mgr, [(fresh, 2, [4, 5])]) == 2
    mgr.engine_release(fresh)
    mgr.planner.wait_background(30)
    assert mgr.stats().storage["stored"] == 4  # 2 old before the switch, 2 new
    assert not mgr.planner.stale and not mgr._engine_reqs  # nothing kept past release
    _, v1 = engine("two", storage_backend="file", storage_url=store, weight_version="1")
    assert lookup(v1, v1.engine_request(old), 4) == (0, 0)
    assert lookup(v1, v1.engine_request(new), 2) == (0, 2)


def test_paused_is_a_miss_and_saves_nothing(engine):
    _, mgr = engine()
    hashes = engine_hashes("p", 2)
    save(mgr, [(mgr.engine_request(hashes), 2, [0, 1])])
    mgr.pause()
    assert lookup(mgr, mgr.engine_request(hashes), 2) == (0, 0)
    assert save(mgr, [(mgr.engine_request(engine_hashes("q", 2)), 2, [2, 3])]) == 0
    mgr.resume()
    assert lookup(mgr, mgr.engine_request(hashes), 2) == (2, 0)


def test_a_lost_load_names_every_block_it_owed(engine):
    planes, mgr = engine()
    hashes = engine_hashes("l", 3)
    save(mgr, [(mgr.engine_request(hashes), 3, [0, 1, 2])])
    reader = mgr.engine_request(hashes)
    plan = mgr.engine_load(reader, 0, 3, [4, 5, 6])
    from kvcached.tasks import TaskResult
    lost = [TaskResult(0, False, "worker lost", True) for _ in plan.tasks]
    assert mgr.engine_finish_load(plan, lost) == [4, 5, 6]
    mgr.engine_release(reader)
    assert lookup(mgr, mgr.engine_request(hashes), 3) == (3, 0)  # still cached


def test_engine_calls_need_the_external_tier(make_manager):
    mgr = make_manager()
    with pytest.raises(RuntimeError, match="external_gpu_tier = true"):
        mgr.engine_request([b"x" * 32])


def test_external_tier_config_errors():
    with pytest.raises(ValueError, match="cannot create them: set create_cache = false"):
        CacheConfig.load(**LAYOUT, external_gpu_tier=True, create_cache=True)
    with pytest.raises(ValueError, match="fused_kv .* and mla .* exclude each other"):
        CacheConfig.load(**LAYOUT, fused_kv=True, mla=True)


def test_a_prefix_on_its_way_in_is_moving_until_it_lands(engine, tmp_path):
    """A request whose blocks are being loaded from storage for another one is
    told so: the connector asks again once they land (in the CPU tier) instead
    of taking the part before."""
    store = str(tmp_path / "store")
    _, mgr = engine("one", storage_backend="file", storage_url=store)
    hashes = engine_hashes("m", 4)
    save(mgr, [(mgr.engine_request(hashes), 4, [0, 1, 2, 3])])
    mgr.planner.wait_background(30)
    mgr.close()
    _, mgr2 = engine("two", storage_backend="file", storage_url=store)
    first = mgr2.engine_request(hashes)
    plan = mgr2.engine_load(first, 0, 4, [4, 5, 6, 7])  # planned: its nodes are on their way
    second = mgr2.engine_request(hashes)
    assert mgr2.engine_cpu_prefix(second, 4) == (0, True)
    handles = [mgr2.submit(task) for task in plan.tasks]
    assert all(h.wait(30) for h in handles)
    assert mgr2.engine_finish_load(plan, [h.result for h in handles]) == []
    assert mgr2.engine_cpu_prefix(second, 4) == (4, False)


def test_no_storage_lookup_without_storage(engine):
    _, mgr = engine()
    assert not mgr.storage_lookup_wanted(0, 3)
    assert mgr.engine_storage_lookups([(mgr.engine_request(engine_hashes("n", 3)), 0, 3)]) is None


def test_scheduler_step_time_in_status(engine):
    """What an engine's scheduler spends in kvcached per step: p50/p99 in status."""
    from kvcached.ops.statusview import render_status
    _, mgr = engine()
    assert "scheduler_step_us" not in mgr.status()
    for us in [10] * 98 + [500, 900]:
        mgr.record_engine_step(us / 1e6, us / 2e6)
    step = mgr.status()["scheduler_step_us"]
    assert step == {"steps": 100, "p50": 10.0, "p99": 900.0, "max": 900.0,
                    "cpu_p50": 5.0, "cpu_p99": 450.0}
    text = render_status(mgr.status())
    assert "p50 10.0 us, p99 900.0 us" in text and "CPU p50 5.0 us, p99 450.0 us" in text


def test_kv_events_of_the_cpu_tier_and_storage_name_the_engine_hashes(engine, tmp_path):
    """What the vLLM connector hands to vLLM's KV events: each block stored in
    or removed from the CPU tier or storage, by its key (``engine_keys``: the
    connector names it by vLLM's own hash)."""
    planes, mgr = engine(num_cpu_blocks=4, storage_backend="file",
                         storage_url=str(tmp_path / "store"))
    mgr.keep_kv_events()
    a, b = engine_hashes("a", 3), engine_hashes("b", 3)
    saver = mgr.engine_request(a)
    save(mgr, [(saver, 3, [0, 1, 2])])
    mgr.engine_release(saver)
    got: list = []
    deadline = time.monotonic() + 30  # storage writes land after the save
    while sum(1 for s, tier, _ in got if s and tier == "storage") < 3:
        assert time.monotonic() < deadline, got
        got += mgr.take_kv_events()
        time.sleep(0.01)
    ka, kb = mgr.engine_keys(a), mgr.engine_keys(b)
    assert [h for s, tier, h in got if s and tier == "cpu"] == ka
    assert sorted(h for s, tier, h in got if s and tier == "storage") == sorted(ka)
    save(mgr, [(mgr.engine_request(b), 3, [3, 4, 5])])  # 4 CPU blocks: 2 of a leave
    got = mgr.take_kv_events()
    assert [h for s, tier, h in got if s and tier == "cpu"] == kb
    assert len([h for s, tier, h in got if not s and tier == "cpu"]) == 2
    assert {h for s, tier, h in got if not s} <= set(ka)


def test_one_lookup_task_answers_every_request_of_a_step(engine, tmp_path):
    """The connector asks storage about every request of a step at once: one
    task, one backend call, a prefix per request."""
    planes, mgr = engine(storage_backend="file", storage_url=str(tmp_path / "store"))
    a, b = engine_hashes("a", 4), engine_hashes("b", 3)
    saver = mgr.engine_request(a)
    save(mgr, [(saver, 4, [0, 1, 2, 3])])
    mgr.engine_release(saver)
    deadline = time.monotonic() + 30  # storage writes land after the save
    while mgr.stats().storage.get("stored", 0) < 4:
        assert time.monotonic() < deadline, mgr.stats().storage
        time.sleep(0.01)
    longer = a + engine_hashes("a2", 2)  # a's 4 blocks, then 2 never stored
    runs = [(mgr.engine_request(longer), 1, 6), (mgr.engine_request(b), 0, 3),
            (mgr.engine_request(a), 0, 4)]
    handle = mgr.engine_storage_lookups(runs)
    assert handle.wait(30) and handle.result.ok, handle.result
    assert handle.result.result["prefixes"] == [3, 0, 4]



def test_a_probe_is_looked_with_and_never_kept(tmp_path):
    """A request made only to look with (a window block's CPU-tier check, a
    lookup's keys) answers as an engine request does, and the manager keeps
    no reference to it: a connector that drops it leaks nothing. An engine
    request is kept until it is released (update_weights marks it)."""
    import sys
    mgr = manager(tmp_path, "probe", storage_backend="none")
    hashes = engine_hashes("probe", 3)
    probe, held = mgr.engine_probe(hashes), mgr.engine_request(hashes)
    assert probe.hashes(0, 3) == held.hashes(0, 3)
    # the manager's one reference, counted by the interpreter's own count
    assert sys.getrefcount(held) == sys.getrefcount(probe) + 1
    mgr.engine_release(held)
    assert sys.getrefcount(held) == sys.getrefcount(probe)
