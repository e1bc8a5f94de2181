"""The reference BlockPool (tests only): the free list of one tier's block ids.

O(1) allocate and free. A double free (or freeing an id out of range) raises:
it always means two owners think they hold the same block, which would later
corrupt KV silently.
"""

from __future__ import annotations

from collections import deque


class PyBlockPool:
    """Free list of ids ``0..num_blocks-1``; allocation takes the oldest freed id first."""

    __slots__ = ("name", "num_blocks", "_free", "_is_free")

    def __init__(self, name: str, num_blocks: int):
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` ids; raises ValueError (state unchanged) if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"{self.name} pool: asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = 0
        return out

    def allocate_one(self) -> int:
        """``allocate(1)[0]`` without the list (eviction takes one at a time)."""
        if not self._free:
            raise ValueError(f"{self.name} pool: asked for 1 block, 0 free")
        b = self._free.popleft()
        self._is_free[b] = 0
        return b

    def free(self, ids: list[int] | tuple[int, ...], front: bool = False) -> None:
        """Return ids to the pool; all are checked before any is freed.

        ``front=True`` undoes an ``allocate`` exactly: the ids go back to the
        head of the free list in their original order (used by rollbacks).
        """
        seen = set()
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{self.name} pool: block id {b} out of range 0..{self.num_blocks - 1}")
            if self._is_free[b] or b in seen:
                raise ValueError(f"{self.name} pool: double free of block {b}")
            seen.add(b)
        for b in ids:
            self._is_free[b] = 1
        if front:
            self._free.extendleft(reversed(ids))
        else:
            self._free.extend(ids)

    def free_one(self, b: int) -> None:
        """``free([b])`` without the batch bookkeeping (eviction frees one at a time)."""
        if not 0 <= b < self.num_blocks or self._is_free[b]:
            self.free([b])  # raises the precise error
        self._is_free[b] = 1
        self._free.append(b)

    def is_free(self, block_id: int) -> bool:
        return bool(self._is_free[block_id])

    def free_ids(self) -> list[int]:
        return list(self._free)


BlockPool = PyBlockPool
