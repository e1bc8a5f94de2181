"""The native core's adaptive eviction policy against its reference.

- The reference policy's calls (tests/reference/policy.py ``Recorder``), on
  random call sequences and on workloads through the tree simulator, are
  replayed into the native one (``_core.Policy``), comparing every victim
  and, at the end, the learned tables.
- The core's own calls, recorded inside a real ``CacheManager`` (GPU and CPU
  tiers), are replayed into the reference (the other direction).
- A GPU-only manager with the adaptive policy gets the simulator's hits,
  request for request, when the simulator keys blocks as the manager does.
- Exact small scenarios through the real manager: a leaf with a known future
  reuse survives one-off prompts; a ghost hit promotes its class.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile

import pytest
from conftest import tiny_config, toks
from helpers import path_nodes
from reference.policy import (
    AdaptiveParams,
    AdaptivePolicy,
    LRUPolicy,
    Recorder,
    replay_calls,
)
from reference.simulator import BlockRequest, simulate, to_block_requests
from test_policy_reference import returning_conversation, tiny_chat, tiny_mix, tiny_think

from kvcached import CacheConfig, CacheManager
from kvcached.core import _core
from kvcached.core.hashing import namespace_hash
from kvcached.tools.workload import (
    ChatRequest,
    iter_think_time_workload,
    mix_one_off_prompts,
    replay,
)

# The defaults, and variants that exercise every branch of the port: small and
# narrow ghosts (8- and 16-bit entries, few ways, none at all), one class, few
# bins (the ring wraps quickly), slow and no decay, coarse windows.
PARAMS = {
    "default": AdaptiveParams(),
    # min_window=1: windows of capacity // 600 ticks (one) even in these small
    # tiers, so the sequences below go through many windows and rebuilds
    "small_window": AdaptiveParams(min_window=1),
    "ghost16": AdaptiveParams(ghost_bits=16, ghost_win_bits=6, ghost_factor=4, min_window=1),
    "ghost8": AdaptiveParams(ghost_bits=8, ghost_win_bits=5, ghost_factor=2, ways=4,
                             min_window=1),
    "ghost32x2way": AdaptiveParams(ghost_factor=16, ways=2, min_window=1),
    "no_ghost": AdaptiveParams(ghost_factor=0, min_window=1),
    "one_class": AdaptiveParams(classes=1, min_window=1),
    "few_bins": AdaptiveParams(bins=3, windows_per_capacity=1, decay_shift=1, min_window=1),
    "many": AdaptiveParams(classes=16, bins=130, windows_per_capacity=2, decay_shift=62,
                           min_window=1),
}


def native(capacity: int, params: AdaptiveParams) -> _core.Policy:
    return _core.Policy(capacity, dataclasses.asdict(params))


def random_calls(pol, rng: random.Random, steps: int, keyspace: int) -> None:
    """Drive ``pol`` with random valid calls: blocks come and go, become leaves and
    stop being ones, get hit, are evicted by victim() or otherwise."""
    held: set[int] = set()
    leaves: set[int] = set()
    now = 0
    for _ in range(steps):
        # the caller's clock: mostly steps of a few ticks, now and then an idle gap
        now += rng.choice((0, 0, 1, 1, 2, 5)) if rng.random() < 0.995 else rng.randrange(50, 5000)
        op = rng.random()
        if op < 0.3 or not held:
            key = rng.getrandbits(64) if rng.random() < 0.3 else rng.randrange(keyspace)
            if key in held:
                continue
            pol.on_insert(key, rng.randrange(1, 9), now)
            held.add(key)
            if rng.random() < 0.7:
                pol.add_leaf(key)
                leaves.add(key)
        elif op < 0.45:
            key = rng.choice(sorted(held))
            if key in leaves and rng.random() < 0.5:
                pol.remove_leaf(key)
                leaves.discard(key)
            pol.on_hit(key, now)
        elif op < 0.55:
            free = sorted(held - leaves)
            if free:
                key = rng.choice(free)
                pol.add_leaf(key)
                leaves.add(key)
        elif op < 0.6 and leaves:
            key = rng.choice(sorted(leaves))
            pol.remove_leaf(key)
            leaves.discard(key)
        elif op < 0.65:
            free = sorted(held - leaves)
            if free:  # a copy that leaves the tier without being a victim
                key = rng.choice(free)
                pol.on_evict(key)
                held.discard(key)
        else:
            key = pol.victim()
            if key is not None:
                leaves.discard(key)
                if rng.random() < 0.9:
                    pol.on_evict(key)
                    held.discard(key)
                else:  # re-listed (a failed copy puts it back)
                    pol.add_leaf(key)
                    leaves.add(key)


def assert_same_tables(ref: AdaptivePolicy, port: _core.Policy) -> None:
    t = port.tables()
    assert t["hits"] == ref.hits and t["ends"] == ref.ends and t["density"] == ref.density
    assert (port.tick, port.cur_win, port.window) == (ref.tick, ref.cur_win, ref.window)
    assert (port.ghost_size, port.ghost_hits) == (ref.ghost.size, ref.ghost_hits)
    assert port.leaves() == ref.leaves()


# ------------------------------------------------ reference -> native replay
@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_random_calls_replay_into_the_port(name, capacity):
    params = PARAMS[name]
    for seed in range(4):
        rec = Recorder(AdaptivePolicy(capacity, params))
        random_calls(rec, random.Random(seed), 3000, keyspace=4 * capacity + 8)
        port = native(capacity, params)
        assert replay_calls(port, rec.log) == len(rec.log)
        assert sum(1 for n, _, r in rec.log if n == "victim" and r is not None) > 100
        assert_same_tables(rec.policy, port)
        assert port.order() == _reference_order(rec.policy)


def _reference_order(pol: AdaptivePolicy) -> list[int]:
    """The reference's leaves in the order victim() would take them."""
    last = pol.params.bins - 1
    out = []
    for c, b in pol.ranks:
        where = (c, -1) if b == last else (c, pol.cur_win - b)
        out += list(pol.buckets.get(where, ()))
    return out


@pytest.mark.parametrize("name", ["default", "ghost16", "ghost8", "few_bins"])
@pytest.mark.parametrize("make", [tiny_chat, tiny_think, tiny_mix])
def test_workload_runs_replay_into_the_port(name, make):
    params = PARAMS[name]
    for seed in range(2):
        blocks = to_block_requests(make(500, seed), 4)
        smallest = max(b.blocks_needed for b in blocks)
        for capacity in (smallest, 2 * smallest, 5 * smallest):
            rec = Recorder(AdaptivePolicy(capacity, params))
            res = simulate(blocks, capacity, rec)
            port = native(capacity, params)
            assert replay_calls(port, rec.log) == len(rec.log)
            assert res.evictions > 0
            assert_same_tables(rec.policy, port)


def test_a_long_run_where_the_ghost_wraps_replays_into_the_port():
    """Thousands of windows: ghost windows wrap (mod 2**win_bits), old lists fill,
    the tables decay over many rebuilds."""
    params = AdaptiveParams(ghost_bits=16, ghost_win_bits=6, ghost_factor=4, min_window=16)
    blocks = to_block_requests(tiny_mix(6000, 11), 4)
    rec = Recorder(AdaptivePolicy(24, params))
    simulate(blocks, 24, rec)
    assert rec.policy.cur_win > 2 ** 6 * 4
    port = native(24, params)
    assert replay_calls(port, rec.log) == len(rec.log)
    assert_same_tables(rec.policy, port)


def test_the_port_refuses_calls_the_reference_refuses():
    pol = _core.Policy(8)
    pol.on_insert(1, 1, 0)
    with pytest.raises(ValueError, match="already"):
        pol.on_insert(1, 1, 0)
    pol.add_leaf(1)
    with pytest.raises(ValueError, match="leaf already"):
        pol.add_leaf(1)
    with pytest.raises(ValueError, match="listed"):
        pol.on_evict(1)
    with pytest.raises(KeyError):
        pol.on_hit(2, 0)
    assert pol.victim() == 1 and pol.victim() is None
    with pytest.raises(KeyError, match="not a leaf"):
        pol.remove_leaf(1)
    pol.on_evict(1)
    assert pol.ghost_size == 1
    with pytest.raises(ValueError, match="capacity"):
        _core.Policy(0)
    with pytest.raises(ValueError, match="unknown policy parameter"):
        _core.Policy(8, {"clases": 4})
    with pytest.raises(ValueError, match="fingerprint"):
        _core.Policy(8, {"ghost_bits": 8, "ghost_win_bits": 6})
    with pytest.raises(ValueError, match="fingerprint"):
        AdaptiveParams(ghost_bits=8, ghost_win_bits=6)


def test_a_ghost_hit_in_the_port_promotes_and_teaches_its_age():
    """The reference's scenario (test_policy_reference), on the port."""
    pol = _core.Policy(8, {"min_window": 1})  # window = 1 tick
    pol.on_insert(12345, 1, 1)  # clock 1
    pol.add_leaf(12345)
    assert pol.victim() == 12345
    pol.on_evict(12345)
    for filler in range(5):
        pol.on_insert(filler, 1, 2 + filler)
    pol.on_insert(12345, 1, 7)  # clock 7: remembered, last used in window 1
    assert pol.entry(12345) == (1, 7) and pol.ghost_hits == 1
    hits = pol.tables()["hits"]
    assert hits[0][6] == 1 << 16 and sum(map(sum, hits)) == 1 << 16


# ------------------------------------------------ the core, through a manager
def gpu_only(run_dir: str, capacity: int, block_size: int, policy: str, **kw) -> CacheManager:
    cfg = CacheConfig.load(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32",
                           block_size=block_size, num_gpu_blocks=capacity, num_cpu_blocks=0,
                           transfer_mode="inprocess", create_cache=True, storage_backend=None,
                           check_host_memory=False, control_socket=False, run_dir=run_dir,
                           eviction_policy=policy, **kw)
    return CacheManager(cfg).start()


def manager_hits(requests, capacity: int, block_size: int, policy: str) -> list[int]:
    """Each request's GPU hit blocks (-1: rejected) through a GPU-only manager."""
    seen = [(0, 0)]
    with tempfile.TemporaryDirectory(prefix="kvc-pol-", dir="/tmp") as run_dir:
        with gpu_only(run_dir, capacity, block_size, policy) as mgr:
            replay(mgr, requests, on_progress=lambda done, res: seen.append(
                (res["hit_tokens"]["gpu"], res["rejected"])))
            mgr.check_invariants()
    return [-1 if r1 > r0 else (h1 - h0) // block_size
            for (h0, r0), (h1, r1) in zip(seen, seen[1:])]


@pytest.mark.parametrize("capacity", [14, 40, 90])
def test_the_managers_adaptive_hits_are_the_simulators(capacity):
    """With the manager's block keys (the ghost hashes them), the simulated adaptive
    policy is the manager's, hit for hit: the core makes the simulator's calls."""
    requests = tiny_mix(400, seed=capacity) + tiny_chat(200, seed=capacity)
    for i, r in enumerate(requests):
        r.request_id = i
    blocks = to_block_requests(requests, 4, namespace=namespace_hash("", "0", ""))
    sim = simulate(blocks, capacity, AdaptivePolicy(capacity), per_request=True)
    assert sim.per_request == manager_hits(requests, capacity, 4, "adaptive")
    assert sim.evictions > 0


def test_the_cores_calls_in_both_tiers_replay_into_the_reference(tmp_path):
    """A GPU + CPU manager (swap-outs, CPU drops, swap-ins) serving a workload: the
    calls the core made on each tier's policy, replayed into the reference."""
    cfg = tiny_config(run_dir=str(tmp_path), num_gpu_blocks=40, num_cpu_blocks=60,
                      eviction_policy="adaptive")
    with CacheManager(cfg).start() as mgr:
        mgr.core.set_policy_log(True)
        requests = tiny_mix(800, seed=3)
        replay(mgr, requests)
        mgr.check_invariants()
        log = mgr.core.drain_policy_log()
        stats = mgr.core.policy_stats()
    refs = {0: AdaptivePolicy(40), 1: AdaptivePolicy(60)}
    victims = {0: 0, 1: 0}
    for tier, name, key, now in log:
        args = {"on_insert": (key, 0, now), "on_hit": (key, now), "victim": ()}.get(name, (key,))
        replay_calls(refs[tier], [(name, args, key if name == "victim" else None)])
        victims[tier] += name == "victim" and key is not None
    assert min(victims.values()) > 100
    for tier, name in ((0, "gpu"), (1, "cpu")):
        ref = refs[tier]
        assert stats[name]["ghost_hits"] == ref.ghost_hits > 0
        assert stats[name]["ghost_entries"] == ref.ghost.size
        assert stats[name]["inserts"] == ref.inserts


# ---------------------------------------------- scenarios through a manager
def conversation_tokens(blocks: list[int], bs: int) -> list[int]:
    """A prompt of whole blocks (block b: bs copies of b) plus one token."""
    return toks(*blocks, bs=bs, tail=1)


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_returning_conversation_survives_one_off_prompts(tmp_path, policy):
    """Conversation A (4 blocks) comes back every round; between its turns, four
    one-off prompts of 6 blocks each fill the 24-block GPU tier. LRU has always
    just evicted A when it returns; the adaptive policy learns (through the
    ghost) that A's blocks come back and the one-offs' never do, and keeps A:
    the simulator's scenario (test_policy_reference), through the real manager."""
    rounds, label = 40, 1000
    a = [1, 2, 3, 4]
    hits = []
    with gpu_only(str(tmp_path), 24, 4, policy) as mgr:
        for r in range(rounds):
            alloc = mgr.allocate(("a", r), conversation_tokens(a, 4))
            hits.append(alloc.num_cached_tokens // 4)
            mgr.commit(("a", r), conversation_tokens(a, 4), 17)
            mgr.free(("a", r))
            for k in range(4):
                one_off = conversation_tokens(list(range(label, label + 6)), 4)
                label += 6
                alloc = mgr.allocate(("x", r, k), one_off)
                assert alloc.num_cached_tokens == 0
                mgr.commit(("x", r, k), one_off, len(one_off))
                mgr.free(("x", r, k))
        mgr.check_invariants()
    if policy == "lru":
        assert hits == [0] * rounds
    else:
        assert hits[-10:] == [4] * 10
    ref = AdaptivePolicy(24) if policy == "adaptive" else LRUPolicy()
    sim = simulate(returning_conversation(rounds), 24, ref, per_request=True).per_request
    assert [sim[i] for i in range(0, 5 * rounds, 5)][-10:] == hits[-10:]


@pytest.mark.parametrize("capacity, lru, at_least, coarse", [
    (19574, 0.425, 1.51, 1.5115),  # LRU gets half of the unbounded hit rate here
    (27447, 0.639, 1.20, 1.2076),  # three quarters
])
def test_think_time_turns_need_age_bins_finer_than_a_turns_gap(capacity, lru, at_least,
                                                               coarse):
    """Turns come back 200-1000 requests later (400-2000 ticks of the clock):
    256 bins of capacity // 600 ticks (33-46 here) tell those ages apart. 64
    bins four times as wide (the same horizon) lump them together and keep
    somewhat worse conversations (``coarse``: that policy's ratio to LRU; under
    the insert clock it cost 2-3%, under the request clock under 1%). A seeded
    run of the benchmark's think workload, 5000 requests."""
    reqs = iter_think_time_workload(5000, seed=0, think_time=(200, 1000), turns=(2, 16),
                                    system_tokens=128)
    blocks = to_block_requests(reqs, 32)
    base = simulate(blocks, capacity, LRUPolicy()).hit_rate
    assert base == pytest.approx(lru, abs=5e-4)

    def ratio(params: AdaptiveParams) -> float:
        return simulate(blocks, capacity, native(capacity, params)).hit_rate / base

    fine = ratio(AdaptiveParams())
    assert fine >= at_least
    wide = ratio(AdaptiveParams(bins=64, windows_per_capacity=150))
    assert wide == pytest.approx(coarse, abs=5e-4) and wide < fine


@pytest.mark.parametrize("capacity, lru, at_least", [
    (12540, 0.1350, 2.70),  # LRU gets a fifth of the unbounded hit rate here
    (23518, 0.3529, 1.58),  # half
])
def test_one_off_prompts_are_ended_before_the_ghost_overwrites_them(capacity, lru, at_least):
    """One-off long prompts (5%) among think-time turns. A ghost of 8x the
    capacity overwrites its first entry only after 8x the capacity in
    evictions, later than this whole run: when ends were counted only then,
    the tables never saw a never-reused block, the one-offs looked as good as
    the turns and pushed them out (2.64x and 1.50x LRU here). Each eviction
    counts as an end at once (undone if the block returns), so the tables see
    them in time."""
    reqs = mix_one_off_prompts(iter_think_time_workload(
        5000, seed=0, think_time=(200, 1000), turns=(2, 16), system_tokens=128), seed=1)
    blocks = to_block_requests(reqs, 32)
    base = simulate(blocks, capacity, LRUPolicy()).hit_rate
    assert base == pytest.approx(lru, abs=5e-4)
    pol = native(capacity, AdaptiveParams())
    assert simulate(blocks, capacity, pol).hit_rate / base >= at_least
    assert pol.tables()["ends"] != [[0] * 256] * 4


def test_a_ghost_hit_promotes_its_class_in_the_manager(tmp_path):
    """A block evicted and computed again is one the ghost remembers: it comes back
    in class 1 (a block seen for the first time starts in class 0), the tier counts
    a ghost hit, and a hit on it promotes it again."""
    with gpu_only(str(tmp_path), 8, 4, "adaptive") as mgr:
        def serve(rid, blocks):
            tokens = conversation_tokens(blocks, 4)
            alloc = mgr.allocate(rid, tokens)
            mgr.commit(rid, tokens, len(tokens))
            path = [n.id for n in _path(mgr, tokens)]
            mgr.free(rid)
            return alloc.num_cached_tokens // 4, path

        _, (x,) = serve("x", [7])
        assert mgr.core.policy_node(0, x)[:1] == (0,)
        serve("big", [100, 101, 102, 103, 104, 105, 106])  # 8 blocks: x is evicted
        assert mgr.core.num_nodes == 7
        assert mgr.core.policy_stats()["gpu"]["ghost_entries"] == 1
        hit, (x,) = serve("x again", [7])
        assert hit == 0  # a miss, computed again...
        cls, _, listed = mgr.core.policy_node(0, x)
        assert (cls, listed) == (1, True)  # ...that the ghost remembered: promoted
        gpu = mgr.core.policy_stats()["gpu"]  # x left the ghost; big's tail, evicted
        assert gpu["ghost_hits"] == 1 and gpu["ghost_entries"] == 1  # for room, joined it
        hit, _ = serve("x hit", [7])
        assert hit == 1 and mgr.core.policy_node(0, x)[0] == 2
        assert mgr.stats().evictions["gpu_dropped"] == 2
        mgr.check_invariants()


def _path(mgr, tokens):
    return path_nodes(mgr, tokens)


def test_a_refused_allocation_changes_no_policy_state(tmp_path):
    """NoFreeBlocks leaves everything as it was: the hits of a refused match are
    not counted, no leaf moves."""
    from kvcached import NoFreeBlocks
    with gpu_only(str(tmp_path), 8, 4, "adaptive") as mgr:
        tokens = conversation_tokens([1, 2, 3], 4)
        mgr.allocate("a", tokens)
        mgr.commit("a", tokens, len(tokens))
        mgr.free("a")
        mgr.allocate("hold", conversation_tokens([9], 4), reserve_tokens=8)  # 4 blocks held
        before = (mgr.core.policy_stats(), [mgr.core.policy_node(0, n.id)
                                            for n in _path(mgr, tokens)], mgr.snapshot().gpu_lru)
        with pytest.raises(NoFreeBlocks):
            mgr.allocate("b", tokens, reserve_tokens=64)
        after = (mgr.core.policy_stats(), [mgr.core.policy_node(0, n.id)
                                           for n in _path(mgr, tokens)], mgr.snapshot().gpu_lru)
        assert before == after
        mgr.check_invariants()


def test_block_requests_with_namespace_use_the_managers_keys():
    ns = namespace_hash("m", "0")
    reqs = [ChatRequest(0, 0, 0, list(range(10)), [1, 2])]
    (b,) = to_block_requests(reqs, 4, namespace=ns)
    assert b == BlockRequest(b.keys, 10, 12, 4) and len(b.keys) == 3
    from kvcached.core.hashing import block_hashes
    assert b.keys == [int.from_bytes(h[:8], "little")
                      for h in block_hashes(ns, list(range(10)) + [1, 2], 4)]


# ------------------------------------------------------ status and metrics
@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_status_and_metrics_show_the_policy_and_its_ghost(tmp_path, policy):
    """A GPU + CPU manager that evicted, and whose tiers saw evicted blocks come
    back: stats().policy, `kvcached status`'s text and /metrics agree."""
    from helpers import metric, scrape

    from kvcached.ops.metrics import MetricsServer
    from kvcached.ops.statusview import render_status

    cfg = tiny_config(run_dir=str(tmp_path), num_gpu_blocks=16, num_cpu_blocks=24,
                      eviction_policy=policy)
    with CacheManager(cfg).start() as mgr:
        replay(mgr, tiny_think(300, seed=1))
        pol = mgr.stats().policy
        assert pol["name"] == policy
        text = render_status(mgr.status())
        assert f"eviction policy: {policy}" in text
        with MetricsServer(mgr) as server:
            scraped = scrape(server.url)
    assert metric(scraped, "kvcached_eviction_policy", policy=policy) == 1
    if policy == "lru":
        assert set(pol) == {"name"} and "ghost" not in text
        return
    for tier, blocks in (("gpu", 16), ("cpu", 24)):
        p = pol[tier]
        assert p["ghost_slots"] == 8 * blocks and p["ghost_bytes"] == 4 * p["ghost_slots"]
        assert 0 < p["ghost_entries"] <= p["ghost_slots"]
        assert p["ghost_hits"] > 0 and p["hits"] > 0 and p["inserts"] > 0
        assert p["ghost_hit_share"] == pytest.approx(
            p["ghost_hits"] / (p["hits"] + p["ghost_hits"]))
        assert (f"{tier}: ghost {p['ghost_entries']} of {p['ghost_slots']} entries") in text
        # nothing ran between the stats and the scrape
        assert metric(scraped, "kvcached_ghost_entries", tier=tier) == p["ghost_entries"]
        assert metric(scraped, "kvcached_ghost_hits_total", tier=tier) == p["ghost_hits"]
        assert metric(scraped, "kvcached_policy_hits_total", tier=tier) == p["hits"]
        assert metric(scraped, "kvcached_ghost_hit_share", tier=tier) == pytest.approx(
            p["ghost_hit_share"])
