"""Typed results the manager hands to the engine: Allocation, HitInfo, CacheStats."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvcached.tasks import TaskHandle


class HitInfo(NamedTuple):
    """Where an allocation's cached tokens come from; the three sum to num_cached_tokens.

    Immutable; a named tuple because every allocation makes one (a frozen
    dataclass took ~0.8 us to construct, a named tuple ~0.2)."""

    gpu_tokens: int = 0
    cpu_tokens: int = 0
    storage_tokens: int = 0


class Allocation:
    """What ``CacheManager.allocate`` returns to the scheduler.

    ``block_ids`` is the request's block table (GPU block ids). It is the
    manager's own list: ``commit`` may replace an id when another request
    cached the same block first, so read it again after commit.
    ``num_cached_tokens`` is final once ``wait()`` has returned.
    """

    __slots__ = ("request_id", "block_ids", "num_cached_tokens", "hit", "error",
                 "_handles", "_waiter")

    def __init__(self, request_id, block_ids: list[int], num_cached_tokens: int,
                 hit: HitInfo, handles: list[TaskHandle], waiter):
        self.request_id = request_id
        self.block_ids = block_ids
        self.num_cached_tokens = num_cached_tokens
        self.hit = hit
        self.error: Exception | None = None
        self._handles = handles
        self._waiter = waiter

    @property
    def ready(self) -> bool:
        """True when no swap-in or load of this allocation is still in flight."""
        return all(h.done() for h in self._handles)

    def wait(self, timeout: float | None = None) -> None:
        """Block until this allocation's swap-ins / loads finished.

        On a failed transfer the allocation is rolled back to what did arrive
        (``num_cached_tokens`` and ``hit`` shrink; the block ids stay the
        request's, to recompute into) and the error is raised. Raises
        TimeoutError, changing nothing, if ``timeout`` passes first.
        """
        self._waiter(self, timeout)

    def __repr__(self) -> str:
        return (f"Allocation({self.request_id!r}, blocks={len(self.block_ids)}, "
                f"cached={self.num_cached_tokens}, hit={self.hit})")


@dataclass(slots=True)
class TierUsage:
    total: int
    used: int
    free: int
    cached: int  # blocks held by the tree (the rest of `used` are requests' private blocks)


@dataclass(slots=True)
class CacheStats:
    """A snapshot of the manager: tiers, hits, evictions, transfers, workers."""

    requests: int = 0
    running: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    hit_requests: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, TierUsage] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    dedup_blocks: int = 0
    no_free_blocks: int = 0
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)
    storage: dict[str, int] = field(default_factory=dict)
    cached_nodes: int = 0
    # the eviction policy: {"name"} and, adaptive, per tier its ghost and reuses
    # (kvcached.core.stats.policy_view)
    policy: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from any tier."""
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    def tier_hit_rate(self, tier: str) -> float:
        return self.hit_tokens.get(tier, 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d
