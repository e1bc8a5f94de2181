"""BlockPool: O(1) allocate / free of one tier's block ids; misuse raises, state unchanged.

Every test runs on the C pool (cuda/block_pool.c) and on PyBlockPool, the reference."""

from __future__ import annotations

import random

import pytest

from kvcached.core import pool as pool_mod
from kvcached.core.pool import PyBlockPool

IMPLS = [PyBlockPool] + ([pool_mod.BlockPool] if pool_mod.BlockPool is not PyBlockPool else [])


@pytest.fixture(params=IMPLS, ids=lambda c: c.__module__)
def BlockPool(request):  # noqa: N802 - the class under test
    return request.param


def test_allocate_takes_the_oldest_freed_ids_first(BlockPool):
    pool = BlockPool("gpu", 6)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (3, 3)
    pool.free([1, 0])
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.allocate_one() == 0
    assert pool.num_free == 0 and not pool.is_free(0)
    pool.free_one(2)
    assert pool.is_free(2) and pool.free_ids() == [2]


def test_asking_for_more_than_is_free_changes_nothing(BlockPool):
    pool = BlockPool("cpu", 3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cpu pool: asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.free_ids() == [2]
    pool.allocate_one()
    with pytest.raises(ValueError, match="cpu pool: asked for 1 block, 0 free"):
        pool.allocate_one()
    assert pool.num_free == 0


@pytest.mark.parametrize("ids", [[1, 1], [0, 5], [-1], [2, 9]])
def test_a_bad_free_raises_before_freeing_any_id(BlockPool, ids):
    """A double free or an id out of range means two owners of one block: it
    raises, and none of the batch is freed (the others are still owned)."""
    pool = BlockPool("gpu", 4)
    pool.allocate(3)
    before = pool.free_ids()
    with pytest.raises(ValueError, match="double free|out of range"):
        pool.free(ids)
    assert pool.free_ids() == before


@pytest.mark.parametrize("b", [3, 4, -1])
def test_free_one_checks_like_free(BlockPool, b):
    pool = BlockPool("gpu", 4)
    pool.allocate(3)  # 3 is still free
    with pytest.raises(ValueError, match="double free of block 3|out of range"):
        pool.free_one(b)
    assert pool.free_ids() == [3]


def test_front_undoes_an_allocate_exactly(BlockPool):
    pool = BlockPool("gpu", 5)
    pool.allocate(1)
    taken = pool.allocate(3)
    pool.free(taken, front=True)
    assert pool.free_ids() == [1, 2, 3, 4]
    assert pool.allocate(3) == taken


def test_the_c_pool_wraps_its_ring_like_the_reference():
    """Random allocate / free / front-undo sequences: both pools hand out the
    same ids in the same order (the C one keeps them in a ring that wraps)."""
    if len(IMPLS) < 2:
        pytest.skip("no native pool")
    rng = random.Random(11)
    ref, c = PyBlockPool("gpu", 37), pool_mod.BlockPool("gpu", 37)
    held: list[int] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(0, 6)
            if n <= ref.num_free:
                got = ref.allocate(n)
                assert c.allocate(n) == got, step
                held += got
        elif op < 0.6 and held:
            b = held.pop(rng.randrange(len(held)))
            ref.free_one(b)
            c.free_one(b)
        elif op < 0.75:
            got = ref.allocate(min(ref.num_free, rng.randint(0, 4)))
            assert c.allocate(len(got)) == got
            ref.free(got, front=True)
            c.free(got, front=True)
        elif held:
            rng.shuffle(held)
            k = rng.randint(0, len(held))
            batch, held = held[:k], held[k:]
            ref.free(batch)
            c.free(batch)
        assert c.free_ids() == ref.free_ids() and c.num_used == ref.num_used, step
    assert [c.is_free(b) for b in range(37)] == [ref.is_free(b) for b in range(37)]
