"""The benchmark's FastDeploy baseline (scripts/_fastdeploy_baseline.py).

It runs FastDeploy's own manager (shared/reference, executed, not copied) on
kvcached's chat workload, so the manager's speed target ("an order of
magnitude cheaper") is a ratio measured in one process. These tests check the harness drives it
faithfully: on the same requests both managers must serve the same hits per
tier, which also cross-checks kvcached's LRU against an independent
implementation (skipped where the reference file is not present). And
bench_manager's handling of what a user can get wrong around it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvcached.tools.workload import generate_chat_workload, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import _fastdeploy_baseline as fastdeploy  # noqa: E402

needs_reference = pytest.mark.skipif(not fastdeploy.REFERENCE.is_file(),
                                     reason=f"{fastdeploy.REFERENCE} not present")

BS = 16
CHAT = dict(num_system_prompts=2, system_tokens=96, turn_tokens=(16, 64),
            output_tokens=(8, 40), max_turns=6, concurrent_conversations=4)


def both(gpu: int, cpu: int, make_manager) -> tuple[dict, dict, dict]:
    reqs = generate_chat_workload(150, seed=3, **CHAT)
    with make_manager(num_gpu_blocks=gpu, num_cpu_blocks=cpu, block_size=BS,
                      eviction_policy="lru") as mgr:  # FastDeploy's policy
        ours = replay(mgr, reqs)
        evictions = mgr.stats().evictions
    theirs = fastdeploy.replay(fastdeploy.make(fastdeploy.load(), gpu, cpu), reqs, BS)
    assert ours["served"] == theirs["served"] == 150
    assert len(theirs["allocate_us"]) == 150 and theirs["cpu_s"] > 0
    return ours["hit_tokens"], theirs["hit_tokens"], evictions


@needs_reference
def test_gpu_only_fastdeploy_serves_exactly_kvcached_s_hits(make_manager):
    ours, theirs, evictions = both(96, 0, make_manager)
    assert evictions["gpu_dropped"] > 300  # under pressure: the LRU order decides the hits
    assert ours["gpu"] == theirs["gpu"] > 0


@needs_reference
def test_with_a_cpu_tier_fastdeploy_serves_as_many_hits(make_manager):
    """Both tiers serve hits and the totals agree; the GPU/CPU split differs by
    a few blocks (FastDeploy makes room for a request's CPU hits and for its
    other blocks in two separate evictions)."""
    ours, theirs, evictions = both(48, 128, make_manager)
    assert evictions["gpu_to_cpu"] > 300 and evictions["cpu_dropped"] > 100
    assert ours["gpu"] + ours["cpu"] == theirs["gpu"] + theirs["cpu"]
    assert ours["cpu"] > 0 and theirs["cpu"] > 0
    assert abs(ours["gpu"] - theirs["gpu"]) <= 0.05 * ours["gpu"]


def test_a_missing_reference_is_reported():
    with pytest.raises(FileNotFoundError):
        fastdeploy.load(Path("/nonexistent/prefix_cache_manager.py"))


def test_a_failing_baseline_leaves_kvcached_s_numbers(tmp_path, capsys):
    """Another FastDeploy version the harness cannot drive: the benchmark says
    so and carries on with kvcached's replays alone."""
    import bench_manager
    broken = tmp_path / "prefix_cache_manager.py"
    broken.write_text("raise RuntimeError('not the FastDeploy this harness knows')\n")
    scenarios = {"chat": (512, 1024), "chat_gpu_resident": (2048, 0)}
    ours, theirs = bench_manager.chat_rounds(tmp_path, scenarios, 40, 2, 0, broken)
    assert [len(r) for r in ours.values()] == [2, 2]
    assert all(r["served"] == 40 and r["us_per_block"] > 0 for rs in ours.values() for r in rs)
    assert theirs == {"chat": [], "chat_gpu_resident": []}
    assert "FastDeploy baseline failed, going on without it: RuntimeError" in capsys.readouterr().err
    speed = bench_manager.speed_vs_fastdeploy(ours, theirs)
    assert "times_cheaper_than_fastdeploy" not in speed and speed["times_cheaper_than_quoted"]


def test_a_gpu_tier_too_small_for_any_prompt_is_named(tmp_path):
    import bench_manager
    with pytest.raises(SystemExit, match="more than 16 GPU blocks .raise --gpu-blocks."):
        bench_manager.bench_chat(tmp_path, 5, 16, 0, 0)


def test_the_benchmark_runs_end_to_end_and_ends_with_its_json_line():
    """The command docs/benchmarks.md quotes, small: every phase runs and the
    last line carries what the docs read (including the machine's load)."""
    import json
    import subprocess
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_manager.py"
    out = subprocess.run([sys.executable, str(script), "--quick", "--no-fastdeploy",
                          "--requests", "30", "--sizes", "1000,2000"],
                         capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["chat"]["served"] + res["chat"]["rejected"] == 30
    assert res["chat_gpu_resident"]["us_per_block"] > 0
    assert set(res["eviction"]["ns_per_block"]) == {"1000", "2000"}
    # both eviction policies, measured in the same run, and the one against the other
    assert set(res["eviction"]["policies"]) == {"lru", "adaptive"}
    assert set(res["eviction"]["adaptive_over_lru"]) == {"1000", "2000"}
    assert len(res["load_avg_1m"]) == 2 and all(x >= 0 for x in res["load_avg_1m"])
    assert "times_cheaper_than_fastdeploy" not in res  # no baseline was run
