"""LeafLRU: the per-tier heap of evictable leaves (order, re-keying, lazy deletion).

Every test runs on the C LeafLRU (with native nodes) and on PyLeafLRU, the
reference (with PyNode and with native nodes)."""

from __future__ import annotations

import random

import pytest

from kvcached.core import tree
from kvcached.core.tree import Node, PyLeafLRU, PyNode, lru_key

IMPLS = [(PyLeafLRU, PyNode), (PyLeafLRU, tree.Node)]
if tree._native is not None:
    IMPLS.append((tree._native.LeafLRU, tree._native.Node))


@pytest.fixture(params=IMPLS, ids=lambda p: f"{p[0].__module__}.{p[0].__name__}/{p[1].__name__}")
def impl(request):
    return request.param


def LeafLRU(slot: str):  # noqa: N802 - stands for the class under test
    return _impl[0](slot)


def node(last_access: int, depth: int = 1) -> Node:
    n = _impl[1](bytes([depth % 256]), None, depth)
    n.last_access = last_access
    return n


_impl = IMPLS[0]


@pytest.fixture(autouse=True)
def _use(impl, monkeypatch):
    monkeypatch.setitem(globals(), "_impl", impl)


def drain(lru) -> list[Node]:
    out = []
    while (n := lru.pop()) is not None:
        out.append(n)
    return out


def test_pops_oldest_first_then_deepest_then_first_added():
    lru = LeafLRU("gpu_key")
    a, b, c, d = node(5, 1), node(3, 1), node(5, 4), node(5, 1)
    for n in (a, b, c, d):
        lru.add(n)
    assert len(lru) == 4
    assert drain(lru) == [b, c, a, d]
    assert len(lru) == 0 and lru.pop() is None


def test_discard_and_membership_use_the_node_slot():
    lru = LeafLRU("cpu_key")
    a, b = node(1), node(2)
    lru.add(a)
    lru.add(b)
    assert a in lru and a.cpu_key is not None and a.gpu_key is None
    lru.discard(a)
    lru.discard(a)  # twice is harmless
    assert a not in lru and len(lru) == 1
    assert drain(lru) == [b]  # the stale entry of a is skipped


def test_readding_after_access_moves_the_node_back():
    lru = LeafLRU("gpu_key")
    a, b = node(1), node(2)
    lru.add(a)
    lru.add(b)
    a.last_access = 3
    lru.add(a)  # re-keyed, not duplicated
    assert len(lru) == 2
    key = a.gpu_key
    lru.add(a)  # unchanged access time: a no-op
    assert a.gpu_key == key
    assert drain(lru) == [b, a]


def test_compaction_keeps_exactly_the_live_nodes():
    lru = LeafLRU("gpu_key")
    nodes = [node(i) for i in range(50)]
    for n in nodes:
        lru.add(n)
    for _ in range(5):  # every re-key leaves a stale entry behind
        for n in nodes:
            n.last_access += 100
            lru.add(n)
    assert lru.heap_len() <= 2 * len(lru) + 64
    assert lru.nodes() == set(nodes)
    assert drain(lru) == nodes


def test_random_operations_match_a_sorted_reference():
    rng = random.Random(7)
    lru = LeafLRU("gpu_key")
    nodes = [node(0, rng.randint(1, 9)) for _ in range(40)]
    live: dict[Node, tuple] = {}
    seq = 0
    for step in range(3000):
        n = rng.choice(nodes)
        op = rng.random()
        if op < 0.5:
            n.last_access = rng.randint(0, 30)
            if live.get(n, (None,))[0] != n.last_access:
                seq += 1
                live[n] = (n.last_access, -n.depth, seq)
            lru.add(n)
        elif op < 0.8:
            live.pop(n, None)
            lru.discard(n)
        elif op < 0.9:  # push_pop(n) must behave exactly like add(n) then pop()
            n.last_access = rng.randint(0, 30)
            if live.get(n, (None,))[0] != n.last_access:
                seq += 1
                live[n] = (n.last_access, -n.depth, seq)
            want = min(live, key=live.get)
            assert lru.push_pop(n) is want, step
            del live[want]
        elif live:
            want = min(live, key=live.get)
            assert lru.pop() is want, step
            del live[want]
        assert len(lru) == len(live)
    assert lru.nodes() == set(live)


def test_packed_key_sorts_like_the_tuple():
    rng = random.Random(3)
    big_depth = (1 << 24) + 5  # saturates: deeper than any real prompt
    cases = [(rng.randint(0, 10**12), rng.choice([1, 2, 500, big_depth]), rng.randint(0, 10**9))
             for _ in range(2000)]
    by_key = sorted(cases, key=lambda c: lru_key(*c))
    by_tuple = sorted(cases, key=lambda c: (c[0], -min(c[1], (1 << 24) - 1), c[2]))
    assert by_key == by_tuple


def test_add_stores_the_packed_key():
    lru = LeafLRU("gpu_key")
    a = node(9, 3)
    lru.add(a)
    assert a.gpu_key == lru_key(9, 3, 1)
    # the inlined key saturates depth and wraps the order exactly as lru_key does
    deep = node(7, (1 << 24) + 5)
    lru._seq = (1 << 40) + 2
    lru.add(deep)
    assert deep.gpu_key == lru_key(7, (1 << 24) + 5, (1 << 40) + 3)


def test_push_pop_returns_an_older_node_without_listing_it():
    lru = LeafLRU("gpu_key")
    a, b = node(5), node(2)
    lru.add(a)
    assert lru.push_pop(b) is b  # older than everything listed
    assert b.gpu_key is None and len(lru) == 1 and lru.heap_len() == 1
    c = node(9)
    assert lru.push_pop(c) is a  # newer: listed, and the oldest comes out
    assert c in lru and len(lru) == 1
    assert lru.push_pop(None) is c and lru.push_pop(None) is None


def test_the_c_lru_refuses_what_it_cannot_key():
    if tree._native is None:
        pytest.skip("no native tree")
    with pytest.raises(ValueError, match="slot must be 'gpu_key' or 'cpu_key'"):
        tree._native.LeafLRU("key")
    lru = tree._native.LeafLRU("gpu_key")
    with pytest.raises(TypeError, match="needs a native Node"):
        lru.add(PyNode(b"x", None, 1))
    n = tree._native.Node(b"x", None, 1)
    n.last_access = -1  # a clock never goes negative; the key cannot hold it
    with pytest.raises(OverflowError):
        lru.add(n)
    assert len(lru) == 0 and lru.heap_len() == 0 and n.gpu_key is None
