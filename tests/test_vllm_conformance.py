"""kvcached under real traffic inside vLLM (its CPU build): one ``generate`` of
16 prompts in four groups that share a 256-token head, served

- with a token budget that schedules a whole group in one step, then again
  after vLLM's prefix cache is reset (the CPU tier serves);
- by a fresh vLLM process on the same storage (every request of a group
  looks its blocks up while another loads the shared head);
- by a fresh process after a quarter of the stored objects were damaged;
- with every prompt chunked (a 256-token budget) and so few KV blocks (48)
  that vLLM queues and preempts;
- with Redis as storage, frozen (SIGSTOP) and then killed.

In every case vLLM's greedy outputs are token-identical to vLLM without a
connector (run with the same scheduling settings), and where the data is in
a tier at least 90% of each prompt's full blocks come cached. Each scenario
is one vLLM process (``tests/vllm_app.py``) shared by the tests that read it.
"""

from __future__ import annotations

import pytest
from conftest_storage import NO_REDIS_REASON, REDIS_SERVER, RedisServer
from test_vllm import BLOCK, generated, run_app

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")

HEAD = 256  # tokens of a group's shared head (8 blocks)
# 4 groups x 4 prompts, 400-688 tokens: [seed, length, head seed, head length]
GROUPS = [[100 * g + i, 400 + 80 * i + 16 * g, 10 + g, HEAD] for g in range(4) for i in range(4)]
NEW = [[500 + s, n, 20 + (s // 4), HEAD] for s, (_, n, _, _) in enumerate(GROUPS)]  # unseen
AFTER = [[900 + s, n] for s, (_, n, _, _) in enumerate(GROUPS)]
PROMPTS = {"g": GROUPS, "new": NEW, "after": AFTER}
# A 256-token budget chunks every prompt (400+ tokens); 48 blocks hold about
# three prompts, whose answers (40 tokens) outgrow them: vLLM preempts.
CHUNKED = {"max_num_batched_tokens": 256, "num_gpu_blocks_override": 48, "max_model_len": 1024,
           "max_tokens": 40, "log_stats": True}


def served_share(step: dict, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the share of its full blocks (one token is always computed)
    that came cached."""
    out = []
    for spec, cached in zip(prompts, step["cached"], strict=True):
        full = (spec[1] - 1) // BLOCK * BLOCK
        out.append(cached / full)
    return out


def kv_extra(run_dir, **kw) -> dict:
    return {"num_cpu_blocks": 1024, "run_dir": str(run_dir), **kw}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def plain(model) -> dict:
    """vLLM without a connector: every prompt set, in one process."""
    res = run_app({"model": model, "extra": None, "prompts": PROMPTS,
                   "steps": [["generate", "g"], ["generate", "new"], ["generate", "after"]]})
    return {s["step"][1]: s for s in generated(res)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def batched(model, store, tmp_path_factory) -> dict:
    """A cold pass (it fills the CPU tier and file storage), then the same
    prompts after vLLM's prefix cache is reset."""
    run = tmp_path_factory.mktemp("run-batched")
    extra = kv_extra(run, storage_backend="file", storage_url=str(store))
    return run_app({"model": model, "extra": extra, "prompts": PROMPTS,
                    "steps": [["generate", "g"], ["reset"], ["generate", "g"], ["status"]]})


def test_a_batch_sharing_prefixes_is_served_whole(batched, plain):
    cold, warm = generated(batched)
    assert cold["outputs"] == plain["g"]["outputs"]
    assert warm["outputs"] == plain["g"]["outputs"]
    assert min(served_share(warm, GROUPS)) >= 0.9, warm["cached"]
    status = batched["steps"][-1]["status"]["stats"]
    distinct = sum(n // BLOCK for _, n, _, _ in GROUPS) - 4 * 3 * (HEAD // BLOCK)
    assert status["tiers"]["cpu"]["used"] >= distinct  # every full prompt block, once


def test_a_fresh_process_gets_every_block_from_storage(batched, model, store, tmp_path):
    """All 16 requests look their blocks up at once; the three of a group
    that wait for the shared head another one loads take their own blocks
    after it, instead of losing them."""
    del batched  # it filled the store
    res = run_app({"model": model, "extra": kv_extra(tmp_path / "run", storage_backend="file",
                                                     storage_url=str(store)),
                   "prompts": PROMPTS, "steps": [["generate", "g"], ["status"]]})
    (step,) = generated(res)
    assert min(served_share(step, GROUPS)) >= 0.9, step["cached"]
    storage = res["steps"][-1]["status"]["stats"]["hit_tokens"]["storage"]
    assert storage >= 0.9 * sum((n - 1) // BLOCK * BLOCK for _, n, _, _ in GROUPS) - 3 * 4 * HEAD


def test_damaged_objects_are_recomputed_and_aborts_are_safe(batched, model, store, tmp_path,
                                                             plain):
    """A quarter of the stored objects damaged; before the pass, every request
    aborted while its lookups and loads are in flight (vLLM keeps the blocks
    a load writes until it lands)."""
    del batched
    res = run_app({"model": model, "extra": kv_extra(tmp_path / "run", storage_backend="file",
                                                     storage_url=str(store)),
                   "prompts": PROMPTS,
                   "steps": [["corrupt", str(store), 4], ["abort_after", "g", 3],
                             ["generate", "g"], ["status"]]})
    assert res["steps"][0]["corrupted"] >= 20  # a quarter of ~150 objects
    assert res["steps"][1]["aborted"] == len(GROUPS)
    (step,) = generated(res)
    assert step["outputs"] == plain["g"]["outputs"]
    assert 0 < sum(step["cached"]) < sum(n - 1 for _, n, _, _ in GROUPS)


@pytest.fixture(scope="module")
def chunked_plain(model) -> dict:
    res = run_app({"model": model, "extra": None, "prompts": PROMPTS, **CHUNKED,
                   "steps": [["generate", "g"]]})
    return generated(res)[0]


def test_chunked_prefill_and_preemption(model, chunked_plain, tmp_path):
    """Every prompt chunked, and few enough blocks that vLLM queues and
    preempts (a preempted request's blocks freed while saves of them may be in
    flight)."""
    res = run_app({"model": model, "extra": kv_extra(tmp_path / "run"), "prompts": PROMPTS,
                   **CHUNKED, "steps": [["generate", "g"], ["preemptions"], ["reset"],
                                        ["generate", "g"], ["preemptions"]]})
    cold, warm = generated(res)
    assert res["steps"][1]["preemptions"] > 0, "the scenario needs vLLM to preempt"
    assert cold["outputs"] == chunked_plain["outputs"]
    assert warm["outputs"] == chunked_plain["outputs"]
    assert min(served_share(warm, GROUPS)) >= 0.9, warm["cached"]


@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)
def test_redis_frozen_then_killed(model, plain, tmp_path):
    """Storage on Redis: while the server is frozen (SIGSTOP) new prompts are
    served at about plain vLLM's speed (a lookup not answered within
    storage_lookup_timeout_s is a miss; storage has a lane of its own in the
    workers); thawed, then killed, outputs stay identical."""
    redis = RedisServer(tmp_path).start()
    try:
        extra = kv_extra(tmp_path / "run", storage_backend="redis", storage_url=redis.url)
        res = run_app({"model": model, "extra": extra, "prompts": PROMPTS,
                       "steps": [["generate", "g"], ["signal", redis.proc.pid, "SIGSTOP"],
                                 ["generate", "new"], ["signal", redis.proc.pid, "SIGCONT"],
                                 ["signal", redis.proc.pid, "SIGKILL"], ["reset"],
                                 ["generate", "after"], ["status"]]})
    finally:
        redis.stop()
    steps = {s["step"][1]: s for s in generated(res)}
    for name in ("g", "new", "after"):
        assert steps[name]["outputs"] == plain[name]["outputs"], name
    frozen, base = steps["new"]["seconds"], plain["new"]["seconds"]
    # The design target is 1.5x (bench); a stalled scheduler took 4x and more.
    assert frozen <= 1.5 * base + 1.0, (frozen, base)
    storage = res["steps"][-1]["status"]["stats"]["storage"]
    assert storage.get("lookup_timed_out", 0) + storage.get("lookup_failed", 0) >= 1, storage


def distinct_blocks(prompts: list[list[int]]) -> int:
    """Full prompt blocks of a set, each shared head counted once."""
    heads = {(spec[2], spec[3]) for spec in prompts if len(spec) == 4}
    shared = sum(len(prompts) // len(heads) - 1 for _ in heads) * HEAD // BLOCK if heads else 0
    return sum(spec[1] // BLOCK for spec in prompts) - shared


@pytest.mark.parametrize("backend", ["file", pytest.param("redis", marks=pytest.mark.skipif(
    REDIS_SERVER is None, reason=NO_REDIS_REASON))])
def test_two_live_instances_share_storage(model, plain, tmp_path, backend):
    """Two vLLM instances alive at once on one storage: B serves what A
    computed, then A serves what B computed, each prompt >= 90% from storage."""
    import concurrent.futures
    redis = RedisServer(tmp_path).start() if backend == "redis" else None
    url = redis.url if redis else str(tmp_path / "store")
    a_done, b_done = str(tmp_path / "a-stored"), str(tmp_path / "b-stored")
    need = distinct_blocks(GROUPS)

    def spec(name: str, steps: list) -> dict:
        extra = kv_extra(tmp_path / name, storage_backend=backend, storage_url=url)
        return {"model": model, "extra": extra, "prompts": PROMPTS, "steps": steps}
    a = spec("a", [["generate", "g"], ["wait_stored", need], ["touch", a_done],
                   ["wait_file", b_done], ["generate", "new"]])
    b = spec("b", [["wait_file", a_done], ["generate", "g"], ["generate", "new"],
                   ["wait_stored", distinct_blocks(NEW)], ["touch", b_done]])
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ra, rb = pool.map(run_app, [a, b])
    finally:
        if redis:
            redis.stop()
    a_steps = {s["step"][1]: s for s in generated(ra)}
    b_steps = {s["step"][1]: s for s in generated(rb)}
    for name in ("g", "new"):
        assert a_steps[name]["outputs"] == b_steps[name]["outputs"] == plain[name]["outputs"]
    assert min(served_share(b_steps["g"], GROUPS)) >= 0.9, b_steps["g"]["cached"]
    assert min(served_share(a_steps["new"], NEW)) >= 0.9, a_steps["new"]["cached"]


def test_producer_prefills_consumer_generates(model, plain, tmp_path):
    """Disaggregated prefill: a kv_producer instance prefills (one token each)
    and saves, never loads; a kv_consumer instance then generates, loading
    >= 90% of every prompt's blocks and saving nothing."""
    url = str(tmp_path / "store")
    prod = run_app({"model": model, "role": "kv_producer", "max_tokens": 1,
                    "extra": kv_extra(tmp_path / "p", storage_backend="file", storage_url=url),
                    "prompts": PROMPTS, "steps": [["generate", "g"], ["reset"], ["generate", "g"],
                                                  ["wait_stored", distinct_blocks(GROUPS)]]})
    again = generated(prod)[1]
    assert again["cached"] == [0] * len(GROUPS)  # a producer never loads
    cons = run_app({"model": model, "role": "kv_consumer",
                    "extra": kv_extra(tmp_path / "c", storage_backend="file", storage_url=url),
                    "prompts": PROMPTS, "steps": [["generate", "g"], ["status"]]})
    (step,) = generated(cons)
    assert step["outputs"] == plain["g"]["outputs"]
    assert min(served_share(step, GROUPS)) >= 0.9, step["cached"]
    transfers = cons["steps"][-1]["status"]["stats"]["transfers"]
    assert transfers.get("swap_out", {}).get("submitted", 0) == 0  # a consumer never saves
