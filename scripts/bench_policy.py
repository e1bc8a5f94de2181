"""Eviction policies against LRU and the offline optimum.

For each workload (and seed): the unbounded hit rate (a cache that never
evicts), then the cache sizes at which LRU gets ~20%, ~50% and ~75% of it
(a search over LRU's own runs), and at each size the hit rates of LRU, the
adaptive policy and the offline optimum (farthest next use first), all
under kvcached's tree semantics. Ratios are of rates measured in the same
run. Progress goes to stderr; the last line of stdout is one JSON object.

Workloads (``kvcached.tools.workload``):

- ``think``: multi-turn chat whose turns come back after a think time of
  hundreds of other requests (``--think-time``, ``--turns``);
- ``synthetic``: the existing chat workload (32 open conversations, each
  step picks one at random);
- ``scan``: ``think`` with one-off long prompts mixed in (``--scan-fraction``);
  its rows also say how much of the conversations' hits each policy loses
  to the one-offs (against ``think`` alone, same seed and capacity).

Backends: the reference simulator (``tests/reference/simulator.py``, whose
LRU reproduces a GPU-only ``CacheManager`` hit for hit) runs every policy;
its adaptive policy is the native core's (``_core.Policy``, which the
differential tests hold to the reference decision for decision; ``--impl
reference`` runs the Python reference instead, a few times slower).
``--manager`` replays the same requests through the real ``CacheManager``
(``CacheConfig(eviction_policy=...)``, GPU tier only), with the manager's
block keys in the simulator (``to_block_requests(namespace=...)``), so its
hits must equal the simulator's with either policy (``manager_*_match_ok``).
The optimum is offline and always comes from the simulator.

The study: each row also runs the simulator of the eviction study the
adaptive policy was modelled on (``../shared/policy_sim``, its
``lhd:learn=ghost,gbound=8``, and its LRU) on the same block chains and
capacity (``--study-dir``; left out when not found or with ``--no-study``).
Its model is the tree's up to details (it reserves no blocks for a running
request), so its LRU is within a percent of the simulator's, and the figure
to compare is ``study_ratio`` (its policy over its LRU) against ``ratio``;
``vs_study`` is the quotient, and ``vs_study_min`` the lowest.

``--ghost-variants`` also runs the adaptive policy with other ghosts at the
same sizes (``BITS/WIN/FACTOR/WAYS``: entry width, bits of window in it,
entries per cached block, associativity) and reports each one's ratio to
LRU and its bytes per cached block (``FACTOR * BITS / 8``): the ghost should
take a few MB per million cached blocks.

Targets: on ``think``, adaptive >= 1.8x LRU at the 20% point and
>= 1.15x at the 50% point; never below 0.99x LRU anywhere; with
``--manager``, the manager's request rate with the adaptive policy >= 0.8x
its rate with LRU.

The default runs (8000 requests) end before the ghost (8x the cache) has
filled at the larger sizes; ``--requests 30000 --seeds 0`` shows the steady
state (a few times longer).

    .venv/bin/python scripts/bench_policy.py            # 3 seeds, ~3 CPU minutes
    .venv/bin/python scripts/bench_policy.py --quick    # one seed, smaller runs

A trace (``--trace PATH``, Mooncake format: ``hash_ids`` of 512-token
blocks): the requests ``--slice A:B`` (1-based, both ends included; ``A:``
to the end) are replayed through a GPU-only ``CacheManager`` of each
``--capacity`` (64-token blocks by default, transfer in process; per request
allocate, wait, commit, free, as ``kvcached bench trace`` drives it: hash
id h becomes tokens h*512 ... h*512+511, cut to ``input_length``, and the
output is reserved, not cached) with LRU and with the adaptive policy, and
the study runs on the same requests as its own trace (``prep.build``'s
blocks; its hit rate is matched / full blocks, the manager's matched /
prompt blocks, as the issue's table). Rows: ``lru``, ``adaptive``,
``study`` (and ``study_lru``), ``vs_study`` (adaptive / study), ``ratio``
(adaptive / LRU) and the manager's request rates. Targets: ``vs_study >=
0.95`` and ``ratio >= 0.99`` at every size, the request rate with the
policy >= 0.8x LRU's. A 3,000-request slice takes ~30 CPU seconds a size::

    .venv/bin/python scripts/bench_policy.py \
        --trace ../shared/traces/mooncake_conversation.jsonl --slice 1:3000 \
        --capacity 20000 55000
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from _bench_util import ROOT, emit, log

sys.path.insert(0, str(ROOT / "tests"))  # the reference models live with the tests

from reference.optimum import OptimumPolicy  # noqa: E402
from reference.policy import AdaptiveParams, AdaptivePolicy, LRUPolicy  # noqa: E402
from reference.simulator import (  # noqa: E402
    BlockRequest,
    SimResult,
    simulate,
    to_block_requests,
)

from kvcached.core import _core  # noqa: E402
from kvcached.core.hashing import namespace_hash  # noqa: E402
from kvcached.tools.workload import (  # noqa: E402
    ChatRequest,
    iter_chat_workload,
    iter_think_time_workload,
    mix_one_off_prompts,
    replay,
)

TARGETS = (0.20, 0.50, 0.75)  # of the unbounded hit rate, for LRU
THINK_MIN_RATIO = {0.20: 1.8, 0.50: 1.15}
FLOOR_RATIO = 0.99
MANAGER_MIN_RATE_RATIO = 0.8  # the manager's request rate, adaptive over LRU
WORKLOADS = ("think", "synthetic", "scan")


# --------------------------------------------------------------- workloads
def chat_requests(name: str, args: argparse.Namespace, seed: int) -> Iterator[ChatRequest]:
    """The requests of workload ``name``, fixed by ``seed``."""
    think = dict(think_time=tuple(args.think_time), turns=tuple(args.turns),
                 system_tokens=args.system_tokens)
    if name == "think":
        return iter_think_time_workload(args.requests, seed=seed, **think)
    if name == "synthetic":
        return iter_chat_workload(args.requests, seed=seed)
    if name == "scan":
        base = iter_think_time_workload(args.requests, seed=seed, **think)
        return mix_one_off_prompts(base, seed=seed + 1, fraction=args.scan_fraction)
    raise ValueError(f"unknown workload {name!r}; pick from {WORKLOADS}")


# ---------------------------------------------------------------- backends
IMPL = {"adaptive": "native"}  # --impl: who runs the adaptive policy in the simulator
STUDY: dict[str, ModuleType | None] = {"sim": None}  # policy_sim's simulator, when found


def adaptive(capacity: int, params: AdaptiveParams | None = None):
    """The adaptive policy: the native core's, or (--impl reference) the Python one."""
    params = params or AdaptiveParams()
    if IMPL["adaptive"] == "reference":
        return AdaptivePolicy(capacity, params)
    return _core.Policy(capacity, dataclasses.asdict(params))


POLICIES: dict[str, Callable[[int], object]] = {
    "lru": lambda capacity: LRUPolicy(),
    "adaptive": adaptive,
}


def sim(blocks: list[BlockRequest], capacity: int, policy: str,
        params: AdaptiveParams | None = None) -> SimResult:
    """``policy`` at ``capacity`` blocks in the simulator (hits per request kept);
    ``params``: the adaptive policy's, when not the defaults."""
    if policy == "optimum":
        pol = OptimumPolicy(blocks)
    elif params is not None:
        pol = adaptive(capacity, params)
    else:
        pol = POLICIES[policy](capacity)
    res = simulate(blocks, capacity, pol, per_request=True)
    assert res.rejected == 0, f"{res.rejected} requests did not fit in {capacity} blocks"
    return res


# ------------------------------------------------------------------ the study
STUDY_SPEC = "lhd:learn=ghost,gbound=8"  # the policy the adaptive one was modelled on
STUDY_DIR = ROOT.parent / "shared" / "policy_sim"


def load_study(path: Path) -> ModuleType | None:
    """policy_sim's ``sim`` module (it imports its ``prep`` by name), or None when
    ``path`` holds no simulator."""
    if not (path / "sim.py").is_file():
        return None
    sys.path.insert(0, str(path))
    try:
        return importlib.import_module("sim")
    finally:
        sys.path.remove(str(path))


def study_data(blocks: list[BlockRequest]) -> tuple:
    """The block chains in the form policy_sim's ``prep.build`` gives a trace:
    per request its blocks as ints (prompt and output, which a next turn
    reuses), the blocks it needs, and each block's parent and depth."""
    ids: dict[int, int] = {}
    reqs, need, par, dep = [], [], [], []
    for b in blocks:
        chain: list[int] = []
        for depth, key in enumerate(b.keys):
            i = ids.get(key)
            if i is None:
                i = ids[key] = len(par)
                par.append(chain[-1] if chain else -1)
                dep.append(depth)
            chain.append(i)
        reqs.append(chain)
        need.append(b.blocks_needed)
    return reqs, need, par, dep, [0] * len(blocks)


def study_rates(study: ModuleType, blocks: list[BlockRequest], capacity: int) -> dict:
    """The study's policy and its LRU at ``capacity`` on the same chains: hit rates
    with the simulator's denominator (prompt blocks), and their ratio. Its model
    differs from the tree's in small ways (a request reserves no blocks while it
    runs; it may match every full block, the last one included), so the ratio
    to its own LRU is the figure to compare."""
    data = study_data(blocks)
    prompt = sum(b.prompt_blocks for b in blocks)
    rates = {}
    for name, spec in (("study", STUDY_SPEC), ("study_lru", "lru")):
        res = study.simulate("bench", 0, capacity, spec, data)
        assert res["skipped"] == 0, f"the study skipped {res['skipped']} requests"
        rates[name] = res["hits"] / prompt
    rates["study_ratio"] = rates["study"] / rates["study_lru"] if rates["study_lru"] else 1.0
    return rates


def scan_losses(requests: list[ChatRequest], blocks: list[BlockRequest],
                runs: dict[str, SimResult], capacity: int, args: argparse.Namespace,
                seed: int) -> dict:
    """What the one-off prompts cost the conversations, per policy: their hit rate
    with the one-offs mixed in (``runs``, on ``scan``) against the same
    conversations alone (``think``, same seed), at the same capacity."""
    alone = block_requests(chat_requests("think", args, seed), args)
    conv = [r.conversation_id >= 0 for r in requests]
    total = sum(b.prompt_blocks for b, c in zip(blocks, conv) if c)
    out = {}
    for policy in ("lru", "adaptive"):
        hits = sum(h for h, c in zip(runs[policy].per_request, conv) if c)
        out[f"scan_loss_{policy}"] = 1 - hits / total / sim(alone, capacity, policy).hit_rate
    return out


# The manager's block keys: the default config's namespace (no model, weights "0").
MANAGER_NAMESPACE = namespace_hash("", "0", "")


def block_requests(requests, args: argparse.Namespace) -> list[BlockRequest]:
    """The requests as block chains; with --manager keyed as the manager keys them,
    so that the adaptive policy's ghost (which hashes keys) decides as it does
    inside the manager."""
    ns = MANAGER_NAMESPACE if args.manager else None
    return to_block_requests(requests, args.block_size, namespace=ns)


def manager_replay(requests: list[ChatRequest], capacity: int, block_size: int,
                   policy: str | None) -> dict:
    """Replay ``requests`` through a GPU-only ``CacheManager`` of ``capacity``
    blocks: ``{"hit_rate", "rejected", "requests_per_s", "per_request"}`` (the
    rate counts the manager's calls only; ``per_request``: each request's GPU hit
    blocks). ``policy`` None is the manager's default."""
    from kvcached import CacheConfig, CacheManager

    extra = {} if policy is None else {"eviction_policy": policy}
    seen = [0]
    with tempfile.TemporaryDirectory(prefix="kvc-policy-", dir="/tmp") as run_dir:
        cfg = CacheConfig.load(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32",
                               block_size=block_size, num_gpu_blocks=capacity,
                               num_cpu_blocks=0, transfer_mode="inprocess",
                               create_cache=True, storage_backend=None,
                               check_host_memory=False, control_socket=False,
                               run_dir=run_dir, **extra)
        with CacheManager(cfg).start() as mgr:
            res = replay(mgr, requests, on_progress=lambda done, r: seen.append(
                r["hit_tokens"]["gpu"] // block_size))
    hit_blocks = res["hit_tokens"]["gpu"] // block_size
    calls_s = sum(map(sum, (res["allocate_us"], res["commit_us"], res["free_us"]))) / 1e6
    return {"hit_rate": hit_blocks / res["prompt_blocks"] if res["prompt_blocks"] else 0.0,
            "rejected": res["rejected"],
            "requests_per_s": res["requests"] / calls_s if calls_s else 0.0,
            "per_request": [b - a for a, b in zip(seen, seen[1:])]}


# -------------------------------------------------------------- cache sizes
def find_capacity(frac: Callable[[int], float], known: dict[int, float], target: float,
                  lo: int, tol: float = 0.01, max_runs: int = 8) -> int:
    """A capacity where LRU gets ``target`` of the unbounded hit rate.

    ``frac(c)`` runs LRU at ``c`` blocks and records its fraction in ``known``
    (which already holds the unbounded size, at 1.0). LRU's fraction grows
    with the capacity, so each step interpolates between the nearest runs
    below and above the target (kept off the bracket's ends, so it shrinks
    by at least an eighth), until a run is within ``tol``. ``lo`` (the
    smallest size every request fits in) when even it gets more than the
    target: the workload's floor, hits no eviction can lose."""
    if frac(lo) >= target - tol:
        return lo
    for _ in range(max_runs):
        below = max(c for c, f in known.items() if f < target)
        above = min(c for c, f in known.items() if f >= target)
        if above - below <= max(1, below // 200):
            break
        f_below, f_above = known[below], known[above]
        guess = below + (target - f_below) / (f_above - f_below) * (above - below)
        margin = (above - below) / 8
        c = round(min(max(guess, below + margin), above - margin))
        if abs(frac(c) - target) <= tol:
            return c
    return min(known, key=lambda c: abs(known[c] - target))


def bench_workload(name: str, seed: int, args: argparse.Namespace) -> list[dict]:
    """The table rows of one workload and seed."""
    requests = list(chat_requests(name, args, seed))
    blocks = block_requests(requests, args)
    distinct = len({k for b in blocks for k in b.keys})
    unbounded = sim(blocks, distinct, "lru").hit_rate
    smallest = max(b.blocks_needed for b in blocks)
    log(f"{name} seed {seed}: {len(blocks)} requests, {distinct} distinct blocks, "
        f"unbounded hit rate {unbounded:.3f}")
    known = {distinct: 1.0}  # LRU's fraction of the unbounded rate, by capacity
    lru_runs: dict[int, SimResult] = {}

    def frac(capacity: int) -> float:
        if capacity not in known:
            lru_runs[capacity] = sim(blocks, capacity, "lru")
            known[capacity] = lru_runs[capacity].hit_rate / unbounded
        return known[capacity]

    rows = []
    for target in TARGETS:
        capacity = find_capacity(frac, known, target, smallest)
        runs = {"lru": lru_runs[capacity]}
        for policy in ("adaptive", "optimum"):
            runs[policy] = sim(blocks, capacity, policy)
        rates = {policy: res.hit_rate for policy, res in runs.items()}
        row = _row(name, seed, target, capacity, unbounded, rates)
        if STUDY["sim"] is not None:
            row.update(study_rates(STUDY["sim"], blocks, capacity))
            row["vs_study"] = row["ratio"] / row["study_ratio"]
        if name == "scan":
            row.update(scan_losses(requests, blocks, runs, capacity, args, seed))
        if args.manager:
            row.update(manager_rows(requests, capacity, args.block_size, runs))
        variants = {}
        for spec in args.ghost_variants:
            rate = sim(blocks, capacity, "adaptive", ghost_params(spec)).hit_rate
            variants[spec] = {"hit_rate": rate, "ratio": rate / rates["lru"]
                              if rates["lru"] else float("inf")}
        if variants:
            row["ghost_variants"] = variants
        rows.append(row)
        study = (f" study {row['study']:.3f} ({row['study_ratio']:.2f}x its lru)"
                 if "study" in row else "")
        log(f"  {target:.0%} point: {capacity} blocks: lru {rates['lru']:.3f} adaptive "
            f"{rates['adaptive']:.3f} ({row['ratio']:.2f}x){study} optimum {rates['optimum']:.3f}"
            + "".join(f"; {spec} {v['ratio']:.2f}x" for spec, v in variants.items()))
    log(f"  ({len(known) - 1} LRU runs to find the sizes)")
    return rows


def manager_rows(requests: list[ChatRequest], capacity: int, block_size: int,
                 runs: dict[str, SimResult], repeats: int = 3) -> dict:
    """Both policies through the real manager: hit rates (each request's hits
    compared with the simulator's), and the request rate with the adaptive
    policy over the rate with LRU (target: >= 0.8). The replays alternate
    between the policies ``repeats`` times and the best rate of each counts (the
    machine is shared: the best run is the one least disturbed)."""
    out: dict = {}
    rates: dict[str, list[float]] = {"lru": [], "adaptive": []}
    for _ in range(repeats):
        for policy in ("lru", "adaptive"):
            res = manager_replay(requests, capacity, block_size, policy)
            assert res["rejected"] == 0, f"the manager rejected {res['rejected']} requests"
            out[f"manager_{policy}"] = res["hit_rate"]
            out[f"manager_{policy}_same_hits"] = res["per_request"] == runs[policy].per_request
            rates[policy].append(res["requests_per_s"])
    for policy, r in rates.items():
        out[f"manager_{policy}_requests_per_s"] = max(r)
    out["manager_rate_ratio"] = (out["manager_adaptive_requests_per_s"]
                                 / out["manager_lru_requests_per_s"])
    out["manager_ratio"] = (out["manager_adaptive"] / out["manager_lru"]
                            if out["manager_lru"] else float("inf"))
    return out


def ghost_params(spec: str) -> AdaptiveParams:
    """``BITS/WIN/FACTOR/WAYS`` (e.g. ``16/6/4/8``) as the adaptive policy's params."""
    try:
        bits, win, factor, ways = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--ghost-variants: {spec!r} is not BITS/WIN/FACTOR/WAYS") from None
    return AdaptiveParams(ghost_bits=bits, ghost_win_bits=win, ghost_factor=factor, ways=ways)


def ghost_bytes_per_block(params: AdaptiveParams) -> float:
    """The ghost's memory per cached block (the sets round it up a little)."""
    return params.ghost_factor * params.ghost_bits / 8


def _row(name: str, seed: int, target: float, capacity: int, unbounded: float,
         rates: dict[str, float]) -> dict:
    lru, ada, opt = rates["lru"], rates["adaptive"], rates["optimum"]
    gap = opt - lru
    return {"workload": name, "seed": seed, "target": target, "capacity": capacity,
            "unbounded": unbounded, "lru_of_unbounded": lru / unbounded, **rates,
            "ratio": ada / lru if lru else float("inf"),
            "optimum_ratio": opt / lru if lru else float("inf"),
            "of_optimum": ada / opt if opt else 1.0,
            "gap_closed": (ada - lru) / gap if gap > 0 else 1.0}


# ------------------------------------------------------------------- a trace
TRACE_MIN_VS_STUDY = 0.95  # adaptive / the study, on a trace, at every size
TRACE_CAPACITIES = (20000, 55000)


def parse_slice(spec: str | None, total: int) -> tuple[int, int]:
    """``A:B`` (1-based, both included; ``A:`` to the end, ``:B`` from the start) as
    a Python range ``(A - 1, B)`` of a trace of ``total`` requests."""
    if not spec:
        return 0, total
    lo, sep, hi = spec.partition(":")
    try:
        a = int(lo) if lo else 1
        b = int(hi) if hi else total
    except ValueError:
        raise SystemExit(f"--slice: {spec!r} is not A:B") from None
    if not sep or not 1 <= a <= b:
        raise SystemExit(f"--slice: {spec!r} is not A:B with 1 <= A <= B")
    if a > total:
        raise SystemExit(f"--slice: {spec!r} starts past the trace's {total} requests")
    return a - 1, min(b, total)


def trace_study_data(reqs: list, block_size: int) -> tuple:
    """The slice as policy_sim's ``prep.build`` makes a trace of it (its block ids:
    (parent, hash id, block within the hash id); the full blocks of each prompt)."""
    per = 512 // block_size
    idx: dict[tuple[int, int, int], int] = {}
    chains, need, par, dep = [], [], [], []
    for r in reqs:
        n, chain, p = r.input_length, [], -1
        for k, h in enumerate(r.hash_ids):
            for j in range(min(per, max(0, n - k * 512) // block_size)):
                b = idx.get((p, h, j))
                if b is None:
                    b = idx[(p, h, j)] = len(par)
                    par.append(p)
                    dep.append(len(chain))
                chain.append(b)
                p = b
        chains.append(chain)
        need.append(-(-n // block_size))
    return chains, need, par, dep, [r.timestamp for r in reqs]


def trace_manager_replay(reqs: list, first: int, capacity: int, block_size: int,
                         policy: str) -> dict:
    """``reqs`` (trace requests; ``first``: the index of the first in the trace)
    through a GPU-only ``CacheManager`` as ``kvcached bench trace`` drives it:
    ``{"hit_rate", "rejected", "requests_per_s"}`` (hit blocks over prompt blocks;
    the rate counts the manager's calls only)."""
    import time

    from kvcached import CacheManager
    from kvcached.errors import NoFreeBlocks
    from kvcached.tools.trace import trace_config, trace_tokens

    hits = prompt = rejected = served = 0
    spent = 0.0
    with tempfile.TemporaryDirectory(prefix="kvc-policy-", dir="/tmp") as run_dir:
        cfg = trace_config(block_size=block_size, num_gpu_blocks=capacity, num_cpu_blocks=0,
                           eviction_policy=policy, check_host_memory=False,
                           control_socket=False, run_dir=run_dir)
        with CacheManager(cfg).start() as mgr:
            for i, r in enumerate(reqs):
                tokens = trace_tokens(r, first + i)
                t0 = time.perf_counter()
                try:
                    a = mgr.allocate(i, tokens, reserve_tokens=r.output_length)
                except NoFreeBlocks:
                    rejected += 1
                    continue
                a.wait()
                mgr.commit(i, tokens, len(tokens))
                mgr.free(i)
                spent += time.perf_counter() - t0
                served += 1
                hits += a.hit.gpu_tokens // block_size
                prompt += -(-len(tokens) // block_size)
    return {"hit_rate": hits / prompt if prompt else 0.0, "rejected": rejected,
            "requests_per_s": served / spent if spent else 0.0}


def bench_trace(args: argparse.Namespace) -> dict:
    """The trace's rows: per capacity, LRU and the adaptive policy through the
    manager, and the study on the same requests."""
    from kvcached.tools.trace import load_trace

    everything = load_trace(args.trace)
    a, b = parse_slice(args.slice, len(everything))
    reqs = everything[a:b]
    block_size = args.block_size or 64
    if 512 % block_size:
        raise SystemExit(f"--block-size {block_size} does not divide the trace's 512-token "
                         "blocks")
    log(f"{args.trace}: requests {a + 1}-{b} of {len(everything)}, {block_size}-token blocks")
    study = STUDY["sim"]
    data = trace_study_data(reqs, block_size) if study is not None else None
    rows = []
    for capacity in args.capacity or TRACE_CAPACITIES:
        row: dict = {"slice": f"{a + 1}:{b}", "capacity": capacity}
        rates: dict[str, list[float]] = {"lru": [], "adaptive": []}
        for _ in range(args.repeats):
            for policy in ("lru", "adaptive"):
                res = trace_manager_replay(reqs, a, capacity, block_size, policy)
                row[policy], row[f"rejected_{policy}"] = res["hit_rate"], res["rejected"]
                rates[policy].append(res["requests_per_s"])
        for policy, r in rates.items():  # the best of the repeats: the least disturbed
            row[f"{policy}_requests_per_s"] = max(r)
        row["ratio"] = row["adaptive"] / row["lru"] if row["lru"] else float("inf")
        row["rate_ratio"] = row["adaptive_requests_per_s"] / row["lru_requests_per_s"]
        if study is not None:
            for name, spec in (("study", STUDY_SPEC), ("study_lru", "lru")):
                res = study.simulate(args.trace, 0, capacity, spec, data)
                row[name], row[f"skipped_{name}"] = res["hit_rate"], res["skipped"]
            row["vs_study"] = row["adaptive"] / row["study"] if row["study"] else float("inf")
        rows.append(row)
        study_s = (f" study {row['study']:.4f} (lru {row['study_lru']:.4f}) adaptive/study "
                   f"{row['vs_study']:.2f}" if "study" in row else "")
        log(f"  {capacity} blocks: lru {row['lru']:.4f} adaptive {row['adaptive']:.4f} "
            f"({row['ratio']:.2f}x){study_s}; requests/s adaptive/lru {row['rate_ratio']:.2f}")
    out: dict = {"min_ratio": min(r["ratio"] for r in rows)}
    out["floor_ok"] = out["min_ratio"] >= FLOOR_RATIO
    out["min_rate_ratio"] = min(r["rate_ratio"] for r in rows)
    out["rate_ok"] = out["min_rate_ratio"] >= MANAGER_MIN_RATE_RATIO
    if study is not None:
        out["vs_study_min"] = min(r["vs_study"] for r in rows)
        out["vs_study_ok"] = out["vs_study_min"] >= TRACE_MIN_VS_STUDY
    out["all_ok"] = all(v for k, v in out.items() if k.endswith("_ok"))
    return {"bench": "policy", "backend": "manager", "trace": str(args.trace),
            "slice": f"{a + 1}:{b}", "block_size": block_size, "rows": rows, **out}


# --------------------------------------------------------------- verdict
def verdict(rows: list[dict]) -> dict:
    """The issue's targets, each with the worst row it applies to."""
    out = {}
    for target, need in THINK_MIN_RATIO.items():
        think = [r["ratio"] for r in rows if r["workload"] == "think" and r["target"] == target]
        if not think:
            continue
        got = min(think)
        out[f"think_{int(target * 100)}pct_min_ratio"] = got
        out[f"think_{int(target * 100)}pct_ok"] = got >= need
    worst = min(rows, key=lambda r: r["ratio"])
    out["min_ratio"] = worst["ratio"]
    out["min_ratio_at"] = f"{worst['workload']} seed {worst['seed']} {worst['target']:.0%}"
    out["floor_ok"] = worst["ratio"] >= FLOOR_RATIO
    if "vs_study" in rows[0]:  # descriptive: the study's model is not the tree's
        low = min(rows, key=lambda r: r["vs_study"])
        out["vs_study_min"] = low["vs_study"]
        out["vs_study_min_at"] = f"{low['workload']} seed {low['seed']} {low['target']:.0%}"
    scan = [r for r in rows if "scan_loss_lru" in r]
    if scan:  # descriptive: the issue quotes it, sets no target
        out["scan_loss_max"] = {p: max(r[f"scan_loss_{p}"] for r in scan)
                                for p in ("lru", "adaptive")}
    if "manager_rate_ratio" in rows[0]:
        out["manager_min_rate_ratio"] = min(r["manager_rate_ratio"] for r in rows)
        out["manager_rate_ok"] = out["manager_min_rate_ratio"] >= MANAGER_MIN_RATE_RATIO
        out["manager_min_ratio"] = min(r["manager_ratio"] for r in rows)
        # The simulator is the manager, request for request, under both policies:
        # a mismatch means the simulated numbers no longer describe the manager.
        for policy in ("lru", "adaptive"):
            out[f"manager_{policy}_match_ok"] = all(r[f"manager_{policy}_same_hits"]
                                                    for r in rows)
        # adaptive is the default only while it is never below 0.99x LRU on any
        # workload of the benchmark through the manager.
        out["adaptive_default_ok"] = out["manager_min_ratio"] >= FLOOR_RATIO
    specs = [s for r in rows for s in r.get("ghost_variants", {})]
    if specs:
        out["ghost_variants"] = {
            spec: {"bytes_per_block": ghost_bytes_per_block(ghost_params(spec)),
                   "min_ratio": min(r["ghost_variants"][spec]["ratio"] for r in rows),
                   "think_20pct_min_ratio": min(
                       (r["ghost_variants"][spec]["ratio"] for r in rows
                        if r["workload"] == "think" and r["target"] == 0.2), default=None)}
            for spec in dict.fromkeys(specs)}
    out["all_ok"] = all(v for k, v in out.items()
                        if k.endswith("_ok") and k != "adaptive_default_ok")
    return out


def print_table(rows: list[dict]) -> None:
    log("workload   seed target capacity    lru  adapt  optim  ratio  opt/lru  of_opt"
        "  study s.lru s.ratio  scan loss lru/adapt")
    for r in rows:
        study = (f" {r['study']:6.3f} {r['study_lru']:5.3f} {r['study_ratio']:7.2f}"
                 if "study" in r else f" {'-':>6} {'-':>5} {'-':>7}")
        loss = (f"  {r['scan_loss_lru']:8.0%} / {r['scan_loss_adaptive']:.0%}"
                if "scan_loss_lru" in r else "")
        log(f"{r['workload']:<10} {r['seed']:>4} {r['target']:>6.0%} {r['capacity']:>8} "
            f"{r['lru']:6.3f} {r['adaptive']:6.3f} {r['optimum']:6.3f} {r['ratio']:6.2f} "
            f"{r['optimum_ratio']:8.2f} {r['of_optimum']:7.2f}{study}{loss}")


def print_trace_table(rows: list[dict]) -> None:
    log("slice        capacity    lru  adaptive   study  adaptive/study  adaptive/lru  rate")
    for r in rows:
        study = (f"{r['study']:7.4f} {r['vs_study']:15.2f}" if "study" in r
                 else f"{'-':>7} {'-':>15}")
        log(f"{r['slice']:<12} {r['capacity']:>8} {r['lru']:6.4f} {r['adaptive']:9.4f} {study} "
            f"{r['ratio']:13.2f} {r['rate_ratio']:5.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block (32; 64 with --trace)")
    ap.add_argument("--think-time", type=int, nargs=2, default=[200, 1000],
                    metavar=("LO", "HI"), help="requests between a conversation's turns")
    ap.add_argument("--turns", type=int, nargs=2, default=[2, 16], metavar=("LO", "HI"),
                    help="turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--scan-fraction", type=float, default=0.05,
                    help="share of one-off long prompts in the scan workload")
    ap.add_argument("--quick", action="store_true", help="one seed, 5000 requests")
    ap.add_argument("--manager", action="store_true",
                    help="also replay through CacheManager with each policy")
    ap.add_argument("--impl", choices=("native", "reference"), default="native",
                    help="the adaptive policy in the simulator: the core's or the Python one")
    ap.add_argument("--ghost-variants", nargs="*", default=[], metavar="BITS/WIN/FACTOR/WAYS",
                    help="also run the adaptive policy with these ghosts (e.g. 16/6/4/8)")
    ap.add_argument("--study-dir", type=Path, default=STUDY_DIR,
                    help="policy_sim's directory: each row also gets its figure "
                         f"({STUDY_SPEC}, and its LRU) on the same chains and capacity")
    ap.add_argument("--no-study", action="store_true", help="leave the study out")
    ap.add_argument("--trace", type=Path, default=None,
                    help="a Mooncake-format trace: replay it (the manager, and the study) "
                         "instead of the generated workloads")
    ap.add_argument("--slice", default=None, metavar="A:B",
                    help="with --trace: its requests A..B (1-based, both included)")
    ap.add_argument("--capacity", type=int, nargs="+", default=None,
                    help=f"with --trace: cache sizes in blocks (default "
                         f"{' '.join(map(str, TRACE_CAPACITIES))})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --trace: replays per policy and size (the best rate counts)")
    args = ap.parse_args(argv)
    if args.trace is None and (args.slice or args.capacity):
        ap.error("--slice and --capacity go with --trace")
    if args.trace is None and args.block_size is None:
        args.block_size = 32
    for spec in args.ghost_variants:
        ghost_params(spec)  # a bad spec fails now, not after an hour
    if args.quick:
        args.seeds, args.requests = args.seeds[:1], min(args.requests, 5000)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    IMPL["adaptive"] = args.impl
    STUDY["sim"] = None if args.no_study else load_study(args.study_dir)
    if STUDY["sim"] is None and not args.no_study:
        log(f"no policy_sim in {args.study_dir}: rows without the study's figure")
    if args.trace is not None:
        result = bench_trace(args)
        print_trace_table(result["rows"])
        emit(result)
        return result
    rows = [row for name in args.workloads for seed in args.seeds
            for row in bench_workload(name, seed, args)]
    print_table(rows)
    result = {"bench": "policy", "backend": "manager+simulator" if args.manager else "simulator",
              "requests": args.requests, "block_size": args.block_size,
              "think_time": args.think_time, "turns": args.turns,
              "scan_fraction": args.scan_fraction, "seeds": args.seeds, "impl": args.impl,
              "ghost_bytes_per_block": ghost_bytes_per_block(AdaptiveParams()),
              "rows": rows, **verdict(rows)}
    emit(result)
    return result


if __name__ == "__main__":
    main()
