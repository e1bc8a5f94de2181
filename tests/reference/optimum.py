"""The offline optimum's anchor: evict the leaf whose next use is farthest away.

Belady's rule under the tree's rules: only unreferenced leaves can go, so it
picks, among them, the one that the fewest near-future requests need. A
block's next use is the next request that would *match* it (among its first
``matchable`` blocks); a block no later request matches goes first. Since a
request that matches a block matches its whole prefix, a parent is never
needed later than its children, so taking the farthest leaf never strands a
prefix that is needed sooner. Ties (never used again, mostly) take the
deeper node first, then the one listed first.

It is the same ``Policy`` as the online ones, built with the whole request
list; the simulator's ``now`` must be its clock (twice the request's index in
that list, one more at commit).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

from reference.simulator import BlockRequest

NEVER = 1 << 62


class OptimumPolicy:
    """Farthest next use first, knowing ``requests`` in advance."""

    def __init__(self, requests: Sequence[BlockRequest]):
        uses: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            for key in req.keys[:req.matchable]:
                uses.setdefault(key, []).append(i)  # increasing: i only grows
        self._uses = uses
        self._next: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        self._live: dict[int, tuple] = {}
        self._heap: list[tuple] = []
        self._seq = 0

    def next_use(self, key: int, now: int) -> int:
        """The first request after the one at ``now`` that matches ``key`` (NEVER if
        none)."""
        times = self._uses.get(key)
        if not times:
            return NEVER
        j = bisect_right(times, now // 2)
        return times[j] if j < len(times) else NEVER

    def on_insert(self, key: int, depth: int, now: int) -> None:
        self._depth[key] = depth
        self._next[key] = self.next_use(key, now)

    def on_hit(self, key: int, now: int) -> None:
        self._next[key] = self.next_use(key, now)
        if key in self._live:
            self.remove_leaf(key)
            self.add_leaf(key)

    def add_leaf(self, key: int) -> None:
        assert key not in self._live, f"{key:#x} is a leaf already"
        self._seq += 1
        entry = (-self._next[key], -self._depth[key], self._seq, key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[3]) is e]
            heapq.heapify(self._heap)

    def remove_leaf(self, key: int) -> None:
        del self._live[key]

    def victim(self) -> int | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[3]) is entry:
                del self._live[entry[3]]
                return entry[3]
        return None

    def on_evict(self, key: int) -> None:
        del self._next[key], self._depth[key]

    def leaves(self) -> set[int]:
        return set(self._live)
