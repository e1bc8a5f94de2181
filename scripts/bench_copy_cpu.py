"""Benchmark the CPU copy engine against a plain memcpy of the same bytes.

For 1, 16 and 256 blocks of the default layout (8 planes of 16 KiB), times
swap_out and swap_in (random, non-contiguous block ids, all planes) through
the engine (kvcached/native/copy/), next to one contiguous torch
copy of a uint8 tensor of the same total size, in the same process. The
engine is timed with 1 thread and with the default ``copy_threads`` (N); the copy
baseline on 1 thread and on N torch threads. The headline (and the target,
>= 0.9x) compares the engine as configured by default with a copy on as many
threads. Each number is the median of several runs; each run repeats the
call enough to last a few ms.

    python scripts/bench_copy_cpu.py [--quick]

The last line printed is JSON: ``{"bench": "copy_cpu", ...}``; ``run()``
returns the same dict for other benchmark scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcached.config import CacheConfig
from kvcached.copy.cpu import CpuCopyEngine
from kvcached.layout import TORCH_DTYPES

logger = logging.getLogger(__name__)

BLOCK_COUNTS = (1, 16, 256)
POOL_BLOCKS = 512  # device and host blocks: 64 MiB each, larger than the caches
TARGET_RATIO = 0.9


@dataclass
class Case:
    """One timed operation: ``fn`` moves ``nbytes``; ``torch_threads`` is set around it."""

    fn: Callable[[], object]
    nbytes: int
    torch_threads: int | None = None


def timed_rate(case: Case, min_bytes: int) -> float:
    """GB/s of one run: ``case.fn`` repeated until about ``min_bytes`` moved."""
    reps = max(1, min_bytes // case.nbytes)
    saved = torch.get_num_threads()
    if case.torch_threads:
        torch.set_num_threads(case.torch_threads)
    try:
        t0 = time.perf_counter()
        for _ in range(reps):
            case.fn()
        return case.nbytes * reps / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(saved)


def measure(cases: dict[str, Case], runs: int, min_bytes: int) -> dict[str, float]:
    """Median GB/s per case. Runs are interleaved across cases so that load from
    other processes on a shared machine hits every case alike."""
    for case in cases.values():
        case.fn()  # warm up: page faults, first-call costs
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, case in cases.items():
            rates[name].append(timed_rate(case, min_bytes))
    return {name: statistics.median(r) for name, r in rates.items()}


def make_pools(layout) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Device planes and host pool filled with data (so every page is really mapped)."""
    planes = [torch.empty((POOL_BLOCKS, p.block_bytes), dtype=torch.uint8).fill_(i + 1)
              .view(TORCH_DTYPES[p.dtype]).view(POOL_BLOCKS, *p.shape)
              for i, p in enumerate(layout.planes)]
    host = torch.empty((POOL_BLOCKS, layout.block_bytes), dtype=torch.uint8).fill_(7)
    return planes, host


def default_threads() -> int:
    """``copy_threads`` of the default configuration: what a worker runs with."""
    return CacheConfig.load(transfer_mode="inprocess").copy_threads


def engines(planes, host, offsets) -> dict[str, CpuCopyEngine]:
    """``native`` (1 thread) and ``native_tN`` (the default ``copy_threads``, N > 1)."""
    out = {"native": CpuCopyEngine(planes, host, offsets)}
    n = default_threads()
    if n > 1:
        out[f"native_t{n}"] = CpuCopyEngine(planes, host, offsets, threads=n)
    return out


def cases_for(n: int, engs: dict[str, CpuCopyEngine], nbytes: int) -> dict[str, Case]:
    """Swap out/in of ``n`` random non-contiguous blocks per engine, plus memcpy."""
    rng = np.random.default_rng(n)
    dev = rng.choice(POOL_BLOCKS, n, replace=False).tolist()
    host = rng.choice(POOL_BLOCKS, n, replace=False).tolist()
    cases = {}
    for name, eng in engs.items():
        cases[f"{name}.swap_out_gbps"] = Case(lambda e=eng: e.swap_out(dev, host), nbytes)
        cases[f"{name}.swap_in_gbps"] = Case(lambda e=eng: e.swap_in(host, dev), nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    n = default_threads()
    cases["memcpy_gbps"] = Case(lambda: dst.copy_(src), nbytes, n)
    if n > 1:
        cases["memcpy_1t_gbps"] = Case(lambda: dst.copy_(src), nbytes, 1)
    return cases


def run(quick: bool = False) -> dict:
    """Run the benchmark; returns the result dict that the JSON line prints."""
    layout = CacheConfig.load(transfer_mode="inprocess").layout
    runs, min_bytes = (3, 32 << 20) if quick else (9, 128 << 20)
    planes, host = make_pools(layout)
    engs = engines(planes, host, layout.host_offsets)
    results: dict[str, dict] = {}
    for n in BLOCK_COUNTS:
        nbytes = n * sum(layout.plane_bytes)
        row: dict = {"bytes": nbytes}
        for key, rate in measure(cases_for(n, engs, nbytes), runs, min_bytes).items():
            name, _, metric = key.rpartition(".")
            (row.setdefault(name, {}) if name else row)[metric] = rate
        results[str(n)] = row
    return summarize(layout, results, engs, quick)


def summarize(layout, results: dict, engs: dict, quick: bool) -> dict:
    """Ratios at 256 blocks (mean of swap_out and swap_in) against a copy on as
    many threads: ``native`` copies on one thread and is compared with the
    one-thread copy; ``native_tN`` with torch's N-thread copy_. The
    headline is the default configuration (``copy_threads`` = N)."""
    last = results[str(BLOCK_COUNTS[-1])]
    n = default_threads()
    ratios = {}
    for name in engs:
        base = last["memcpy_gbps" if n == 1 or name == f"native_t{n}" else "memcpy_1t_gbps"]
        mean = (last[name]["swap_out_gbps"] + last[name]["swap_in_gbps"]) / 2
        ratios[name] = round(mean / base, 3)
    headline = ratios.get(f"native_t{n}" if n > 1 else "native")
    return {
        "bench": "copy_cpu",
        "quick": quick,
        "planes": len(layout.planes),
        "plane_bytes": layout.plane_bytes[0],
        "copy_threads": n,
        "results": _rounded(results),
        "ratio_vs_memcpy_256": ratios,
        "ratio_native_memcpy_256": headline,
        "target_ratio": TARGET_RATIO,
        "meets_target": headline is not None and headline >= TARGET_RATIO,
    }


def _rounded(obj):
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return round(obj, 2) if isinstance(obj, float) else obj


def main() -> None:
    """Command line entry: print a table, then the JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    res = run(quick=args.quick)
    for n, row in res["results"].items():
        cols = [f"{name} out {v['swap_out_gbps']:6.2f} in {v['swap_in_gbps']:6.2f}"
                for name, v in row.items() if isinstance(v, dict)]
        print(f"{n:>4} blocks  memcpy {row['memcpy_gbps']:6.2f} GB/s | " + " | ".join(cols))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
