"""Step-by-step scenarios with exact block ids and eviction order.

Block size 4; ``toks(1, 2, 3, tail=1)`` is a 13-token prompt whose full blocks
are "1", "2", "3". The GPU free list hands out the oldest freed id first.
"""

from __future__ import annotations

import pytest
from conftest import toks
from helpers import FlakyTransfer, cpu_used, path_nodes, snapshot, tier_of

from kvcached import NoFreeBlocks, TransferFailed


def serve(mgr, rid, tokens, extra_key=None):
    """allocate, wait, compute everything, commit, free: one whole request."""
    a = mgr.allocate(rid, tokens, extra_key=extra_key)
    a.wait()
    mgr.commit(rid, tokens, len(tokens))
    mgr.free(rid)
    return a


def test_first_request_full_hit_and_partial_hit(make_manager):
    mgr = make_manager(num_gpu_blocks=8)
    prompt = toks(1, 2, 3, tail=1)

    # 1. A cold request gets fresh blocks and nothing cached.
    a = mgr.allocate("r1", prompt)
    assert a.block_ids == [0, 1, 2, 3] and a.num_cached_tokens == 0
    mgr.commit("r1", prompt, len(prompt))
    mgr.free("r1")  # blocks 0-2 stay cached; the private tail block 3 is freed
    assert mgr.snapshot().gpu_free == [4, 5, 6, 7, 3]

    # 2. The same prompt hits its three full blocks on GPU.
    a = mgr.allocate("r2", prompt)
    assert a.block_ids == [0, 1, 2, 4]
    assert a.num_cached_tokens == 12 and a.hit.gpu_tokens == 12 and a.hit.cpu_tokens == 0

    # 3. A prompt that diverges at block 3 reuses blocks 0-1 (shared with r2).
    a3 = mgr.allocate("r3", toks(1, 2, 7, tail=2))
    assert a3.block_ids == [0, 1, 5, 6] and a3.num_cached_tokens == 8
    assert [n.ref for n in path_nodes(mgr, prompt)] == [2, 2, 1]
    mgr.check_invariants()

    st = mgr.stats()
    assert st.hit_tokens["gpu"] == 20 and st.prompt_tokens == 13 + 13 + 14
    assert st.tiers["gpu"].used == 6 and st.tiers["gpu"].cached == 3


def test_last_token_is_always_computed(make_manager):
    mgr = make_manager()
    serve(mgr, "r1", toks(1, 2))
    # An 8-token prompt whose two blocks are cached still computes its last block.
    a = mgr.allocate("r2", toks(1, 2))
    assert a.num_cached_tokens == 4 and len(a.block_ids) == 2


def test_commit_deduplicates_a_block_cached_first_by_another_request(make_manager):
    mgr = make_manager()
    serve(mgr, "r1", toks(1, 2))  # caches blocks 0, 1
    a = mgr.allocate("r2", toks(1, 2))
    assert a.block_ids == [0, 2]  # block "2" is recomputed into block 2
    ids = mgr.commit("r2", toks(1, 2), 8)
    assert ids == [0, 1] and a.block_ids == [0, 1]  # the duplicate went back to the pool
    assert 2 in mgr.snapshot().gpu_free
    assert mgr.stats().dedup_blocks == 1
    mgr.check_invariants()


def test_concurrent_requests_share_blocks_then_both_free(make_manager):
    mgr = make_manager()
    a = mgr.allocate("a", toks(1, 2, tail=1))
    b = mgr.allocate("b", toks(1, 2, tail=1))
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]  # nothing cached yet
    mgr.commit("a", toks(1, 2, tail=1), 9)
    mgr.commit("b", toks(1, 2, tail=1), 9)
    assert b.block_ids == [0, 1, 5]  # b's copies of "1", "2" were duplicates
    mgr.free("a")
    mgr.check_invariants()
    mgr.free("b")
    mgr.check_invariants()
    assert sorted(mgr.snapshot().gpu_free) == [2, 3, 4, 5, 6, 7]


def test_eviction_without_cpu_tier_drops_lru_leaves_deepest_first(make_manager):
    mgr = make_manager(num_gpu_blocks=4)
    serve(mgr, "r1", toks(1, 2, 3))  # nodes "1"->0, "2"->1, "3"->2; free list [3]
    a = mgr.allocate("r2", toks(5, 6, tail=1))  # needs 3: evicts "3" then "2"
    assert a.block_ids == [3, 2, 1]
    assert tier_of(mgr, toks(1, 2, 3)) == [("GPU", 0, -1)]
    assert mgr.stats().evictions == {"gpu_dropped": 2}
    mgr.check_invariants()


def test_eviction_prefers_least_recently_used_conversation(make_manager):
    mgr = make_manager(num_gpu_blocks=6)
    serve(mgr, "old", toks(1, 2))  # blocks 0, 1
    serve(mgr, "new", toks(3, 4))  # blocks 2, 3
    serve(mgr, "old-again", toks(1, 2, tail=1))  # touches "1", "2": now most recent
    a = mgr.allocate("big", toks(7, 8, 9, tail=1))  # 4 blocks: free has 2, evicts "4", "3"
    assert sorted(a.block_ids) == [2, 3, 4, 5]
    assert tier_of(mgr, toks(3, 4)) == []
    assert [s for s, _, _ in tier_of(mgr, toks(1, 2))] == ["GPU", "GPU"]


def test_no_free_blocks_leaves_state_unchanged(make_manager):
    mgr = make_manager(num_gpu_blocks=4)
    serve(mgr, "r1", toks(1, 2, 3))
    mgr.allocate("r2", toks(5, 6, tail=1))  # holds 3 blocks; one cached node left
    before = snapshot(mgr)
    with pytest.raises(NoFreeBlocks) as e:
        mgr.allocate("r3", toks(1, 2, 3, tail=1))  # needs 3 more, matched "1" is pinned
    assert (e.value.needed, e.value.available) == (3, 0)
    assert snapshot(mgr) == before
    with pytest.raises(NoFreeBlocks):
        mgr.extend("r2", 8)
    assert snapshot(mgr) == before
    assert mgr.stats().no_free_blocks == 2
    mgr.check_invariants()


def test_eviction_with_cpu_tier_swaps_out_and_back_in(make_manager):
    mgr = make_manager(num_gpu_blocks=4, num_cpu_blocks=2)
    prompt = toks(1, 2, 3)
    serve(mgr, "r1", prompt)  # "1"->0, "2"->1, "3"->2
    a = mgr.allocate("r2", toks(5, 6, tail=1))  # evicts "3" then "2" to CPU 0, 1
    assert a.block_ids == [3, 2, 1]
    assert tier_of(mgr, prompt) == [("GPU", 0, -1), ("CPU", -1, 1), ("CPU", -1, 0)]
    swap_out = mgr.stats().transfers["swap_out"]
    assert swap_out["done"] == 1 and swap_out["blocks"] == 2
    mgr.commit("r2", toks(5, 6, tail=1), 9)  # "5"->3, "6"->2
    mgr.free("r2")  # free list [1]

    # "1" hits on GPU, "2" and "3" on CPU. The CPU tier is full and its blocks
    # are the ones being swapped in, so GPU eviction of "6", "5" must drop them.
    a = mgr.allocate("r3", prompt + [0])
    assert a.block_ids == [0, 1, 2, 3]
    assert a.hit.gpu_tokens == 4 and a.hit.cpu_tokens == 8 and a.num_cached_tokens == 12
    assert tier_of(mgr, toks(5, 6)) == []
    a.wait()
    assert tier_of(mgr, prompt) == [("GPU", 0, -1), ("GPU", 1, 1), ("GPU", 2, 0)]
    assert mgr.stats().evictions == {"gpu_to_cpu": 2, "gpu_dropped": 2}
    mgr.check_invariants()

    # GPU eviction of a node with a CPU backup is free: no copy, just a drop.
    mgr.free("r3")
    mgr.allocate("r4", toks(8, 9, 10, tail=1))  # evicts "3", "2" (backed up), "1"
    assert mgr.stats().evictions["gpu_to_cpu_backup"] == 2
    assert mgr.stats().transfers["swap_out"]["submitted"] == 2  # one more for "1"
    mgr.check_invariants()


def test_cpu_eviction_drops_least_recently_used_cpu_leaf(make_manager):
    mgr = make_manager(num_gpu_blocks=2, num_cpu_blocks=2)
    serve(mgr, "a", toks(1, tail=1))  # "1" on GPU
    serve(mgr, "b", toks(2, tail=1))  # evicts "1" to CPU
    serve(mgr, "c", toks(3, tail=1))  # evicts "2" to CPU
    serve(mgr, "d", toks(4, tail=1))  # evicts "3": CPU full, drops "1" (oldest)
    assert tier_of(mgr, toks(1)) == []
    assert [s for s, _, _ in tier_of(mgr, toks(2))] == ["CPU"]
    assert [s for s, _, _ in tier_of(mgr, toks(3))] == ["CPU"]
    assert mgr.stats().evictions["cpu_dropped"] == 1
    mgr.check_invariants()


def test_hit_across_gpu_and_cpu_moves_bytes(make_manager):
    """The swapped bytes come back to a different GPU block unchanged."""
    from kvcached.memory.kvshare import attach_kv_cache
    mgr = make_manager(num_gpu_blocks=4, num_cpu_blocks=4)
    planes = attach_kv_cache(mgr.run_dir, 0)
    prompt = toks(1, 2, 3)
    a = mgr.allocate("r1", prompt)
    for i, b in enumerate(a.block_ids):
        for p, plane in enumerate(planes):
            plane[b].fill_(100 * i + p + 1)
    mgr.commit("r1", prompt, 12)
    mgr.free("r1")
    serve(mgr, "r2", toks(5, 6, 7, tail=1))  # pushes r1's blocks to CPU
    a = mgr.allocate("r3", prompt + [0])
    a.wait()
    assert a.hit.cpu_tokens > 0
    for i in range(3):
        for p, plane in enumerate(planes):
            assert bool((plane[a.block_ids[i]] == 100 * i + p + 1).all()), (i, p)


def test_extend_appends_blocks_for_decode(make_manager):
    mgr = make_manager(num_gpu_blocks=4)
    a = mgr.allocate("r", toks(1, tail=1), reserve_tokens=2)  # 5 + 2 tokens: 2 blocks
    assert a.block_ids == [0, 1]
    assert mgr.extend("r", 2) == []  # 7 tokens still fit
    assert mgr.extend("r", 2) == [2]  # 9 tokens: a third block
    assert a.block_ids == [0, 1, 2]
    generated = toks(1, tail=1) + [5, 6, 7, 8]
    mgr.commit("r", generated, 9)  # generated tokens are cached too
    mgr.free("r")
    assert len(tier_of(mgr, generated)) == 2
    with pytest.raises(ValueError, match="extend"):
        mgr.allocate("s", toks(1, tail=1))
        mgr.commit("s", toks(1, 2, 3), 12)


def test_namespaces_and_extra_keys_never_share_blocks(make_manager, tmp_path):
    mgr = make_manager(num_gpu_blocks=16)
    serve(mgr, "lora-a", toks(1, 2, tail=1), extra_key="adapter-a")
    assert mgr.allocate("lora-b", toks(1, 2, tail=1), extra_key="adapter-b").num_cached_tokens == 0
    assert mgr.allocate("base", toks(1, 2, tail=1)).num_cached_tokens == 0
    assert mgr.allocate("lora-a2", toks(1, 2, tail=1),
                        extra_key="adapter-a").num_cached_tokens == 8
    other = make_manager(weight_version="1")
    assert other.snapshot().namespace != mgr.snapshot().namespace


def test_failed_swap_out_falls_back_to_dropping(make_manager):
    """A broken CPU tier costs hits, never the ability to serve."""
    mgr = make_manager(transfer=FlakyTransfer, num_gpu_blocks=4, num_cpu_blocks=4)
    serve(mgr, "r1", toks(1, 2, 3))
    mgr._transfer.fail_kinds = {"swap_out"}
    mgr._transfer.lost = True
    a = mgr.allocate("r2", toks(5, 6, tail=1))
    assert a.block_ids == [3, 2, 1]  # "3" and "2" were dropped after the failed copy
    assert tier_of(mgr, toks(1, 2, 3)) == [("GPU", 0, -1)]
    assert cpu_used(mgr) == 0  # the rolled-back CPU blocks came back
    st = mgr.stats()
    assert st.transfers["swap_out"]["failed"] == 1 and st.evictions == {"gpu_dropped": 2}
    mgr.check_invariants()


def test_unhealthy_transfer_switches_cpu_tier_off(make_manager):
    mgr = make_manager(transfer=FlakyTransfer, num_gpu_blocks=4, num_cpu_blocks=4)
    serve(mgr, "r1", toks(1, 2, 3))
    serve(mgr, "r2", toks(5, 6, tail=1))  # "2", "3" to CPU
    assert cpu_used(mgr) == 2
    mgr._transfer.is_healthy = False
    mgr.check_invariants()  # reaps: the CPU tier goes
    assert not mgr.cpu_enabled and cpu_used(mgr) == 0
    assert tier_of(mgr, toks(1, 2, 3)) == [("GPU", 0, -1)]
    serve(mgr, "r3", toks(8, 9, tail=1))  # evicts by dropping, no transfer
    mgr.check_invariants()


def test_failed_swap_in_keeps_blocks_on_cpu_and_shrinks_the_hit(make_manager):
    mgr = make_manager(transfer=FlakyTransfer, num_gpu_blocks=4, num_cpu_blocks=4)
    prompt = toks(1, 2, 3)
    serve(mgr, "r1", prompt)
    serve(mgr, "r2", toks(5, 6, tail=1))  # "2", "3" go to CPU
    mgr._transfer.fail_kinds = {"swap_in"}
    a = mgr.allocate("r3", prompt + [0])
    assert a.num_cached_tokens == 12
    with pytest.raises(TransferFailed):
        a.wait()
    assert a.num_cached_tokens == 4 and a.hit.cpu_tokens == 0
    assert [s for s, _, _ in tier_of(mgr, prompt)] == ["GPU", "CPU", "CPU"]
    mgr.check_invariants()
    # The engine recomputes blocks 1-2 into the blocks it got; commit adopts them.
    mgr.commit("r3", prompt + [0], 13)
    assert [s for s, _, _ in tier_of(mgr, prompt)] == ["GPU", "GPU", "GPU"]
    mgr.free("r3")
    mgr.check_invariants()
    assert mgr.stats().hit_tokens["cpu"] == 0


def test_commit_before_wait_is_refused(make_manager):
    mgr = make_manager(num_gpu_blocks=4, num_cpu_blocks=4)
    serve(mgr, "r1", toks(1, 2, 3))
    serve(mgr, "r2", toks(5, 6, tail=1))
    a = mgr.allocate("r3", toks(1, 2, 3, tail=1))
    mgr.stats()  # reaps: lands the (synchronous) swap-in; then pretend it is still running
    h = a._handles[0]
    result, h.result = h.result, None
    with pytest.raises(RuntimeError, match="wait"):
        mgr.commit("r3", toks(1, 2, 3, tail=1), 13)
    h.result = result


def test_request_errors(make_manager):
    mgr = make_manager()
    mgr.allocate("r", toks(1))
    with pytest.raises(ValueError, match="already allocated"):
        mgr.allocate("r", toks(1))
    with pytest.raises(KeyError, match="unknown request"):
        mgr.free("nope")
    with pytest.raises(KeyError):
        mgr.commit("nope", toks(1), 4)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        mgr.commit("r", toks(1), 5)
    with pytest.raises(ValueError):
        mgr.allocate("empty", [])
    with pytest.raises(ValueError):
        mgr.extend("r", -1)
    mgr.check_invariants()


def test_allocate_before_start_is_refused(tmp_path):
    from conftest import tiny_config

    from kvcached import CacheManager
    mgr = CacheManager(tiny_config(run_dir=str(tmp_path / "r")))
    with pytest.raises(RuntimeError, match="start"):
        mgr.allocate("r", toks(1))


@pytest.mark.parametrize("how", ["eviction", "sleep"])
def test_a_node_kept_for_storage_takes_the_cpu_copies_below_it_along(make_manager, tmp_path,
                                                                      how):
    """A GPU node without a backup that storage still holds stays, as STORAGE,
    when its GPU copy goes; its CPU-held children are unreachable from then on
    (a match stops at a STORAGE node), so their host blocks go too rather
    than sit under it."""
    mgr = make_manager(transfer=FlakyTransfer, num_gpu_blocks=4, num_cpu_blocks=4,
                       storage_backend="file", storage_url=str(tmp_path / "store"))
    serve(mgr, "r0", toks(1, 2))  # written through: both blocks in storage
    mgr.sleep(release_host_pool=True)
    mgr.wakeup()  # only storage holds them now
    assert tier_of(mgr, toks(1, 2)) == [("STORAGE", -1, -1)] * 2
    mgr.transfer.fail_kinds = {"load"}  # the load of "1" fails: r1 computes both blocks,
    a = mgr.allocate("r1", toks(1, 2))
    with pytest.raises(TransferFailed):
        a.wait()
    mgr.commit("r1", toks(1, 2), 8)  # and its commit adopts the nodes: on GPU, no backup
    mgr.free("r1")
    assert tier_of(mgr, toks(1, 2)) == [("GPU", 2, -1), ("GPU", 3, -1)]
    a = mgr.allocate("r2", toks(5, tail=5))  # needs 3: "2" is swapped out to a host block
    a.wait()
    assert tier_of(mgr, toks(1, 2)) == [("GPU", 2, -1), ("CPU", -1, 3)]
    mgr.free("r2")
    dropped = mgr.stats().evictions["cpu_dropped"]
    if how == "sleep":
        mgr.sleep()  # every GPU copy goes
    else:
        mgr.pause()  # evictions drop instead of swapping out
        mgr.allocate("r3", toks(7, 8, tail=5)).wait()  # needs all 4 GPU blocks
    assert tier_of(mgr, toks(1, 2)) == [("STORAGE", -1, -1)] * 2
    assert cpu_used(mgr) == 0 and mgr.stats().evictions["cpu_dropped"] == dropped + 1
    mgr.check_invariants()
