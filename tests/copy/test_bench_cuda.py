"""scripts/bench_cuda.py without a GPU: its exit status and its measuring code.

The copy phases run over the emulated library (host memory; the launches go
through the library's own packing and kernel code), which proves the script
measures and records what it claims; the numbers themselves need a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cuda_build import EmulatedLib

from kvcached.copy import cuda as kvc

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from _bench_util import load_script  # noqa: E402

bench = load_script("bench_cuda")


@pytest.mark.skipif(kvc.driver_present(), reason="checks the machine without a GPU driver")
def test_without_a_gpu_it_says_so_and_fails(tmp_path):
    out = tmp_path / "bench.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_cuda.py"), "--out",
                          str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == bench.EXIT_NO_GPU, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["skipped"] == "no GPU" and "libcuda" in line["reason"]
    assert json.loads(out.read_text().splitlines()[-1]) == line


@pytest.fixture
def emu():
    if kvc.find_nvcc() is None:
        pytest.skip("nvcc not found: cannot build the library")
    return EmulatedLib(kvc.build().path)


def test_measure_shape_records_every_mode_and_the_ceiling(emu, tmp_path):
    out = tmp_path / "rows.jsonl"
    record = bench.Recorder(out)
    pools = bench.Pools(emu, 2, 4096, 8)
    try:
        bench.measure_shape(emu, pools, 8, np.random.default_rng(0), 0, record, "modes")
    finally:
        pools.free()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["mode"], r["dir"]) for r in rows} == {
        (m, d) for m in (*bench.MODES, "contiguous") for d in ("d2h", "h2d")}
    assert all(r["gbps"] > 0 and r["bytes"] == 8 * 2 * 4096 for r in rows)
    assert not emu.buffers  # every allocation freed


def test_sweep_stops_at_the_deadline(emu, tmp_path):
    record = bench.Recorder(tmp_path / "rows.jsonl")
    args = type("Args", (), {"max_gib": 1 / 1024, "planes": 2})()
    assert bench.sweep_phase(emu, args, np.random.default_rng(0), 0, record, 0.0) is False
    assert not emu.buffers


def test_recommend_prefers_the_fastest_copy_that_spares_the_gemm():
    rows = [
        {"dir": "d2h", "mode": "kernel", "copy_gbps_under_gemm": 50, "gemm_slowdown": 1.30},
        {"dir": "d2h", "mode": "direct", "copy_gbps_under_gemm": 40, "gemm_slowdown": 1.02},
        {"dir": "d2h", "mode": "batch", "copy_gbps_under_gemm": 45, "gemm_slowdown": 1.05},
        {"dir": "h2d", "mode": "kernel", "copy_gbps_under_gemm": 52, "gemm_slowdown": 1.04},
        {"dir": "h2d", "mode": "batch", "copy_gbps_under_gemm": 30, "gemm_slowdown": 1.01},
    ]
    assert bench.recommend(rows) == {"d2h": "batch", "h2d": "kernel"}
    assert bench.recommend([]) == {}
