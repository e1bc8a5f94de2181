"""Eviction's loops in C (cuda/tree_evict.c) against the Python loops of
kvcached/eviction.py, the reference: two managers serve the same random
workload, one evicting in C and one in Python, and after every request the
whole tree, both LRUs' orders, both pools and the stats must agree."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import FlakyTransfer, lru_order, running_workload

import kvcached.core.eviction as eviction_mod
import kvcached.core.tree as tree_mod
from kvcached.core.manager import CacheManager

CALLBACKS = ("_remove", "_drop_cpu", "_drop_cpu_below")

FIELDS = ("hash", "depth", "state", "gpu", "cpu", "ref", "last_access", "n_gpu_children",
          "n_cpu_children", "in_storage", "busy", "gpu_key", "cpu_key")

SETUPS = {
    "gpu only": dict(num_gpu_blocks=10),
    "gpu and cpu": dict(num_gpu_blocks=10, num_cpu_blocks=12),
    "small cpu tier": dict(num_gpu_blocks=10, num_cpu_blocks=5),
    "with storage": dict(num_gpu_blocks=10, num_cpu_blocks=8, storage_backend="file"),
}


@pytest.fixture(scope="module")
def native():
    if tree_mod._native is None:
        pytest.skip(f"no native tree: {tree_mod.native_node_error}")
    return tree_mod._native


def state(mgr) -> tuple:
    nodes = sorted((tuple(getattr(n, f) for f in FIELDS), n.parent.hash)
                   for n in mgr.tree.walk())
    return (nodes, mgr.tree.num_nodes, mgr._n_gpu_idle, mgr.gpu_pool.free_ids(),
            mgr.cpu_pool.free_ids(), lru_order(mgr.tree.gpu_lru), lru_order(mgr.tree.cpu_lru),
            len(mgr.tree.gpu_lru), len(mgr.tree.cpu_lru))


def counts(mgr) -> dict:
    """The stats but the transfers' timings."""
    st = dataclasses.asdict(mgr.stats())
    st["transfers"] = {k: (v["submitted"], v["done"], v["blocks"])
                       for k, v in st["transfers"].items()}
    return st


def serve(make_manager, monkeypatch, setup: dict, evict, seed: int, store):
    """Every state along a random workload that also pauses (eviction drops
    instead of swapping) and makes swap-outs fail (rollback, then drop).
    ``store``: a storage directory of this run alone (a shared one would let
    the second run hit what the first one stored)."""
    monkeypatch.setattr(eviction_mod, "native_evict_gpu", evict)
    if setup.get("storage_backend"):
        setup = {**setup, "storage_url": str(store)}
    mgr = make_manager(transfer=FlakyTransfer, **setup)
    steps = []
    for _, rng, _ in running_workload(mgr, seed):
        roll = rng.random()
        if roll < 0.08:
            mgr.transfer.fail_kinds ^= {"swap_out"}
        elif roll < 0.16:
            mgr.resume() if mgr._paused else mgr.pause()
        mgr.check_invariants()  # e.g. no CPU copy left under a node kept for storage
        steps.append(state(mgr))
    return steps, counts(mgr)


@pytest.mark.parametrize("setup", SETUPS.values(), ids=SETUPS.keys())
@pytest.mark.parametrize("seed", [1, 2])
def test_native_eviction_is_the_python_loop(native, make_manager, monkeypatch, setup, seed,
                                           tmp_path):
    calls = dict.fromkeys(("evict", "flush", *CALLBACKS), 0)
    inside = []

    def evict(*args):
        calls["evict"] += 1
        inside.append(1)
        try:
            out = native.evict_gpu(*args)
        finally:
            inside.pop()
        calls["flush"] += out[2] == eviction_mod._FLUSH
        return out

    for name in CALLBACKS:  # the rare steps C hands back to the manager
        def spy(self, node, _name=name, _orig=getattr(CacheManager, name)):
            calls[_name] += bool(inside)
            return _orig(self, node)
        monkeypatch.setattr(CacheManager, name, spy)

    want, want_counts = serve(make_manager, monkeypatch, setup, None, seed, tmp_path / "s1")
    got, got_counts = serve(make_manager, monkeypatch, setup, evict, seed, tmp_path / "s2")
    assert len(got) == len(want) > 100
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, i
    assert got_counts == want_counts
    ev = want_counts["evictions"]
    assert calls["evict"] > 20 and ev.get("gpu_dropped", 0) > 0  # C ran, and dropped
    if setup.get("num_cpu_blocks"):  # and swapped out, made room in the CPU tier, flushed,
        assert ev.get("gpu_to_cpu", 0) > 0 and ev.get("cpu_dropped", 0) > 0  # handed back
        assert calls["flush"] and calls["_remove"] and calls["_drop_cpu"], calls
    if setup.get("storage_backend"):  # kept nodes for storage, dropping CPU copies below
        assert calls["_drop_cpu_below"], calls


def test_native_eviction_checks_its_arguments(native, make_manager):
    mgr = make_manager(num_gpu_blocks=4)
    tree = mgr.tree
    with pytest.raises(TypeError, match="native LRUs and pools"):
        native.evict_gpu(mgr, tree.gpu_lru, tree.cpu_lru, [], mgr.cpu_pool, [0] * 4, [], [],
                         0, 1, None, False)
    with pytest.raises(TypeError, match="evict_gpu"):
        native.evict_gpu(mgr, tree.gpu_lru, tree.cpu_lru, mgr.gpu_pool, mgr.cpu_pool, [0] * 3,
                         [], [], 0, 1, None, False)
    # nothing to evict: back to the Python loop (which waits or raises), nothing done
    assert native.evict_gpu(mgr, tree.gpu_lru, tree.cpu_lru, mgr.gpu_pool, mgr.cpu_pool,
                            [0] * 4, [], [], 0, 1, None, False) == (0, None, 2)
