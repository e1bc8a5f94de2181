"""Tier states, and a plain-data snapshot of the cache for checks and tests.

``CacheManager.snapshot()`` copies out everything the native core holds
(every node, both tiers' evictable leaves in eviction order, both free lists) and what
the manager tracks around it (running requests, stores in flight). The
invariant checks (``kvcached.core.invariants``) and the tests read this,
never the manager's private fields. O(cached blocks): not for hot paths.

Tier state of a node, and which copies it holds::

    GPU       a GPU block, maybe a CPU block backup (the same bytes)
    SWAP_OUT  GPU -> CPU copy in flight (both held)
    CPU       a CPU block only
    SWAP_IN   CPU -> GPU copy (swap-in) or storage -> CPU -> GPU (load) in flight
    STORAGE   nothing local; the block is in storage (in_storage)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import IntEnum


class Tier(IntEnum):
    """A node's state; the numbers are the native core's (core.h)."""

    GPU = 0
    SWAP_OUT = 1
    CPU = 2
    SWAP_IN = 3
    STORAGE = 4


GPU_STATES = (Tier.GPU, Tier.SWAP_IN, Tier.SWAP_OUT)  # states that hold a GPU block
ROOT = 0  # the root's node id: a sentinel that "holds" every tier


@dataclass(frozen=True, slots=True)
class NodeView:
    """One cached block (a node of the prefix tree)."""

    id: int
    hash: bytes
    parent: int  # node id; ROOT for a first block
    state: Tier
    gpu: int  # GPU block id, -1 for none
    cpu: int  # CPU (host pool) block id, -1 for none
    ref: int  # running requests whose path holds it
    last_access: int
    depth: int
    in_storage: bool
    busy: int  # write-through tasks reading its blocks
    n_children: int
    n_gpu_children: int  # children in GPU or SWAP_IN
    n_cpu_children: int  # children holding a CPU block
    record: bytes | None  # hash-memo record (None: the node has none)

    @classmethod
    def from_tuple(cls, t: tuple) -> NodeView:
        (i, h, parent, state, gpu, cpu, ref, last, depth, in_storage, busy, n_children,
         n_gpu, n_cpu, record) = t
        return cls(i, h, parent, Tier(state), gpu, cpu, ref, last, depth, bool(in_storage),
                   busy, n_children, n_gpu, n_cpu, record)

    def __repr__(self) -> str:
        return (f"Node({self.hash.hex()[:8]} {self.state.name} gpu={self.gpu} cpu={self.cpu} "
                f"ref={self.ref} t={self.last_access} d={self.depth})")


@dataclass(frozen=True, slots=True)
class RequestView:
    """A running request: its block table and the nodes its path holds."""

    rid: Hashable
    blocks: tuple[int, ...]  # block_ids[i] is path[i]'s GPU block; the rest are private
    path: tuple[int, ...]  # node ids, root first


@dataclass(slots=True)
class CacheSnapshot:
    """Everything about the cache's state at one moment, as plain data."""

    block_size: int
    namespace: bytes
    gpu_blocks: int
    cpu_blocks: int
    clock: int
    nodes: dict[int, NodeView]  # in walk order (a stack walk from the root)
    root_children: tuple[int, int]  # the root's (n_gpu_children, n_cpu_children)
    gpu_lru: list[int]  # evictable GPU leaves, in the order eviction takes them
    cpu_lru: list[int]
    gpu_free: list[int]  # free block ids, in the order allocation takes them
    cpu_free: list[int]
    gpu_idle: int  # GPU nodes no request holds
    num_nodes: int
    external: bool  # the engine owns the GPU tier: nodes hold CPU copies and storage only
    requests: list[RequestView] = field(default_factory=list)
    stores: list[list[int]] = field(default_factory=list)  # node ids of each store in flight
    policy: str = "lru"  # the eviction policy (config eviction_policy)
    # adaptive: the nodes each tier's policy keeps state for (must be those holding
    # the tier's copy); empty under LRU
    gpu_tracked: list[int] = field(default_factory=list)
    cpu_tracked: list[int] = field(default_factory=list)

    @classmethod
    def from_core(cls, raw: dict, namespace: bytes, requests: list[RequestView],
                  stores: list[list[int]]) -> CacheSnapshot:
        nodes = {t[0]: NodeView.from_tuple(t) for t in raw["nodes"]}
        return cls(raw["block_size"], namespace, raw["gpu_blocks"], raw["cpu_blocks"],
                   raw["clock"], nodes, tuple(raw["root_children"]), raw["gpu_lru"],
                   raw["cpu_lru"], raw["gpu_free"], raw["cpu_free"], raw["gpu_idle"],
                   raw["num_nodes"], bool(raw["external"]), requests, stores,
                   raw.get("policy", "lru"), raw.get("gpu_tracked", []),
                   raw.get("cpu_tracked", []))

    def by_hash(self) -> dict[bytes, NodeView]:
        return {n.hash: n for n in self.nodes.values()}

    def children(self, node_id: int) -> list[NodeView]:
        return [n for n in self.nodes.values() if n.parent == node_id]
