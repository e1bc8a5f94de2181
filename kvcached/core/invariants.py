"""``CacheManager.check_invariants``: prove every block id is in exactly one place.

Recomputes from scratch what the manager maintains incrementally (ownership
of every GPU and CPU id, ref counts, child counters, idle count, LRU sets,
tree structure) and raises InvariantError on the first difference. O(n):
for tests and debugging, never on a hot path.
"""

from __future__ import annotations

import collections
from hashlib import blake2b
from typing import TYPE_CHECKING

from kvcached.core.hashing import hash_input, memo_key
from kvcached.core.tree import GPU_STATES, Node, Tier

if TYPE_CHECKING:
    from kvcached.core.manager import CacheManager


class InvariantError(AssertionError):
    """A manager invariant does not hold (always a kvcached bug)."""


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check(mgr: CacheManager) -> None:
    nodes = list(mgr.tree.walk())
    if len(nodes) != mgr.tree.num_nodes:
        _fail(f"tree counts {mgr.tree.num_nodes} nodes, walk finds {len(nodes)}")
    _check_structure(nodes)
    _check_ownership(mgr, nodes, "gpu")
    _check_ownership(mgr, nodes, "cpu")
    _check_requests(mgr, nodes)
    _check_busy(mgr, nodes)
    _check_lru(mgr, nodes)
    _check_memo(mgr, nodes)


def _check_busy(mgr: CacheManager, nodes: list[Node]) -> None:
    """``busy`` counts the write-through tasks in flight that read the node."""
    busy: collections.Counter[Node] = collections.Counter()
    for kind, _, task_nodes, _ in mgr._pending.values():
        if kind == "store":
            busy.update(task_nodes)
    for n in nodes:
        if n.busy != busy[n]:
            _fail(f"{n}: busy={n.busy} but {busy[n]} store tasks in flight read it")
        if n.busy and (n.state is not Tier.GPU or n.cpu < 0):
            _fail(f"{n}: a busy node must be on GPU with its staging CPU block")


def _check_structure(nodes: list[Node]) -> None:
    for n in nodes:
        p = n.parent
        if p.child(n.hash) is not n or n.depth != p.depth + 1:
            _fail(f"{n} is not linked under its parent {p}")
        holds_gpu = n.state in GPU_STATES
        if holds_gpu != (n.gpu >= 0):
            _fail(f"{n}: state {n.state.name} but gpu block {n.gpu}")
        if n.state in (Tier.CPU, Tier.SWAP_IN, Tier.SWAP_OUT) and n.cpu < 0:
            _fail(f"{n}: state {n.state.name} without a CPU block")
        if n.state is Tier.STORAGE and (n.cpu >= 0 or not n.in_storage):
            _fail(f"{n}: STORAGE node must hold no CPU block and be in storage")
        if p.parent is not None and p.state is Tier.STORAGE and n.state is not Tier.STORAGE:
            _fail(f"{n} holds a copy under the STORAGE-only node {p}")
        if p.parent is not None:
            if holds_gpu and p.state not in GPU_STATES:
                _fail(f"{n} holds a GPU block under {p} which does not (GPU not prefix-closed)")
            if n.cpu >= 0 and p.gpu < 0 and p.cpu < 0:
                _fail(f"{n} holds a CPU block under {p} which holds nothing")
        n_gpu = sum(c.state in (Tier.GPU, Tier.SWAP_IN) for c in n.child_nodes())
        n_cpu = sum(c.cpu >= 0 for c in n.child_nodes())
        if (n_gpu, n_cpu) != (n.n_gpu_children, n.n_cpu_children):
            _fail(f"{n}: child counters ({n.n_gpu_children}, {n.n_cpu_children}) "
                  f"but children hold ({n_gpu}, {n_cpu})")


def _check_ownership(mgr: CacheManager, nodes: list[Node], tier: str) -> None:
    pool = mgr.gpu_pool if tier == "gpu" else mgr.cpu_pool
    owners: dict[int, object] = {}  # block -> holder; described only on failure

    def claim(block: int, who: object) -> None:
        if not 0 <= block < pool.num_blocks:
            _fail(f"{tier} block {block} held by {who!r} is out of range")
        if block in owners:
            _fail(f"{tier} block {block} is held by {owners[block]!r} and by {who!r}")
        owners[block] = who

    for b in pool.free_ids():
        claim(b, "the free list")
    for n in nodes:
        b = n.gpu if tier == "gpu" else n.cpu
        if b >= 0:
            claim(b, n)
    if tier == "gpu":
        for r in mgr._reqs.values():
            for b in r.blocks[len(r.nodes):]:
                claim(b, f"request {r.rid!r}")
    if len(owners) != pool.num_blocks:
        missing = sorted(set(range(pool.num_blocks)) - set(owners))[:10]
        _fail(f"{tier} blocks leaked (held by nobody): {missing}")


def _check_requests(mgr: CacheManager, nodes: list[Node]) -> None:
    refs: collections.Counter[Node] = collections.Counter()
    for r in mgr._reqs.values():
        parent = mgr.tree.root
        for i, n in enumerate(r.nodes):
            if n.parent is not parent:
                _fail(f"request {r.rid!r}: node {i} is not a child of node {i - 1}")
            if r.blocks[i] != n.gpu:
                _fail(f"request {r.rid!r}: block {i} is {r.blocks[i]} but its node has {n.gpu}")
            refs[n] += 1
            parent = n
    idle = 0
    for n in nodes:
        if n.ref != refs[n]:
            _fail(f"{n}: ref_count {n.ref} but {refs[n]} live requests hold it")
        idle += n.state is Tier.GPU and n.ref == 0
    if idle != mgr._n_gpu_idle:
        _fail(f"idle GPU node count is {mgr._n_gpu_idle}, actual {idle}")


def _check_lru(mgr: CacheManager, nodes: list[Node]) -> None:
    from kvcached.core.eviction import cpu_evictable, gpu_evictable
    for name, lru, pred in (("GPU", mgr.tree.gpu_lru, gpu_evictable),
                            ("CPU", mgr.tree.cpu_lru, cpu_evictable)):
        expected = {n for n in nodes if pred(n)}
        actual = lru.nodes()
        if expected != actual:
            extra = list(actual - expected)[:3]
            missing = list(expected - actual)[:3]
            _fail(f"{name} LRU differs from the evictable leaves: extra {extra}, missing {missing}")
        if lru.size != len(actual):  # what eviction and stats() take for its length
            _fail(f"{name} LRU size is {lru.size}, it lists {len(actual)} nodes")


def _check_memo(mgr: CacheManager, nodes: list[Node]) -> None:
    """Every remembered input is true: it has the node's memo key and hashes to
    the node's hash (the memo hands that hash out), and the memo's walk finds
    the node under its parent by that key."""
    for n in nodes:
        if n.mkey is None:
            continue
        if memo_key(n.input) != n.mkey:
            _fail(f"{n}: memo key {n.mkey} is not the key of its input")
        block_input = hash_input(n.input, mgr.block_size)
        if blake2b(block_input, digest_size=len(n.hash)).digest() != n.hash:
            _fail(f"{n}: its remembered input does not hash to its hash")
        found = n.parent.memo_child(n.mkey) if hasattr(n.parent, "memo_child") else n
        if found is not n and not any(c is not n and c.mkey == n.mkey
                                      for c in n.parent.child_nodes()):
            # (a sibling whose key collides may shadow it: a miss, never a wrong hash)
            _fail(f"{n}: the memo walk does not find it under its parent by its key")
