"""BlockTree: a radix tree over chained block hashes, with per-tier LRU leaves.

A node is one cached full block; the path from the root to it is the prefix
it was computed under (its hash already folds in that prefix). Children are
keyed by block hash, so matching a prompt is one dict lookup per block.

Tier state of a node (``Tier``) and which copies it holds:

    GPU       gpu_block >= 0, maybe a cpu_block backup (same bytes)
    SWAP_OUT  gpu_block -> cpu_block copy in flight (both held)
    CPU       cpu_block >= 0 only
    SWAP_IN   cpu_block -> gpu_block copy in flight (both held)
    STORAGE   nothing local; the block is in storage (in_storage)

Structural rules the manager keeps (``CacheManager.check_invariants`` checks them):
a node holding a GPU block has a parent holding one (GPU is prefix-closed);
a node holding a CPU block has a parent holding a GPU or CPU block; the
children of a STORAGE node are STORAGE nodes.

Eviction takes the least recently used *leaf of a tier*: a GPU leaf has no
child holding a GPU block, a CPU leaf no child holding a CPU block. Each tier
keeps its evictable leaves in a ``LeafLRU`` (a heap with lazy deletion): add,
discard and pop are O(log n); nothing ever scans all leaves.
"""

from __future__ import annotations

import heapq
import itertools
from enum import IntEnum


class Tier(IntEnum):
    GPU = 0
    SWAP_OUT = 1
    CPU = 2
    SWAP_IN = 3
    STORAGE = 4


# States in which the node holds a GPU block that a child must sit under.
GPU_STATES = (Tier.GPU, Tier.SWAP_IN, Tier.SWAP_OUT)
IN_FLIGHT = (Tier.SWAP_IN, Tier.SWAP_OUT)


class Node:
    """One cached block. Plain slots: the tree holds up to millions of these."""

    __slots__ = ("hash", "parent", "children", "state", "gpu", "cpu", "in_storage",
                 "ref", "last_access", "depth", "n_gpu_children", "n_cpu_children", "busy")

    def __init__(self, h: bytes, parent: Node | None, depth: int):
        self.hash = h
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.state = Tier.STORAGE
        self.gpu = -1
        self.cpu = -1
        self.in_storage = False
        self.ref = 0
        self.last_access = 0
        self.depth = depth
        # Children holding a GPU block that keeps this node off the GPU LRU:
        # state GPU or SWAP_IN (a SWAP_OUT child is already leaving).
        self.n_gpu_children = 0
        self.n_cpu_children = 0  # children holding a CPU block
        self.busy = 0  # background tasks (write-through) reading this node's blocks

    @property
    def holds_gpu_for_parent(self) -> bool:
        return self.state is Tier.GPU or self.state is Tier.SWAP_IN

    def __repr__(self) -> str:
        return (f"Node({self.hash.hex()[:8]} {self.state.name} gpu={self.gpu} cpu={self.cpu} "
                f"ref={self.ref} t={self.last_access} d={self.depth})")


class LeafLRU:
    """Evictable leaves of one tier, oldest first; ties evict the deeper node first.

    A heap of ``(key, node)`` with lazy deletion: ``discard`` only forgets the
    node's live key; stale heap entries are skipped on pop and the heap is
    rebuilt when stale entries outnumber live ones (amortised O(log n)).
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Node]] = []
        self._live: dict[Node, tuple[int, int, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, node: Node) -> bool:
        return node in self._live

    def add(self, node: Node) -> None:
        """Insert, or re-key if the node's last_access changed."""
        key = self._live.get(node)
        if key is not None and key[0] == node.last_access:
            return
        key = (node.last_access, -node.depth, next(self._seq))
        self._live[node] = key
        heapq.heappush(self._heap, (key, node))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def discard(self, node: Node) -> None:
        self._live.pop(node, None)

    def pop(self) -> Node | None:
        """Remove and return the oldest evictable leaf, or None."""
        heap, live = self._heap, self._live
        while heap:
            key, node = heapq.heappop(heap)
            if live.get(node) == key:
                del live[node]
                return node
        return None

    def nodes(self) -> set[Node]:
        return set(self._live)

    def _compact(self) -> None:
        self._heap = [(k, n) for n, k in self._live.items()]
        heapq.heapify(self._heap)


class BlockTree:
    """The radix tree plus the two tiers' LRU leaf sets."""

    def __init__(self) -> None:
        self.root = Node(b"", None, 0)
        self.root.state = Tier.GPU  # the root is a sentinel that always "holds" everything
        self.gpu_lru = LeafLRU()
        self.cpu_lru = LeafLRU()
        self.num_nodes = 0

    def child(self, parent: Node, h: bytes) -> Node | None:
        return parent.children.get(h)

    def add_child(self, parent: Node, h: bytes) -> Node:
        """A new node (state STORAGE, no copies) under ``parent``; caller sets its state."""
        node = Node(h, parent, parent.depth + 1)
        parent.children[h] = node
        self.num_nodes += 1
        return node

    def remove(self, node: Node) -> int:
        """Unlink ``node`` and its subtree; every removed node must hold no block.

        Returns the number of nodes removed. Only STORAGE-only subtrees hang
        under a node that loses its last copy, so nothing is leaked.
        """
        assert node.gpu < 0 and node.cpu < 0 and node.ref == 0, f"removing a live node {node}"
        del node.parent.children[node.hash]
        if not node.children:  # a leaf: no walk
            self.gpu_lru.discard(node)
            self.cpu_lru.discard(node)
            self.num_nodes -= 1
            return 1
        removed, stack = 0, [node]
        while stack:
            n = stack.pop()
            assert n.gpu < 0 and n.cpu < 0 and n.ref == 0, f"subtree holds blocks: {n}"
            self.gpu_lru.discard(n)
            self.cpu_lru.discard(n)
            stack.extend(n.children.values())
            n.children = {}
            removed += 1
        self.num_nodes -= removed
        return removed

    def walk(self):
        """Every node except the root (depth first); for checks and tests, not hot paths."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
