"""scripts/bench_fleet.py without vLLM: the routing its claim rests on (every
turn after the first lands on an instance that did not serve the previous
one) and how its targets are judged."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from _bench_util import load_script  # noqa: E402

bench = load_script("bench_fleet")


def test_consecutive_turns_land_on_different_instances_and_rounds_split_evenly():
    users, turns = 8, 5
    orders = bench.round_order(users, turns)
    assert orders == bench.round_order(users, turns)  # every mode replays the same workload
    for n in (2, 4):
        for t, order in enumerate(orders):
            assert sorted(order) == list(range(users))
            assert Counter(bench.route(u, t, n) for u in order) == {i: users // n
                                                                  for i in range(n)}
            if t:
                assert all(bench.route(u, t, n) != bench.route(u, t - 1, n) for u in order)


def mode(computed: int, ttft: float, outputs=((0, 0, [1, 2]),)) -> dict:
    return {"computed_tokens": computed, "ttft_mean_s": ttft, "outputs": list(outputs)}


def test_targets_compare_shared_storage_with_one_instance_holding_everything():
    modes = {"none": mode(200, 2.0), "cpu": mode(180, 1.5), "file": mode(110, 1.0),
             "redis": mode(111, 1.0), "single": mode(100, 0.5)}
    out = bench.summary(modes, {})
    assert out["computed_vs_single"] == {"none": 2.0, "cpu": 1.8, "file": 1.1, "redis": 1.11}
    assert out["targets"] == {"identical_outputs": True, "computed_vs_single_file_le_1.10": True,
                              "computed_vs_single_redis_le_1.10": False}
    assert out["ttft_mean_vs_none"]["single"] == 0.25
    assert all("outputs" not in m for m in out["modes"].values())
    modes["cpu"] = mode(180, 1.5, outputs=((0, 0, [1, 3]),))
    assert bench.summary(modes, {})["targets"]["identical_outputs"] is False
