"""The reference engine: cache reuse gives bitwise the logits of a full recompute.

Every case serves prompts that share prefixes through kvcached, checks
which tier the prefix came from, and compares tokens and logits with
``TinyTransformer.generate`` (no cache at all) using ``torch.equal``.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcached import CacheConfig
from kvcached.engine import DenseKV, Engine, ModelConfig, TinyTransformer

BS = 16
LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32",
              storage_backend=None)
MODEL = dict(d_model=64, ffn_dim=128, vocab_size=256)
WORKERS = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=2.0,
               engine_timeout_s=5.0, task_timeout_s=10.0, worker_start_timeout_s=60.0)


# ----------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _one_thread():
    """Per-token ops are tiny: one intra-op thread is several times faster on 2 cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def engines(tmp_path):
    """Start engines on small layouts; all are closed at teardown."""
    made: list[Engine] = []

    def make(transfer=None, **overrides) -> Engine:
        values = dict(LAYOUT, tp_size=2, num_gpu_blocks=32, num_cpu_blocks=64,
                      transfer_mode="inprocess", run_dir=str(tmp_path / f"run{len(made)}"))
        cfg = CacheConfig.load(**{**values, **overrides})
        eng = Engine.create(cfg, ModelConfig.for_cache(cfg, **MODEL), transfer=transfer)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(MODEL["vocab_size"]) for _ in range(n)]


def assert_same_as_recompute(eng: Engine, prompt: list[int], res) -> None:
    ref = eng.model.generate(prompt, len(res.tokens))
    assert res.tokens == ref.tokens
    assert torch.equal(res.logits, ref.logits), "cache reuse changed the logits"


def serve(eng: Engine, rid, prompt: list[int], max_new: int = 6):
    res = eng.generate(rid, prompt, max_new)
    assert_same_as_recompute(eng, prompt, res)
    eng.mgr.check_invariants()
    return res


def evict_everything(eng: Engine, rng: random.Random, rounds: int = 3) -> None:
    """Unrelated prompts that fill the GPU tier, pushing older blocks to CPU."""
    for i in range(rounds):
        eng.generate(f"filler{i}", words(rng, BS * 8 + 3), 4)


# ------------------------------------------------------------------- tests
def test_gpu_tier_prefix_gives_the_recompute_logits(engines):
    eng = engines()
    rng = random.Random(1)
    system = words(rng, 3 * BS + 5)
    chat_a = system + words(rng, 20)
    first = serve(eng, "a", chat_a)
    assert first.num_cached_tokens == 0 and first.computed_tokens == first.prompt_tokens
    other = serve(eng, "b", system + words(rng, 11))  # shares the system prompt only
    assert other.hit.gpu_tokens == 3 * BS
    assert other.computed_tokens == other.prompt_tokens - 3 * BS
    turn2 = serve(eng, "a2", chat_a + first.tokens + words(rng, 4))
    assert turn2.hit.gpu_tokens == len(chat_a) // BS * BS


def test_multi_turn_reuses_decoded_blocks(engines):
    eng = engines()
    rng = random.Random(2)
    prompt = words(rng, 2 * BS - 3)
    res = serve(eng, "t1", prompt, max_new=2 * BS)  # decode fills and commits blocks
    follow = prompt + res.tokens + words(rng, 7)
    again = serve(eng, "t2", follow)
    # Everything the first turn computed is cached: its prompt and all but the
    # last decoded token (sampled, never fed back), in whole blocks.
    assert again.hit.gpu_tokens == (len(prompt) + len(res.tokens) - 1) // BS * BS


def test_block_aligned_prompt_recomputes_last_block_and_dedups(engines):
    eng = engines()
    prompt = words(random.Random(3), 4 * BS)
    serve(eng, "x1", prompt)
    res = serve(eng, "x2", prompt)
    # One token is always left to compute: the last block is recomputed, and
    # commit maps it back onto the cached copy.
    assert res.num_cached_tokens == 3 * BS
    assert eng.mgr.stats().dedup_blocks >= 1


def test_cpu_tier_prefix_after_forced_eviction(engines):
    eng = engines(num_gpu_blocks=12, num_cpu_blocks=64)
    rng = random.Random(4)
    prompt = words(rng, 5 * BS + 2)
    serve(eng, "p1", prompt)
    evict_everything(eng, rng)
    ev = eng.mgr.stats().evictions
    assert ev.get("gpu_to_cpu", 0) + ev.get("gpu_to_cpu_backup", 0) >= 5
    res = serve(eng, "p2", prompt + words(rng, 9))
    assert res.hit.cpu_tokens > 0 and res.num_cached_tokens == 5 * BS
    assert eng.mgr.stats().transfers["swap_in"]["done"] >= 1


def test_tp2_worker_processes_swap_prefix_back_exactly(engines):
    eng = engines(num_gpu_blocks=12, num_cpu_blocks=64, **WORKERS)
    assert len(eng.mgr.stats().workers) == 2
    rng = random.Random(5)
    prompt = words(rng, 4 * BS + 7)
    first = serve(eng, "w1", prompt, max_new=BS)
    evict_everything(eng, rng)
    turn2 = prompt + first.tokens + words(rng, 5)
    res = serve(eng, "w2", turn2)
    assert res.hit.cpu_tokens > 0
    assert [w["state"] for w in eng.mgr.stats().workers] == ["ready", "ready"]


def test_create_cache_engine_attaches_to_kvcached_planes(engines):
    eng = engines(create_cache=True, tp_size=1, num_kv_heads=4)
    prompt = words(random.Random(6), 2 * BS + 1)
    serve(eng, "c1", prompt)
    assert serve(eng, "c2", prompt).hit.gpu_tokens == 2 * BS


def test_failed_swap_in_is_recomputed(engines, tmp_path):
    from helpers import FlakyTransfer
    eng = engines(transfer=FlakyTransfer, num_gpu_blocks=12)
    rng = random.Random(7)
    prompt = words(rng, 5 * BS)
    serve(eng, "f1", prompt)
    evict_everything(eng, rng)
    eng.mgr.transfer.fail_kinds.add("swap_in")
    res = serve(eng, "f2", prompt + [1, 2, 3])
    assert res.transfer_error and "injected" in res.transfer_error
    assert res.hit.cpu_tokens == 0 and res.computed_tokens == res.prompt_tokens - res.num_cached_tokens
    eng.mgr.transfer.fail_kinds.clear()
    assert serve(eng, "f3", prompt + [4]).num_cached_tokens == 5 * BS  # re-cached by f2


def test_each_rank_holds_its_head_group_in_the_block_table_order(engines):
    """Rank r's K/V planes hold KV heads [r*h, (r+1)*h) at (block, slot) of each position."""
    eng = engines()
    prompt = words(random.Random(8), 2 * BS + 3)
    a = eng.mgr.allocate("probe", prompt)
    table = list(a.block_ids)
    from kvcached.engine.runner import PagedKV
    kv = PagedKV(eng.planes, table, BS, eng.model.cfg, 0, capacity=len(prompt))
    eng.model.forward(prompt, 0, kv)
    eng.mgr.free("probe")
    ref = DenseKV(eng.model.cfg)
    eng.model.forward(prompt, 0, ref)
    h = eng.mgr.cfg.num_kv_heads
    for layer in range(eng.model.cfg.n_layers):
        for pos in range(len(prompt)):
            blk, slot = table[pos // BS], pos % BS
            for r, planes in enumerate(eng.planes):
                heads = slice(r * h, (r + 1) * h)
                assert torch.equal(planes[2 * layer][blk, :, slot], ref.k[layer, heads, pos])
                assert torch.equal(planes[2 * layer + 1][blk, :, slot], ref.v[layer, heads, pos])


def test_prefill_computes_only_uncached_positions(engines, monkeypatch):
    eng = engines()
    prompt = words(random.Random(9), 3 * BS + 4)
    serve(eng, "s1", prompt)
    positions: list[int] = []
    real = eng.model.step
    monkeypatch.setattr(eng.model, "step",
                        lambda tok, pos, kv, logits=True: positions.append(pos) or
                        real(tok, pos, kv, logits))
    eng.generate("s2", prompt, 3)
    assert positions == list(range(3 * BS, len(prompt) + 2))


def test_storage_tier_prefix_survives_a_restart(engines, tmp_path):
    store = tmp_path / "store"
    try:
        CacheConfig.load(**{**LAYOUT, "storage_backend": "file", "storage_url": str(store),
                            "model_id": "tiny-transformer"})
    except ValueError as e:
        pytest.skip(f"storage_backend='file' is not accepted: {e}")
    kw = dict(num_gpu_blocks=12, num_cpu_blocks=16, storage_backend="file",
              storage_url=str(store), model_id="tiny-transformer")
    rng = random.Random(10)
    prompt = words(rng, 4 * BS + 1)
    eng = engines(**kw)
    serve(eng, "s1", prompt)
    evict_everything(eng, rng)  # write-through: blocks reaching the CPU tier are stored
    eng.close()
    eng2 = engines(**kw)
    res = eng2.generate("s2", prompt, 6)
    assert res.hit.storage_tokens == 4 * BS, "a restarted manager should load the prefix"
    assert_same_as_recompute(eng2, prompt, res)


def test_mismatched_planes_are_refused(engines):
    eng = engines()
    with pytest.raises(ValueError, match="KV heads"):
        Engine(eng.mgr, TinyTransformer(ModelConfig(n_kv_heads=2, n_heads=4, n_layers=2,
                                                    head_dim=16)), eng.planes)
    with pytest.raises(ValueError, match="ranks"):
        Engine(eng.mgr, eng.model, eng.planes[:1])
