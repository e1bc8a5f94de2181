"""The native tree node (cuda/tree_node.c): PyNode's attributes, invisible to the
garbage collector, freed without leaks or deep recursion; PyNode as the fallback."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import running_workload

import kvcached.core.tree as tree_mod
from kvcached.core.tree import BlockTree, PyNode, Tier

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def native_node():
    """The extension module; skipped only where it cannot be built at all."""
    from kvcached.copy.native_build import find_compiler
    if find_compiler() is None:
        pytest.skip("no C compiler: PyNode is used (covered by the fallback test below)")
    assert tree_mod.native_node_error is None, tree_mod.native_node_error
    assert tree_mod.Node is not PyNode
    return sys.modules["kvcached._tree_node"]


def chain(tree: BlockTree, length: int):
    n = tree.root
    for i in range(length):
        n = tree.add_child(n, i.to_bytes(16, "little"))
    return n


def test_same_attributes_and_defaults_as_pynode(native_node):
    parent = PyNode(b"p", None, 0)
    for node in (tree_mod.Node(b"\x01" * 16, parent, 3), PyNode(b"\x01" * 16, parent, 3)):
        assert (node.hash, node.parent, node.depth) == (b"\x01" * 16, parent, 3)
        assert (node.n_children, node.child_nodes(), node.child(b"x")) == (0, [], None)
        assert node.state is Tier.STORAGE
        assert (node.gpu, node.cpu, node.ref, node.last_access, node.busy) == (-1, -1, 0, 0, 0)
        assert (node.n_gpu_children, node.n_cpu_children, node.in_storage) == (0, 0, False)
        assert (node.gpu_key, node.cpu_key, node.input, node.mkey) == (None,) * 4
        node.gpu, node.state = 7, Tier.GPU
        assert repr(node) == "Node(01010101 GPU gpu=7 cpu=-1 ref=0 t=0 d=3)"
        with pytest.raises(AttributeError):
            node.colour = "red"  # slots only: a typo is an error, not a new attribute


@pytest.mark.parametrize("node_type", ["native", "python"])
def test_children_one_then_many_then_none(native_node, node_type):
    """One child is stored without a dict; a second makes the node branch;
    unlinking goes back down. Both node types answer the same."""
    make = tree_mod.Node if node_type == "native" else PyNode
    p = make(b"p" * 16, None, 0)
    a, b, c = (make(bytes([i]) * 16, p, 1) for i in (1, 2, 3))
    p.link_child(a.hash, a)
    assert (p.n_children, p.child(a.hash), p.child(b.hash), p.child_nodes()) == (1, a, None, [a])
    assert p.child(bytes(a.hash)) is a  # equal bytes, not only the same object
    p.link_child(b.hash, b)
    p.link_child(c.hash, c)
    assert p.n_children == 3 and {n.hash for n in p.child_nodes()} == {a.hash, b.hash, c.hash}
    assert (p.child(a.hash), p.child(b.hash), p.child(c.hash)) == (a, b, c)
    p.unlink_child(b.hash)
    assert p.n_children == 2 and p.child(b.hash) is None
    with pytest.raises(KeyError):
        p.unlink_child(b.hash)
    p.unlink_child(a.hash)
    p.unlink_child(c.hash)
    assert (p.n_children, p.child_nodes()) == (0, [])
    with pytest.raises(KeyError):
        p.unlink_child(a.hash)
    # a child under a key that is not its own hash still works (a dict holds it)
    p.link_child(b"other", a)
    assert p.child(b"other") is a and p.child(a.hash) is None
    p.unlink_children()
    assert p.n_children == 0


def test_the_collector_never_sees_the_tree(native_node):
    gc.collect()
    before = len(gc.get_objects())
    tree = BlockTree()
    for branch in range(50):
        n = tree.add_child(tree.root, bytes([branch]) * 16)
        for depth in range(40):
            n = tree.add_child(n, bytes([branch, depth]) * 8, b"input", branch * 100 + depth)
    assert tree.num_nodes == 50 * 41
    assert not gc.is_tracked(n)
    # The tree, its LRU heaps and lists: a handful of objects, not one per node.
    assert len(gc.get_objects()) - before < 20


def test_a_dropped_tree_frees_every_node(native_node):
    gc.collect()
    live = native_node.live()
    tree = BlockTree()
    leaf = chain(tree, 1000)
    for i in range(100):
        tree.add_child(tree.root, bytes([i + 1]) * 16)  # never chain()'s first hash
    assert native_node.live() == live + 1101
    del tree, leaf
    gc.collect()
    assert native_node.live() == live


def test_removed_subtrees_are_freed(native_node):
    tree = BlockTree()
    keep = tree.add_child(tree.root, b"k" * 16)
    live = native_node.live()
    top = tree.add_child(tree.root, b"t" * 16)
    n = top
    for i in range(200):
        n = tree.add_child(n, i.to_bytes(16, "little"))
    del n
    assert native_node.live() == live + 201
    assert tree.remove(top) == 201
    del top
    assert native_node.live() == live
    assert keep.parent is tree.root


def test_freeing_a_very_long_chain_does_not_recurse():
    """A million-node chain freed at once (its last reference dropped) must not
    overflow the C stack, whether it hangs by parent links (a leaf held last) or
    by child links (a head held last): the type frees nodes from a work stack.
    Run in a child so a crash is a failure, not a dead test run."""
    code = textwrap.dedent("""
        import sys
        import kvcached.core.tree as t
        assert t.native_node_error is None, t.native_node_error
        mod = sys.modules["kvcached._tree_node"]
        n = None
        for i in range(1_000_000):  # held by its leaf, up the parent links
            n = t.Node(i.to_bytes(8, "little"), n, i)
        del n
        head = n = t.Node(b"head", None, 0)
        for i in range(1_000_000):  # held by its head, down the child links
            c = t.Node(i.to_bytes(8, "little"), None, i + 1)
            n.link_child(c.hash, c)
            n = c
        del n, c, head
        print("live", mod.live())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "live 0"


def test_without_native_code_the_python_node_is_used(tmp_path):
    code = textwrap.dedent("""
        import gc
        import sys
        import kvcached.core.tree as t
        from kvcached import CacheConfig
        from kvcached.core.manager import CacheManager
        assert t.Node is t.PyNode and "KVCACHED_NO_NATIVE" in t.native_node_error
        cfg = CacheConfig.load(num_gpu_blocks=8, num_cpu_blocks=4, block_size=4,
                               transfer_mode="inprocess", create_cache=True,
                               check_host_memory=False, run_dir=sys.argv[1])
        with CacheManager(cfg) as mgr:
            for i in range(40):
                toks = [i % 3, 1, 2, 3] * (1 + i % 4) + [9]
                a = mgr.allocate(i, toks)
                a.wait()
                mgr.commit(i, toks, len(toks))
                mgr.free(i)
                mgr.check_invariants()
            assert type(mgr.tree.root) is t.PyNode and gc.is_tracked(mgr.tree.root)
            print(mgr.stats().hit_tokens.get("gpu", 0))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**env, "KVCACHED_NO_NATIVE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 0  # the cache served hits on PyNode



def serve_chat(mgr, requests) -> int:
    """Allocate, wait, commit and free each request; returns tokens served from cache."""
    from kvcached import NoFreeBlocks
    hits = 0
    for r in requests:
        try:
            a = mgr.allocate(r.request_id, r.prompt, reserve_tokens=len(r.output))
        except NoFreeBlocks:
            continue
        a.wait(timeout=30)
        tokens = r.prompt + r.output
        mgr.commit(r.request_id, tokens, len(tokens))
        mgr.free(r.request_id)
        hits += a.num_cached_tokens
    return hits


@pytest.mark.parametrize("tiers", [
    dict(num_gpu_blocks=12, num_cpu_blocks=0),
    dict(num_gpu_blocks=12, num_cpu_blocks=24),  # swap-outs, swap-ins, CPU evictions
    dict(num_gpu_blocks=12, num_cpu_blocks=8, storage_backend="file"),  # and storage
])
def test_a_dropped_manager_leaves_no_node_behind(native_node, tmp_path, tiers):
    """Whatever the manager did to its tree (hits, evictions, swaps, storage
    loads, dedup), once it is closed and dropped every node is freed: the
    collector cannot break these nodes' cycles, so a path that left one would leak."""
    from conftest import tiny_config

    from kvcached.core.manager import CacheManager
    from kvcached.tools.workload import generate_chat_workload
    gc.collect()
    live = native_node.live()
    if "storage_backend" in tiers:
        tiers = {**tiers, "storage_url": str(tmp_path / "store"),
                 "storage_load_policy": "wait_complete"}
    reqs = generate_chat_workload(300, seed=1, num_system_prompts=2, system_tokens=8,
                                  turn_tokens=(1, 6), output_tokens=(1, 5), max_turns=4,
                                  concurrent_conversations=4, vocab=5)
    for run in range(2):  # the second manager hits the first one's storage
        mgr = CacheManager(tiny_config(run_dir=str(tmp_path / f"run{run}"), **tiers)).start()
        try:
            assert serve_chat(mgr, reqs) > 0
            assert native_node.live() > live
            mgr.check_invariants()
        finally:
            mgr.close()
        del mgr
        gc.collect()  # the manager itself sits in ordinary cycles (threads, callbacks)
        assert native_node.live() == live, f"run {run}: nodes leaked"


def compare_native(mgr, fields: tuple[str, ...], native, python, *args):
    """Run ``native(*args)`` and ``python(*args)`` from the same tree state;
    returns both results and the ``fields`` of every node after each run (the
    state is restored after both)."""
    def state():
        return {n: tuple(getattr(n, f) for f in fields) for n in mgr.tree.walk()}

    def restore(saved):
        for n, values in saved.items():
            for f, v in zip(fields, values):
                setattr(n, f, v)

    before = state()
    got = native(*args)
    after_native = state()
    restore(before)
    want = python(*args)
    after_python = state()
    restore(before)
    return got, want, after_native, after_python


def test_native_match_ref_is_the_python_loop(native_node, make_manager):
    """``match_ref`` in C must do exactly what ``match_ref_py`` does: the same
    nodes, counts, LRU unlistings and block ids, and the same refs and LRU keys
    left on every node, on trees that a random workload left in every tier."""
    from conftest import toks

    from kvcached.core.hashing import block_hashes
    from kvcached.core.manager import match_ref_py
    from kvcached.core.tree import native_match_ref
    mgr = make_manager(num_gpu_blocks=10, num_cpu_blocks=12)
    seen = set()
    for i, rng, _ in running_workload(mgr, seed=5):
        probe = toks(*[rng.randrange(3) for _ in range(rng.randrange(1, 7))])
        hashes = block_hashes(mgr._ns, probe, 4)
        for limit in (len(hashes), rng.randrange(len(hashes) + 1)):
            got, want, after_native, after_py = compare_native(
                mgr, ("ref", "gpu_key", "cpu_key"), native_match_ref, match_ref_py,
                mgr.tree.root, hashes, limit, Tier.GPU, Tier.CPU)
            assert got == want and after_native == after_py, (i, limit)
            nodes, n_gpu, _, gpu_unlisted, cpu_unlisted, _ = want
            seen.update(k for k, hit in (("gpu", n_gpu), ("cpu", len(nodes) - n_gpu),
                                         ("gpu_unlisted", gpu_unlisted),
                                         ("cpu_unlisted", cpu_unlisted)) if hit)
    mgr.check_invariants()
    assert seen == {"gpu", "cpu", "gpu_unlisted", "cpu_unlisted"}  # every branch compared


def test_native_unref_path_is_the_python_loop(native_node, make_manager):
    """``unref_path`` in C must do exactly what ``unref_path_py`` does: the same
    refs and access times left on every node, the same idle count and the same
    nodes to refresh, on paths a random workload left in every tier and with
    other requests still holding some of their nodes."""
    from kvcached.core.eviction import unref_path_py
    from kvcached.core.tree import native_unref_path
    mgr = make_manager(num_gpu_blocks=10, num_cpu_blocks=12)
    seen = set()
    for i, _, held in running_workload(mgr, seed=9):
        path = mgr._reqs[held[0]].nodes  # a running request's path, as free() passes it
        got, want, after_native, after_py = compare_native(
            mgr, ("ref", "last_access"), native_unref_path, unref_path_py,
            path, 10_000 + i, Tier.GPU)
        assert got == want and after_native == after_py, i
        seen.update(k for k, hit in (("idle", want[0]), ("changed", want[1]),
                                     ("held", any(n.ref > 1 for n in path))) if hit)
    mgr.check_invariants()
    assert seen == {"idle", "changed", "held"}


def test_memo_child_finds_children_by_key_whether_one_or_many(native_node):
    """The memo walk asks a node for its child under a memo key: the single
    child itself, or the branching node's key index, kept in step with
    link_child / unlink_child."""
    p = tree_mod.Node(b"p" * 16, None, 0)

    def kid(i, key):
        n = tree_mod.Node(bytes([i]) * 16, p, 1)
        n.mkey = key
        return n

    a, b, c, blind = kid(1, 101), kid(2, 102), kid(3, 103), kid(4, None)
    assert p.memo_child(101) is None
    p.link_child(a.hash, a)
    assert (p.memo_child(101), p.memo_child(102)) == (a, None)
    for n in (b, c, blind):
        p.link_child(n.hash, n)
    assert [p.memo_child(k) for k in (101, 102, 103, 104)] == [a, b, c, None]
    p.unlink_child(b.hash)
    assert (p.memo_child(102), p.memo_child(101)) == (None, a)
    b2 = kid(2, 202)  # a new node under b's hash
    p.link_child(b2.hash, b2)
    twin = kid(5, 103)  # a sibling whose key collides with c's: the newer one answers
    p.link_child(twin.hash, twin)
    assert (p.memo_child(202), p.memo_child(103)) == (b2, twin)
    p.unlink_child(twin.hash)
    assert p.memo_child(103) is None  # a miss costs one BLAKE2b, never a wrong hash
    for n in (a, b2, c, blind):
        p.unlink_child(n.hash)
    assert p.n_children == 0 and p.memo_child(101) is None


def test_native_insert_new_is_the_python_loop(native_node, make_manager, monkeypatch):
    """``insert_new`` in C must leave exactly the tree ``_insert``'s Python loop
    leaves: two managers serve the same random workload, one with the C loop
    and one without, and every node's fields and the stats agree after each
    request (new chains, chains that meet cached blocks midway, every tier)."""
    import kvcached.core.manager as manager_mod

    fields = ("hash", "depth", "state", "gpu", "cpu", "ref", "last_access", "n_gpu_children",
              "n_cpu_children", "in_storage", "input", "mkey", "gpu_key", "cpu_key")

    def snapshot(mgr):
        return sorted((tuple(getattr(n, f) for f in fields), n.parent.hash)
                      for n in mgr.tree.walk())

    with_c = make_manager(num_gpu_blocks=10, num_cpu_blocks=12)
    steps_c = [(snapshot(with_c), with_c.tree.num_nodes) for _ in running_workload(with_c, 11)]
    monkeypatch.setattr(manager_mod, "native_insert_new", None)
    python = make_manager(num_gpu_blocks=10, num_cpu_blocks=12)
    steps_py = [(snapshot(python), python.tree.num_nodes) for _ in running_workload(python, 11)]
    assert len(steps_c) == len(steps_py) > 100
    for i, (got, want) in enumerate(zip(steps_c, steps_py)):
        assert got == want, i
    def counts(mgr):  # the stats but the transfers' timings
        st = dataclasses.asdict(mgr.stats())
        st["transfers"] = {k: (v["submitted"], v["done"], v["blocks"])
                           for k, v in st["transfers"].items()}
        return st

    assert counts(with_c) == counts(python)
    with_c.check_invariants()
    python.check_invariants()
    assert with_c.tree.num_nodes == len(list(with_c.tree.walk())) > 0


def test_native_insert_new_checks_its_arguments(native_node):
    from kvcached.core.tree import native_insert_new
    tree = BlockTree()
    nodes: list = []
    with pytest.raises(TypeError, match="insert_new"):
        native_insert_new(tree.root, [b"h"], [b"r"], None, [3], 0, 1, Tier.GPU, nodes)
    with pytest.raises(IndexError, match="out of range"):
        native_insert_new(tree.root, [b"h"], None, None, [3], 0, 2, Tier.GPU, nodes)
    parent, i = native_insert_new(tree.root, [b"h1", b"h2"], None, None, [3, 4], 0, 2,
                                  Tier.GPU, nodes)
    assert i == 2 and parent is nodes[-1] and [n.gpu for n in nodes] == [3, 4]
    assert parent.depth == 2 and parent.parent is nodes[0] and tree.root.n_gpu_children == 1
    assert nodes[0].n_gpu_children == 1 and parent.ref == 1 and parent.input is None
    # a block whose hash has a node already stops the loop there
    again: list = []
    assert native_insert_new(tree.root, [b"h1"], None, None, [9], 0, 1, Tier.GPU,
                             again) == (tree.root, 0) and again == []
    tree.root.unlink_children()
