"""Model families beyond plain attention, inside a real vLLM (its CPU build),
with vLLM's hybrid KV cache manager on (kvcached declares ``SupportsHMA``):

- Gemma 3 (three sliding-window layers of 64 tokens, one full-attention
  layer: four KV cache groups overlaid on the same pages). After vLLM's
  prefix cache is reset the CPU tier serves every full block vLLM's own
  cache hit, and so does storage in a second instance alive beside the
  first (a fleet of two on one store; the second a kv_consumer: it loads,
  never saves); outputs are identical to vLLM without a connector.
- Gemma 3 with every prompt chunked and so few blocks that vLLM preempts:
  outputs stay identical, the CPU tier serves.
- Qwen3-Next (three gated delta-net layers and a full-attention one: Mamba
  groups whose blocks are recurrent states, kept by vLLM where a chunk of
  the prompt ended). The CPU tier and storage serve every hit vLLM's own
  cache serves, by restoring the state the hit ends at; a new process
  started after the first ended (a restart; a consumer of what that
  producer stored; its memory never held those states) gets outputs
  identical to vLLM's.
- DeepSeek-V2 (MLA: one 576-wide latent per token and layer). vLLM's CPU
  MLA backend cannot prefill on top of a cached prefix (vLLM turns its own
  prefix caching off for it), so kvcached saves its KV and serves no hit
  there: outputs stay identical.

One vLLM process per run (``tests/vllm_app.py``), each made model shared by
its module's runs.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from vllm_runs import BLOCK, SINGLE, by_set, generated, run_app, status_of

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")

PROMPTS = {"p": SINGLE}
MAX_TOKENS = 8  # vllm_app's default


def full_blocks(block: int) -> int:
    """Tokens of the prompts' full blocks that a cache may serve (one token is
    always computed)."""
    return sum((n - 1) // block * block for _, n in SINGLE)


def computed_blocks(block: int) -> int:
    """Full blocks the requests computed: prompt and output, but the last token."""
    return sum((n + MAX_TOKENS - 1) // block for _, n in SINGLE)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> dict:
    """vLLM without a connector (its own prefix cache hits on the second pass);
    kvcached (a cold pass, vLLM's cache reset, a pass the CPU tier serves) and,
    alive at the same time on the same storage, a second instance that
    generates once the first stored every block and before it ends (a fleet;
    it started beside the first, paying its start-up meanwhile)."""
    base = tmp_path_factory.mktemp("gemma3")
    spec = {"model": str(base / "model"), "model_shape": [4, 128, "gemma3"],
            "prompts": PROMPTS}
    plain = run_app({**spec, "extra": None,
                     "steps": [["generate", "p"], ["generate", "p"]]})
    # a fresh process's first lookup on a loaded 2-core machine can take
    # longer than the default 0.1 s (then a miss); the test asserts the hit
    extra = {"num_cpu_blocks": 512, "storage_backend": "file", "storage_url": str(base / "kv"),
             "storage_lookup_timeout_s": 10.0}
    stored, done = str(base / "first-stored"), str(base / "second-done")
    first = {**spec, "extra": {**extra, "run_dir": str(base / "run1")},
             "steps": [["generate", "p"], ["reset"], ["generate", "p"],
                       ["wait_stored", 4 * computed_blocks(BLOCK)], ["status"],
                       ["touch", stored], ["wait_file", done]]}
    # the second is a kv_consumer: it loads and never saves
    second = {**spec, "extra": {**extra, "run_dir": str(base / "run2")}, "role": "kv_consumer",
              "steps": [["wait_file", stored], ["generate", "p"], ["status"], ["touch", done]]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.map(run_app, [first, second])
    return {"plain": plain, "first": first, "second": second, "model": spec["model"]}


def test_gemma3_cpu_tier_and_a_live_fleet_serve_what_vllm_hits(gemma3):
    """The CPU tier serves the first instance; the second, alive beside it
    (the first waits for its signal before it ends), is served from storage
    what the first computed."""
    plain = generated(gemma3["plain"])
    baseline, own_hit = plain[0]["outputs"], sum(plain[-1]["cached"])
    assert own_hit == full_blocks(BLOCK)  # vLLM's hybrid manager hits every full block
    assert len({tuple(o) for o in baseline}) == len(baseline)  # outputs tell prompts apart
    cold, warm = generated(gemma3["first"])
    fleet = generated(gemma3["second"])[0]
    for run in (cold, warm, fleet):
        assert run["outputs"] == baseline
    assert sum(warm["cached"]) >= 0.9 * own_hit, warm["cached"]
    assert sum(fleet["cached"]) >= 0.9 * own_hit, fleet["cached"]
    hits = status_of(gemma3["first"])["stats"]["hit_tokens"]
    assert hits["cpu"] == sum(warm["cached"])
    consumer = status_of(gemma3["second"])["stats"]
    assert consumer["hit_tokens"]["storage"] == sum(fleet["cached"])
    assert consumer["storage"].get("stored", 0) == 0 and consumer["tiers"]["cpu"]["used"] > 0


def test_gemma3_caches_every_group_apart(gemma3):
    """Four groups, one block of each per (vLLM hash, group): the CPU tier holds
    four blocks for each full block the requests computed (prompt and output
    but the last token), storage as many objects."""
    status = status_of(gemma3["first"])
    per_group = computed_blocks(BLOCK)
    assert status["stats"]["tiers"]["cpu"]["used"] == 4 * per_group
    assert status["stats"]["storage"]["stored"] == 4 * per_group


def test_gemma3_storage_hit_reads_only_the_windows(gemma3):
    """A sliding-window group's blocks are cached one by one: a storage hit
    reads every block of the full-attention group but only each window
    group's last window (64 tokens: two blocks here), not its whole prompt."""
    loads = status_of(gemma3["second"])["stats"]["transfers"]["load"]["blocks"]
    full, windows = 0, 0
    for _, n in SINGLE:
        stop = (n - 1) // BLOCK
        full += stop
        windows += stop - max(0, stop * BLOCK - 64 + 1) // BLOCK
    assert loads == full + 3 * windows, (loads, full, windows)  # three window groups


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("deepseek")
    spec = {"model": str(base / "model"), "model_shape": [2, 128, "deepseek_v2"],
            "dtype": "bfloat16", "prompts": PROMPTS}
    plain = run_app({**spec, "extra": None, "steps": [["generate", "p"], ["generate", "p"]]})
    extra = {"num_cpu_blocks": 512, "run_dir": str(base / "run")}
    served = run_app({**spec, "extra": extra,
                      "steps": [["generate", "p"], ["reset"], ["generate", "p"], ["status"]]})
    return {"plain": plain, "served": served}


def test_deepseek_mla_is_saved_and_outputs_stay_identical(deepseek):
    plain = by_set(deepseek["plain"])["p"]
    assert sum(plain["cached"]) == 0  # vLLM's own prefix cache is off for CPU MLA
    for run in generated(deepseek["served"]):
        assert run["outputs"] == plain["outputs"]
        assert sum(run["cached"]) == 0  # no hit where vLLM cannot use one
    mla_block = 16  # vLLM's CPU MLA backend's
    cpu = status_of(deepseek["served"])["stats"]["tiers"]["cpu"]
    assert cpu["used"] == computed_blocks(mla_block)  # one latent block each


# Two groups of four prompts sharing a 256-token head; a 256-token budget
# chunks every prompt, and 72 blocks (every token block takes one per group,
# a window's fewer) make vLLM queue and preempt: the window's blocks vLLM
# drops mid-request are the ones a save must still read.
CHUNKED_PROMPTS = {"g": [[100 * g + i, 400 + 80 * i + 16 * g, 10 + g, 256]
                         for g in range(2) for i in range(4)]}
CHUNKED = {"max_num_batched_tokens": 256, "num_gpu_blocks_override": 72, "max_model_len": 1024,
           "log_stats": True}


def test_gemma3_chunked_and_preempted_outputs_stay_identical(gemma3, tmp_path):
    spec = {"model": gemma3["model"], "model_shape": [4, 128, "gemma3"],
            "prompts": CHUNKED_PROMPTS, **CHUNKED}
    plain = run_app({**spec, "extra": None, "steps": [["generate", "g"]]})
    served = run_app({**spec, "extra": {"num_cpu_blocks": 1024, "run_dir": str(tmp_path / "run")},
                      "steps": [["generate", "g"], ["reset"], ["generate", "g"],
                                ["preemptions"], ["status"]]})
    baseline = generated(plain)[0]["outputs"]
    cold, warm = generated(served)
    assert cold["outputs"] == baseline and warm["outputs"] == baseline
    assert next(s["preemptions"] for s in served["steps"] if s["step"] == ["preemptions"]) > 0
    assert status_of(served)["stats"]["hit_tokens"]["cpu"] >= 0.5 * sum(
        n - 1 for _, n, *_ in CHUNKED_PROMPTS["g"])


# Qwen3-Next: vLLM aligns the attention block (544 tokens here) so that its
# page holds one gated delta-net state. The prompts end a few tokens past a
# block: a state restored wrong changes the next tokens (over a long suffix
# the random model's decay would hide it).
QWEN_BLOCK = 544
QWEN_PROMPTS = {"p": [[1, 1633], [2, 1090], [3, 1092]]}


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> dict:
    """vLLM without a connector; kvcached with every prompt chunked (a cold
    pass, vLLM's cache reset, a pass the CPU tier serves); a new process on
    the same storage (a kv_consumer, prompts whole)."""
    base = tmp_path_factory.mktemp("qwen3_next")
    spec = {"model": str(base / "model"), "model_shape": [4, 128, "qwen3_next"],
            "dtype": "bfloat16", "mamba_cache_mode": "align", "prompts": QWEN_PROMPTS}
    plain = run_app({**spec, "extra": None,
                     "steps": [["generate", "p"], ["generate", "p"]]})
    extra = {"num_cpu_blocks": 64, "storage_backend": "file", "storage_url": str(base / "kv")}
    first = run_app({**spec, "extra": {**extra, "run_dir": str(base / "run1")},
                     "max_num_batched_tokens": 600,
                     "steps": [["generate", "p"], ["reset"], ["generate", "p"], ["status"]]})
    second = run_app({**spec, "extra": {**extra, "run_dir": str(base / "run2")},
                      "role": "kv_consumer",
                      "steps": [["generate", "p"], ["status"]]})
    # every object damaged: each load fails, vLLM computes the request again
    third = run_app({**spec, "extra": {**extra, "run_dir": str(base / "run3")},
                     "role": "kv_consumer",
                     "steps": [["corrupt", str(base / "kv"), 1], ["generate", "p"], ["status"]]})
    return {"plain": plain, "first": first, "second": second, "third": third}


def test_qwen3_next_states_restore_every_hit_vllm_serves(qwen3_next):
    cold_plain, hit_plain = generated(qwen3_next["plain"])
    own_hit = sum(hit_plain["cached"])
    assert own_hit == sum((n - 1) // QWEN_BLOCK * QWEN_BLOCK for _, n, *_ in QWEN_PROMPTS["p"])
    assert hit_plain["outputs"] == cold_plain["outputs"]
    cold, warm = generated(qwen3_next["first"])
    restarted = generated(qwen3_next["second"])[0]
    for run in (cold, warm, restarted):
        assert run["outputs"] == cold_plain["outputs"]
    assert sum(warm["cached"]) >= 0.9 * own_hit, warm["cached"]
    assert sum(restarted["cached"]) >= 0.9 * own_hit, restarted["cached"]
    assert status_of(qwen3_next["first"])["stats"]["hit_tokens"]["cpu"] == sum(warm["cached"])


def test_qwen3_next_storage_hit_reads_one_state_per_group(qwen3_next):
    """A hit of s blocks reads s blocks of the full-attention group and, of
    each of the three gated delta-net groups, the state after block s only."""
    stats = status_of(qwen3_next["second"])["stats"]
    hits = [n // QWEN_BLOCK for run in generated(qwen3_next["second"]) for n in run["cached"]]
    assert stats["hit_tokens"]["storage"] == QWEN_BLOCK * sum(hits)
    assert stats["transfers"]["load"]["blocks"] == sum(hits) + 3 * len(hits)


def test_qwen3_next_failed_loads_are_computed_again(qwen3_next):
    """vLLM stops on failed block ids of a model of several KV cache groups
    (a block id is one group's): kvcached fails such a request whole
    (``failed_recving``) and vLLM computes it again, outputs identical."""
    assert qwen3_next["third"]["steps"][0]["corrupted"] > 0
    damaged = generated(qwen3_next["third"])[0]
    assert damaged["outputs"] == generated(qwen3_next["plain"])[0]["outputs"]
    assert damaged["cached"] == [0] * len(QWEN_PROMPTS["p"])
    # the hits were found and loaded, every load failed: no hit is counted
    stats = status_of(qwen3_next["third"])["stats"]
    assert stats["transfers"].get("load", {}).get("submitted", 0) > 0, stats["transfers"]
    assert stats["hit_tokens"]["storage"] == 0, stats["hit_tokens"]
