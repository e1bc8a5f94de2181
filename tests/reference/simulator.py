"""A single-tier block cache with kvcached's tree semantics, driven by any ``Policy``.

It replays requests one after another the way ``workload.replay`` drives a
GPU-only ``CacheManager`` (allocate -> commit every token -> free), so that
the LRU policy reproduces the manager's hits exactly (a test checks this),
and any other policy, the offline optimum included, is measured under the
same rules:

- A request's prompt is a chain of block keys (each key hashes its parent's
  key and its block's tokens, so a key names a whole prefix). At allocate it
  matches the longest cached prefix, at most ``(prompt_tokens - 1) //
  block_size`` blocks (the last token is always computed), and references
  it: a referenced block is never evicted.
- It needs ``ceil((prompt + output tokens) / block_size)`` blocks, the
  matched ones included; it is rejected (NoFreeBlocks, nothing changes) if
  the free and unreferenced blocks do not cover that. Otherwise eviction
  takes the policy's victims, which must be unreferenced leaves, until the
  free blocks cover the rest. A victim's parent that becomes a leaf is a
  candidate from then on, so the tree stays prefix-closed.
- Commit caches every full block of prompt + output: a new node per block
  not in the tree, a dedup onto one that is (beyond the match limit).
- Free unreferences the path; its tail becomes an evictable leaf.

Hit rate = blocks matched / prompt blocks (``ceil(prompt_tokens /
block_size)``), over served requests, as ``workload.replay`` counts them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from reference.policy import MASK64, Policy


@dataclass(slots=True)
class BlockRequest:
    """One request as the cache sees it: the keys of its full blocks (prompt then
    output) and its token counts."""

    keys: list[int]
    prompt_tokens: int
    total_tokens: int
    block_size: int

    @property
    def matchable(self) -> int:
        """How many leading blocks allocate may match."""
        return min(len(self.keys), (self.prompt_tokens - 1) // self.block_size)

    @property
    def prompt_blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)

    @property
    def blocks_needed(self) -> int:
        return -(-self.total_tokens // self.block_size)


def block_key(parent: int, block: Sequence[int]) -> int:
    """A block's key: its parent's key and its tokens (Python's hash of ints is not
    salted, so keys are the same in every process)."""
    return hash((parent, tuple(block))) & MASK64


def node_keys(namespace: bytes, tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys a ``CacheManager`` knows the full blocks of ``tokens`` by: the first
    8 bytes of each block's hash (chained from ``namespace``), little-endian, as
    the native core hands them to its eviction policy."""
    from kvcached.core.hashing import block_hashes
    return [int.from_bytes(h[:8], "little") for h in block_hashes(namespace, tokens, block_size)]


def to_block_requests(requests: Iterable, block_size: int, remember: int = 4096,
                      namespace: bytes | None = None) -> list[BlockRequest]:
    """``ChatRequest``s as block chains. A conversation's turn extends its previous
    turn's prompt + output, so the keys of that part are reused (checked), not
    rehashed; ``remember`` conversations are kept for that. With ``namespace``
    (the manager's: ``namespace_hash(model_id, weight_version, salt)``) the keys
    are the manager's own (``node_keys``), so that a policy that hashes keys
    (the adaptive one's ghost) decides exactly as inside a GPU-only manager."""
    if namespace is not None:
        return [BlockRequest(node_keys(namespace, r.prompt + r.output, block_size),
                             len(r.prompt), len(r.prompt) + len(r.output), block_size)
                for r in requests]
    memo: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()
    out = []
    for req in requests:
        tokens = req.prompt + req.output
        keys: list[int] = []
        prev = memo.get(req.conversation_id) if req.conversation_id >= 0 else None
        if prev is not None and tokens[:len(prev[0])] == prev[0]:
            keys = prev[1][:]
        parent = keys[-1] if keys else 0
        for i in range(len(keys), len(tokens) // block_size):
            parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
            keys.append(parent)
        if req.conversation_id >= 0:
            memo[req.conversation_id] = (tokens, keys)
            memo.move_to_end(req.conversation_id)
            if len(memo) > remember:
                memo.popitem(last=False)
        out.append(BlockRequest(keys, len(req.prompt), len(tokens), block_size))
    return out


class _Node:
    __slots__ = ("key", "parent", "children", "ref", "depth")

    def __init__(self, key: int, parent: _Node | None, depth: int):
        self.key, self.parent, self.depth = key, parent, depth
        self.children = 0
        self.ref = 0


@dataclass(slots=True)
class SimResult:
    """Counts of one replay; ``per_request`` holds each request's hit blocks (-1:
    rejected) when asked for."""

    hits: int = 0
    prompt_blocks: int = 0
    served: int = 0
    rejected: int = 0
    evictions: int = 0
    per_request: list[int] | None = field(default=None)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.prompt_blocks if self.prompt_blocks else 0.0


class TreeCache:
    """``capacity`` blocks, one tier, evicting what ``policy`` picks."""

    def __init__(self, capacity: int, policy: Policy):
        self.capacity = capacity
        self.policy = policy
        self.nodes: dict[int, _Node] = {}
        self.evictions = 0

    def serve(self, req: BlockRequest, now: int) -> int:
        """Allocate, commit, free ``req``; returns its hit blocks, or -1 if rejected.
        The clock as a manager's: allocate matches at ``now`` and ticks, commit
        runs at ``now + 1``, free ticks again (the next request's ``now`` is
        ``now + 2``)."""
        path = self._match(req)
        need = req.blocks_needed - len(path)
        if need > self.capacity - len(path):  # free + unreferenced blocks
            return -1
        policy = self.policy
        for node in path:
            if node.ref == 0 and node.children == 0:
                policy.remove_leaf(node.key)
            node.ref += 1
            policy.on_hit(node.key, now)
        self._evict(need)
        hits = len(path)
        self._commit(req, path, now + 1)
        for node in reversed(path):  # free
            node.ref -= 1
            if node.ref == 0 and node.children == 0:
                policy.add_leaf(node.key)
        return hits

    def _match(self, req: BlockRequest) -> list[_Node]:
        path = []
        for key in req.keys[:req.matchable]:
            node = self.nodes.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def _evict(self, need: int) -> None:
        while self.capacity - len(self.nodes) < need:
            key = self.policy.victim()
            assert key is not None, "no victim although unreferenced blocks exist"
            node = self.nodes.pop(key)
            assert node.ref == 0 and node.children == 0, f"victim {key:#x} is not a free leaf"
            self.policy.on_evict(key)
            self.evictions += 1
            parent = node.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.ref == 0:
                    self.policy.add_leaf(parent.key)

    def _commit(self, req: BlockRequest, path: list[_Node], now: int) -> None:
        for key in req.keys[len(path):]:
            node = self.nodes.get(key)
            if node is not None:  # cached beyond the match limit: dedup onto it
                if node.ref == 0 and node.children == 0:
                    self.policy.remove_leaf(key)
                node.ref += 1
                self.policy.on_hit(key, now)
            else:
                parent = path[-1] if path else None
                node = _Node(key, parent, len(path) + 1)
                node.ref = 1
                if parent is not None:
                    parent.children += 1
                self.nodes[key] = node
                self.policy.on_insert(key, node.depth, now)
            path.append(node)
        assert len(self.nodes) <= self.capacity, "committed past the capacity"

    def check_invariants(self) -> None:
        """Prefix-closed, no reference left, and the policy lists exactly the leaves."""
        leaves = set()
        for key, node in self.nodes.items():
            assert node.ref == 0, f"{key:#x} still referenced"
            if node.parent is not None:
                assert self.nodes.get(node.parent.key) is node.parent, f"{key:#x} orphaned"
            if node.children == 0:
                leaves.add(key)
        counts: dict[int, int] = {}
        for node in self.nodes.values():
            if node.parent is not None:
                counts[node.parent.key] = counts.get(node.parent.key, 0) + 1
        for key, node in self.nodes.items():
            assert node.children == counts.get(key, 0), f"{key:#x} child count"
        assert self.policy.leaves() == leaves, "the policy's leaves are not the tree's"


def simulate(requests: Sequence[BlockRequest], capacity: int, policy: Policy,
             per_request: bool = False, check_every: int = 0) -> SimResult:
    """Replay ``requests`` in order (request ``i`` allocates at ``now = 2 i``, commits
    at ``2 i + 1``: a manager's clock, one tick per allocate and per free)."""
    cache = TreeCache(capacity, policy)
    res = SimResult(per_request=[] if per_request else None)
    for i, req in enumerate(requests):
        hits = cache.serve(req, 2 * i)
        if hits < 0:
            res.rejected += 1
        else:
            res.served += 1
            res.hits += hits
            res.prompt_blocks += req.prompt_blocks
        if per_request:
            res.per_request.append(hits)
        if check_every and i % check_every == 0:
            cache.check_invariants()
    res.evictions = cache.evictions
    return res
