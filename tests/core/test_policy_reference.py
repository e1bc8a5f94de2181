"""The reference eviction policies, the tree-semantics simulator and the workloads
they are measured on (``tests/reference``, ``kvcached.tools.workload``).

Scenarios drive the policies through the simulator (or their interface
directly) with hand-made block chains; the simulator's LRU is checked hit
for hit against the real ``CacheManager``; random workloads check the
invariants of every policy and that the offline optimum never loses to LRU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from reference.optimum import NEVER, OptimumPolicy
from reference.policy import (
    ONE,
    AdaptiveParams,
    AdaptivePolicy,
    Ghost,
    LRUPolicy,
    Recorder,
    replay_calls,
    splitmix64,
)
from reference.simulator import BlockRequest, block_key, simulate, to_block_requests

from kvcached import CacheConfig, CacheManager
from kvcached.tools.workload import (
    generate_chat_workload,
    iter_think_time_workload,
    mix_one_off_prompts,
    replay,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_policy as bench  # noqa: E402


# ------------------------------------------------------------------ helpers
def chain(*labels: int) -> list[int]:
    """The keys of a prefix made of one-token blocks ``labels`` (block size 1)."""
    keys, parent = [], 0
    for label in labels:
        parent = block_key(parent, [label])
        keys.append(parent)
    return keys


def req(keys: list[int]) -> BlockRequest:
    """A request whose prompt is ``keys`` plus one more token (block size 1): it can
    match all of ``keys``, caches them, and needs one private block more."""
    return BlockRequest(keys, len(keys) + 1, len(keys) + 1, 1)


def tiny_think(n: int, seed: int, **kw) -> list:
    args = dict(think_time=(3, 30), turns=(1, 6), num_system_prompts=2, system_tokens=8,
                turn_tokens=(1, 6), output_tokens=(1, 5), vocab=3)
    return list(iter_think_time_workload(n, seed=seed, **{**args, **kw}))


def tiny_chat(n: int, seed: int) -> list:
    return generate_chat_workload(n, seed=seed, num_system_prompts=2, system_tokens=8,
                                  turn_tokens=(1, 6), output_tokens=(1, 5), max_turns=5,
                                  concurrent_conversations=4, vocab=3)


def tiny_mix(n: int, seed: int) -> list:
    return list(mix_one_off_prompts(tiny_think(n, seed), seed=seed, fraction=0.1,
                                    prompt_tokens=(8, 30), output_tokens=(1, 4), vocab=3))


POLICIES = {"lru": lambda blocks, c: LRUPolicy(), "adaptive": lambda blocks, c: AdaptivePolicy(c),
            "optimum": lambda blocks, c: OptimumPolicy(blocks)}


# --------------------------------------------------------------- scenarios
def returning_conversation(rounds: int) -> list[BlockRequest]:
    """Conversation A (4 blocks) comes back every round; between its turns, four
    one-off prompts of 6 blocks each (24 blocks: as much as the cache holds)."""
    reqs, label = [], 1000
    a = chain(1, 2, 3, 4)
    for _ in range(rounds):
        reqs.append(req(a))
        for _ in range(4):
            reqs.append(req(chain(*range(label, label + 6))))
            label += 6
    return reqs


def test_a_leaf_that_comes_back_survives_one_off_prompts():
    reqs = returning_conversation(rounds=40)
    turns = range(0, len(reqs), 5)  # A's requests
    last = turns[-10:]
    lru = simulate(reqs, 24, LRUPolicy(), per_request=True).per_request
    ada = simulate(reqs, 24, AdaptivePolicy(24), per_request=True).per_request
    opt = simulate(reqs, 24, OptimumPolicy(reqs), per_request=True).per_request
    # LRU: the one-offs push A out before it returns, every time.
    assert [lru[i] for i in turns] == [0] * len(turns)
    # The optimum keeps A; so does the adaptive policy once its tables know
    # that one-off blocks never come back and A's do (the ghost told it).
    assert [opt[i] for i in turns[1:]] == [4] * (len(turns) - 1)
    assert [ada[i] for i in last] == [4] * len(last)
    assert all(ada[i] == 0 for i in range(len(reqs)) if i % 5)  # one-offs never hit


def test_a_ghost_hit_promotes_the_block_and_teaches_its_age():
    pol = AdaptivePolicy(8, AdaptiveParams(min_window=1))  # window = 1 tick of the clock
    key = 12345
    pol.on_insert(key, 1, 1)  # at clock 1
    assert pol.cls[key] == 0
    pol.add_leaf(key)
    assert pol.victim() == key
    pol.on_evict(key)  # an end (not reused), until the ghost sees it return
    assert pol.ends[0][-1] == ONE
    for filler in range(5):  # clock 2..6
        pol.on_insert(filler, 1, 2 + filler)
    pol.on_insert(key, 1, 7)  # clock 7: the ghost remembers it, last used in window 1
    assert pol.cls[key] == 1 and pol.ghost_hits == 1
    assert pol.hits[0][6] == ONE and sum(map(sum, pol.hits)) == ONE
    assert sum(map(sum, pol.ends)) == 0  # the end is undone
    for want in (2, 3, 3):  # promoted on each return, up to the last class
        pol.add_leaf(key)
        assert pol.victim() == key
        pol.on_evict(key)
        pol.on_insert(key, 1, 7)
        assert pol.cls[key] == want
    assert pol.ghost_hits == 4


def test_a_hit_promotes_and_counts_at_its_age():
    pol = AdaptivePolicy(8, AdaptiveParams(min_window=1))
    pol.on_insert(7, 1, 1)  # clock 1
    pol.on_insert(8, 1, 2)
    pol.on_insert(9, 1, 3)
    pol.on_hit(7, 3)  # clock 3: two windows after its insert
    assert pol.cls[7] == 1 and pol.hits[0][2] == ONE and pol.stamp[7] == 3


def test_rebuild_is_the_best_hits_per_lifetime_over_the_holding_horizon():
    """The O(BINS) hull pass equals the density written out directly: for a
    block of age a, the most hits per unit of space-time over every horizon A
    it could be held to (held until reused or age A), the last bin 0."""
    pol = AdaptivePolicy(8, AdaptiveParams(bins=64, decay_shift=62))  # no decay
    hits, ends = [0] * 64, [0] * 64
    hits[2], hits[3], hits[4], hits[40] = 5 * ONE, 3 * ONE, ONE, ONE // 100
    ends[1], ends[30], ends[63] = ONE, 2 * ONE, 4 * ONE
    pol.hits[1], pol.ends[1] = hits[:], ends[:]
    pol._rebuild()

    def direct(a: int) -> int:
        best = 0
        for horizon in range(a + 1, 64):
            life = sum((x - a + 1) * (hits[x] + ends[x]) for x in range(a, horizon))
            life += (horizon - a) * sum(hits[x] + ends[x] for x in range(horizon, 64))
            if life:
                best = max(best, (sum(hits[a:horizon]) << 32) // life)
        return best

    assert pol.density[1] == [direct(a) for a in range(63)] + [0]
    assert pol.density[1][2] > pol.density[1][0] > pol.density[1][6] > 0  # reuses near: dense
    assert pol.density[0] == [0] * 64  # a class with no events
    keys = [(pol.density[c][b], -b, c) for c, b in pol.ranks]
    assert keys == sorted(keys) and len(keys) == 4 * 64


def test_cold_tables_evict_in_lru_order_and_a_branch_tail_first():
    pol = AdaptivePolicy(64)  # window = 4 ticks (min_window): all of this in one window
    a, b, c, x = 1, 2, 3, 4  # a chain a <- b <- c (one request), and x, used after it
    for key in (a, b, c):
        pol.on_insert(key, 1, 0)
    pol.on_insert(x, 1, 2)
    pol.add_leaf(c)
    pol.add_leaf(x)
    assert pol.victim() == c
    pol.on_evict(c)
    pol.add_leaf(b)  # c's parent, older than x: it goes next
    assert pol.victim() == b
    pol.on_evict(b)
    pol.add_leaf(a)
    assert [pol.victim(), pol.victim(), pol.victim()] == [a, x, None]


def test_lru_ties_on_the_clock_take_the_deeper_node():
    pol = LRUPolicy()
    for key, depth in ((1, 1), (2, 3), (3, 2)):
        pol.on_insert(key, depth, now=5)
        pol.add_leaf(key)
    pol.on_insert(4, 9, now=4)
    pol.add_leaf(4)
    assert [pol.victim() for _ in range(5)] == [4, 2, 3, 1, None]


def test_optimum_evicts_the_leaf_needed_last():
    a, b, c = chain(1), chain(2), chain(3)
    reqs = [req(a), req(b), req(c), req(b), req(a), req(b)]
    pol = OptimumPolicy(reqs)
    for key in (a[0], b[0], c[0]):  # all three cached by request 2 (clock 4)
        pol.on_insert(key, 1, now=4)
        pol.add_leaf(key)
    assert [pol.next_use(k, 4) for k in (a[0], b[0], c[0])] == [4, 3, NEVER]
    assert [pol.victim(), pol.victim(), pol.victim()] == [c[0], a[0], b[0]]


# ------------------------------------------------------------------ ghost
def test_splitmix64_matches_the_published_generator():
    # splitmix64 seeded with 0 first outputs mix(0x9E3779B97F4A7C15).
    assert splitmix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_ghost_overwrites_its_oldest_entry_and_hands_it_back():
    ghost = Ghost(4, ways=4)  # one set
    assert ghost.sets == 1
    for key in range(4):
        assert ghost.put(key, cls=key % 2, win=10 + key, cur_win=20) is None
    assert ghost.size == 4
    assert ghost.put(99, cls=1, win=19, cur_win=20) == (0, 10)  # key 0: the oldest
    assert ghost.take(0) is None and ghost.take(99) == (1, 19)
    assert ghost.take(99) is None  # taking clears it
    assert ghost.take(2) == (0, 12)
    assert ghost.size == sum(1 for e in ghost.table if e) == 2


def test_ghost_size_is_bounded_by_its_sets():
    pol = AdaptivePolicy(16, AdaptiveParams(ghost_factor=2))
    for key in range(1000):
        pol.on_insert(key, 1, 0)
        pol.add_leaf(key)
        pol.on_evict(pol.victim())
    assert pol.ghost.size == sum(1 for e in pol.ghost.table if e) <= 32 == len(pol.ghost.table)
    assert sum(map(sum, pol.ends)) > 0  # overwritten entries ended in the tables


def test_params_are_checked():
    with pytest.raises(ValueError, match="classes"):
        AdaptiveParams(classes=17)
    with pytest.raises(ValueError, match="bins"):
        AdaptiveParams(bins=1)
    with pytest.raises(ValueError, match="capacity"):
        AdaptivePolicy(0)


# -------------------------------------------------------------- simulator
@pytest.mark.parametrize("make", [tiny_chat, tiny_think, tiny_mix])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_keeps_the_tree_invariants(make, policy):
    """Victims are free leaves (the simulator asserts it), the tree stays
    prefix-closed and the policy lists exactly the tree's leaves, after every
    request, at capacities from the smallest that fits up."""
    for seed in range(3):
        blocks = to_block_requests(make(150, seed), 4)
        smallest = max(b.blocks_needed for b in blocks)
        for capacity in (smallest, smallest + 3, 3 * smallest):
            res = simulate(blocks, capacity, POLICIES[policy](blocks, capacity),
                           check_every=1)
            assert res.rejected == 0 and res.evictions > 0 and res.hits > 0


@pytest.mark.parametrize("make", [tiny_chat, tiny_think, tiny_mix])
def test_the_optimum_never_loses_to_lru(make):
    for seed in range(12):
        blocks = to_block_requests(make(120, seed), 4)
        smallest = max(b.blocks_needed for b in blocks)
        for capacity in (smallest, smallest + 5, 2 * smallest, 4 * smallest):
            lru = simulate(blocks, capacity, LRUPolicy()).hits
            opt = simulate(blocks, capacity, OptimumPolicy(blocks)).hits
            assert opt >= lru, (seed, capacity)


def test_the_adaptive_policy_is_deterministic():
    blocks = to_block_requests(tiny_mix(300, 5), 4)
    runs = [simulate(blocks, 40, AdaptivePolicy(40), per_request=True).per_request
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_recorded_run_replays_into_a_fresh_policy():
    """How the native port is checked: record the reference's calls on a workload,
    replay them into the other implementation, compare every victim."""
    blocks = to_block_requests(tiny_mix(300, 6), 4)
    rec = Recorder(AdaptivePolicy(30))
    res = simulate(blocks, 30, rec)
    victims = [r for name, _, r in rec.log if name == "victim"]
    assert len(victims) == res.evictions > 100
    assert replay_calls(AdaptivePolicy(30), rec.log) == len(rec.log)
    with pytest.raises(AssertionError, match="victim"):  # a different policy diverges
        replay_calls(AdaptivePolicy(30, AdaptiveParams(classes=1)), rec.log)


def manager_hits(requests, capacity: int, block_size: int) -> list[int]:
    """Each request's GPU hit blocks (-1: rejected) through a GPU-only CacheManager."""
    with tempfile.TemporaryDirectory(prefix="kvc-sim-", dir="/tmp") as run_dir:
        cfg = CacheConfig.load(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32",
                               block_size=block_size, num_gpu_blocks=capacity,
                               num_cpu_blocks=0, transfer_mode="inprocess",
                               create_cache=True, storage_backend=None,
                               check_host_memory=False, control_socket=False,
                               run_dir=run_dir, eviction_policy="lru")
        seen = [(0, 0)]  # (hit tokens, rejected) after each request
        with CacheManager(cfg).start() as mgr:
            replay(mgr, requests, on_progress=lambda done, res: seen.append(
                (res["hit_tokens"]["gpu"], res["rejected"])))
    return [-1 if r1 > r0 else (h1 - h0) // block_size
            for (h0, r0), (h1, r1) in zip(seen, seen[1:])]


@pytest.mark.parametrize("capacity", [14, 40, 90])
def test_the_simulated_lru_is_the_managers_hit_for_hit(capacity):
    requests = tiny_mix(400, seed=capacity) + tiny_chat(200, seed=capacity)
    for i, r in enumerate(requests):
        r.request_id = i
    blocks = to_block_requests(requests, 4)
    sim = simulate(blocks, capacity, LRUPolicy(), per_request=True)
    assert sim.per_request == manager_hits(requests, capacity, 4)
    assert sim.evictions > 0


def test_block_requests_reuse_a_conversations_keys():
    requests = tiny_think(200, seed=2)
    fresh = [to_block_requests([r], 4)[0] for r in requests]  # no memo across requests
    assert to_block_requests(requests, 4) == fresh


# --------------------------------------------------------------- workloads
def test_think_time_workload_is_fixed_by_its_seed():
    assert tiny_think(300, seed=4) == tiny_think(300, seed=4)
    assert tiny_think(300, seed=4) != tiny_think(300, seed=5)


def test_think_time_turns_come_back_after_the_think_time():
    requests = tiny_think(2000, seed=1, think_time=(40, 90), turns=(2, 7))
    last = {}
    for r in requests:
        prev = last.get(r.conversation_id)
        if prev is None:
            assert r.turn == 0
        else:
            assert r.turn == prev.turn + 1 <= 6
            assert r.request_id - prev.request_id >= 41  # due 1 + think steps later
            grown = prev.prompt + prev.output
            assert r.prompt[:len(grown)] == grown and len(r.prompt) > len(grown)
        last[r.conversation_id] = r
    gaps = sorted(r.request_id - last_id for r, last_id in _turn_gaps(requests))
    assert gaps[len(gaps) // 2] < 100  # the queue of due turns stays short
    assert [r.request_id for r in requests] == list(range(2000))


def _turn_gaps(requests):
    prev = {}
    for r in requests:
        if r.conversation_id in prev:
            yield r, prev[r.conversation_id]
        prev[r.conversation_id] = r.request_id


def test_think_time_workload_rejects_bad_ranges():
    with pytest.raises(ValueError, match="think_time"):
        list(iter_think_time_workload(1, think_time=(9, 3)))
    with pytest.raises(ValueError, match="turns"):
        list(iter_think_time_workload(1, turns=(0, 3)))


def test_one_off_prompts_are_mixed_in_deterministically():
    base = tiny_chat(1000, seed=3)
    mixed = list(mix_one_off_prompts(base, seed=9, fraction=0.2, prompt_tokens=(50, 60)))
    assert mixed == list(mix_one_off_prompts(base, seed=9, fraction=0.2,
                                             prompt_tokens=(50, 60)))
    one_offs = [r for r in mixed if r.conversation_id == -1]
    assert 150 < len(one_offs) < 250
    assert all(50 <= len(r.prompt) <= 60 and r.turn == 0 for r in one_offs)
    kept = [r for r in mixed if r.conversation_id != -1]
    assert [(r.prompt, r.output) for r in kept] == [(r.prompt, r.output) for r in base]
    assert [r.request_id for r in mixed] == list(range(len(mixed)))
    assert list(mix_one_off_prompts(base, fraction=0.0)) == base
    with pytest.raises(ValueError, match="fraction"):
        list(mix_one_off_prompts(base, fraction=1.0))


# ---------------------------------------------------------------- benchmark
def test_find_capacity_hits_the_target_on_a_monotone_curve():
    runs = []

    def frac(c: int) -> float:
        runs.append(c)
        known[c] = min(1.0, (c / 1000) ** 2)
        return known[c]

    known = {1000: 1.0}
    for target in (0.2, 0.5, 0.75):
        c = bench.find_capacity(frac, known, target, lo=10)
        assert abs(known[c] - target) <= 0.01
    assert len(runs) < 25
    known = {1000: 1.0}
    assert bench.find_capacity(lambda c: known.setdefault(c, 0.4), known, 0.2, lo=10) == 10


def test_bench_policy_runs_end_to_end(capsys):
    result = bench.main(["--seeds", "0", "--requests", "400", "--think-time", "20", "80",
                         "--turns", "2", "8", "--scan-fraction", "0.2"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["backend"] == "simulator" and len(line["rows"]) == 9
    for row in result["rows"]:
        assert row["optimum"] >= row["lru"] - 1e-9
        assert row["ratio"] == pytest.approx(row["adaptive"] / row["lru"])
        assert ("scan_loss_adaptive" in row) == (row["workload"] == "scan")
    assert set(result) >= {"think_20pct_ok", "think_50pct_ok", "floor_ok", "min_ratio",
                           "scan_loss_max"}
    assert result["scan_loss_max"]["lru"] > 0  # the one-offs do push conversations out


def test_bench_manager_replay_is_the_simulators_lru():
    """--manager's replay path, run with the manager's LRU policy."""
    requests = tiny_think(300, seed=8)
    got = bench.manager_replay(requests, 40, 4, "lru")
    want = simulate(to_block_requests(requests, 4), 40, LRUPolicy())
    assert got["hit_rate"] == pytest.approx(want.hit_rate) and want.evictions > 0
    assert got["rejected"] == 0 and got["requests_per_s"] > 0


@pytest.mark.skipif(not (bench.STUDY_DIR / "sim.py").is_file(),
                    reason=f"the study (policy_sim) is not beside this checkout: {bench.STUDY_DIR}")
def test_bench_policy_replays_a_trace_slice_beside_the_study(capsys):
    """--trace: the manager with each policy and the study on the same slice."""
    trace = Path(__file__).resolve().parents[1] / "data" / "synthetic_trace.jsonl"
    result = bench.main(["--trace", str(trace), "--slice", "21:140", "--capacity", "200", "400"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["slice"] == "21:140" and [r["capacity"] for r in line["rows"]] == [200, 400]
    for row in result["rows"]:
        assert row["rejected_lru"] == row["rejected_adaptive"] == 0
        assert 0 < row["lru"] <= row["study_lru"] * 1.1  # the same requests, nearly one model
        assert row["vs_study"] == pytest.approx(row["adaptive"] / row["study"])
        assert row["ratio"] == pytest.approx(row["adaptive"] / row["lru"])
    assert {"floor_ok", "vs_study_ok", "rate_ok", "all_ok"} <= set(result)
    assert bench.parse_slice("3:", 10) == (2, 10) and bench.parse_slice(None, 10) == (0, 10)
    with pytest.raises(SystemExit):
        bench.parse_slice("5:2", 10)
