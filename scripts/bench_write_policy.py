"""Storage write policies on a fleet: bytes written per request against the
fleet's storage hit rate.

A Mooncake-format trace (``--trace FILE``; by default the generator behind
``tests/data/synthetic_trace.jsonl``, ``kvcached.tools.trace.synthetic_trace``,
with ``--requests`` requests: multi-turn sessions over a few shared system
prompts, plus one-off requests) is replayed over N instances, each a
``CacheManager`` in this process (GPU and CPU tiers of ``--gpu-blocks`` /
``--cpu-blocks``, in-process copies, a tiny layout) sharing one file store, a
fresh directory per run. Each request goes to one instance:

- ``random``: any instance;
- ``sticky``: a conversation stays on the instance of its first turn (the
  trace has no conversation ids: a request continues the conversation of the
  earlier request whose hash ids are the longest prefix of its own).

For every policy (``storage_write_policy``), routing and instance count it
reports the bytes written to storage per request (objects: header + block),
the fleet's hit rate from storage and in total (shares of all prompt tokens),
and the hit rate of one unbounded cache (the ceiling). Progress and a table
go to stderr; the last line of stdout is one JSON object.

    .venv/bin/python scripts/bench_write_policy.py                  # ~2 CPU minutes
    .venv/bin/python scripts/bench_write_policy.py --quick          # a smoke run
    .venv/bin/python scripts/bench_write_policy.py --trace mooncake_trace.jsonl
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from _bench_util import emit, log, short_tmp_dir

from kvcached.core.manager import CacheManager
from kvcached.errors import NoFreeBlocks
from kvcached.ops.statusview import storage_health
from kvcached.storage import HEADER_SIZE
from kvcached.tools.trace import (
    IdealCache,
    TraceRequest,
    load_trace,
    parse_line,
    synthetic_trace,
    trace_config,
    trace_tokens,
)

POLICIES = ("write_through", "write_through_selective", "write_back")
ROUTINGS = ("random", "sticky")


def synthetic_requests(n: int, seed: int) -> list[TraceRequest]:
    import json
    return [parse_line(json.dumps(r), f"synthetic line {i}")
            for i, r in enumerate(synthetic_trace(n, seed))]


def conversations(reqs: list[TraceRequest]) -> list[int]:
    """A conversation id per request: that of the earlier request whose hash ids
    are the longest proper prefix of this one's, else a new one."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for r in reqs:
        ids = r.hash_ids
        cid = next((seen[ids[:k]] for k in range(len(ids) - 1, 0, -1) if ids[:k] in seen),
                   len(seen))
        seen.setdefault(ids, cid)
        out.append(cid)
    return out


def routes(convs: list[int], n: int, routing: str, seed: int) -> list[int]:
    """The instance of every request."""
    rng = random.Random(seed)
    if routing == "random":
        return [rng.randrange(n) for _ in convs]
    home: dict[int, int] = {}
    return [home.setdefault(c, rng.randrange(n)) for c in convs]


@dataclass
class Result:
    policy: str
    routing: str
    instances: int
    requests: int = 0
    prompt_tokens: int = 0
    hit: dict = field(default_factory=lambda: {"gpu": 0, "cpu": 0, "storage": 0})
    stored_blocks: int = 0
    skipped_blocks: int = 0
    elapsed_s: float = 0.0

    def row(self, object_bytes: int, ideal: float) -> dict:
        tokens = max(1, self.prompt_tokens)
        return {"policy": self.policy, "routing": self.routing, "instances": self.instances,
                "requests": self.requests,
                "bytes_written_per_request": self.stored_blocks * object_bytes / self.requests,
                "blocks_written": self.stored_blocks,
                "blocks_skipped_by_policy": self.skipped_blocks,
                "hit_rate_storage": self.hit["storage"] / tokens,
                "hit_rate": sum(self.hit.values()) / tokens,
                "hit_rate_gpu": self.hit["gpu"] / tokens, "hit_rate_cpu": self.hit["cpu"] / tokens,
                "ideal_hit_rate": ideal, "elapsed_s": self.elapsed_s}


def serve(mgr: CacheManager, rid: int, tokens: list[int], out: Result) -> None:
    """One request as an engine drives it (no model): allocate, wait, commit, free."""
    try:
        a = mgr.allocate(rid, tokens)
    except NoFreeBlocks:
        return
    a.wait()
    mgr.commit(rid, tokens, len(tokens))
    mgr.free(rid)
    out.requests += 1
    out.prompt_tokens += len(tokens)
    for tier, n in zip(("gpu", "cpu", "storage"), a.hit, strict=True):
        out.hit[tier] += n


def replay(reqs, convs, args, policy: str, routing: str, n: int) -> Result:
    """The trace over ``n`` fresh instances on one fresh store."""
    res = Result(policy, routing, n)
    where = routes(convs, n, routing, args.seed)
    t0 = time.perf_counter()
    with short_tmp_dir("kvc-wp-") as tmp:
        mgrs = [CacheManager(trace_config(
            run_dir=str(tmp / f"i{k}"), block_size=args.block_size,
            num_gpu_blocks=args.gpu_blocks, num_cpu_blocks=args.cpu_blocks,
            storage_backend="file", storage_url=str(tmp / "store"), storage_max_bytes=-1,
            storage_write_policy=policy, storage_write_threshold=args.threshold,
            storage_load_policy="wait_complete", control_socket=False)).start()
                for k in range(n)]
        try:
            for i, (r, k) in enumerate(zip(reqs, where, strict=True)):
                serve(mgrs[k], i, trace_tokens(r, i), res)
            for m in mgrs:
                m.planner.wait_background(60)  # stores in flight land (written is written)
                st = m.stats().storage
                # written by the ranks: a block storage already held is not rewritten
                res.stored_blocks += sum(h.get("stored", 0)
                                         for _, h in storage_health(m.status()))
                res.skipped_blocks += st.get("write_skipped_policy", 0)
        finally:
            for m in mgrs:
                m.close()
    res.elapsed_s = time.perf_counter() - t0
    return res


def table(rows: list[dict]) -> str:
    base = {(r["routing"], r["instances"]): r["bytes_written_per_request"]
            for r in rows if r["policy"] == "write_through"}
    lines = ["| instances | routing | policy | KiB written / request | of write_through "
             "| storage hit rate | total hit rate |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        wt = base.get((r["routing"], r["instances"])) or 1
        lines.append(f"| {r['instances']} | {r['routing']} | {r['policy']} | "
                     f"{r['bytes_written_per_request'] / 1024:.1f} | "
                     f"{r['bytes_written_per_request'] / wt:.0%} | "
                     f"{r['hit_rate_storage']:.1%} | {r['hit_rate']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="a Mooncake-format JSONL trace (default: synthetic)")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--instances", type=int, nargs="+", default=[2, 4])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    p.add_argument("--gpu-blocks", type=int, default=256)
    p.add_argument("--cpu-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--threshold", type=int, default=1, help="storage_write_threshold")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="300 requests, 2 instances")
    args = p.parse_args()
    if args.quick:
        args.requests, args.instances = 300, [2]
    reqs = (load_trace(args.trace, args.requests) if args.trace
            else synthetic_requests(args.requests, args.seed))
    convs = conversations(reqs)
    ideal = IdealCache(args.block_size)
    for i, r in enumerate(reqs):
        ideal.add(trace_tokens(r, i))
    prompt_tokens = sum(r.input_length for r in reqs)
    cfg = trace_config(block_size=args.block_size)
    object_bytes = HEADER_SIZE + cfg.layout.block_bytes
    log(f"{len(reqs)} requests, {len(set(convs))} conversations, {prompt_tokens} prompt "
        f"tokens; unbounded hit rate {ideal.hit_tokens / prompt_tokens:.1%}")
    rows = []
    for n in args.instances:
        for routing in args.routings:
            for policy in args.policies:
                res = replay(reqs, convs, args, policy, routing, n)
                rows.append(res.row(object_bytes, ideal.hit_tokens / prompt_tokens))
                log(f"{n} instances, {routing}, {policy}: "
                    f"{rows[-1]['bytes_written_per_request'] / 1024:.1f} KiB/request, storage "
                    f"hits {rows[-1]['hit_rate_storage']:.1%}, total {rows[-1]['hit_rate']:.1%} "
                    f"({res.elapsed_s:.1f}s)")
    log("\n" + table(rows))
    emit({"bench": "write_policy", "trace": args.trace or f"synthetic({args.requests}, "
          f"seed {args.seed})", "requests": len(reqs), "gpu_blocks": args.gpu_blocks,
          "cpu_blocks": args.cpu_blocks, "block_size": args.block_size,
          "threshold": args.threshold, "object_bytes": object_bytes, "rows": rows})


if __name__ == "__main__":
    main()
