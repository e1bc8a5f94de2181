"""Bandwidth of the CUDA copy engine: kernel vs direct (cudaMemcpy) vs one contiguous copy.

    python scripts/bench_cuda.py [--planes 4] [--max-gib 2] [--out result.json]

Builds the library (cached), then for every "block size" (the contiguous bytes
of one block in one plane: 4 KiB ... 2 MiB) and block count (1 ... 1024)
moves ``count`` random, non-contiguous blocks of ``--planes`` planes between
device memory and a pinned host pool, both directions, with:

- ``kernel``: one launch (default grid 4 x 256);
- ``direct``: cudaMemcpy2DAsync per run of consecutive ids and plane
  (random ids: one copy per block-plane), and ``batch`` (cudaMemcpyBatchAsync)
  when the toolkit has it;
- ``contiguous``: one cudaMemcpyAsync of the same number of bytes between
  contiguous pinned host and device buffers: the ceiling.

Times are wall clock per task including the Python call and a stream
synchronize (what a transfer worker pays). Prints ONE JSON line on stdout
(progress goes to stderr). Needs no CUDA build of torch (only an importable
torch, as all of kvcached): device and pinned memory come from the library. Without a GPU it prints
``{"bench": "cuda", "skipped": "no CUDA device", ...}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached.copy import cuda as kvc  # noqa: E402

BLOCK_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20]
COUNTS = [1, 16, 64, 256, 1024]
GRID_SWEEP = [(1, 256), (2, 256), (4, 256), (8, 256), (16, 256), (4, 512), (32, 256)]
MIN_TIME_S, MAX_REPS = 0.05, 50
BUDGET_S = 240.0  # the whole run must stay under 5 minutes; stop sweeping after this


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def skip(skipped: str, out: Path | None, **extra) -> int:
    line = json.dumps({"bench": "cuda", "skipped": skipped, **extra})
    print(line)
    if out:
        out.write_text(line + "\n")
    return 0


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                              "0"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def timed(fn, lib: kvc.KvcLib, stream: int) -> float:
    """Seconds per call: one warm-up, then repeat for MIN_TIME_S (2..MAX_REPS calls)."""
    fn()
    lib.stream_synchronize(stream)
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        lib.stream_synchronize(stream)
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= MAX_REPS or (reps >= 2 and elapsed >= MIN_TIME_S):
            return elapsed / reps


class Pools:
    """Device planes and a pinned host pool for one block size, sized for max_count."""

    def __init__(self, lib: kvc.KvcLib, planes: int, block: int, max_count: int):
        self.lib, self.block = lib, block
        self.num_blocks = 2 * max_count  # ids drawn from twice the count: scattered
        self.plane_span = self.num_blocks * block
        self.dev = lib.malloc(planes * self.plane_span)
        self.host_block = planes * block  # block-major: [num_blocks][planes][block]
        self.host = lib.host_alloc(self.num_blocks * self.host_block)
        self.planes = [kvc.CudaPlane(self.dev + p * self.plane_span, block, block)
                       for p in range(planes)]
        self.offsets = [p * block for p in range(planes)]

    def engine(self, **kw) -> kvc.CudaCopyEngine:
        return kvc.CudaCopyEngine(self.planes, self.host, self.offsets,
                                  host_block_bytes=self.host_block,
                                  num_host_blocks=self.num_blocks,
                                  num_device_blocks=self.num_blocks, lib=self.lib, **kw)

    def free(self) -> None:
        self.lib.free(self.dev)
        self.lib.host_free(self.host)


def bench_size(lib, pools: Pools, engines: dict, stream: int, count: int, rng) -> dict:
    nbytes = count * len(pools.planes) * pools.block
    dev_ids = rng.choice(pools.num_blocks, count, replace=False)
    host_ids = rng.choice(pools.num_blocks, count, replace=False)
    row = {"block_bytes": pools.block, "count": count, "bytes": nbytes}
    for name, eng in engines.items():
        for d, fn in (("d2h", lambda e=eng: e.swap_out(dev_ids, host_ids, sync=False)),
                      ("h2d", lambda e=eng: e.swap_in(host_ids, dev_ids, sync=False))):
            row[f"{name}_{d}_gbps"] = round(nbytes / timed(fn, lib, eng.stream) / 1e9, 3)
    for d, (dst, src) in (("d2h", (pools.host, pools.dev)), ("h2d", (pools.dev, pools.host))):
        t = timed(lambda dst=dst, src=src: lib.memcpy_async(dst, src, nbytes, stream), lib, stream)
        row[f"contiguous_{d}_gbps"] = round(nbytes / t / 1e9, 3)
    for d in ("d2h", "h2d"):
        ceil = row[f"contiguous_{d}_gbps"]
        row[f"kernel_vs_contiguous_{d}"] = round(row[f"kernel_{d}_gbps"] / ceil, 3)
        row[f"kernel_vs_direct_{d}"] = round(row[f"kernel_{d}_gbps"] / row[f"direct_{d}_gbps"], 3)
    return row


def grid_sweep(lib, pools: Pools, count: int, rng) -> list[dict]:
    """Kernel bandwidth by grid shape at one size: how small can the grid be?"""
    nbytes = count * len(pools.planes) * pools.block
    dev_ids = rng.choice(pools.num_blocks, count, replace=False)
    host_ids = rng.choice(pools.num_blocks, count, replace=False)
    out = []
    for blocks, threads in GRID_SWEEP:
        with pools.engine(grid_blocks=blocks, block_threads=threads) as eng:
            row = {"grid": f"{blocks}x{threads}", "block_bytes": pools.block, "count": count}
            for d, fn in (("d2h", lambda: eng.swap_out(dev_ids, host_ids, sync=False)),
                          ("h2d", lambda: eng.swap_in(host_ids, dev_ids, sync=False))):
                row[f"{d}_gbps"] = round(nbytes / timed(fn, lib, eng.stream) / 1e9, 3)
        out.append(row)
    return out


def targets(rows: list[dict]) -> dict:
    """The issue's targets, evaluated on the rows they name."""
    big = [r for r in rows if r["block_bytes"] >= 64 << 10 and r["count"] >= 64]
    small = [r for r in rows if r["block_bytes"] <= 16 << 10 and r["count"] >= 16]

    def worst(rs, key):
        vals = [min(r[f"{key}_d2h"], r[f"{key}_h2d"]) for r in rs]
        return min(vals) if vals else None
    vs_ceil, vs_direct = worst(big, "kernel_vs_contiguous"), worst(small, "kernel_vs_direct")
    return {"kernel_vs_contiguous_min (>=64 blocks of >=64KiB)": vs_ceil,
            "kernel_vs_contiguous_ok (>=0.9)": vs_ceil is not None and vs_ceil >= 0.9,
            "kernel_vs_direct_min (4-16KiB, >=16 blocks)": vs_direct,
            "kernel_vs_direct_ok (>=3)": vs_direct is not None and vs_direct >= 3.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planes", type=int, default=4, help="planes per block (2 layers K+V)")
    ap.add_argument("--max-gib", type=float, default=2.0, help="cap on bytes of one task")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if not kvc.driver_present():
        return skip("no CUDA device", args.out,
                    reason="no NVIDIA driver (libcuda.so) on this machine")
    try:
        info = kvc.build()
        lib = kvc.KvcLib(info.path)
        if lib.device_count() < 1:
            return skip("no CUDA device", args.out, reason="cudaGetDeviceCount found 0 GPUs")
    except RuntimeError as e:  # no nvcc, build failure, or a CUDA error
        return skip("no CUDA device", args.out, reason=str(e))
    lib.set_device(0)
    stream = lib.stream_create()
    rng = np.random.default_rng(0)
    rows, sweep, truncated = [], [], False
    cap = int(args.max_gib * (1 << 30))
    use_batch = bool(lib.raw.kvc_has_batch_memcpy())
    for block in BLOCK_SIZES:
        counts = [c for c in COUNTS if c * args.planes * block <= cap]
        pools = Pools(lib, args.planes, block, max(counts))
        engines = {"kernel": pools.engine(), "direct": pools.engine(mode="direct")}
        if use_batch:
            engines["batch"] = pools.engine(mode="direct", use_batch=True)
        try:
            for count in counts:
                if time.perf_counter() - t0 > BUDGET_S:
                    truncated = True
                    break
                rows.append(bench_size(lib, pools, engines, stream, count, rng))
                log(json.dumps(rows[-1]))
            if block == 256 << 10 and not truncated:
                sweep = grid_sweep(lib, pools, min(64, max(counts)), rng)
                log(json.dumps(sweep))
        finally:
            for e in engines.values():
                e.close()
            pools.free()
    lib.stream_destroy(stream)
    result = {"bench": "cuda", "device": gpu_name(), "planes": args.planes,
              "block_bytes_means": "contiguous bytes of one block in one plane",
              "cudart": lib.raw.kvc_cudart_build_version(), "archs": list(info.archs),
              "default_grid": "4x256", "results": rows, "grid_sweep": sweep,
              "targets": targets(rows), "truncated": truncated,
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
