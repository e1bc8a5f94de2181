#!/usr/bin/env python
"""Benchmark the CacheManager's own cost: a chat replay and eviction at scale.

Both phases use in-process transfer on a tiny-bytes layout (one 128-byte
plane per block), so copies cost next to nothing and what is measured is the
manager: hashing, matching, the tree, the pools, eviction.

1. Chat replay: the synthetic multi-turn chat workload (``kvcached.tools.workload``)
   with blocks of 64 tokens and prompts of ~190 blocks on average, through a
   GPU + CPU manager sized so that both tiers serve hits. Reports requests/s
   of manager time, p50/p99 of allocate+commit+free per request, manager time
   per prompt block, and the hit rate per tier. The collector is frozen
   after start-up (engines do this too), so a full collection over the
   imported torch heap (~100 ms) is not charged to whichever call it hits.
   The same replay runs through FastDeploy's own manager as the baseline of
   the speed target (``_fastdeploy_baseline.py``; when its source is found),
   taking turns with kvcached's; each scenario runs 7 times, the median is
   reported, and ``times_cheaper_than_fastdeploy`` is the ratio per block,
   by wall time and by CPU time (target: 10x in both): the median of the 7
   pairs' ratios. (One pair's ratio swings by 10-20% on a shared machine,
   more than the target's margin; 3 pairs, as before, made the verdict
   flip between runs of the same code: docs/benchmarks.md.)
2. Eviction scaling: a GPU-only tree of N cached blocks (N = 10K, 100K, 1M;
   chains of a few blocks, so the LRU holds N/chain leaves) in a pool of N
   blocks plus a little slack; then allocations that each need ``chunk``
   blocks (one token plus a reservation: nothing to hash) force eviction of
   10K blocks per round (5K for the 10K tree); the tree is refilled between
   rounds, and rounds alternate between the sizes. Reports ns per evicted
   block (median over rounds) and the 1M/10K ratio (target <= 1.5: eviction
   must not slow down with the size of the cache), under each eviction
   policy (``--policies``; all trees are built first and every round's calls
   alternate between all of them, so the policies are compared in the same
   run), and the adaptive policy's cost over LRU's per size. The headline
   (``ratio``, ``meets_target``) is the default policy's. The collector is frozen
   after the builds (as engines do after start-up), so the timing is the
   manager's, not a full GC pass over whatever else the process holds. The
   pause of a full collection over what the builds added is reported too
   (``gc_full_pause_ms``): tree nodes are not GC-tracked, so it must stay
   small whatever the size of the cache (0.9 s at 1M with Python nodes).

    python scripts/bench_manager.py [--quick] [--phases eviction] [--policies lru,adaptive]

Progress goes to stderr; the last line on stdout is JSON ``{"bench": "manager", ...}``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import _fastdeploy_baseline as fastdeploy
from _bench_util import Progress, emit, log, percentile, short_tmp_dir

from kvcached import CacheConfig, CacheManager
from kvcached.tools.workload import iter_chat_workload, replay

BLOCK_SIZE = 64
# One K-only bf16 plane of 64 tokens x 1 head x 1 dim: 128 bytes per block.
TINY = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="bfloat16", mla=True,
            block_size=BLOCK_SIZE, transfer_mode="inprocess", create_cache=True,
            check_host_memory=False, storage_backend=None)
# ~190 blocks of 64 tokens per prompt on average (196 over 3000 requests at seed 0).
CHAT = dict(num_system_prompts=4, system_tokens=4864, turn_tokens=(256, 1024),
            output_tokens=(128, 512), max_turns=24, concurrent_conversations=32)
TARGET_RATIO = 1.5
FASTDEPLOY_US_PER_BLOCK = (5.0, 15.0)  # the range quoted for this machine
SPEED_TARGET_TIMES = 10.0  # an order of magnitude cheaper per block


def make_manager(run_dir, **overrides) -> CacheManager:
    cfg = CacheConfig.load(**{**TINY, "run_dir": str(run_dir), **overrides})
    return CacheManager(cfg).start()


# ------------------------------------------------------------------- chat
def bench_chat(tmp, requests: int, gpu_blocks: int, cpu_blocks: int, seed: int) -> dict:
    """Replay the chat workload; manager time only (the workload is generated lazily
    between the timed calls)."""
    log(f"chat replay: {requests} requests, {gpu_blocks} GPU + {cpu_blocks} CPU blocks")
    with make_manager(tmp / "chat", num_gpu_blocks=gpu_blocks,
                      num_cpu_blocks=cpu_blocks) as mgr:
        reqs = iter_chat_workload(requests, seed=seed, **CHAT)
        gc.collect()
        gc.freeze()  # what exists after start-up (torch, ...) is long-lived, as in
        try:         # engines that freeze after start; young objects are still collected
            res = replay(mgr, reqs, on_progress=Progress("chat replay", requests))
        finally:
            gc.unfreeze()
        mgr.check_invariants()
        st = mgr.stats()
    return {**summarize(res, gpu_blocks, cpu_blocks), "evictions": st.evictions,
            "wall_s": res["total_s"]}


def summarize(res: dict, gpu_blocks: int, cpu_blocks: int) -> dict:
    """A replay's numbers per request and per prompt block (``workload.replay``'s
    result, or the FastDeploy baseline's)."""
    if not res["served"]:
        raise SystemExit(f"no request was served: the prompts need more than {gpu_blocks} "
                         "GPU blocks (raise --gpu-blocks)")
    per_req = [a + c + f for a, c, f in zip(res["allocate_us"], res["commit_us"],
                                           res["free_us"])]
    total_us = sum(per_req)
    tokens = res["prompt_tokens"]
    return {
        "requests": res["requests"], "served": res["served"], "rejected": res["rejected"],
        "gpu_blocks": gpu_blocks, "cpu_blocks": cpu_blocks,
        "mean_prompt_blocks": res["prompt_blocks"] / max(res["served"], 1),
        "requests_per_s": res["served"] / (total_us / 1e6),
        "p50_us": percentile(per_req, 0.5), "p99_us": percentile(per_req, 0.99),
        "p50_us_by_op": {op: percentile(res[f"{op}_us"], 0.5)
                         for op in ("allocate", "commit", "free")},
        "us_per_block": total_us / res["prompt_blocks"],
        "cpu_us_per_block": res["cpu_s"] * 1e6 / res["prompt_blocks"],
        "hit_rate": {t: res["hit_tokens"][t] / tokens for t in ("gpu", "cpu")},
    }


def bench_fastdeploy(reference: Path, requests: int, gpu_blocks: int, cpu_blocks: int,
                     seed: int) -> dict:
    """The same replay through FastDeploy's manager (scripts/_fastdeploy_baseline.py)."""
    log(f"FastDeploy baseline: {requests} requests, {gpu_blocks} GPU + {cpu_blocks} CPU blocks")
    fdm = fastdeploy.make(fastdeploy.load(reference), gpu_blocks, cpu_blocks)
    reqs = iter_chat_workload(requests, seed=seed, **CHAT)
    gc.collect()
    gc.freeze()
    try:
        res = fastdeploy.replay(fdm, reqs, BLOCK_SIZE,
                                on_progress=Progress("FastDeploy replay", requests))
    finally:
        gc.unfreeze()
    return {**summarize(res, gpu_blocks, cpu_blocks), "poll_sleeps": res["poll_sleeps"],
            "poll_s": res["poll_s"]}


# --------------------------------------------------------------- eviction
class ChainFiller:
    """Caches chains of ``chain`` fresh blocks (never seen tokens, so every block is new)."""

    def __init__(self, mgr: CacheManager, chain: int):
        self.mgr, self.chain = mgr, chain
        self.next_token = 1
        self.rid = 0

    def fill(self, blocks: int, what: str = "") -> None:
        progress = Progress(what, blocks) if what else None
        done = 0
        while done < blocks:
            n = min(self.chain, blocks - done)
            start = self.next_token
            self.next_token += n * BLOCK_SIZE
            tokens = list(range(start, self.next_token))
            tokens.append(0)  # a partial tail: all n full blocks can be committed
            self.rid += 1
            self.mgr.allocate(("fill", self.rid), tokens)
            self.mgr.commit(("fill", self.rid), tokens, len(tokens))
            self.mgr.free(("fill", self.rid))
            done += n
            if progress:
                progress(done)


def _dropped(mgr: CacheManager) -> int:
    return mgr.stats().evictions.get("gpu_dropped", 0)


def evict_round(setups: list, evict: int, chunk: int, tag: int) -> dict[tuple, list[float]]:
    """One round: on every tree, allocations of ``chunk`` blocks each until ``evict``
    blocks (at most half the tree) were evicted; returns ns per evicted block of
    each allocation, per tree (policy, size). Calls alternate between the trees,
    so that a burst of load from elsewhere lands on all sizes and policies alike.
    The requests stay live (holding their blocks) until the round ends, then are
    freed, untimed."""
    plan = {key: -(-min(evict, key[1] // 2) // chunk) + 1  # +1: the slack
            for key, _, _ in setups}
    samples: dict[tuple, list[float]] = {key: [] for key in plan}
    clock = time.perf_counter
    for i in range(max(plan.values())):
        for key, mgr, _ in setups:
            if i >= plan[key]:
                continue
            before = _dropped(mgr)
            t0 = clock()
            mgr.allocate(("evict", tag, i), [0], reserve_tokens=chunk * BLOCK_SIZE - 1)
            spent = clock() - t0
            evicted = _dropped(mgr) - before
            if evicted:  # the first call of a round only takes the free slack
                samples[key].append(spent / evicted * 1e9)
    for key, mgr, filler in setups:
        for i in range(plan[key]):
            mgr.free(("evict", tag, i))
        filler.fill(key[1] - mgr.core.num_nodes)  # back to n cached blocks
    return samples


def bench_eviction(tmp, sizes: list[int], evict: int, rounds: int, chain: int,
                   chunk: int, policies: list[str]) -> dict:
    """ns per evicted block for each eviction policy and tree size (median over every
    evicting call of every round; all trees stay built and the calls are
    interleaved). The top-level numbers are the default policy's (or the first
    one measured); ``policies`` holds each one's, and ``adaptive_over_lru`` the
    adaptive policy's cost per block over LRU's, per size."""
    keys = [(policy, n) for policy in policies for n in sizes]
    with ExitStack() as stack:
        gc.collect()
        gc.freeze()  # what the process held before: only what the builds add is walked below
        setups = [_build_tree(stack, tmp, key, chain, chunk) for key in keys]
        pause_ms, tracked = _full_gc_pause()
        log(f"a full collection over what {sum(n for _, n in keys)} cached blocks added: "
            f"{pause_ms:.2f} ms, {tracked} objects tracked")
        gc.freeze()  # the built trees are long-lived: out of the collector's way, as
        try:         # engines do after start-up, so a full GC pass is not timed
            per_block: dict[tuple, list[float]] = {key: [] for key in keys}
            for r in range(rounds):
                for key, samples in evict_round(setups, evict, chunk, r).items():
                    per_block[key].extend(samples)
                log(f"eviction round {r + 1}/{rounds}: median so far " + ", ".join(
                    f"{p} {_short(n)} {statistics.median(per_block[p, n]):.0f}"
                    for p, n in keys) + " ns/block")
        finally:
            gc.unfreeze()
        leaves = {key: mgr.core.gpu_leaves for key, mgr, _ in setups}
        for _, mgr, _ in setups:
            mgr.check_invariants()
    by_policy = {policy: _eviction_result(
        {n: per_block[policy, n] for n in sizes}, {n: leaves[policy, n] for n in sizes},
        evict) for policy in policies}
    default = CacheConfig().eviction_policy
    head = by_policy[default if default in by_policy else policies[0]]
    out = {"chain_blocks": chain, "chunk_blocks": chunk, "policy": default
           if default in by_policy else policies[0], **head,
           "gc_full_pause_ms": pause_ms, "gc_tracked_objects": tracked,
           "policies": {p: {k: r[k] for k in ("ns_per_block", "ratio", "ratio_p10",
                                               "meets_target")}
                        for p, r in by_policy.items()}}
    if {"lru", "adaptive"} <= set(by_policy):
        out["adaptive_over_lru"] = {
            str(n): by_policy["adaptive"]["ns_per_block"][str(n)]
            / by_policy["lru"]["ns_per_block"][str(n)] for n in sizes}
    return out


def _eviction_result(per_block: dict[int, list[float]], leaves: dict[int, int],
                     evict: int) -> dict:
    """One policy's numbers: per size, and the largest size's over the smallest's."""
    sizes = list(per_block)
    out = {str(n): {"ns_per_block": statistics.median(v), "p10_ns": percentile(v, 0.1),
                    "p90_ns": percentile(v, 0.9), "samples": len(v),
                    "evicted_per_round": min(evict, n // 2), "leaves": leaves[n]}
           for n, v in per_block.items()}
    lo, hi = out[str(sizes[0])], out[str(sizes[-1])]
    ratio = hi["ns_per_block"] / lo["ns_per_block"]
    return {"sizes": out, "ns_per_block": {k: v["ns_per_block"] for k, v in out.items()},
            f"ratio_{_short(sizes[-1])}_{_short(sizes[0])}": ratio, "ratio": ratio,
            "ratio_p10": hi["p10_ns"] / lo["p10_ns"],
            "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO}


def _full_gc_pause() -> tuple[float, int]:
    """How long a full collection over the unfrozen objects takes, and how many
    it walks: with native tree nodes the cached blocks are not among them (0.9 s
    at 1M with Python nodes, paid by whichever engine call triggers it)."""
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3, len(gc.get_objects())


def _build_tree(stack: ExitStack, tmp, key: tuple[str, int], chain: int, chunk: int):
    """A GPU-only manager with the eviction policy and ``cached`` blocks in the tree
    of ``key``, and ``chunk`` blocks free."""
    policy, cached = key
    mgr = stack.enter_context(make_manager(tmp / f"ev-{policy}-{cached}",
                                           num_gpu_blocks=cached + chunk, num_cpu_blocks=0,
                                           eviction_policy=policy))
    filler = ChainFiller(mgr, chain)
    t0 = time.perf_counter()
    filler.fill(cached, what=f"build {_short(cached)} blocks ({policy})")
    assert mgr.core.num_nodes == cached, (mgr.core.num_nodes, cached)
    log(f"built {cached} cached blocks ({policy}) in {time.perf_counter() - t0:.1f}s")
    return key, mgr, filler


def _short(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n // 1000}K"


# ------------------------------------------------------------------- main
def main() -> None:
    """Command line: run both phases, print the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    ap.add_argument("--requests", type=int, default=None, help="chat requests (3000; quick 600)")
    ap.add_argument("--gpu-blocks", type=int, default=2048)
    ap.add_argument("--cpu-blocks", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", type=str, default="10000,100000,1000000",
                    help="cached blocks for the eviction phase")
    ap.add_argument("--chain", type=int, default=4, help="blocks per cached chain")
    ap.add_argument("--chunk", type=int, default=256, help="blocks per evicting allocation")
    ap.add_argument("--fastdeploy", type=Path, default=fastdeploy.REFERENCE,
                    help="FastDeploy's prefix_cache_manager.py to replay as the baseline "
                         "(default: shared/reference's copy; skipped if absent)")
    ap.add_argument("--no-fastdeploy", action="store_true", help="skip the baseline")
    ap.add_argument("--chat-repeats", type=int, default=None,
                    help="replays per scenario, median reported (7; quick 1)")
    ap.add_argument("--phases", type=str, default="chat,eviction",
                    help="which phases to run (chat, eviction)")
    ap.add_argument("--policies", type=str, default="lru,adaptive",
                    help="eviction policies of the eviction phase, compared in one run")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    policies = args.policies.split(",")
    requests = args.requests or (600 if args.quick else 3000)
    rounds = 3 if args.quick else 7
    sizes = [int(s) for s in args.sizes.split(",")]
    baseline = None if args.no_fastdeploy else args.fastdeploy
    if baseline is not None and not baseline.is_file():
        log(f"no FastDeploy baseline: {baseline} not found (--fastdeploy PATH)")
        baseline = None
    # The same replay with a GPU tier that holds the working set: the
    # bookkeeping floor (hash, match, ref, commit, free) without tier churn.
    scenarios = {"chat": (args.gpu_blocks, args.cpu_blocks),
                 "chat_gpu_resident": (8 * args.gpu_blocks, 0)}
    repeats = args.chat_repeats or (1 if args.quick else 7)
    t0, load_before = time.perf_counter(), os.getloadavg()
    ours: dict = {}
    theirs: dict = {}
    eviction: dict = {}
    with short_tmp_dir("kvbm-") as tmp:
        if "chat" in phases:
            ours, theirs = chat_rounds(tmp, scenarios, requests, repeats, args.seed, baseline)
        if "eviction" in phases:
            eviction = bench_eviction(tmp, sizes, 10_000, rounds, args.chain, args.chunk,
                                      policies)
    runs = {name: median_run(rs) for name, rs in ours.items()}
    fd_runs = {name: median_run(rs) for name, rs in theirs.items() if rs}
    emit({"bench": "manager", "quick": args.quick, "block_size": BLOCK_SIZE, **runs,
          "eviction": eviction, "fastdeploy": fd_runs,
          **(speed_vs_fastdeploy(ours, theirs) if ours else {}),
          "total_s": time.perf_counter() - t0,
          # 1-minute load average before and after: other jobs on the machine
          # slow this memory-bound replay more than FastDeploy's interpreter-bound one
          "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]})


def chat_rounds(tmp, scenarios: dict[str, tuple[int, int]], requests: int, repeats: int,
                seed: int, baseline: Path | None) -> tuple[dict, dict]:
    """``repeats`` replays of each scenario, kvcached's and FastDeploy's taking
    turns so that a noisy spell hits both alike. Returns both sides' runs per
    scenario; FastDeploy's are empty without a baseline, or when it fails (a
    FastDeploy version the harness does not drive: reported, kvcached's kept)."""
    ours = {name: [] for name in scenarios}
    theirs: dict[str, list[dict]] = {name: [] for name in scenarios}
    for rep in range(repeats):
        for name, (gpu, cpu) in scenarios.items():
            r = bench_chat(tmp / f"{name}{rep}", requests, gpu, cpu, seed)
            ours[name].append(r)
            log(f"{name} ({rep + 1}/{repeats}): {r['us_per_block']:.2f} us/block, "
                f"p50 {r['p50_us']:.0f} us, hits {r['hit_rate']}")
            if baseline is None:
                continue
            try:
                fd = bench_fastdeploy(baseline, requests, gpu, cpu, seed)
            except Exception as e:  # any failure of their code
                log(f"FastDeploy baseline failed, going on without it: {type(e).__name__}: {e}")
                baseline, theirs = None, {n: [] for n in scenarios}
                continue
            theirs[name].append(fd)
            log(f"{name}, FastDeploy: {fd['us_per_block']:.2f} us/block")
    return ours, theirs


def median_run(runs: list[dict]) -> dict:
    """The run with the median cost per block, with every run's cost beside it."""
    ranked = sorted(runs, key=lambda r: r["us_per_block"])
    return {**ranked[(len(ranked) - 1) // 2],
            "us_per_block_runs": [r["us_per_block"] for r in runs],
            "cpu_us_per_block_runs": [r["cpu_us_per_block"] for r in runs]}


def speed_vs_fastdeploy(ours: dict[str, list[dict]], theirs: dict[str, list[dict]]) -> dict:
    """How many times cheaper per block than FastDeploy, per scenario.

    Measured: against FastDeploy's manager replaying the same requests in this
    process right after kvcached, by wall time (what the engine's scheduler
    waits; FastDeploy's includes its 1 ms polls) and by CPU time (no sleeps;
    its eviction thread's work counted); the median over the repeats of each
    pair's ratio, so a noisy spell weighs on both sides of a ratio alike. The
    target (an order of magnitude) counts as met only if both hold in every
    scenario. Without the baseline, against the 5-15 us per block quoted for
    FastDeploy on this machine (against 5 us).
    """
    lo, hi = FASTDEPLOY_US_PER_BLOCK
    quoted = {}
    for name, rs in ours.items():
        us = statistics.median(r["us_per_block"] for r in rs)
        quoted[name] = [round(lo / us, 2), round(hi / us, 2)]
    out = {"fastdeploy_quoted_us_per_block": [lo, hi], "times_cheaper_than_quoted": quoted,
           "speed_target_times": SPEED_TARGET_TIMES}
    if any(theirs.values()):
        measured = {name: {"wall": statistics.median(
                               fd["us_per_block"] / r["us_per_block"]
                               for r, fd in zip(ours[name], fds)),
                           "cpu": statistics.median(
                               fd["cpu_us_per_block"] / r["cpu_us_per_block"]
                               for r, fd in zip(ours[name], fds))}
                    for name, fds in theirs.items()}
        out["times_cheaper_than_fastdeploy"] = measured
        out["meets_speed_target"] = all(min(m.values()) >= SPEED_TARGET_TIMES
                                        for m in measured.values())
    else:
        out["meets_speed_target"] = all(t[0] >= SPEED_TARGET_TIMES for t in quoted.values())
    return out


if __name__ == "__main__":
    main()
