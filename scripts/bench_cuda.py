"""The CUDA copy engine per direction and mode, alone and next to a GEMM.

    python scripts/bench_cuda.py [--planes 4] [--budget-s 60] [--out bench.jsonl]

Phases, the most important first; each stops when the time budget is spent:

1. ``modes``: per representative shape (bytes of one block-plane x blocks per
   task, random non-contiguous ids) and direction, GB/s of ``kernel``,
   ``direct`` (cudaMemcpy per run) and ``batch`` (cudaMemcpyBatchAsync; the
   per-run copies where the toolkit lacks it), and of one contiguous
   cudaMemcpyAsync of the same bytes (the ceiling).
2. ``gemm``: a bf16 GEMM loop (torch) on its own stream, alone, then while
   each mode copies back to back in each direction: the copy's GB/s under
   load and the GEMM's slowdown. ``recommended`` per direction: the fastest
   copy under load among the modes that slow the GEMM least (within 5%).
3. ``sweep``: every block-plane size x count and the kernel's grid shapes.

Times are wall clock per task including the Python call and the wait on the
task's completion event (what a transfer worker pays). Each measurement is
appended to ``--out`` as one JSON line the moment it is taken, so a timeout
still leaves what ran; the last line (also printed on stdout) is the summary.

Exit status: 0 when phases 1 and 2 measured; 2 without a GPU (``"skipped"``);
1 on any error or when the budget ended before phase 2 (the JSON says which).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached.copy import cuda as kvc  # noqa: E402

MODES = ("kernel", "direct", "batch")
SHAPES = [(16 << 10, 256), (64 << 10, 256), (2 << 20, 16)]  # (block-plane bytes, blocks)
BLOCK_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20]
COUNTS = [1, 16, 64, 256, 1024]
GRID_SWEEP = [(1, 256), (2, 256), (4, 256), (8, 256), (16, 256), (4, 512), (32, 256)]
GEMM_SHAPE = (64 << 10, 256)  # the copy that runs next to the GEMM: 64 MiB at 4 planes
GEMM_N, GEMM_ITERS = 8192, 100
MIN_TIME_S, MAX_REPS = 0.05, 50
EXIT_ERROR, EXIT_NO_GPU = 1, 2
SLOWDOWN_SLACK = 0.05


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Recorder:
    """Appends each record to --out as one JSON line, at once."""

    def __init__(self, out: Path | None):
        self.out = out
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("")

    def __call__(self, record: dict) -> dict:
        line = json.dumps(record)
        log(line)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")
        return record

    def finish(self, summary: dict, code: int) -> int:
        line = json.dumps(summary)
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")
        return code


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                              "0"], capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def timed(fn) -> float:
    """Seconds per call: one warm-up, then repeat for MIN_TIME_S (2..MAX_REPS calls)."""
    fn()
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if reps >= MAX_REPS or (reps >= 2 and elapsed >= MIN_TIME_S):
            return elapsed / reps


class Pools:
    """Device planes and a pinned host pool for one block-plane size."""

    def __init__(self, lib: kvc.KvcLib, planes: int, block: int, max_count: int):
        self.lib, self.block, self.nplanes = lib, block, planes
        self.num_blocks = 2 * max_count  # ids drawn from twice the count: scattered
        self.plane_span = self.num_blocks * block
        self.dev = lib.malloc(planes * self.plane_span)
        try:
            self.host_block = planes * block  # block-major: [num_blocks][planes][block]
            self.host = lib.host_alloc(self.num_blocks * self.host_block)
        except BaseException:
            lib.free(self.dev)
            raise
        self.planes = [kvc.CudaPlane(self.dev + p * self.plane_span, block, block)
                       for p in range(planes)]
        self.offsets = [p * block for p in range(planes)]

    def engine(self, mode, **kw) -> kvc.CudaCopyEngine:
        return kvc.CudaCopyEngine(self.planes, self.host, self.offsets,
                                  host_block_bytes=self.host_block,
                                  num_host_blocks=self.num_blocks,
                                  num_device_blocks=self.num_blocks, lib=self.lib, mode=mode,
                                  **kw)

    def ids(self, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
        return (rng.choice(self.num_blocks, count, replace=False),
                rng.choice(self.num_blocks, count, replace=False))

    def free(self) -> None:
        self.lib.free(self.dev)
        self.lib.host_free(self.host)


def copy_fn(engine: kvc.CudaCopyEngine, direction: str, dev_ids, host_ids):
    if direction == "d2h":
        return lambda: engine.swap_out(dev_ids, host_ids)
    return lambda: engine.swap_in(host_ids, dev_ids)


def measure_shape(lib, pools: Pools, count: int, rng, stream: int, record,
                  phase: str) -> None:
    """GB/s of every mode and of the contiguous ceiling, both directions."""
    nbytes = count * pools.nplanes * pools.block
    dev_ids, host_ids = pools.ids(count, rng)
    for mode in MODES:
        with pools.engine(mode) as eng:
            for d in ("d2h", "h2d"):
                t = timed(copy_fn(eng, d, dev_ids, host_ids))
                record({"phase": phase, "mode": mode, "dir": d, "block_bytes": pools.block,
                        "count": count, "bytes": nbytes, "gbps": round(nbytes / t / 1e9, 3),
                        "us_per_task": round(t * 1e6, 1)})
    for d, (dst, src) in (("d2h", (pools.host, pools.dev)), ("h2d", (pools.dev, pools.host))):
        def one(dst=dst, src=src):
            lib.memcpy_async(dst, src, nbytes, stream)
            lib.stream_synchronize(stream)
        t = timed(one)
        record({"phase": phase, "mode": "contiguous", "dir": d, "block_bytes": pools.block,
                "count": count, "bytes": nbytes, "gbps": round(nbytes / t / 1e9, 3),
                "us_per_task": round(t * 1e6, 1)})


class Gemm:
    """A bf16 GEMM loop on its own torch stream; ms per GEMM from CUDA events."""

    def __init__(self, n: int):
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("the GEMM phase needs torch with CUDA (torch.cuda.is_available() "
                               f"is False for torch {torch.__version__})")
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.run(5)  # warm-up (cuBLAS heuristics, clocks)

    def run(self, iters: int) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(iters):
                torch.mm(self.a, self.b, out=self.c)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters


def gemm_phase(lib, pools: Pools, rng, record, deadline: float) -> dict:
    """Copy GB/s and GEMM slowdown per (mode, direction); the recommendation."""
    gemm = Gemm(GEMM_N)
    alone = gemm.run(GEMM_ITERS)
    record({"phase": "gemm", "mode": "none", "dir": "none", "gemm_ms": round(alone, 3)})
    count = GEMM_SHAPE[1]
    dev_ids, host_ids = pools.ids(count, rng)
    nbytes = count * pools.nplanes * pools.block
    rows = []
    for mode in MODES:
        for d in ("d2h", "h2d"):
            if time.monotonic() > deadline:
                return {"rows": rows, "complete": False}
            with pools.engine(mode) as eng:
                fn = copy_fn(eng, d, dev_ids, host_ids)
                fn()  # warm-up
                stop, counted = threading.Event(), [0, 0.0, 0.0]

                def loop(fn=fn, stop=stop, counted=counted):
                    t0 = time.perf_counter()
                    while not stop.is_set():
                        fn()
                        counted[0] += 1
                    counted[1] = time.perf_counter() - t0

                th = threading.Thread(target=loop, daemon=True)
                th.start()
                time.sleep(0.02)  # the copy loop is running before the GEMMs start
                loaded = gemm.run(GEMM_ITERS)
                stop.set()
                th.join(timeout=30)
                copy_gbps = counted[0] * nbytes / counted[1] / 1e9 if counted[1] else 0.0
                rows.append(record({
                    "phase": "gemm", "mode": mode, "dir": d, "block_bytes": pools.block,
                    "count": count, "copy_gbps_under_gemm": round(copy_gbps, 3),
                    "gemm_ms": round(loaded, 3), "gemm_slowdown": round(loaded / alone, 3)}))
    return {"rows": rows, "complete": True, "gemm_ms_alone": round(alone, 3)}


def recommend(gemm_rows: list[dict]) -> dict:
    """Per direction: the fastest copy under load among the modes that slow the
    GEMM least (within SLOWDOWN_SLACK of the best)."""
    out = {}
    for d in ("d2h", "h2d"):
        rows = [r for r in gemm_rows if r["dir"] == d]
        if not rows:
            continue
        best = min(r["gemm_slowdown"] for r in rows)
        fair = [r for r in rows if r["gemm_slowdown"] <= best + SLOWDOWN_SLACK]
        out[d] = max(fair, key=lambda r: r["copy_gbps_under_gemm"])["mode"]
    return out


def sweep_phase(lib, args, rng, stream, record, deadline) -> bool:
    cap = int(args.max_gib * (1 << 30))
    for block in BLOCK_SIZES:
        counts = [c for c in COUNTS if c * args.planes * block <= cap]
        pools = Pools(lib, args.planes, block, max(counts))
        try:
            for count in counts:
                if time.monotonic() > deadline:
                    return False
                measure_shape(lib, pools, count, rng, stream, record, "sweep")
            if block == 256 << 10:
                count = min(64, max(counts))
                dev_ids, host_ids = pools.ids(count, rng)
                nbytes = count * args.planes * block
                for blocks, threads in GRID_SWEEP:
                    with pools.engine("kernel", grid_blocks=blocks,
                                      block_threads=threads) as eng:
                        for d in ("d2h", "h2d"):
                            t = timed(copy_fn(eng, d, dev_ids, host_ids))
                            record({"phase": "grid", "grid": f"{blocks}x{threads}", "dir": d,
                                    "block_bytes": block, "count": count,
                                    "gbps": round(nbytes / t / 1e9, 3)})
        finally:
            pools.free()
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planes", type=int, default=4, help="planes per block (2 layers K+V)")
    ap.add_argument("--max-gib", type=float, default=2.0, help="cap on bytes of one task")
    ap.add_argument("--budget-s", type=float, default=60.0, help="stop starting new work after")
    ap.add_argument("--out", type=Path, default=None, help="append JSON lines here as measured")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    record = Recorder(args.out)
    summary = {"bench": "cuda", "device": None, "planes": args.planes}
    if not kvc.driver_present():
        return record.finish({**summary, "skipped": "no GPU",
                              "reason": "no NVIDIA driver (libcuda.so) on this machine"},
                             EXIT_NO_GPU)
    try:
        info = kvc.build()
        lib = kvc.KvcLib(info.path)
        if lib.device_count() < 1:
            return record.finish({**summary, "skipped": "no GPU",
                                  "reason": "cudaGetDeviceCount found 0 GPUs"}, EXIT_NO_GPU)
    except RuntimeError as e:  # no nvcc, a build failure, a CUDA error: not measured
        return record.finish({**summary, "error": f"{type(e).__name__}: {e}"}, EXIT_ERROR)
    summary.update(device=gpu_name(), cudart=lib.raw.kvc_cudart_build_version(),
                   batch_memcpy=bool(lib.raw.kvc_has_batch_memcpy()), archs=list(info.archs))
    rng = np.random.default_rng(0)
    phases = {}
    try:
        lib.set_device(0)
        stream = lib.stream_create()
        for block, count in SHAPES:
            pools = Pools(lib, args.planes, block, count)
            try:
                measure_shape(lib, pools, count, rng, stream, record, "modes")
            finally:
                pools.free()
        phases["modes"] = True
        pools = Pools(lib, args.planes, *GEMM_SHAPE)
        try:
            g = gemm_phase(lib, pools, rng, record, deadline)
        finally:
            pools.free()
        phases["gemm"] = g["complete"]
        summary["gemm_ms_alone"] = g.get("gemm_ms_alone")
        summary["recommended"] = recommend(g["rows"])
        phases["sweep"] = sweep_phase(lib, args, rng, stream, record, deadline)
        lib.stream_destroy(stream)
    except Exception as e:  # noqa: BLE001 (any failure is reported, never "skipped")
        summary.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
    summary.update(phases=phases, elapsed_s=round(time.monotonic() - t0, 1))
    measured = phases.get("modes") and phases.get("gemm") and "error" not in summary
    if not measured and "error" not in summary:
        summary["error"] = "the budget ended before the GEMM phase finished"
    return record.finish(summary, 0 if measured else EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
