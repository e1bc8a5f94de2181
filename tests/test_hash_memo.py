"""The hash memo: hashing a prompt takes the hash of blocks the tree already holds.

``block_hashes_memo`` must return exactly ``block_hashes``'s hashes whatever
the memo holds: the right nodes, nodes of other inputs under a colliding key,
malformed entries, nothing. The manager keeps the memo to the nodes in its
tree, lazily (``check_invariants`` verifies every entry hashes to its node's hash).
"""

from __future__ import annotations

import random
from hashlib import blake2b

import numpy as np
import pytest

import kvcached.core.hashing as hashing
from kvcached.core.hashing import block_hashes, block_hashes_memo, namespace_hash

BS = 16
NS = namespace_hash("model", "w1")


class Entry:
    """What the memo's values must offer (tree nodes do)."""

    __slots__ = ("input", "hash")

    def __init__(self, block_input, h):
        self.input = block_input
        self.hash = h


def remember(memo: dict, hashed: tuple) -> None:
    for h, block_input, key in zip(*hashed):
        memo[key] = Entry(block_input, h)


def tokens(seed: int, n: int, vocab: int = 200_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def test_without_memo_entries_it_is_block_hashes(native):
    toks = tokens(1, 10 * BS + 3)
    hashes, inputs, keys = block_hashes_memo(NS, toks, BS, "lora", {})
    assert hashes == block_hashes(NS, toks, BS, "lora")
    # each record is what its hash was computed from, parent hash, extra,
    # tokens, with the ids narrowed to uint32 and a width byte
    parent = NS
    for i, (h, record) in enumerate(zip(hashes, inputs)):
        ids = toks[i * BS:(i + 1) * BS]
        assert record == parent + b"lora" + np.array(ids, dtype="<u4").tobytes() + b"\x04"
        block_input = parent + b"lora" + np.array(ids, dtype="<i8").tobytes()
        assert hashing.hash_input(record, BS) == block_input
        assert blake2b(block_input, digest_size=16).digest() == h
        parent = h
    assert keys == [native.memo_key(x) for x in inputs]


@pytest.mark.parametrize("odd", [2**32, -1, 2**63 - 1, -2**63])
def test_ids_outside_uint32_keep_the_int64_form(native, odd):
    """A block with an id that does not fit in uint32 is remembered in the hash
    input's own form (width byte 8); its neighbours stay narrow, and every
    block hits again with the same hashes."""
    toks = tokens(7, 3 * BS)
    toks[BS + 5] = odd
    want = block_hashes(NS, toks, BS)
    memo: dict = {}
    first = block_hashes_memo(NS, toks, BS, None, memo)
    assert first[0] == want
    assert [r[-1] for r in first[1]] == [4, 8, 4]
    assert first[1][1] == want[0] + np.array(toks[BS:2 * BS], dtype="<i8").tobytes() + b"\x08"
    assert [hashing.hash_input(r, BS)[16:] for r in first[1]] == \
        [np.array(toks[i * BS:(i + 1) * BS], dtype="<i8").tobytes() for i in range(3)]
    remember(memo, first)
    again = block_hashes_memo(NS, toks, BS, None, memo)
    assert again[0] == want and all(a is b for a, b in zip(again[1], first[1]))
    # the same ids as int64 array: the same records
    assert block_hashes_memo(NS, np.array(toks, dtype=np.int64), BS, None, None)[1] == first[1]


def test_ids_that_fit_in_uint16_get_the_narrowest_records(native):
    """A vocabulary under 64K (Llama 2, Mistral) gives records of uint16 ids
    (width byte 2): a block is as wide as its widest id needs, blocks of one
    prompt may differ, and every form stands for the same int64 input."""
    toks = tokens(8, 3 * BS, vocab=1 << 16)
    toks[5] = 0xFFFF  # still fits
    toks[BS + 3] = 0x10000  # does not: this block alone is uint32
    want = block_hashes(NS, toks, BS, "lora")
    memo: dict = {}
    first = block_hashes_memo(NS, toks, BS, "lora", memo)
    assert first[0] == want
    assert [r[-1] for r in first[1]] == [2, 4, 2]
    assert first[1][0] == NS + b"lora" + np.array(toks[:BS], dtype="<u2").tobytes() + b"\x02"
    parent = NS
    for i, (h, record) in enumerate(zip(first[0], first[1])):
        block_input = parent + b"lora" + np.array(toks[i * BS:(i + 1) * BS], dtype="<i8").tobytes()
        assert hashing.hash_input(record, BS) == block_input
        parent = h
    remember(memo, first)
    again = block_hashes_memo(NS, toks, BS, "lora", memo)
    assert again[0] == want and all(a is b for a, b in zip(again[1], first[1]))
    arr = block_hashes_memo(NS, np.array(toks, dtype=np.int64), BS, "lora", None)
    assert arr[1] == first[1]


def test_hash_input_rejects_what_is_not_a_record():
    for bad in (b"", b"\x00" * 20 + b"\x05", b"\x00" * 10 + b"\x04"):
        with pytest.raises(ValueError, match="not a memo record"):
            hashing.hash_input(bad, BS)


def test_remembered_blocks_give_the_same_hashes(native):
    toks = tokens(2, 12 * BS)
    memo: dict = {}
    first = block_hashes_memo(NS, toks, BS, None, memo)
    remember(memo, first)
    again = block_hashes_memo(NS, toks, BS, None, memo)
    assert again[0] == first[0]
    # a hit hands back the remembered objects themselves: no new bytes per block
    assert all(a is b for a, b in zip(again[1], first[1]))
    # a prompt that shares 5 blocks and then differs
    other = toks[:5 * BS] + tokens(3, 7 * BS)
    got = block_hashes_memo(NS, other, BS, None, memo)
    assert got[0] == block_hashes(NS, other, BS)
    assert got[0][:5] == first[0][:5] and got[0][5] != first[0][5]


def test_collisions_and_malformed_entries_are_misses(native):
    toks = tokens(4, 6 * BS)
    want = block_hashes(NS, toks, BS)
    _, inputs, keys = block_hashes_memo(NS, toks, BS, None, {})
    bad_hash = b"\xee" * 16
    cases = [
        Entry(b"other input" + inputs[0][11:], bad_hash),  # same length, other bytes
        Entry(inputs[0][:-1], bad_hash),                   # shorter
        Entry(inputs[0] + b"x", bad_hash),                 # longer
        Entry(inputs[0].decode("latin-1"), bad_hash),      # not bytes
        Entry(inputs[0], b"short"),                        # a hash of the wrong size
        Entry(inputs[0], None),
        object(),                                          # no attributes at all
    ]
    for case in cases:
        memo = {k: case for k in keys}
        try:
            got = block_hashes_memo(NS, toks, BS, None, memo)[0]
        except AttributeError:
            assert type(case) is object  # an entry that is not a node: an error, not a guess
            continue
        assert got == want, case


def test_other_namespace_extra_key_or_start_never_hit(native):
    toks = tokens(5, 8 * BS)
    memo: dict = {}
    remember(memo, block_hashes_memo(NS, toks, BS, None, memo))
    other_ns = namespace_hash("model", "w2")
    assert block_hashes_memo(other_ns, toks, BS, None, memo)[0] == \
        block_hashes(other_ns, toks, BS)
    assert block_hashes_memo(NS, toks, BS, "lora-2", memo)[0] == \
        block_hashes(NS, toks, BS, "lora-2")
    full = block_hashes(NS, toks, BS)
    assert block_hashes_memo(full[2], toks, BS, None, memo, start=3)[0] == full[3:]


def test_arrays_tuples_and_argument_errors(native):
    toks = tokens(6, 5 * BS + 1)
    want = block_hashes(NS, toks, BS)
    memo: dict = {}
    for data in (toks, tuple(toks), np.array(toks, dtype=np.int64)):
        got = block_hashes_memo(NS, data, BS, None, memo)
        assert got[0] == want, type(data).__name__
        remember(memo, got)
    assert block_hashes_memo(NS, toks, BS, None, memo, start=5) == ([], [], [])
    with pytest.raises(TypeError, match="memo must be a dict"):
        native.chain_memo(NS, toks, BS, b"", 0, 5, [])
    with pytest.raises(TypeError, match="7 arguments"):
        native.chain_memo(NS, toks, BS, b"", 0, 5)
    with pytest.raises(ValueError, match="not within"):
        native.chain_memo(NS, toks, BS, b"", 0, 6, {})
    with pytest.raises(TypeError, match="memo_key takes bytes"):
        native.memo_key("text")


def test_python_path_has_no_memo(monkeypatch):
    monkeypatch.setattr(hashing, "_native", None)
    toks = tokens(7, 4 * BS)
    assert block_hashes_memo(NS, toks, BS, None, {}) == (block_hashes(NS, toks, BS), None, None)


def serve(mgr, rid, toks: list[int]) -> None:
    mgr.allocate(rid, toks)
    mgr.commit(rid, toks, len(toks))
    mgr.free(rid)


def test_manager_memo_is_the_tree(native, make_manager):
    """Nodes are remembered when created and forgotten with the tree: hashing a
    prompt takes the hashes of the nodes it walks through, and a removed node
    is hashed again. Every remembered input stays true (check_invariants)."""
    with make_manager(num_gpu_blocks=16, block_size=BS) as mgr:
        tree = mgr.tree
        a = tokens(8, 6 * BS)
        serve(mgr, "a", a)
        a_nodes = list(tree.walk())
        assert len(a_nodes) == 6 and all(n.mkey is not None for n in a_nodes)
        mgr.check_invariants()
        hashes, inputs, _ = block_hashes_memo(mgr._ns, a, BS, None, tree.memo_root)
        assert hashes == block_hashes(mgr._ns, a, BS)
        assert {id(x) for x in inputs} == {id(n.input) for n in a_nodes}  # taken, not hashed
        assert mgr.allocate("a2", a + [1]).hit.gpu_tokens == 6 * BS
        mgr.free("a2")

        serve(mgr, "b", tokens(9, 16 * BS))  # needs every GPU block: all of a's go
        assert tree.num_nodes == 16 and not set(a_nodes) & set(tree.walk())
        mgr.check_invariants()
        hashes, inputs, _ = block_hashes_memo(mgr._ns, a, BS, None, tree.memo_root)
        assert hashes == block_hashes(mgr._ns, a, BS)  # hashed again: the same hashes
        assert not {id(x) for x in inputs} & {id(n.input) for n in a_nodes}


def test_the_walk_takes_only_its_own_branch(native):
    """In tree mode a block is looked up among the previous block's node's
    children only: a node of the same input elsewhere is not a candidate, and
    after the first miss the rest is hashed (no later block can be in the tree)."""
    import kvcached.core.tree as tree_mod
    if tree_mod.native_node_error is not None:
        pytest.skip("tree-mode memo needs native nodes")
    tree = tree_mod.BlockTree()
    toks = tokens(21, 4 * BS)
    hashes, inputs, keys = block_hashes_memo(NS, toks, BS, None, None)
    node = tree.root
    for h, x, k in zip(hashes, inputs, keys):
        node = tree.add_child(node, h, x, k)
    got = block_hashes_memo(NS, toks, BS, None, tree.root)
    assert got[0] == hashes and all(a is b for a, b in zip(got[1], inputs))
    # a different second block: blocks 3 and 4 have other parents, so other hashes
    other = toks[:BS] + tokens(22, BS) + toks[2 * BS:]
    got = block_hashes_memo(NS, other, BS, None, tree.root)
    assert got[0] == block_hashes(NS, other, BS)
    assert got[1][0] is inputs[0] and all(a is not b for a, b in zip(got[1][1:], inputs[1:]))
    # starting under block 2's node (as a request resuming there) hits blocks 3-4
    n2 = tree.root.child(hashes[0]).child(hashes[1])
    got = block_hashes_memo(hashes[1], toks, BS, None, n2, start=2)
    assert got[0] == hashes[2:] and all(a is b for a, b in zip(got[1], inputs[2:]))


class Proxy:
    """A tree node seen only through Python attributes: the walk's generic path."""

    def __init__(self, node):
        self._node = node
        self.input, self.hash, self.mkey = node.input, node.hash, node.mkey

    def memo_child(self, key):
        child = self._node.memo_child(key)
        return None if child is None else Proxy(child)


def native_tree(n_chains: int, blocks: int, seed: int, vocab: int = 200_000, bs: int = BS):
    import kvcached.core.tree as tree_mod
    if tree_mod.native_node_error is not None:
        pytest.skip("tree-mode memo needs native nodes")
    tree = tree_mod.BlockTree()
    prompts = []
    shared = tokens(seed, 2 * bs, vocab)  # every chain shares two blocks: the root branches below
    for c in range(n_chains):
        toks = shared + tokens(seed + 1 + c, (blocks - 2) * bs, vocab)
        hashes, inputs, keys = block_hashes_memo(NS, toks, bs, None, None)
        node = tree.root
        for h, x, k in zip(hashes, inputs, keys):
            node = node.child(h) or tree.add_child(node, h, x, k)
        prompts.append(toks)
    return tree, prompts


def tree_path(tree, hashes: list[bytes]) -> list:
    """The nodes of a cached prefix, top down."""
    path, node = [], tree.root
    for h in hashes:
        node = node.child(h)
        path.append(node)
    return path


def test_native_nodes_are_read_directly_with_the_same_results(native):
    """kvcached.core.tree hands its node type to the hashing extension (a capsule),
    and the walk then reads native nodes' fields in C: it must agree exactly
    with the generic path, which asks a node through Python attributes."""
    tree, prompts = native_tree(5, 6, seed=30)
    assert hashing._node_api is not None
    for toks in prompts + [prompts[0][:3 * BS] + tokens(40, 3 * BS)]:
        steps = native.native_steps()
        fast = block_hashes_memo(NS, toks, BS, None, tree.root)
        assert native.native_steps() > steps  # the walk read native nodes directly
        steps = native.native_steps()
        slow = block_hashes_memo(NS, toks, BS, None, Proxy(tree.root))
        assert native.native_steps() == steps  # a Python node: attributes, not the capsule
        assert fast[0] == slow[0] == block_hashes(NS, toks, BS)
        assert fast[1] == slow[1] and fast[2] == slow[2]
    # a hit hands back the node's own record and key objects
    node, toks = tree.root, prompts[1]
    got = block_hashes_memo(NS, toks, BS, None, tree.root)
    for x, k, h in zip(got[1], got[2], got[0]):
        node = node.child(h)
        assert x is node.input and k is node.mkey


def test_a_chain_link_is_matched_by_its_record_alone(native):
    """Where the tree does not branch, the walk compares the block's record
    with the only child's without computing the block's key (most hits are
    such links): a link whose key no longer fits its record still hits, by
    the record, and hands back the node's own objects."""
    tree, prompts = native_tree(3, 6, seed=31)
    toks = prompts[0]
    hashes = block_hashes(NS, toks, BS)
    path = tree_path(tree, hashes)
    link = path[3]  # below the branch at block 2, its parent has no other child
    assert link.parent.n_children == 1 and path[1].n_children == 3
    link.mkey ^= 1
    got = block_hashes_memo(NS, toks, BS, None, tree.root)
    assert got[0] == hashes
    assert all(g is n.hash for g, n in zip(got[0], path))  # every block a hit
    assert got[2][3] is link.mkey


@pytest.mark.parametrize("as_array", [False, True])
def test_a_uint16_link_tells_apart_ids_equal_in_their_low_16_bits(native, as_array):
    """A link's uint16 record is compared with the token ints themselves: an id
    of 2^16 + x must not pass for x, anywhere in the block, and the block's
    hash must then be its own (BLAKE2b), not the node's."""
    tree, prompts = native_tree(3, 6, seed=32, vocab=1 << 16)
    toks = prompts[0]
    hashes = block_hashes(NS, toks, BS)
    path = tree_path(tree, hashes[:3])
    node = path[-1]
    assert node.n_children == 1 and node.child(hashes[3]).input[-1] == 2
    for pos in (3 * BS, 3 * BS + BS // 2, 4 * BS - 1):
        other = list(toks)
        other[pos] += 1 << 16
        want = block_hashes(NS, other, BS)
        got = block_hashes_memo(NS, np.array(other) if as_array else other, BS, None, tree.root)
        assert got[0] == want and want[3] != hashes[3]
        assert all(g is n.hash for g, n in zip(got[0], path))  # the blocks before: hits
        assert got[1][3][-1] == 4  # the block's own record, as wide as its ids need
    same = block_hashes_memo(NS, np.array(toks) if as_array else toks, BS, None, tree.root)
    assert same[0] == hashes and same[1][3] is node.child(hashes[3]).input


@pytest.fixture(params=[False, True], ids=["one-by-one", "gathered"])
def gather(request, native):
    """Chain links' token ids compared with AVX2 gathers, or one by one."""
    try:
        before = native.set_gather(request.param)
    except ValueError as e:
        pytest.skip(str(e))
    yield request.param
    native.set_gather(before)


class IntSub(int):
    pass


def test_set_gather_switches_and_returns_the_previous_setting(native, gather):
    if not gather:  # the gathered case switches both ways (and skips where unavailable)
        pytest.skip("covered by the gathered case")
    assert native.set_gather(False) is True
    assert native.set_gather(True) is False


@pytest.mark.parametrize("vocab,bs", [(1 << 16, 16), (200_000, 16), (1 << 16, 6), (200_000, 2)])
def test_a_link_compares_every_id_exactly(native, gather, vocab, bs):
    """At a chain link, a block that differs from the node's record in any one
    token, in any way (another id, an id outside the record's width, a
    two-digit int equal in its low digit, zero, a negative id), gets its own
    hash; the same ids as other int-like objects (a subclass, numpy ints, a
    tuple of them) hit. Gathered or one by one, at every position of the
    groups of four and of a block's tail. (A list holding numpy ints takes
    the reference path: equal hashes, no memo.)"""
    tree, prompts = native_tree(3, 6, seed=33, vocab=vocab, bs=bs)
    toks = prompts[0]
    hashes = block_hashes(NS, toks, bs)
    path = tree_path(tree, hashes)
    assert path[2].n_children == 1  # block 3 is a chain link
    for pos in range(3 * bs, 4 * bs):
        v = toks[pos]
        for odd in (v + 1, v + (1 << 16), v + (1 << 30), 0 if v else 1, -v - 1):
            other = list(toks)
            other[pos] = odd
            want = block_hashes(NS, other, bs)
            got = block_hashes_memo(NS, other, bs, None, tree.root)
            assert got[0] == want and want[3] != hashes[3], (pos, odd)
            assert all(g is n.hash for g, n in zip(got[0][:3], path))
        for alike in (IntSub(v), np.int64(v), np.uint16(v) if v < 1 << 16 else np.uint32(v)):
            other = list(toks)
            other[pos] = alike
            for form in (other, tuple(other)):
                got = block_hashes_memo(NS, form, bs, None, tree.root)
                assert got[0] == hashes, (pos, alike)
                if type(alike) is IntSub:  # an int: the memo's path, every block a hit
                    assert all(g is n.hash for g, n in zip(got[0], path)), pos
    # a block holding id 0 (an int of no digits) hits as well
    toks0 = list(toks)
    toks0[3 * bs + 1] = 0
    want = block_hashes(NS, toks0, bs)
    first = block_hashes_memo(NS, toks0, bs, None, tree.root)
    assert first[0] == want
    node = path[2]
    for h, x, k in zip(first[0][3:], first[1][3:], first[2][3:]):
        node = node.child(h) or tree.add_child(node, h, x, k)
    again = block_hashes_memo(NS, toks0, bs, None, tree.root)
    assert again[0] == want and all(a is b for a, b in zip(again[0], first[0]))


def test_a_link_refuses_a_token_that_only_looks_like_an_int(native, gather):
    """A 1-tuple's memory reads like a one-digit int's (size 1, then its item's
    address): at a link whose record holds the low 32 bits of that address,
    the tuple must still be refused as a token, never taken for the id."""
    tree, _ = native_tree(0, 0, seed=34)  # an empty tree
    item = object()
    toks = tokens(34, 6 * BS)
    toks[3 * BS + 2] = id(item) & 0xFFFFFFFF
    hashed = block_hashes_memo(NS, toks, BS, None, tree.root)
    assert hashed[1][3][-1] == 4  # a uint32 record holds the id
    node = tree.root
    for h, x, k in zip(*hashed):
        node = tree.add_child(node, h, x, k)  # one chain: every block is a link
    assert block_hashes_memo(NS, toks, BS, None, tree.root)[0] == hashed[0]
    other = list(toks)
    other[3 * BS + 2] = (item,)
    with pytest.raises(TypeError):
        block_hashes_memo(NS, other, BS, None, tree.root)


def test_the_memo_key_leaves_out_the_parent_hash(native):
    """The walk stands on the parent already, so a key covers only the block's
    own bytes: equal tokens under two parents share a key, and only the exact
    input compare tells them apart (a flat memo then misses, never mixes)."""
    toks = tokens(50, 2 * BS)
    a = block_hashes_memo(NS, toks, BS, None, None)
    other = namespace_hash("model", "w2")
    b = block_hashes_memo(other, toks, BS, None, None)
    assert a[2][0] == b[2][0] and a[1][0][16:] == b[1][0][16:] and a[0][0] != b[0][0]
    assert native.memo_key(a[1][0]) == native.memo_key(b[1][0])
    memo: dict = {}
    remember(memo, a)
    assert block_hashes_memo(other, toks, BS, None, memo)[0] == block_hashes(other, toks, BS)
    # a parent of another length (a caller's own bytes) keys its first block
    # over what follows the first 16 input bytes, like memo_key does
    long_parent = b"p" * 40
    got = block_hashes_memo(long_parent, toks, BS, None, None)
    assert got[0] == block_hashes(long_parent, toks, BS)
    assert got[2] == [native.memo_key(x) for x in got[1]]


def test_native_memo_keys_are_checked(native):
    import kvcached.core.tree as tree_mod
    if tree_mod.native_node_error is not None:
        pytest.skip("native nodes only")
    n = tree_mod.Node(b"h", None, 0)
    assert n.mkey is None
    n.mkey = 2**61 - 1
    assert n.mkey == 2**61 - 1
    for bad, err in (("1", TypeError), (-1, OverflowError), (2**64, OverflowError)):
        with pytest.raises(err):
            n.mkey = bad
        assert n.mkey == 2**61 - 1  # unchanged
    with pytest.raises(AttributeError):
        del n.mkey
    n.mkey = None
    assert n.mkey is None
    parent = tree_mod.Node(b"p", None, 0)
    parent.link_child(b"h", n)
    assert parent.memo_child(7) is None  # the child has no key: not in the memo
    n.mkey = 7
    assert parent.memo_child(7) is n
    assert parent.memo_child(-7) is None and parent.memo_child("7") is None
    parent.unlink_children()


def test_manager_on_the_python_path_still_caches(monkeypatch, make_manager):
    monkeypatch.setattr(hashing, "_native", None)
    with make_manager(num_gpu_blocks=16, block_size=BS) as mgr:
        a = tokens(10, 4 * BS + 1)
        mgr.allocate("a", a)
        mgr.commit("a", a, len(a))
        mgr.free("a")
        assert mgr.allocate("b", a).hit.gpu_tokens == 4 * BS
        assert all(n.mkey is None and n.input is None for n in mgr.tree.walk())
        mgr.check_invariants()


@pytest.mark.parametrize("how", ["kwarg", "env"])
def test_hash_memo_off_keeps_no_inputs_and_caches_the_same(native, make_manager, monkeypatch,
                                                           how):
    """``hash_memo = false`` (or KVCACHED_HASH_MEMO=off): no memo, no inputs kept,
    and the same hits, block ids and hashes as with the memo."""
    rng = random.Random(3)
    # Prompts of a few shared prefixes: many blocks are hits, some evicted.
    prompts = [tokens(rng.randrange(4), rng.randrange(1, 6) * BS + 1) for _ in range(30)]
    seen = []
    for memo_on in (False, True):
        if how == "env":
            monkeypatch.setenv("KVCACHED_HASH_MEMO", "on" if memo_on else "off")
            kw = {}
        else:
            kw = {"hash_memo": memo_on}
        with make_manager(num_gpu_blocks=12, block_size=BS, **kw) as mgr:
            assert mgr.cfg.hash_memo is memo_on
            out = []
            for i, p in enumerate(prompts):
                a = mgr.allocate(i, p)
                out.append((a.hit.gpu_tokens, list(a.block_ids)))
                mgr.commit(i, p, len(p))
                mgr.free(i)
            out.append(sorted(n.hash for n in mgr.tree.walk()))
            mgr.check_invariants()
            assert any(n.mkey is not None for n in mgr.tree.walk()) is memo_on
            assert all((n.input is not None) is memo_on for n in mgr.tree.walk())
        seen.append(out)
    assert seen[0] == seen[1]
    assert any(gpu_hit for gpu_hit, _ in seen[0][:-1])  # the workload does hit


@pytest.mark.parametrize("seed", range(6))
def test_random_memos_never_change_a_hash(native, seed):
    """Whatever a memo holds (a native tree grown from random prompts sharing
    prefixes, or a flat dict with entries planted under other blocks' keys),
    block_hashes_memo returns exactly block_hashes, for lists, tuples and int64
    arrays, any extra key, start and block size, and ids that need int64."""
    import kvcached.core.tree as tree_mod
    rng = random.Random(seed)
    bs = rng.choice([1, 3, 16])
    stems = [tokens(100 * seed + i, rng.randrange(1, 5) * bs) for i in range(3)]

    def prompt():
        toks = list(rng.choice(stems)) + tokens(rng.randrange(10**6), rng.randrange(0, 4) * bs)
        if rng.random() < 0.2:
            toks[rng.randrange(len(toks))] = rng.choice([2**40, -5, 2**63 - 1])
        return toks + [7] * rng.randrange(bs)  # a partial tail is never hashed

    tree = tree_mod.BlockTree() if tree_mod.native_node_error is None else None
    flat: dict = {}
    remembered, hits = set(), 0  # ids of remembered records; blocks answered from them
    for _ in range(30):
        toks, extra = prompt(), rng.choice([None, "lora", b"\x00x"])
        want = block_hashes(NS, toks, bs, extra)
        for memo in ([tree.root] if tree else []) + [flat, None]:
            for form in (toks, tuple(toks), np.array(toks, dtype=np.int64)):
                got = block_hashes_memo(NS, form, bs, extra, memo)
                assert got[0] == want, (seed, type(form), type(memo))
                hits += sum(id(r) in remembered for r in got[1])
                assert [hashing.hash_input(r, bs) for r in got[1]] == [
                    (h0 + hashing._extra_bytes(extra)
                     + np.array(toks[i * bs:(i + 1) * bs], dtype="<i8").tobytes())
                    for i, h0 in enumerate([NS] + want[:-1])]
        # resuming at a block, even from the wrong walk position: a record holds
        # its parent hash, so a candidate there can only miss
        start = rng.randrange(len(want) + 1)
        parent = want[start - 1] if start else NS
        assert block_hashes_memo(parent, toks, bs, extra, tree.root if tree else flat,
                                 start=start)[0] == want[start:]
        # remember this prompt: in the tree (as commits do) and in the flat dict,
        # there also under a wrong key (a collision must only be a miss)
        hashes, records, keys = block_hashes_memo(NS, toks, bs, extra, None)
        if tree is not None:
            node = tree.root
            for h, x, k in zip(hashes, records, keys):
                node = node.child(h) or tree.add_child(node, h, x, k)
        for h, x, k in zip(hashes, records, keys):
            flat[k] = Entry(x, h)
            flat[rng.choice(keys) ^ 1] = Entry(x, h)
            remembered.add(id(x))
    assert hits > 30  # the shared stems were found again, in both kinds of memo


def test_a_failed_walk_leaves_the_working_buffer_usable(native):
    """chain_memo keeps its working memory between calls: a call that fails
    midway (a bad token in block 3) must hand it back, and later calls, short
    and long, hash exactly as block_hashes does."""
    good = tokens(4, 40 * BS)
    bad = good[:3 * BS] + [None] + good[3 * BS + 1:]
    with pytest.raises(TypeError, match="token 48 is a NoneType"):
        native.chain_memo(NS, bad, BS, b"", 0, 40, {})
    for n in (40, 2, 40, 400):
        toks = tokens(n, n * BS)
        assert block_hashes_memo(NS, toks, BS, None, {})[0] == block_hashes(NS, toks, BS)
