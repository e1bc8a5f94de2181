"""BlockPool: O(1) allocate / free of one tier's block ids; misuse raises, state unchanged."""

from __future__ import annotations

import pytest

from kvcached.pool import BlockPool


def test_allocate_takes_the_oldest_freed_ids_first():
    pool = BlockPool("gpu", 6)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (3, 3)
    pool.free([1, 0])
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.allocate_one() == 0
    assert pool.num_free == 0 and not pool.is_free(0)
    pool.free_one(2)
    assert pool.is_free(2) and pool.free_ids() == [2]


def test_asking_for_more_than_is_free_changes_nothing():
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
def test_a_bad_free_raises_before_freeing_any_id(ids):
    """A double free or an id out of range means two owners of one block: it
    raises, and none of the batch is freed (the others are still owned)."""
    pool = BlockPool("gpu", 4)
    pool.allocate(3)
    before = pool.free_ids()
    with pytest.raises(ValueError, match="double free|out of range"):
        pool.free(ids)
    assert pool.free_ids() == before


@pytest.mark.parametrize("b", [3, 4, -1])
def test_free_one_checks_like_free(b):
    pool = BlockPool("gpu", 4)
    pool.allocate(3)  # 3 is still free
    with pytest.raises(ValueError, match="double free of block 3|out of range"):
        pool.free_one(b)
    assert pool.free_ids() == [3]


def test_front_undoes_an_allocate_exactly():
    pool = BlockPool("gpu", 5)
    pool.allocate(1)
    taken = pool.allocate(3)
    pool.free(taken, front=True)
    assert pool.free_ids() == [1, 2, 3, 4]
    assert pool.allocate(3) == taken
