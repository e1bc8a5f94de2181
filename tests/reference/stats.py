"""The reference counters (tests only), behind the reference ``CacheManager.stats()``."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from kvcached.types import CacheStats, HitInfo, TierUsage

if TYPE_CHECKING:
    from kvcached.tasks import Task, TaskResult

TIERS = ("gpu", "cpu", "storage")


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


class Counters:
    """Plain counters updated on the manager's thread; snapshot() copies them out."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = dict.fromkeys(TIERS, 0)
        self.hit_requests = dict.fromkeys(TIERS, 0)
        self.evictions: collections.Counter[str] = collections.Counter()
        self.dedup_blocks = 0
        self.no_free_blocks = 0
        self.storage: collections.Counter[str] = collections.Counter()
        self.tasks: dict[str, dict[str, Any]] = {}
        self._latency: dict[str, collections.deque[float]] = {}

    def count_request(self, prompt_tokens: int, hit: HitInfo) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        gpu, cpu, storage = hit  # every request: three tests, no loop over the tiers
        if gpu:
            self._count_hit("gpu", gpu)
        if cpu:
            self._count_hit("cpu", cpu)
        if storage:
            self._count_hit("storage", storage)

    def _count_hit(self, tier: str, tokens: int) -> None:
        self.hit_tokens[tier] += tokens
        self.hit_requests[tier] += 1

    def _kind(self, kind: str) -> dict[str, Any]:
        d = self.tasks.get(kind)
        if d is None:
            d = self.tasks[kind] = {"submitted": 0, "done": 0, "failed": 0, "blocks": 0,
                                    "seconds": 0.0}
            self._latency[kind] = collections.deque(maxlen=2048)
        return d

    def task_submitted(self, task: Task) -> None:
        self._kind(task.kind)["submitted"] += 1

    def task_done(self, task: Task, res: TaskResult) -> None:
        d = self._kind(task.kind)
        if res.ok:
            d["done"] += 1
            d["blocks"] += len(task.src) or len(task.dst)
            d["seconds"] += res.elapsed_s  # task time summed: bytes / seconds = bandwidth
            self._latency[task.kind].append(res.elapsed_s)
        else:
            d["failed"] += 1

    def snapshot(self, mgr, workers: list[dict[str, Any]]) -> CacheStats:
        block_bytes = mgr.cfg.layout.block_bytes * mgr.cfg.tp_size
        transfers = {}
        for kind, d in self.tasks.items():
            lat = list(self._latency[kind])
            transfers[kind] = {**d, "bytes": d["blocks"] * block_bytes,
                               "p50_ms": percentile(lat, 0.5) * 1e3,
                               "p99_ms": percentile(lat, 0.99) * 1e3}
        private = sum(len(r.blocks) - len(r.nodes) for r in mgr._reqs.values())
        return CacheStats(
            requests=self.requests, running=len(mgr._reqs), prompt_tokens=self.prompt_tokens,
            hit_tokens=dict(self.hit_tokens), hit_requests=dict(self.hit_requests),
            tiers={"gpu": _usage(mgr.gpu_pool, mgr.gpu_pool.num_used - private),
                   "cpu": _usage(mgr.cpu_pool, mgr.cpu_pool.num_used)},
            evictions=dict(self.evictions), dedup_blocks=self.dedup_blocks,
            no_free_blocks=self.no_free_blocks, transfers=transfers, workers=workers,
            storage=dict(self.storage),
            cached_nodes=mgr.tree.num_nodes)


def _usage(pool, cached: int) -> TierUsage:
    return TierUsage(total=pool.num_blocks, used=pool.num_used, free=pool.num_free,
                     cached=cached)
