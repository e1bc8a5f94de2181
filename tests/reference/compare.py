"""The state of a manager as comparable plain data, for the real manager (from
its public snapshot) and for the reference manager (from its Python tree).

Two managers that served the same calls must have equal states: every node
(by hash) with its tier state, block ids, references, clock, depth and
storage flags; both free lists in allocation order; both tiers' evictable
leaves in eviction order; every running request's block table; the stats.
"""

from __future__ import annotations


def state(mgr) -> dict:
    """The real manager's state."""
    snap = mgr.snapshot()
    nodes = {n.hash: _node(n, snap.nodes[n.parent].hash if n.parent else b"")
             for n in snap.nodes.values()}
    return {
        "nodes": nodes,
        "gpu_free": list(snap.gpu_free), "cpu_free": list(snap.cpu_free),
        "gpu_lru": [snap.nodes[i].hash for i in snap.gpu_lru],
        "cpu_lru": [snap.nodes[i].hash for i in snap.cpu_lru],
        "requests": {r.rid: (list(r.blocks), len(r.path)) for r in snap.requests},
        "stats": _stats(mgr),
    }


def reference_state(ref) -> dict:
    """The reference manager's state (tests/reference/manager.py), after applying
    what its transfer completed (the real manager's snapshot does the same)."""
    ref._reap()
    nodes = {n.hash: _node(n, n.parent.hash if n.parent.parent is not None else b"")
             for n in ref.tree.walk()}
    return {
        "nodes": nodes,
        "gpu_free": ref.gpu_pool.free_ids(), "cpu_free": ref.cpu_pool.free_ids(),
        "gpu_lru": _lru_order(ref.tree.gpu_lru), "cpu_lru": _lru_order(ref.tree.cpu_lru),
        "requests": {r.rid: (list(r.blocks), len(r.nodes)) for r in ref._reqs.values()},
        "stats": _stats(ref),
    }


def _node(n, parent_hash: bytes) -> tuple:
    return (parent_hash, int(n.state), n.gpu, n.cpu, n.ref, n.last_access, n.depth,
            bool(n.in_storage), n.busy)


def _lru_order(lru) -> list[bytes]:
    return [n.hash for n in sorted(lru.nodes(), key=lambda n: getattr(n, lru.slot))]


def _stats(mgr) -> tuple:
    st = mgr.stats()
    tiers = {t: (u.used, u.free, u.cached) for t, u in st.tiers.items()}
    return (st.requests, st.running, st.prompt_tokens, st.hit_tokens, st.hit_requests, tiers,
            {k: v for k, v in st.evictions.items() if v}, st.dedup_blocks, st.no_free_blocks,
            {k: v for k, v in st.storage.items() if v}, st.cached_nodes)


def diff(a: dict, b: dict) -> str | None:
    """A short description of the first difference, or None."""
    for key in a:
        if a[key] == b[key]:
            continue
        if key == "nodes":
            for h in sorted(set(a[key]) | set(b[key])):
                if a[key].get(h) != b[key].get(h):
                    return f"node {h.hex()[:8]}: {a[key].get(h)} != {b[key].get(h)}"
        return f"{key}: {a[key]} != {b[key]}"
    return None
