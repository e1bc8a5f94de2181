"""A running request, as the manager and the planner track it."""

from __future__ import annotations

from collections.abc import Hashable

from kvcached.types import Allocation


class RunningRequest:
    """``core`` is the native core's view (block hashes, the path of nodes the
    request holds); ``blocks`` is the block table handed to the engine
    (``Allocation.block_ids``): ``blocks[i]`` is path node i's GPU block for i
    below the path's length, the rest are the request's private blocks."""

    __slots__ = ("rid", "core", "blocks", "num_tokens", "alloc")

    def __init__(self, rid: Hashable, core, blocks: list[int], num_tokens: int):
        self.rid = rid
        self.core = core
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.alloc: Allocation | None = None
