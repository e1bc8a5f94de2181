"""storage_write_policy: which blocks go to storage, and when.

Scenarios on a tiny layout (blocks of 4 tokens, 8 GPU and 8 CPU blocks, LRU
so that eviction order is exact) with in-process copies and a file store;
``in_storage`` asks the store itself which blocks of a prompt it holds.
"""

from __future__ import annotations

import pytest
from conftest import tiny_config, toks

from kvcached import CacheConfig, CacheManager
from kvcached.core.hashing import block_hashes
from kvcached.storage import BlockStore
from kvcached.tasks import TaskHandle, TaskResult, merge_results
from kvcached.transfer.inprocess import InProcessTransfer


class HeldStore(TaskHandle):
    """A store that runs when someone waits for it (or the test releases it)."""

    __slots__ = ("run",)

    def wait(self, timeout=None) -> bool:
        if self.result is None:
            self.run(self)
        return super().wait(timeout)


class SlowStores(InProcessTransfer):
    """In-process copies, but a store runs (and completes) only when waited on
    or released: stores stay in flight across calls, as with worker processes."""

    def __init__(self, cfg, run_dir):
        super().__init__(cfg, run_dir)
        self.held: list[TaskHandle] = []

    def submit(self, task):
        if task.kind != "store":
            return super().submit(task)
        handle = HeldStore(task, self.completed)
        handle.run = self._run
        task.task_id = next(self._ids)
        self.held.append(handle)
        return handle

    def _run(self, handle: TaskHandle) -> None:
        self.held.remove(handle)
        per_rank = {ex.rank: ex.run(handle.task) for ex in self.executors}
        handle.complete(TaskResult(handle.task.task_id, True, "", per_rank=per_rank,
                                   result=merge_results(per_rank)))

    def release(self, n: int) -> None:
        for h in self.held[:n]:
            self._run(h)


def make_cfg(tmp_path, name: str, policy: str, **kw) -> CacheConfig:
    base = dict(run_dir=str(tmp_path / name), num_gpu_blocks=8, num_cpu_blocks=8,
                eviction_policy="lru", storage_backend="file",
                storage_url=str(tmp_path / "store"), storage_load_policy="wait_complete",
                storage_write_policy=policy)
    return tiny_config(**{**base, **kw})


@pytest.fixture
def instance(tmp_path):
    """Started managers sharing one file store; closed at teardown."""
    made: list[CacheManager] = []

    def make(policy: str, transfer=None, **kw) -> CacheManager:
        """``transfer``: an optional factory ``(cfg, run_dir) -> Transfer``."""
        cfg = make_cfg(tmp_path, f"run{len(made)}", policy, **kw)
        mgr = CacheManager(cfg, transfer=transfer(cfg, cfg.run_dir) if transfer else None)
        mgr.start()
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.close()


def serve(mgr: CacheManager, rid, prompt: list[int]):
    """One request as an engine drives it; returns its allocation."""
    a = mgr.allocate(rid, prompt)
    a.wait(timeout=30)
    mgr.commit(rid, prompt, len(prompt))
    mgr.free(rid)
    return a


def in_storage(mgr: CacheManager, prompt: list[int]) -> list[bool]:
    """Per full block of ``prompt``: whether the store holds its object now."""
    mgr.planner.wait_background(30)  # stores in flight land first
    store = BlockStore.from_config(mgr.cfg, rank=0)
    try:
        hashes = block_hashes(mgr.snapshot().namespace, prompt, mgr.block_size)
        return store.backend.exists(store.keys(hashes))
    finally:
        store.close()


def counters(mgr: CacheManager) -> dict:
    keys = ("stored", "write_skipped_policy", "write_selected", "write_back")
    return {k: v for k, v in mgr.stats().storage.items() if k in keys}


PROMPT = toks(1, 2, 3, tail=1)  # three full blocks


def push_out(mgr: CacheManager, first: int) -> None:
    """Serve three 7-block prompts of fresh blocks: every block cached before
    leaves the GPU tier (8 blocks) and then the CPU tier (8 blocks)."""
    for k in range(first, first + 3):
        serve(mgr, f"push{k}", toks(*range(100 * k, 100 * k + 7), tail=1))


def store_keys(mgr: CacheManager) -> set[str]:
    """Keys of every store task a FlakyTransfer saw."""
    return {k for t in mgr.transfer.submitted if t.kind == "store" for k in t.args["keys"]}


# -------------------------------------------------------------- config
@pytest.mark.parametrize("bad, match", [
    (dict(storage_write_policy="write_around"),
     r"storage_write_policy must be one of 'write_through', 'write_through_selective', "
     r"'write_back'; got 'write_around'"),
    (dict(storage_write_policy=3), r"storage_write_policy must be a string, got 3"),
    (dict(storage_write_threshold=0), r"storage_write_threshold must be >= 1 .* got 0"),
    (dict(storage_write_threshold=-2), r"storage_write_threshold must be >= 1 .* got -2"),
    (dict(storage_write_threshold=1.5), r"storage_write_threshold must be an integer, got 1.5"),
])
def test_config_errors_name_the_field_and_what_is_allowed(bad, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig.load(**bad)


def test_config_from_env_and_toml(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_STORAGE_WRITE_POLICY", "write_back")
    monkeypatch.setenv("KVCACHED_STORAGE_WRITE_THRESHOLD", "3")
    cfg = CacheConfig.load()
    assert (cfg.storage_write_policy, cfg.storage_write_threshold) == ("write_back", 3)
    monkeypatch.setenv("KVCACHED_STORAGE_WRITE_THRESHOLD", "often")
    with pytest.raises(ValueError, match="KVCACHED_STORAGE_WRITE_THRESHOLD='often': "
                                         "storage_write_threshold must be an integer"):
        CacheConfig.load()
    monkeypatch.delenv("KVCACHED_STORAGE_WRITE_THRESHOLD")
    monkeypatch.delenv("KVCACHED_STORAGE_WRITE_POLICY")
    toml = tmp_path / "c.toml"
    toml.write_text('storage_write_policy = "write_through_selective"\n')
    assert CacheConfig.load(toml).storage_write_policy == "write_through_selective"
    toml.write_text('storage_write_policy = "selective"\n')
    with pytest.raises(ValueError, match="storage_write_policy must be one of"):
        CacheConfig.load(toml)


def test_default_policy_is_documented_in_default_toml():
    assert CacheConfig.load().storage_write_policy == CacheConfig().storage_write_policy


# ------------------------------------------------------------- policies
def test_write_through_writes_every_block_at_commit(instance):
    mgr = instance("write_through")
    serve(mgr, "a", PROMPT)
    assert in_storage(mgr, PROMPT) == [True, True, True]
    assert counters(mgr) == {"stored": 3}


def test_write_back_writes_only_what_leaves_the_cpu_tier(instance):
    mgr = instance("write_back")
    serve(mgr, "a", PROMPT)
    assert in_storage(mgr, PROMPT) == [False, False, False]
    assert counters(mgr) == {"write_skipped_policy": 3}
    serve(mgr, "b", toks(*range(10, 17), tail=1))  # 7 blocks: PROMPT goes to the CPU tier
    assert [n.state.name for n in _path(mgr, PROMPT)] == ["CPU", "CPU", "CPU"]
    assert in_storage(mgr, PROMPT) == [False, False, False]
    push_out(mgr, 1)
    # PROMPT left the CPU tier: written on the way out, then dropped.
    assert in_storage(mgr, PROMPT) == [True, True, True]
    assert _path(mgr, PROMPT) == [] or all(n.state.name == "STORAGE"
                                           for n in _path(mgr, PROMPT))
    c = counters(mgr)
    assert c["write_back"] == c["stored"] >= 3
    mgr.check_invariants()


def test_write_back_blocks_are_served_to_another_instance(instance):
    from helpers import FlakyTransfer
    a = instance("write_back")
    serve(a, "a", PROMPT)
    push_out(a, 1)
    b = instance("write_back", transfer=FlakyTransfer)  # records its tasks
    alloc = serve(b, "again", PROMPT)
    assert alloc.hit.storage_tokens == 12
    push_out(b, 4)
    # Loaded from storage, PROMPT left b's CPU tier without being written again.
    hashes = block_hashes(b.snapshot().namespace, PROMPT, b.block_size)
    assert {h.hex() for h in hashes} & store_keys(b) == set()
    assert len(store_keys(b)) == counters(b)["write_back"] > 0
    b.check_invariants()


@pytest.mark.parametrize("threshold, writes", [(1, [True, True, False]),
                                               (2, [False, False, False])])
def test_selective_writes_blocks_reused_threshold_times(instance, threshold, writes):
    mgr = instance("write_through_selective", storage_write_threshold=threshold)
    serve(mgr, "a", PROMPT)
    assert in_storage(mgr, PROMPT) == [False, False, False]
    serve(mgr, "b", toks(1, 2, 9, tail=1))  # reuses blocks 1 and 2 once
    assert in_storage(mgr, PROMPT) == writes
    serve(mgr, "c", toks(1, 2, 8, tail=1))  # and a second time
    assert in_storage(mgr, PROMPT) == [True, True, False]
    assert counters(mgr)["write_selected"] == 2
    assert in_storage(mgr, toks(1, 2, 9, 8)) == [True, True, False, False]
    mgr.check_invariants()


def test_selective_writes_a_reused_block_when_it_leaves_the_cpu_tier(instance):
    """Below the threshold, a block reused at least once is still worth keeping:
    written when evicted; a block never reused is dropped unwritten."""
    mgr = instance("write_through_selective", storage_write_threshold=5)
    serve(mgr, "a", PROMPT)
    serve(mgr, "b", toks(1, 2, 9, tail=1))
    assert in_storage(mgr, PROMPT) == [False, False, False]
    serve(mgr, "c", toks(*range(10, 17), tail=1))
    push_out(mgr, 1)
    assert in_storage(mgr, toks(1, 2, 9)) == [True, True, False]
    assert in_storage(mgr, PROMPT) == [True, True, False]
    c = counters(mgr)
    assert c["write_back"] == 2 and c.get("write_selected", 0) == 0
    mgr.check_invariants()


def test_selective_writes_a_swapped_in_block_from_its_host_copy(instance):
    """A reused block that came back from the CPU tier is stored from its backup."""
    mgr = instance("write_through_selective")
    serve(mgr, "a", PROMPT)
    serve(mgr, "b", toks(*range(10, 17), tail=1))  # PROMPT to the CPU tier
    alloc = serve(mgr, "c", PROMPT)  # a CPU hit: swapped in, the backup stays
    assert alloc.hit.cpu_tokens == 12
    assert in_storage(mgr, PROMPT) == [True, True, True]
    mgr.check_invariants()


def test_write_skips_are_in_status(instance):
    from kvcached.ops.statusview import render_status
    mgr = instance("write_back")
    serve(mgr, "a", PROMPT)
    st = mgr.status()
    assert st["stats"]["storage"]["write_skipped_policy"] == 3
    assert "write_skipped_policy" in render_status(st)


def test_failed_write_back_drops_the_block_without_retrying(instance):
    from helpers import FlakyTransfer
    mgr = instance("write_back", transfer=FlakyTransfer)
    mgr.transfer.fail_kinds.add("store")
    serve(mgr, "a", PROMPT)
    push_out(mgr, 1)  # PROMPT's write-back fails: dropped, never written
    assert in_storage(mgr, PROMPT) == [False, False, False]
    assert _path(mgr, PROMPT) == []
    c = mgr.stats().storage
    assert c["store_failed"] == c["write_back"] >= 3 and c["stored"] == 0
    stores = [t for t in mgr.transfer.submitted if t.kind == "store"]
    assert sum(len(t.src) for t in stores) == c["write_back"]  # each block tried once
    mgr.check_invariants()


def _path(mgr: CacheManager, prompt: list[int]) -> list:
    from helpers import path_nodes
    return path_nodes(mgr, prompt)


# ------------------------------------------------- external GPU tier (vLLM)
def test_engine_tier_write_back_and_selective(tmp_path):
    """With the engine owning the GPU tier, saves fill the CPU tier; under
    write_back a full CPU tier writes its victims before they go, under
    selective a reused block is written when the request lets go."""
    from test_engine_tier import engine_hashes, engine_planes, save

    run = tmp_path / "eng"
    run.mkdir()
    _, region = engine_planes(run, fused=True)
    cfg = CacheConfig.load(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4,
                           fused_kv=True, num_gpu_blocks=16, num_cpu_blocks=4,
                           external_gpu_tier=True, run_dir=str(run), model_id="m",
                           transfer_mode="inprocess", eviction_policy="lru",
                           storage_backend="file", storage_url=str(tmp_path / "store"),
                           storage_write_policy="write_back")
    with CacheManager(cfg) as mgr:
        first, second = engine_hashes("a", 4), engine_hashes("b", 4)
        r = mgr.engine_request(first)
        assert save(mgr, [(r, 4, [0, 1, 2, 3])]) == 4
        mgr.engine_release(r)
        assert counters(mgr) == {"write_skipped_policy": 4}
        # The CPU tier is full of blocks storage lacks: the next save holds
        # them for write-back (it saves nothing now), a later one takes their place.
        r2 = mgr.engine_request(second)
        assert save(mgr, [(r2, 4, [4, 5, 6, 7])]) == 0
        mgr.planner.wait_background(30)
        assert save(mgr, [(r2, 4, [4, 5, 6, 7])]) == 4
        mgr.engine_release(r2)
        assert counters(mgr)["write_back"] == counters(mgr)["stored"] == 4
        mgr.check_invariants()

        mgr.attach_storage("file", str(tmp_path / "store2"))  # a fresh store, same rules
        mgr._set_cfg(mgr.cfg.replace(storage_write_policy="write_through_selective"))
        third = engine_hashes("c", 2)
        for _k in range(2):  # computed, then reused once
            r3 = mgr.engine_request(third)
            save(mgr, [(r3, 2, [8, 9])])
            mgr.engine_release(r3)
        assert counters(mgr)["write_selected"] == 2
        mgr.check_invariants()
    del region


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("eviction", ["lru", "adaptive"])
def test_random_workload_keeps_every_invariant(instance, policy, eviction):
    """Shared prefixes, 1-3 running requests, both tiers evicting: every block
    id stays in exactly one place while stores hold host blocks."""
    from helpers import running_workload
    mgr = instance(policy, eviction_policy=eviction, num_cpu_blocks=6,
                   storage_write_threshold=3)  # selective: both of its rules fire
    for step, _, _ in running_workload(mgr, seed=11, steps=150):
        if step % 5 == 0:
            mgr.check_invariants()
    mgr.planner.wait_background(30)
    mgr.check_invariants()
    c = mgr.stats().storage
    assert c.get("store_failed", 0) == 0
    fired = {k for k in ("write_back", "write_selected", "write_skipped_policy") if c.get(k)}
    assert fired == {"write_through": set(), "write_back": {"write_back", "write_skipped_policy"},
                     "write_through_selective": {"write_back", "write_selected",
                                                 "write_skipped_policy"}}[policy]


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_stores_in_flight_across_calls_keep_every_invariant(instance, policy):
    """Host blocks being stored stay held while GPU eviction runs (a GPU block
    whose CPU descendants are being stored is not dropped under them)."""
    import random

    from helpers import running_workload
    mgr = instance(policy, transfer=SlowStores, num_cpu_blocks=6, storage_write_threshold=2)
    rng = random.Random(5)
    for _ in running_workload(mgr, seed=3, steps=300):
        mgr.check_invariants()
        mgr.transfer.release(rng.randrange(3))
    mgr.transfer.release(len(mgr.transfer.held))
    mgr.planner.reap()
    mgr.check_invariants()
    assert mgr.stats().storage["write_back"] > 0
