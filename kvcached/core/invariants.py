"""``CacheManager.check_invariants``: prove every block id is in exactly one place.

Reads a ``CacheSnapshot`` and recomputes from scratch what the core keeps
incrementally (ownership of every GPU and CPU id, reference counts, child
counters, the idle count, both tiers' evictable leaves, the tree's shape,
the hash memo), raising InvariantError on the first difference. O(n): for
tests and debugging, never on a hot path.
"""

from __future__ import annotations

import collections
from hashlib import blake2b

from kvcached.core.hashing import hash_input
from kvcached.core.snapshot import GPU_STATES, ROOT, CacheSnapshot, NodeView, Tier


class InvariantError(AssertionError):
    """A cache invariant does not hold (always a kvcached bug)."""


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check(snap: CacheSnapshot) -> None:
    """Check every invariant of ``snap``."""
    nodes = snap.nodes
    if len(nodes) != snap.num_nodes:
        _fail(f"the core counts {snap.num_nodes} nodes, the walk finds {len(nodes)}")
    _check_structure(snap)
    _check_ownership(snap, "gpu")
    _check_ownership(snap, "cpu")
    _check_requests(snap)
    _check_busy(snap)
    _check_leaves(snap)
    _check_policy(snap)
    _check_memo(snap)


def _check_structure(snap: CacheSnapshot) -> None:
    nodes = snap.nodes
    counts = collections.defaultdict(lambda: [0, 0, 0])  # children, on GPU, holding CPU
    for n in nodes.values():
        p = nodes.get(n.parent)
        if p is None and n.parent != ROOT:
            _fail(f"{n}'s parent {n.parent} is not in the tree")
        if n.depth != (p.depth + 1 if p else 1):
            _fail(f"{n} has depth {n.depth} under a parent of depth {p.depth if p else 0}")
        c = counts[n.parent]
        c[0] += 1
        c[1] += n.state in (Tier.GPU, Tier.SWAP_IN)
        c[2] += n.cpu >= 0
        _check_node(n, p, snap.external)
    for n in nodes.values():
        got = (n.n_children, n.n_gpu_children, n.n_cpu_children)
        if got != tuple(counts[n.id]):
            _fail(f"{n}: child counters {got} but its children are {tuple(counts[n.id])}")
    if snap.root_children != tuple(counts[ROOT][1:]):
        _fail(f"the root's child counters {snap.root_children} but its children "
              f"are {tuple(counts[ROOT][1:])}")


def _check_node(n: NodeView, p: NodeView | None, external: bool) -> None:
    """A node's copies match its state; copies are prefix-closed. With an
    external GPU tier no node holds a GPU block (the engine's are its own)."""
    holds_gpu = n.state in GPU_STATES and not external
    if external and n.state is Tier.GPU:
        _fail(f"{n}: state GPU in a cache whose GPU tier is the engine's")
    if holds_gpu != (n.gpu >= 0):
        _fail(f"{n}: state {n.state.name} but gpu block {n.gpu}")
    if n.state in (Tier.CPU, Tier.SWAP_IN, Tier.SWAP_OUT) and n.cpu < 0:
        _fail(f"{n}: state {n.state.name} without a CPU block")
    if n.state is Tier.STORAGE and (n.cpu >= 0 or not n.in_storage):
        _fail(f"{n}: STORAGE node must hold no CPU block and be in storage")
    if p is None:
        return
    if p.state is Tier.STORAGE and n.state is not Tier.STORAGE:
        _fail(f"{n} holds a copy under the STORAGE-only node {p}")
    if holds_gpu and p.state not in GPU_STATES:
        _fail(f"{n} holds a GPU block under {p} which does not (GPU not prefix-closed)")
    if n.cpu >= 0 and p.gpu < 0 and p.cpu < 0:
        _fail(f"{n} holds a CPU block under {p} which holds nothing")


def _check_ownership(snap: CacheSnapshot, tier: str) -> None:
    total = snap.gpu_blocks if tier == "gpu" else snap.cpu_blocks
    owners: dict[int, object] = {}  # block -> holder; described only on failure

    def claim(block: int, who: object) -> None:
        if not 0 <= block < total:
            _fail(f"{tier} block {block} held by {who!r} is out of range")
        if block in owners:
            _fail(f"{tier} block {block} is held by {owners[block]!r} and by {who!r}")
        owners[block] = who

    for b in snap.gpu_free if tier == "gpu" else snap.cpu_free:
        claim(b, "the free list")
    for n in snap.nodes.values():
        b = n.gpu if tier == "gpu" else n.cpu
        if b >= 0:
            claim(b, n)
    if tier == "gpu":
        for r in snap.requests:
            for b in r.blocks[len(r.path):]:
                claim(b, f"request {r.rid!r}")
    if len(owners) != total:
        missing = sorted(set(range(total)) - set(owners))[:10]
        _fail(f"{tier} blocks leaked (held by nobody): {missing}")


def _check_requests(snap: CacheSnapshot) -> None:
    nodes = snap.nodes
    refs: collections.Counter[int] = collections.Counter()
    for r in snap.requests:
        parent = ROOT
        for i, nid in enumerate(r.path):
            n = nodes.get(nid)
            if n is None or n.parent != parent:
                _fail(f"request {r.rid!r}: node {i} is not a child of node {i - 1}")
            if not snap.external and r.blocks[i] != n.gpu:
                _fail(f"request {r.rid!r}: block {i} is {r.blocks[i]} but its node has {n.gpu}")
            refs[nid] += 1
            parent = nid
    idle = 0
    for n in nodes.values():
        if n.ref != refs[n.id]:
            _fail(f"{n}: ref_count {n.ref} but {refs[n.id]} live requests hold it")
        idle += n.state is Tier.GPU and n.ref == 0
    if idle != snap.gpu_idle:
        _fail(f"idle GPU node count is {snap.gpu_idle}, actual {idle}")


def _check_busy(snap: CacheSnapshot) -> None:
    """``busy`` counts the write-through tasks in flight that read the node."""
    busy = collections.Counter(nid for store in snap.stores for nid in store)
    for n in snap.nodes.values():
        if n.busy != busy[n.id]:
            _fail(f"{n}: busy={n.busy} but {busy[n.id]} store tasks in flight read it")
        # GPU: staged (or a backup) for a store; CPU: stored from its host block (an
        # external GPU tier's write-through, a write-back, a selective store), and
        # meanwhile maybe matched (SWAP_IN: the swap-in reads the same block).
        if n.busy and (n.state not in (Tier.GPU, Tier.CPU, Tier.SWAP_IN) or n.cpu < 0):
            _fail(f"{n}: a node being stored must hold its host block (GPU, CPU or SWAP_IN)")


def gpu_evictable(n: NodeView) -> bool:
    """An unreferenced GPU node with no child on GPU."""
    return n.state is Tier.GPU and n.ref == 0 and n.n_gpu_children == 0 and n.busy == 0


def cpu_evictable(n: NodeView) -> bool:
    """A CPU copy that no CPU child depends on; a backup of a GPU node always qualifies."""
    if n.cpu < 0 or n.n_cpu_children or n.busy:
        return False
    if n.state is Tier.GPU:
        return True
    return n.state is Tier.CPU and n.ref == 0 and n.n_gpu_children == 0


def _extra_missing(snap: CacheSnapshot, expected: set[int], actual: set[int]) -> str:
    """A few node ids listed but not expected, and expected but not listed."""
    extra = [snap.nodes.get(i, i) for i in list(actual - expected)[:3]]
    missing = [snap.nodes[i] for i in list(expected - actual)[:3]]
    return f"extra {extra}, missing {missing}"


def _check_leaves(snap: CacheSnapshot) -> None:
    for name, listed, pred in (("GPU", snap.gpu_lru, gpu_evictable),
                               ("CPU", snap.cpu_lru, cpu_evictable)):
        expected = {n.id for n in snap.nodes.values() if pred(n)}
        actual = set(listed)
        if len(actual) != len(listed):
            _fail(f"{name} leaf heap lists a node twice")
        if expected != actual:
            _fail(f"{name} leaf heap differs from the evictable leaves: "
                  f"{_extra_missing(snap, expected, actual)}")


def _check_policy(snap: CacheSnapshot) -> None:
    """The adaptive policy of a tier keeps state for exactly the nodes holding the
    tier's copy: it heard of every copy gained (on_insert) and lost (on_evict)."""
    if snap.policy == "lru":
        return
    for name, tracked, total, holds in (
            ("GPU", snap.gpu_tracked, snap.gpu_blocks, lambda n: n.gpu >= 0),
            ("CPU", snap.cpu_tracked, snap.cpu_blocks, lambda n: n.cpu >= 0)):
        if not total:
            continue
        expected = {n.id for n in snap.nodes.values() if holds(n)}
        actual = set(tracked)
        if expected != actual:
            _fail(f"the {name} tier's {snap.policy} policy tracks other nodes than those "
                  f"holding its copy: {_extra_missing(snap, expected, actual)}")


def _check_memo(snap: CacheSnapshot) -> None:
    """Every remembered record is true: it hashes to its node's hash (the memo
    hands that hash out to any block with the same record under the parent)."""
    for n in snap.nodes.values():
        if n.record is None:
            continue
        has_ns = n.parent == ROOT
        parent_hash = snap.namespace if has_ns else snap.nodes[n.parent].hash
        data = hash_input(n.record, parent_hash, snap.block_size, has_ns)
        if blake2b(data, digest_size=len(n.hash)).digest() != n.hash:
            _fail(f"{n}: its remembered input does not hash to its hash")
