"""The hash memo (kvcached/native/core/hashing.h): a cached node remembers the
exact input its hash was computed from, and a prompt whose block has the same
input under the same parent node takes the node's hash instead of running
BLAKE2b. It must never change a hash: every test compares with the reference
(hashlib over the int64 bytes) and checks the memo was actually used."""

from __future__ import annotations

import random

import numpy as np
import pytest
from reference.hashing import block_hashes as reference_hashes

from kvcached.core import _core
from kvcached.core.hashing import namespace_hash

BS = 4
NS = namespace_hash("model", "1")
GPU = 0


def cache(c: _core.Core, tokens, ns: bytes = NS, extra: bytes = b"") -> list[bytes]:
    """Serve a prompt whose blocks are all computed; returns its hashes."""
    r = c.request(ns, tokens, extra)
    n_gpu, _, blocks = c.match(r, r.n_hashes)
    blocks += c.alloc(GPU, r.n_hashes - n_gpu)
    c.insert(r, blocks, r.n_hashes)
    c.tick()
    c.unref_path(r)
    return r.hashes()


def hashed(c: _core.Core, tokens, ns: bytes = NS, extra: bytes = b"") -> tuple[list, int, int]:
    """A new request's hashes, and how many blocks the memo / BLAKE2b supplied."""
    before = c.counters()
    hashes = c.request(ns, tokens, extra).hashes()
    after = c.counters()
    return (hashes, after["memo_hits"] - before["memo_hits"],
            after["blocks_hashed"] - before["blocks_hashed"])


def blocks(*values: int) -> list[int]:
    return [v for v in values for _ in range(BS)]


def test_a_cached_prompt_is_not_hashed_again():
    c = _core.Core(64, 0, BS)
    prompt = blocks(5, 6, 7) + [1]
    cache(c, prompt)
    got, memo, blake = hashed(c, prompt)
    assert got == reference_hashes(NS, prompt, BS) and (memo, blake) == (3, 0)
    got, memo, blake = hashed(c, blocks(5, 6, 8, 9))  # diverges at block 2
    assert got == reference_hashes(NS, blocks(5, 6, 8, 9), BS) and (memo, blake) == (2, 2)
    cache(c, blocks(5, 6, 8, 9))
    # block 1 branches now ("7" and "8" under it): block 2 is hashed, block 3 a link again
    got, memo, blake = hashed(c, blocks(5, 6, 8, 9))
    assert got == reference_hashes(NS, blocks(5, 6, 8, 9), BS) and (memo, blake) == (3, 1)


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_never_change_a_hash(seed):
    rng = random.Random(seed)
    c = _core.Core(4096, 0, BS)
    vocab = rng.choice([300, 70_000, 2**33])
    prefixes = [[rng.randrange(vocab) for _ in range(BS * rng.randrange(1, 6))] for _ in range(8)]
    memo_hits = 0
    for _ in range(120):
        tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        extra = rng.choice([b"", b"lora-1"])
        ns = rng.choice([NS, namespace_hash("model", "2")])
        got, memo, _ = hashed(c, tokens, ns, extra)
        assert got == reference_hashes(ns, tokens, BS, extra)
        memo_hits += memo
        cache(c, tokens, ns, extra)
    assert memo_hits > 100


@pytest.mark.parametrize("ids,width", [([1, 2, 3, 65535], 2), ([1, 2, 3, 65536], 4),
                                       ([0, 2**32 - 1, 5, 6], 4), ([-1, 2, 3, 4], 8),
                                       ([2**32, 2, 3, 4], 8), ([2**63 - 1, -(2**63), 0, 1], 8)])
def test_records_keep_the_narrowest_form_that_holds_every_id(ids, width):
    c = _core.Core(8, 0, BS)
    cache(c, ids + ids)  # block 0 under the root (its record carries the namespace), block 1
    records = {n[1]: n[14] for n in c.snapshot()["nodes"]}
    h0, h1 = reference_hashes(NS, ids + ids, BS)
    assert records[h0][-1] == records[h1][-1] == width
    assert len(records[h1]) == width * BS + 1 and len(records[h0]) == 16 + width * BS + 1
    assert hashed(c, ids + ids)[1:] == (2, 0)


def test_ids_equal_in_their_low_bits_do_not_match():
    """A uint16 record and a block whose ids differ above bit 16 are different
    records (the width is part of the record)."""
    c = _core.Core(8, 0, BS)
    cache(c, [1, 2, 3, 4] * 2)
    for other in ([1 + 65536, 2, 3, 4], [1, 2, 3, 4 + 2**32], [1, 2, 3, 4 - 2**63]):
        tokens = [1, 2, 3, 4] + other
        got, memo, blake = hashed(c, tokens)
        assert got == reference_hashes(NS, tokens, BS) and (memo, blake) == (1, 1)


def test_namespace_and_extra_key_never_hit_across():
    """A first block's record carries the namespace (the root is shared by
    every namespace); an extra key is part of every record."""
    c = _core.Core(16, 0, BS)
    prompt = blocks(1, 2)
    cache(c, prompt)
    other = namespace_hash("model", "2")
    got, memo, _ = hashed(c, prompt, ns=other)
    assert got == reference_hashes(other, prompt, BS) and memo == 0
    got, memo, _ = hashed(c, prompt, extra=b"lora")
    assert got == reference_hashes(NS, prompt, BS, b"lora") and memo == 0


@pytest.mark.parametrize("make", [list, tuple, lambda t: np.array(t, dtype=np.int64)])
def test_the_memo_serves_every_token_form(make):
    c = _core.Core(16, 0, BS)
    cache(c, blocks(3, 4, 5))
    got, memo, blake = hashed(c, make(blocks(3, 4, 5)))
    assert got == reference_hashes(NS, blocks(3, 4, 5), BS) and (memo, blake) == (3, 0)


def test_without_the_memo_nothing_is_remembered():
    c = _core.Core(16, 0, BS, memo=False)
    cache(c, blocks(3, 4))
    assert all(n[14] is None for n in c.snapshot()["nodes"])
    got, memo, blake = hashed(c, blocks(3, 4))
    assert got == reference_hashes(NS, blocks(3, 4), BS) and (memo, blake) == (0, 2)


def test_a_removed_node_leaves_the_memo():
    c = _core.Core(4, 0, BS)
    cache(c, blocks(1, 2))
    cache(c, blocks(7, 8))
    # the root branches: block 0 is hashed and looked up; block 1 is a chain link
    assert hashed(c, blocks(1, 2))[1:] == (1, 1)
    assert c.evict(2, False, 0) == (0, 2)  # drops the oldest leaf "2", then its parent "1"
    assert c.find(reference_hashes(NS, blocks(1, 2), BS)[0]) == -1
    got, memo, blake = hashed(c, blocks(1, 2))
    assert got == reference_hashes(NS, blocks(1, 2), BS) and (memo, blake) == (0, 2)


def test_manager_hash_memo_setting(make_manager):
    for memo in (True, False):
        mgr = make_manager(num_gpu_blocks=16, hash_memo=memo)
        for rid in range(3):
            a = mgr.allocate(rid, blocks(1, 2, 3) + [9])
            mgr.commit(rid, blocks(1, 2, 3) + [9], 13)
            mgr.free(rid)
        assert a.num_cached_tokens == 12
        counted = mgr.core.counters()
        assert (counted["memo_hits"] > 0) == memo
        mgr.check_invariants()  # rehashes every record
