"""The state of a manager as comparable plain data, for the real manager (from
its public snapshot) and for the model (tests/reference/model.py).

Two managers that served the same calls must have equal states: every node
(by hash) with its tier state, block ids, references, clock, depth and
storage flags; both free lists in allocation order; both tiers' evictable
leaves in eviction order; every running request's block table; the stats.
"""

from __future__ import annotations


def state(mgr) -> dict:
    """The real manager's state."""
    snap = mgr.snapshot()
    nodes = {n.hash: (snap.nodes[n.parent].hash if n.parent else b"", int(n.state), n.gpu,
                      n.cpu, n.ref, n.last_access, n.depth, bool(n.in_storage), n.busy)
             for n in snap.nodes.values()}
    return {
        "nodes": nodes,
        "gpu_free": list(snap.gpu_free), "cpu_free": list(snap.cpu_free),
        "gpu_lru": [snap.nodes[i].hash for i in snap.gpu_lru],
        "cpu_lru": [snap.nodes[i].hash for i in snap.cpu_lru],
        "requests": {r.rid: (list(r.blocks), len(r.path)) for r in snap.requests},
        "stats": _stats(mgr.stats()),
    }


def model_state(model) -> dict:
    """The model's state, once the tasks submitted so far have landed (the real
    manager's snapshot lands them too)."""
    model.reap()
    nodes = {n.hash: (n.parent.hash, n.state, n.gpu, n.cpu, n.ref, n.last_access, n.depth,
                      n.in_storage, n.busy)
             for n in model.nodes.values()}
    return {
        "nodes": nodes,
        "gpu_free": list(model.gpu_free.ids), "cpu_free": list(model.cpu_free.ids),
        "gpu_lru": [n.hash for n in model.gpu_leaves.order()],
        "cpu_lru": [n.hash for n in model.cpu_leaves.order()],
        "requests": {r.rid: (list(r.blocks), len(r.path)) for r in model.reqs.values()},
        "stats": model.stats(),
    }


def _stats(st) -> dict:
    """The counters of a ``CacheStats`` that the model keeps too."""
    return {
        "requests": st.requests, "running": st.running, "prompt_tokens": st.prompt_tokens,
        "hit_tokens": dict(st.hit_tokens), "hit_requests": dict(st.hit_requests),
        "tiers": {t: (u.used, u.free, u.cached) for t, u in st.tiers.items()},
        "evictions": {k: v for k, v in st.evictions.items() if v},
        "dedup_blocks": st.dedup_blocks, "no_free_blocks": st.no_free_blocks,
        "storage": {k: v for k, v in st.storage.items() if v},
        "cached_nodes": st.cached_nodes,
    }


def diff(a: dict, b: dict) -> str | None:
    """A short description of the first difference, or None."""
    for key in a:
        if a[key] == b[key]:
            continue
        if key in ("nodes", "stats"):
            for k in sorted(set(a[key]) | set(b[key])):
                if a[key].get(k) != b[key].get(k):
                    name = k.hex()[:8] if isinstance(k, bytes) else k
                    return f"{key} {name}: {a[key].get(k)} != {b[key].get(k)}"
        return f"{key}: {a[key]} != {b[key]}"
    return None
