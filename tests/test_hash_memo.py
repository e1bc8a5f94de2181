"""The hash memo: hashing a prompt takes the hash of blocks the tree already holds.

``block_hashes_memo`` must return exactly ``block_hashes``'s hashes whatever
the memo holds: the right nodes, nodes of other inputs under a colliding key,
malformed entries, nothing. The manager keeps the memo to the nodes in its
tree, lazily (``check_invariants`` verifies every entry hashes to its node's hash).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import kvcached.hashing as hashing
from kvcached.hashing import block_hashes, block_hashes_memo, namespace_hash
from kvcached.tree import MEMO_SLACK

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


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


def test_without_memo_entries_it_is_block_hashes(native):
    toks = tokens(1, 10 * BS + 3)
    hashes, inputs, keys = block_hashes_memo(NS, toks, BS, "lora", {})
    assert hashes == block_hashes(NS, toks, BS, "lora")
    # each input is what its hash was computed from: parent hash, extra, tokens
    parent = NS
    for i, (h, block_input) in enumerate(zip(hashes, inputs)):
        raw = np.array(toks[i * BS:(i + 1) * BS], dtype="<i8").tobytes()
        assert block_input == parent + b"lora" + raw
        parent = h
    assert keys == [native.memo_key(x) for x in inputs]


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


def test_manager_memo_follows_the_tree_lazily(native, make_manager):
    """Nodes are remembered when created; removal only marks them; a prune drops
    the marked ones. Every entry stays true throughout (check_invariants)."""
    with make_manager(num_gpu_blocks=16, block_size=BS) as mgr:
        tree = mgr.tree
        a = tokens(8, 6 * BS)
        serve(mgr, "a", a)
        a_nodes = list(tree.memo.values())
        assert len(a_nodes) == 6 == tree.num_nodes and all(n.mkey is not None for n in a_nodes)
        mgr.check_invariants()
        assert mgr.allocate("a2", a + [1]).hit.gpu_tokens == 6 * BS
        mgr.free("a2")

        serve(mgr, "b", tokens(9, 16 * BS))  # needs every GPU block: all of a's go
        assert all(n.mkey is None for n in a_nodes)  # removed: marked, not yet dropped
        assert len(tree.memo) == 6 + 16 and tree.num_nodes == 16
        mgr.check_invariants()
        # a removed node's entry still answers, with its own bytes
        hashes, inputs, _ = block_hashes_memo(mgr._ns, a, BS, None, tree.memo)
        assert hashes == block_hashes(mgr._ns, a, BS)
        assert all(x is n.input for x, n in zip(inputs, a_nodes))

        tree.memo_cap = len(tree.memo)  # the next remembered node prunes
        serve(mgr, "c", tokens(10, BS + 1))  # evicts 2 of b's blocks, adds 1 node
        assert tree.num_nodes == 15
        assert set(tree.memo.values()) == set(tree.walk())  # only live nodes are left
        assert tree.memo_cap == 2 * 15 + MEMO_SLACK
        mgr.check_invariants()


def test_manager_on_the_python_path_still_caches(monkeypatch, make_manager):
    monkeypatch.setattr(hashing, "_native", None)
    with make_manager(num_gpu_blocks=16, block_size=BS) as mgr:
        a = tokens(10, 4 * BS + 1)
        mgr.allocate("a", a)
        mgr.commit("a", a, len(a))
        mgr.free("a")
        assert mgr.allocate("b", a).hit.gpu_tokens == 4 * BS
        assert mgr.tree.memo == {}
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
            assert (len(mgr.tree.memo) > 0) is memo_on
            assert all((n.input is not None) is memo_on for n in mgr.tree.walk())
        seen.append(out)
    assert seen[0] == seen[1]
    assert any(gpu_hit for gpu_hit, _ in seen[0][:-1])  # the workload does hit
