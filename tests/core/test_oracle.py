"""The manager against an obviously-correct reference simulator, plus the chat workload.

``RefCache`` replays sequential requests (allocate -> wait -> commit every prompt
token -> free) with plain dicts and O(n) scans, written from the policy rules
alone (no heaps, no incremental counters):

- Full blocks only; at allocate at most ``(n - 1) // bs`` blocks can match
  (the last token is always computed); matching stops at the first missing node.
- A logical clock ticks at every allocate and every free; at free every node
  of the request's path gets ``last = clock``.
- GPU victim: a node on the GPU, not on the current request's matched path,
  with no child on the GPU, smallest ``(last, -depth)``. With a CPU tier it
  moves to the CPU (a backup copy makes that free; otherwise it needs a CPU
  block: a free one, or the CPU victim's); without one, or when no CPU block
  can be had, it is dropped with its subtree.
- CPU victim: a node holding a CPU copy, with no child holding one, that is
  on the GPU (only the backup goes) or CPU-only and not matched by the
  current request (it is dropped), smallest ``(last, -depth)``.
- Victims of one allocate leave in one batch; a victim that needs a CPU block
  when none can be had while the batch is non-empty first lands the batch
  (whose members then become CPU victims) and is retried.
- Matched CPU-only nodes are swapped in (GPU afterwards, the CPU copy kept).

The manager must agree on every request's (gpu, cpu) hit tokens and on which
blocks sit on which tier after every request.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcached import NoFreeBlocks
from kvcached.core.hashing import block_hashes
from kvcached.core.snapshot import Tier
from kvcached.tools.workload import ChatRequest, generate_chat_workload, replay

BS = 4


class RefCache:
    """Brute-force model of the manager's policy for one request at a time."""

    def __init__(self, bs: int, num_gpu: int, num_cpu: int):
        self.bs, self.num_gpu, self.num_cpu = bs, num_gpu, num_cpu
        # prefix tokens (a whole number of blocks) -> {"gpu", "cpu", "out", "last"}
        self.nodes: dict[tuple, dict] = {}
        self.clock = 0
        self.held: set[tuple] = set()  # the current request's matched path

    # ------------------------------------------------------------- queries
    def children(self, key: tuple) -> list[dict]:
        n = len(key)
        return [v for k, v in self.nodes.items() if len(k) == n + self.bs and k[:n] == key]

    def gpu_evictable(self, key: tuple) -> bool:
        v = self.nodes[key]
        return (v["gpu"] and not v["out"] and key not in self.held
                and not any(c["gpu"] and not c["out"] for c in self.children(key)))

    def cpu_evictable(self, key: tuple) -> bool:
        v = self.nodes[key]
        if not v["cpu"] or any(c["cpu"] for c in self.children(key)):
            return False
        on_gpu = v["gpu"] and not v["out"]
        return on_gpu or (not v["gpu"] and key not in self.held)

    def lru(self, evictable) -> tuple | None:
        cands = [k for k in self.nodes if evictable(k)]
        if not cands:
            return None
        keys = sorted((self.nodes[k]["last"], -len(k), k) for k in cands)
        # Each free stamps one node per depth, so (last, -depth) never ties.
        assert len(keys) == 1 or keys[0][:2] != keys[1][:2], keys[:2]
        return keys[0][2]

    # ------------------------------------------------------------- actions
    def remove(self, key: tuple) -> None:
        for k in [k for k in self.nodes if k[:len(key)] == key]:
            del self.nodes[k]

    def take_cpu(self) -> bool:
        if sum(v["cpu"] for v in self.nodes.values()) < self.num_cpu:
            return True
        victim = self.lru(self.cpu_evictable)
        if victim is None:
            return False
        if self.nodes[victim]["gpu"]:
            self.nodes[victim]["cpu"] = False  # only the backup goes
        else:
            self.remove(victim)
        return True

    def land(self, batch: list[tuple]) -> None:
        for k in batch:
            self.nodes[k].update(gpu=False, out=False)

    def evict_gpu(self, count: int) -> None:
        batch: list[tuple] = []
        freed = 0
        while freed < count:
            victim = self.lru(self.gpu_evictable)
            assert victim is not None, "no GPU victim although blocks were idle"
            v = self.nodes[victim]
            if not v["cpu"]:
                got = self.num_cpu > 0 and self.take_cpu()
                if not got and batch:
                    self.land(batch)
                    batch = []
                    continue
                if not got:
                    self.remove(victim)
                    freed += 1
                    continue
                v["cpu"] = True
            v["out"] = True
            batch.append(victim)
            freed += 1
        self.land(batch)

    def serve(self, tokens: list[int]) -> tuple[int, int] | None:
        """One whole request; (gpu, cpu) hit tokens, or None for NoFreeBlocks."""
        bs, n = self.bs, len(tokens)
        matched = []
        for k in range(1, (n - 1) // bs + 1):
            key = tuple(tokens[:k * bs])
            if key not in self.nodes:
                break
            matched.append(key)
        n_gpu = 0
        while n_gpu < len(matched) and self.nodes[matched[n_gpu]]["gpu"]:
            n_gpu += 1
        need = -(-n // bs) - n_gpu
        on_gpu = sum(v["gpu"] for v in self.nodes.values())
        free = self.num_gpu - on_gpu
        if need > free + on_gpu - n_gpu:  # every GPU node but the matched ones is idle
            return None
        self.clock += 1
        self.held = set(matched)
        if need > free:
            self.evict_gpu(need - free)
        for key in matched[n_gpu:]:
            self.nodes[key]["gpu"] = True  # swapped in; the CPU copy stays as a backup
        self.commit(tokens, len(matched))
        self.clock += 1
        for key in self.held:
            self.nodes[key]["last"] = self.clock
        self.held = set()
        assert sum(v["gpu"] for v in self.nodes.values()) <= self.num_gpu
        assert sum(v["cpu"] for v in self.nodes.values()) <= self.num_cpu
        return n_gpu * bs, (len(matched) - n_gpu) * bs

    def commit(self, tokens: list[int], first: int) -> None:
        for k in range(first + 1, len(tokens) // self.bs + 1):
            key = tuple(tokens[:k * self.bs])
            node = self.nodes.setdefault(key, {"gpu": False, "cpu": False, "out": False,
                                               "last": 0})
            node["gpu"] = True  # new, a duplicate, or a CPU copy adopting our block
            self.held.add(key)


# ------------------------------------------------------------------ helpers
def block_prompts(seed: int, count: int, max_blocks: int, alphabet: int = 3) -> list[list[int]]:
    """Prompts of 1..max_blocks blocks drawn from a tiny alphabet (so prefixes collide
    often), each block ``bs`` copies of its letter, plus a random partial tail."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        letters = rng.integers(1, alphabet + 1, int(rng.integers(1, max_blocks + 1)))
        tail = int(rng.integers(0, BS))
        out.append([int(x) for x in letters for _ in range(BS)] + [9999] * tail)
    return out


def tree_state(mgr) -> dict[bytes, tuple[bool, bool]]:
    out = {}
    for n in mgr.snapshot().nodes.values():
        assert n.state in (Tier.GPU, Tier.CPU), n  # nothing in flight between requests
        out[n.hash] = (n.state is Tier.GPU, n.cpu >= 0)
    return out


def ref_state(mgr, ref: RefCache, cache: dict) -> dict[bytes, tuple[bool, bool]]:
    out = {}
    for key, v in ref.nodes.items():
        h = cache.get(key)
        if h is None:
            h = cache[key] = block_hashes(mgr.snapshot().namespace, list(key), ref.bs)[-1]
        out[h] = (v["gpu"], v["cpu"])
    return out


def serve(mgr, rid, tokens) -> tuple[int, int] | None:
    try:
        a = mgr.allocate(rid, tokens)
    except NoFreeBlocks:
        return None
    a.wait()
    mgr.commit(rid, tokens, len(tokens))
    mgr.free(rid)
    return a.hit.gpu_tokens, a.hit.cpu_tokens


def compare(mgr, ref: RefCache, prompts: list[list[int]]) -> dict:
    """Serve ``prompts`` through both; assert equal hits and tiers after every request."""
    hashes: dict = {}
    totals = {"gpu": 0, "cpu": 0, "rejected": 0}
    for i, tokens in enumerate(prompts):
        got, want = serve(mgr, i, tokens), ref.serve(tokens)
        assert got == want, f"request {i} ({len(tokens)} tokens): manager {got}, reference {want}"
        assert tree_state(mgr) == ref_state(mgr, ref, hashes), f"tiers differ after request {i}"
        if got is None:
            totals["rejected"] += 1
        else:
            totals["gpu"] += got[0]
            totals["cpu"] += got[1]
    mgr.check_invariants()
    return totals


# ------------------------------------------------------------------- oracle
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_gpu,max_blocks", [(4, 5), (8, 6), (16, 6), (64, 5)])
def test_gpu_only_matches_reference(make_manager, seed, num_gpu, max_blocks):
    mgr = make_manager(num_gpu_blocks=num_gpu, num_cpu_blocks=0, eviction_policy="lru")
    totals = compare(mgr, RefCache(BS, num_gpu, 0), block_prompts(seed, 250, max_blocks))
    assert totals["gpu"] > 0 and totals["cpu"] == 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_gpu,num_cpu,max_blocks", [
    (4, 1, 5),    # heavy pressure on both tiers, some requests do not fit at all
    (5, 2, 5),
    (6, 3, 6),
    (8, 4, 6),
    (8, 16, 6),
    (12, 40, 6),  # the CPU tier holds everything the GPU tier drops
])
def test_gpu_and_cpu_match_reference(make_manager, seed, num_gpu, num_cpu, max_blocks):
    mgr = make_manager(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, eviction_policy="lru")
    totals = compare(mgr, RefCache(BS, num_gpu, num_cpu),
                     block_prompts(100 + seed, 250, max_blocks, alphabet=3))
    assert totals["gpu"] > 0 and totals["cpu"] > 0


@pytest.mark.parametrize("num_gpu,num_cpu", [(12, 0), (12, 6), (16, 32)])
def test_chat_workload_matches_reference(make_manager, num_gpu, num_cpu):
    mgr = make_manager(num_gpu_blocks=num_gpu, num_cpu_blocks=num_cpu, eviction_policy="lru")
    reqs = small_chat(200, seed=num_gpu + num_cpu)
    totals = compare(mgr, RefCache(BS, num_gpu, num_cpu), [r.prompt for r in reqs])
    assert totals["gpu"] > 0


# --------------------------------------------------------------- workload
def small_chat(n: int, seed: int = 0) -> list[ChatRequest]:
    return generate_chat_workload(n, seed=seed, num_system_prompts=2, system_tokens=8,
                                  turn_tokens=(1, 6), output_tokens=(1, 5), max_turns=4,
                                  concurrent_conversations=4, vocab=5)


def test_workload_is_deterministic_by_seed():
    a, b = generate_chat_workload(200, seed=7), generate_chat_workload(200, seed=7)
    assert a == b
    assert a != generate_chat_workload(200, seed=8)


def test_later_turns_extend_earlier_ones():
    reqs = generate_chat_workload(400, seed=3, num_system_prompts=3, system_tokens=64,
                                  turn_tokens=(4, 16), output_tokens=(2, 8), max_turns=6,
                                  concurrent_conversations=8)
    last: dict[int, ChatRequest] = {}
    systems = set()
    for r in reqs:
        assert r.request_id == reqs.index(r)
        prev = last.get(r.conversation_id)
        if prev is None:
            assert r.turn == 0
            systems.add(tuple(r.prompt[:64]))
        else:
            assert r.turn == prev.turn + 1
            grown = prev.prompt + prev.output
            assert r.prompt[:len(grown)] == grown and 4 <= len(r.prompt) - len(grown) <= 16
        assert 2 <= len(r.output) <= 8 and r.turn < 6
        last[r.conversation_id] = r
    assert len(systems) == 3  # conversations share a few system prompts
    # Turns of different conversations interleave.
    cids = [r.conversation_id for r in reqs[:50]]
    assert len(set(cids)) > 4 and any(x != y for x, y in zip(cids, cids[1:]))


def test_workload_rejects_bad_ranges():
    with pytest.raises(ValueError, match="turn_tokens"):
        generate_chat_workload(1, turn_tokens=(5, 2))
    with pytest.raises(ValueError, match="concurrent_conversations must be >= 1"):
        generate_chat_workload(1, concurrent_conversations=0)


def test_replay_counts_hits_timings_and_rejections(make_manager):
    mgr = make_manager(num_gpu_blocks=16, num_cpu_blocks=16)
    reqs = small_chat(120, seed=1)
    reqs.append(ChatRequest(999, 999, 0, list(range(100)), [1, 2]))  # 26 blocks: never fits
    seen = []
    res = replay(mgr, reqs, on_progress=lambda done, r: seen.append(done))
    assert seen == list(range(1, 122))
    assert res["requests"] == 121 and res["rejected"] == 1 and res["served"] == 120
    assert len(res["allocate_us"]) == len(res["commit_us"]) == len(res["free_us"]) == 120
    assert 0 < res["cpu_s"] < res["total_s"] * 2  # one thread, give or take clock grain
    assert res["prompt_tokens"] == sum(len(r.prompt) for r in reqs[:-1])
    st = mgr.stats()
    assert res["hit_tokens"]["gpu"] == st.hit_tokens["gpu"] > 0
    assert res["hit_tokens"]["cpu"] == st.hit_tokens["cpu"]
    assert st.running == 0 and st.no_free_blocks == 1
    mgr.check_invariants()
