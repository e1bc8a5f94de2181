"""The reference BlockTree (the Python loops the native core replaced; tests only).

A radix tree over chained block hashes, with per-tier LRU leaves.

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

The tree breaks its own parent/child cycles (``remove`` empties what it
unlinks, a dropped ``BlockTree`` unlinks every node), as the native core's
nodes are not Python objects at all.
"""

from __future__ import annotations

import heapq
from enum import IntEnum


class Tier(IntEnum):
    GPU = 0
    SWAP_OUT = 1
    CPU = 2
    SWAP_IN = 3
    STORAGE = 4


# The members as plain module names, for the hot paths: on Python 3.11 every
# `Tier.GPU` goes through EnumType's __getattr__ hook (~0.1 us a lookup).
GPU, SWAP_OUT, CPU, SWAP_IN, STORAGE = Tier

# States in which the node holds a GPU block that a child must sit under.
GPU_STATES = (Tier.GPU, Tier.SWAP_IN, Tier.SWAP_OUT)
IN_FLIGHT = (Tier.SWAP_IN, Tier.SWAP_OUT)


class PyNode:
    """One cached block. Plain slots: the tree holds up to millions of these."""

    __slots__ = ("hash", "parent", "_children", "state", "gpu", "cpu", "in_storage",
                 "ref", "last_access", "depth", "n_gpu_children", "n_cpu_children", "busy",
                 "gpu_key", "cpu_key", "input", "mkey")

    def __init__(self, h: bytes, parent: PyNode | None, depth: int):
        self.hash = h
        self.parent = parent
        self._children: dict[bytes, PyNode] = {}
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
        self.gpu_key: int | None = None  # live key in the GPU LRU (LeafLRU), or None
        self.cpu_key: int | None = None  # live key in the CPU LRU
        self.input: bytes | None = None  # the bytes hashed into ``hash`` (the memo)
        self.mkey: int | None = None  # the memo key of ``input``, or None

    # Children by block hash; the native Node stores a single child without a dict.
    def child(self, h: bytes) -> PyNode | None:
        return self._children.get(h)

    def link_child(self, h: bytes, node: PyNode) -> None:
        self._children[h] = node

    def unlink_child(self, h: bytes) -> None:
        del self._children[h]

    def child_nodes(self) -> list[PyNode]:
        return list(self._children.values())

    def unlink_children(self) -> None:
        self._children = {}

    @property
    def n_children(self) -> int:
        return len(self._children)

    def __repr__(self) -> str:
        return (f"Node({self.hash.hex()[:8]} {self.state.name} gpu={self.gpu} cpu={self.cpu} "
                f"ref={self.ref} t={self.last_access} d={self.depth})")


Node = PyNode


class PyLeafLRU:
    """Evictable leaves of one tier, oldest first; ties evict the deeper node first.

    A heap of ``(key, node)`` with lazy deletion. Each node carries its live
    key in a slot of its own (``slot``: ``gpu_key`` or ``cpu_key``; None when
    it is not in this set), so membership is one attribute read and discard
    one write, with no dict on the hot path. Stale heap entries (key no longer
    the node's) are skipped on pop, and the heap is rebuilt when they
    outnumber live ones (amortised O(log n)). Keys are single ints, ordered
    as ``(last_access, -depth, insertion)``: cheaper to compare than tuples,
    and a heap pop compares ~2 log n times.
    """

    __slots__ = ("slot", "size", "_heap", "_seq")

    def __init__(self, slot: str) -> None:
        self.slot = slot
        self.size = 0  # live nodes
        self._heap: list[tuple[int, Node]] = []
        self._seq = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, node: Node) -> bool:
        return getattr(node, self.slot) is not None

    def add(self, node: Node) -> None:
        """Insert, or re-key if the node's last_access changed."""
        slot = self.slot
        key = getattr(node, slot)
        if key is None:
            self.size += 1
        elif key >> KEY_SHIFT == node.last_access:
            return
        key = self._next_key(node)
        setattr(node, slot, key)
        heapq.heappush(self._heap, (key, node))
        if len(self._heap) > 2 * self.size + 64:
            self._compact()

    def push_pop(self, node: Node | None) -> Node | None:
        """``add(node)`` then ``pop()`` (just ``pop()`` for None). When ``node``
        would come straight back out, the heap is not touched: eviction walking
        up a chain (a victim's parent becomes the oldest leaf) takes this path."""
        if node is None:
            return self.pop()
        if getattr(node, self.slot) is None:
            heap = self._heap
            if not heap or node.last_access < heap[0][0] >> KEY_SHIFT:
                return node  # older than every entry, live or stale: no key needed
            key = self._next_key(node)
            if key < heap[0][0]:
                return node
            setattr(node, self.slot, key)
            self.size += 1
            heapq.heappush(heap, (key, node))
        else:
            self.add(node)
        return self.pop()

    def _next_key(self, node: Node) -> int:
        """The node's key with the next insertion number (``lru_key`` inlined: one
        per evicted block)."""
        self._seq = seq = self._seq + 1
        depth = node.depth
        inv_depth = _DEPTH_MAX - depth if depth < _DEPTH_MAX else 0
        return (node.last_access << KEY_SHIFT) | (inv_depth << _SEQ_BITS) | (seq & _SEQ_MASK)

    def discard(self, node: Node) -> None:
        if getattr(node, self.slot) is not None:
            setattr(node, self.slot, None)
            self.size -= 1

    def pop(self) -> Node | None:
        """Remove and return the oldest evictable leaf, or None."""
        heap, slot, pop = self._heap, self.slot, heapq.heappop
        while heap:
            key, node = pop(heap)
            if getattr(node, slot) == key:
                setattr(node, slot, None)
                self.size -= 1
                return node
        return None

    def nodes(self) -> set[Node]:
        slot = self.slot
        return {n for k, n in self._heap if getattr(n, slot) == k}

    def heap_len(self) -> int:
        """Heap entries, stale ones included."""
        return len(self._heap)

    def _compact(self) -> None:
        slot = self.slot
        self._heap[:] = [(k, n) for k, n in self._heap if getattr(n, slot) == k]
        heapq.heapify(self._heap)


LeafLRU = PyLeafLRU


# LRU key layout: last_access above 64 bits of (inverted depth, insertion
# order). Depth saturates and the order wraps far beyond any real run; either
# would only reorder ties, never break the heap.
KEY_SHIFT = 64
_DEPTH_BITS, _SEQ_BITS = 24, 40
_DEPTH_MAX, _SEQ_MASK = (1 << _DEPTH_BITS) - 1, (1 << _SEQ_BITS) - 1


def lru_key(last_access: int, depth: int, seq: int) -> int:
    """``(last_access, -depth, seq)`` packed into one int that sorts the same way."""
    inv_depth = _DEPTH_MAX - min(depth, _DEPTH_MAX)
    return (last_access << KEY_SHIFT) | (inv_depth << _SEQ_BITS) | (seq & _SEQ_MASK)


class BlockTree:
    """The radix tree and the two tiers' LRU leaf sets.

    The tree is also the hash memo: a node created with its hash input
    (``input``, and ``mkey``, a fast key of it) lets hashing a prompt take
    the node's hash instead of running BLAKE2b (``hashing.block_hashes_memo``
    walks down from ``memo_root``, asking each node for its child under the
    next block's key: ``Node.memo_child``). A removed node leaves the memo
    with the tree: nothing to prune, and nothing kept alive.
    """

    def __init__(self) -> None:
        self.root = Node(b"", None, 0)
        self.root.state = Tier.GPU  # the root is a sentinel that always "holds" everything
        self.gpu_lru = LeafLRU("gpu_key")
        self.cpu_lru = LeafLRU("cpu_key")
        self.num_nodes = 0
        self.memo_root = None  # the reference has no hash memo: every block is hashed

    def add_child(self, parent: Node, h: bytes, block_input: bytes | None = None,
                  key: int | None = None) -> Node:
        """A new node (state STORAGE, no copies) under ``parent``; caller sets its
        state. ``block_input``/``key`` (from ``block_hashes_memo``) put it in the
        memo: they are set before linking, as a branching parent indexes its
        children by key."""
        node = Node(h, parent, parent.depth + 1)
        if key is not None:
            node.input = block_input
            node.mkey = key
        parent.link_child(h, node)
        self.num_nodes += 1
        return node

    def remove(self, node: Node) -> int:
        """Unlink ``node`` and its subtree; every removed node must hold no block.

        Returns the number of nodes removed. Only STORAGE-only subtrees hang
        under a node that loses its last copy, so nothing is leaked.
        """
        assert node.gpu < 0 and node.cpu < 0 and node.ref == 0, f"removing a live node {node}"
        node.parent.unlink_child(node.hash)
        if not node.n_children:  # a leaf: no walk
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
            stack.extend(n.child_nodes())
            n.unlink_children()
            removed += 1
        self.num_nodes -= removed
        return removed

    def __del__(self) -> None:
        # Native nodes are not GC-tracked: the collector would never free their
        # parent <-> child cycles, so a dropped tree unlinks them itself.
        root = getattr(self, "root", None)
        if root is not None:
            self._unlink(root)

    @staticmethod
    def _unlink(root: Node) -> None:
        """Empty every node's children and parent under (and including) ``root``.
        The parent links go too, so that freeing a long chain does not recurse."""
        stack = [root]
        while stack:
            n = stack.pop()
            stack.extend(n.child_nodes())
            n.unlink_children()
            n.parent = None

    def walk(self):
        """Every node except the root (depth first); for checks and tests, not hot paths."""
        stack = self.root.child_nodes()
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.child_nodes())
