"""Counters behind ``CacheManager.stats()``: requests, hits per tier, transfers,
storage reads skipped (the core counts evictions, dedups and its eviction
policy's events itself)."""

from __future__ import annotations

import bisect
import collections
from typing import Any

from kvcached.tasks import Task, TaskResult
from kvcached.types import CacheStats, HitInfo, TierUsage

TIERS = ("gpu", "cpu", "storage")
# Upper bounds (seconds) of the task latency histogram (/metrics task_latency_seconds).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def policy_view(core) -> dict[str, Any]:
    """The eviction policy, for status and metrics: ``{"name": ...}`` and, under the
    adaptive policy, per tier with blocks:

    - ``ghost_entries`` / ``ghost_slots`` / ``ghost_bytes``: the ghost (keys of
      recently evicted blocks) as filled, as sized, and its memory;
    - ``hits``: reuses of blocks the tier held (matched at allocate; GPU: also a
      commit that found the block cached);
    - ``ghost_hits``: reuses that came too late, blocks that entered the tier
      again after it evicted them, and that the ghost remembered;
    - ``ghost_hit_share``: ghost_hits / (hits + ghost_hits), the share of the
      reuses the tier saw that it had evicted (what a larger tier would serve);
    - ``inserts``: blocks that entered the tier.
    """
    raw = core.policy_stats()
    out: dict[str, Any] = {"name": raw["policy"]}
    for tier in ("gpu", "cpu"):
        t = raw.get(tier)
        if t is None:
            continue
        reuses = t["hits"] + t["ghost_hits"]
        out[tier] = {"ghost_entries": t["ghost_entries"], "ghost_slots": t["ghost_slots"],
                     "ghost_bytes": t["ghost_bytes"], "hits": t["hits"],
                     "ghost_hits": t["ghost_hits"], "inserts": t["inserts"],
                     "ghost_hit_share": t["ghost_hits"] / reuses if reuses else 0.0}
    return out


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
        self.no_free_blocks = 0
        self.storage: collections.Counter[str] = collections.Counter()
        self.tasks: dict[str, dict[str, Any]] = {}
        self._latency: dict[str, collections.deque[float]] = {}
        # per kind: tasks done per LATENCY_BUCKETS bucket (+ one past the last bound)
        self._buckets: dict[str, list[int]] = {}

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
            self._buckets[kind] = [0] * (len(LATENCY_BUCKETS) + 1)
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
            self._buckets[task.kind][bisect.bisect_left(LATENCY_BUCKETS, res.elapsed_s)] += 1
        else:
            d["failed"] += 1

    def snapshot(self, core, running: int, private_blocks: int, block_bytes: int,
                 workers: list[dict[str, Any]]) -> CacheStats:
        """The counters, the core's tiers and eviction counts, as CacheStats.
        ``private_blocks``: GPU blocks running requests hold outside the tree."""
        transfers = {}
        for kind, d in self.tasks.items():
            lat = list(self._latency[kind])
            transfers[kind] = {**d, "bytes": d["blocks"] * block_bytes,
                               "p50_ms": percentile(lat, 0.5) * 1e3,
                               "p99_ms": percentile(lat, 0.99) * 1e3,
                               "histogram": self._histogram(kind)}
        gpu_used = core.gpu_blocks - core.gpu_free
        cpu_used = core.cpu_blocks - core.cpu_free
        counted = core.counters()
        return CacheStats(
            requests=self.requests, running=running, prompt_tokens=self.prompt_tokens,
            hit_tokens=dict(self.hit_tokens), hit_requests=dict(self.hit_requests),
            tiers={"gpu": TierUsage(core.gpu_blocks, gpu_used, core.gpu_free,
                                    gpu_used - private_blocks),
                   "cpu": TierUsage(core.cpu_blocks, cpu_used, core.cpu_free, cpu_used)},
            evictions=counted["evictions"], dedup_blocks=counted["dedup_blocks"],
            no_free_blocks=self.no_free_blocks, transfers=transfers, workers=workers,
            storage=dict(self.storage), cached_nodes=core.num_nodes,
            policy=policy_view(core))

    def _histogram(self, kind: str) -> dict[str, Any]:
        """Every done task's latency, Prometheus style: cumulative counts per upper
        bound (``+Inf`` last), their sum and count."""
        counts, total, out = self._buckets[kind], 0, []
        for bound, n in zip((*LATENCY_BUCKETS, "+Inf"), counts):
            total += n
            out.append([bound, total])
        return {"buckets": out, "sum": self.tasks[kind]["seconds"], "count": total}
