"""kvcached as vLLM's own observability shows it.

- Hit sources (``get_external_cache_hit_sources``): the tokens of each
  external hit split by the tier that supplied them, so vLLM's prefix-cache
  metrics count CPU-tier hits as ``host`` and storage hits as ``disk`` (a
  file store) or ``external_unspecified`` (Redis, Mooncake: remote stores).
- Stats (``get_kv_connector_stats`` on the scheduler side, rebuilt in vLLM's
  logger process by ``build_kv_connector_stats``): counters per interval and
  the load latencies; ``KvcachedPromMetrics`` turns them into the
  ``vllm:kvcached_*`` series of ``vllm serve``'s ``/metrics``.
- KV cache events (``take_events``): blocks stored into and removed from the
  CPU tier and storage, as vLLM's ``BlockStored`` / ``BlockRemoved`` with the
  medium named (``CPU``, ``STORAGE``), keyed by vLLM's own block hashes, so a
  KV-aware router follows every tier of an instance on one stream.

The stats travel between processes as plain data (``to_dict``): counters
keyed by name and a list of load latencies.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

TIERS = ("cpu", "storage")
# Counters of one interval; per-tier ones take the tier as a suffix.
PER_TIER = ("hit_tokens", "loaded_bytes")
PLAIN = ("load_failed_blocks", "saved_blocks", "saved_bytes", "saves_dropped", "step_loads")
COUNTERS = tuple(f"{c}_{t}" for c in PER_TIER for t in TIERS) + PLAIN
MEDIUM = {"cpu": MEDIUM_CPU, "storage": MEDIUM_STORAGE}
# Load latency buckets (seconds): a CPU-tier load takes milliseconds, a
# storage read up to its timeout.
LOAD_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def storage_source(backend: str | None) -> CacheHitSource:
    """vLLM's name for where a storage hit came from."""
    return CacheHitSource.DISK if backend == "file" else CacheHitSource.EXTERNAL_UNSPECIFIED


def hit_sources(cpu_tokens: int, storage_tokens: int,
                storage: CacheHitSource) -> dict[CacheHitSource, int]:
    """vLLM's form: non-zero counts only."""
    out = {CacheHitSource.HOST: cpu_tokens, storage: storage_tokens}
    return {k: v for k, v in out.items() if v > 0}


@dataclass
class KvcachedStats(KVConnectorStats):
    """One interval of kvcached's counters and load latencies (see the module)."""

    def __post_init__(self):
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": dict.fromkeys(COUNTERS, 0), "load_seconds": []}

    def count(self, name: str, n: int | float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown kvcached stats counter {name!r}")
        self.data["counters"][name] += n

    def load_took(self, seconds: float) -> None:
        self.data["load_seconds"].append(float(seconds))

    def aggregate(self, other: KVConnectorStats) -> KvcachedStats:
        if other.is_empty():
            return self
        for name, n in other.data["counters"].items():
            self.data["counters"][name] = self.data["counters"].get(name, 0) + n
        self.data["load_seconds"] += other.data["load_seconds"]
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: n for name, n in self.data["counters"].items() if n}
        lat = self.data["load_seconds"]
        if lat:
            out["loads"] = len(lat)
            out["load_ms_median"] = round(1000 * statistics.median(lat), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data["load_seconds"] and not any(self.data["counters"].values())


class KvcachedPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvcached_*`` series, one child per engine (and tier)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tiered = labelnames + ["tier"]
        self.counters = {
            "hit_tokens": self._counter_cls(
                name="vllm:kvcached_hit_tokens",
                documentation="Prompt tokens whose KV kvcached loaded, by tier.",
                labelnames=tiered),
            "loaded_bytes": self._counter_cls(
                name="vllm:kvcached_loaded_bytes",
                documentation="Bytes of KV kvcached loaded into vLLM's blocks, by tier.",
                labelnames=tiered),
            "load_failed_blocks": self._counter_cls(
                name="vllm:kvcached_load_failed_blocks",
                documentation="Blocks a load did not deliver (vLLM recomputed them).",
                labelnames=labelnames),
            "saved_blocks": self._counter_cls(
                name="vllm:kvcached_saved_blocks",
                documentation="vLLM blocks copied into kvcached's CPU tier.",
                labelnames=labelnames),
            "saved_bytes": self._counter_cls(
                name="vllm:kvcached_saved_bytes",
                documentation="Bytes of KV copied into kvcached's CPU tier.",
                labelnames=labelnames),
            "step_loads": self._counter_cls(
                name="vllm:kvcached_step_loads",
                documentation="Requests whose CPU-tier hit loaded inside the step that "
                              "computed the rest of their prompt.",
                labelnames=labelnames),
            "saves_dropped": self._counter_cls(
                name="vllm:kvcached_saves_dropped",
                documentation="Planned saves dropped (their request was preempted first).",
                labelnames=labelnames),
        }
        self.load_seconds = self._histogram_cls(
            name="vllm:kvcached_load_seconds",
            documentation="Time from a load's submission to its landing in vLLM's blocks.",
            labelnames=labelnames, buckets=list(LOAD_BUCKETS))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for name, n in transfer_stats_data.get("counters", {}).items():
            if not n:
                continue
            base, _, tier = name.rpartition("_")
            if base in PER_TIER and tier in TIERS:
                self.counters[base].labels(*labels, tier).inc(n)
            else:
                self.counters[name].labels(*labels).inc(n)
        hist = self.load_seconds.labels(*labels)
        for seconds in transfer_stats_data.get("load_seconds", ()):
            hist.observe(seconds)


def kv_events(raw: list[tuple[bool, str, bytes]]) -> list[BlockStored | BlockRemoved]:
    """vLLM's events for (stored, tier, vLLM block hash) records of the CPU tier
    and storage, consecutive records of one kind and tier in one event."""
    out: list[BlockStored | BlockRemoved] = []
    run: list = []
    for i, (stored, tier, h) in enumerate(raw):
        run.append(maybe_convert_block_hash(h))
        if i + 1 < len(raw) and raw[i + 1][:2] == (stored, tier):
            continue
        if stored:
            out.append(BlockStored(block_hashes=run, parent_block_hash=None, token_ids=[],
                                   block_size=0, lora_id=None, medium=MEDIUM[tier],
                                   lora_name=None))
        else:
            out.append(BlockRemoved(block_hashes=run, medium=MEDIUM[tier]))
        run = []
    return out
