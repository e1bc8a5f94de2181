#!/usr/bin/env python
"""Where a storage hit stops paying off: the shortest hit worth loading, per backend.

A storage hit of k blocks costs a lookup (the request waits a step for its
answer), a read and a copy; recomputing costs the prefill of the k blocks.
``storage_min_load_blocks`` is the line between the two: a hit shorter than
it is recomputed. This measures where that line is inside vLLM (its CPU
build, the random-weight Llama of ``bench_vllm.py``), for each backend:

1. one vLLM process with kvcached fills the backend with prompts of k full
   blocks and one token more, for k in ``--blocks`` (several prompts each);
2. a new process (its CPU tier empty) serves each prompt from storage, then
   pauses kvcached (``kvcached ctl pause``: a hit in the CPU tier or in
   storage is a miss while paused), resets vLLM's prefix cache, computes
   the same prompt again and resumes. Both are timed (TTFT) in the same
   process, one right after the other; the outputs must be identical.

Per k, the median over the prompts of storage TTFT / recompute TTFT;
``break_even_blocks`` is the smallest k from which every measured k's median
ratio is below 1 (loading wins), or None when none is. Backends: ``file``
and ``redis`` (a local ``redis-server`` on 127.0.0.1, skipped when it is not
installed).

    python scripts/bench_break_even.py [--quick] [--backends file,redis]
                                       [--blocks 1,2,4,8,16,32] [--prompts 3]
                                       [--fork-server SOCKET]

``--quick`` is a smoke run (a tiny model, two sizes, vLLM in one process).
Progress on stderr; the last line on stdout is JSON
``{"bench": "break_even", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import load_script, log, result_file, run_child  # noqa: E402

FULL = dict(layers=6, hidden=1024, kv_mb=56, blocks=(1, 2, 4, 8, 16, 32), prompts=3)
QUICK = dict(layers=2, hidden=128, kv_mb=6, blocks=(1, 4), prompts=1, one_process=True)
CTL_TIMEOUT_S = 60.0


def prompt(bv, k: int, i: int) -> list[int]:
    """The i-th prompt of k full blocks and one token more (the token vLLM
    always computes)."""
    return bv.tokens(1000 * k + i, k * bv.BS + 1)


# ------------------------------------------------------------------ child
def fill(bv, srv, p: dict) -> dict:
    for k in p["blocks"]:
        for i in range(p["prompts"]):
            srv.serve([prompt(bv, k, i)], 1)
    return {}


def measure(bv, srv, p: dict, run_dir: str) -> dict:
    """Per prompt: its storage hit, then (kvcached paused, vLLM reset) its
    recompute, both in this process."""
    from kvcached.ops.ctlserver import request
    warm = bv.tokens(7, p["blocks"][-1] * bv.BS + 1)  # the process's first passes
    srv.serve([warm], 1)
    srv.serve([warm], 1)
    out = {str(k): {"storage": [], "recompute": [], "cached": []} for k in p["blocks"]}
    for i in range(p["prompts"]):
        for k in p["blocks"]:
            q, row = prompt(bv, k, i), out[str(k)]
            hit = srv.serve([q], 4)[0]
            srv.reset()  # waits for the hit's saves: nothing may wait for a resume
            request(run_dir, "pause", {}, timeout_s=CTL_TIMEOUT_S)
            try:
                again = srv.serve([q], 4)[0]
            finally:
                request(run_dir, "resume", {}, timeout_s=CTL_TIMEOUT_S)
            srv.reset()
            assert again["output"] == hit["output"], f"k={k}: the storage hit changed the output"
            assert again["cached"] == 0, f"k={k}: the recompute was served from a cache"
            row["storage"].append(hit["ttft"])
            row["recompute"].append(again["ttft"])
            row["cached"].append(hit["cached"])
    return out


def child(spec: dict) -> dict:
    bv = load_script("bench_vllm")
    srv = bv.Server(spec)
    if spec["phase"] == "fill":
        return fill(bv, srv, spec["params"])
    return measure(bv, srv, spec["params"],
                   spec["connector"]["kv_connector_extra_config"]["run_dir"])


# ----------------------------------------------------------------- parent
FORK_SERVER: str | None = None  # --fork-server (the tests' smoke run): see _bench_util.run_child


def run_mode_child(name: str, model: str, p: dict, connector: dict, phase: str) -> dict:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
           **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if p.get("one_process") else {})}
    t = time.monotonic()
    with result_file() as result:
        spec = {"name": name, "model": model, "params": p, "connector": connector,
                "phase": phase, "kv_mb": p["kv_mb"], "result": str(result)}
        rc = run_child(__file__, ["--child", json.dumps(spec)], env, 3600, FORK_SERVER)
        if rc or not result.exists():
            raise SystemExit(f"{name} failed (rc {rc}); its log is above")
        out = json.loads(result.read_text())
    log(f"{name}: done in {time.monotonic() - t:.0f}s")
    return out


def connector(run_dir: Path, backend: str, url: str) -> dict:
    """bench_vllm's kvcached connector on ``backend``; a cold lookup here is not
    what is measured, so it may take its time."""
    conn = load_script("bench_vllm").kvcached_connector(run_dir, Path(url), 1024)
    conn["kv_connector_extra_config"].update(storage_backend=backend, storage_url=url,
                                             storage_lookup_timeout_s=10.0)
    return conn


def summarize(rows: dict, bs: int) -> dict:
    """Per k: median storage / recompute ratio and TTFTs; the break-even k."""
    per_k, winning = {}, []
    for k, row in rows.items():
        ratios = [s / r for s, r in zip(row["storage"], row["recompute"], strict=True)]
        per_k[k] = {"storage_vs_recompute": statistics.median(ratios),
                    "min": min(ratios), "max": max(ratios),
                    "storage_ttft_s": statistics.median(row["storage"]),
                    "recompute_ttft_s": statistics.median(row["recompute"]),
                    "blocks_served": min(row["cached"]) / (int(k) * bs)}
        winning.append((int(k), per_k[k]["storage_vs_recompute"] < 1.0))
    winning.sort()
    even = None
    for k, wins in reversed(winning):  # the longest run of wins ending at the largest k
        if not wins:
            break
        even = k
    return {"per_blocks": per_k, "break_even_blocks": even}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, two sizes (smoke)")
    ap.add_argument("--backends", default="file,redis", help="comma-separated: file, redis")
    ap.add_argument("--blocks", help="comma-separated hit lengths in blocks")
    ap.add_argument("--prompts", type=int, help="prompts per length")
    ap.add_argument("--fork-server", metavar="SOCKET",
                    help="tests: each process forked by this fork server "
                         "(tests/vllm_forkserver.py: vLLM imported once) instead of started")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        Path(spec["result"]).write_text(json.dumps(child(spec)))
        return
    global FORK_SERVER
    FORK_SERVER = args.fork_server
    p = dict(QUICK if args.quick else FULL)
    if args.blocks:
        p["blocks"] = tuple(sorted(int(b) for b in args.blocks.split(",")))
    if args.prompts:
        p["prompts"] = args.prompts
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - {"file", "redis"}
    if unknown or not backends or min(p["blocks"]) < 1 or p["prompts"] < 1:
        ap.error(f"--backends takes file and/or redis (got {args.backends!r}); --blocks "
                 f"and --prompts take positive numbers")
    bv = load_script("bench_vllm")
    out = {"bench": "break_even", "quick": bool(args.quick), "block_size": bv.BS,
           "backends": {}, "skipped": {}}
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-even-") as tmp:
        work = Path(tmp)
        model = bv.make_model(str(work / "model"), p["layers"], p["hidden"])
        for backend in backends:
            server, url = None, str(work / "store")
            if backend == "redis":
                server, why = load_script("bench_fleet").redis_server(work)
                if server is None:
                    log(f"redis: skipped: {why}")
                    out["skipped"]["redis"] = why
                    continue
                url = server.url
            try:
                run_mode_child(f"{backend}: fill", model, p,
                          connector(work / f"run-{backend}-1", backend, url), "fill")
                rows = run_mode_child(f"{backend}: measure", model, p,
                                 connector(work / f"run-{backend}-2", backend, url), "measure")
            finally:
                if server is not None:
                    server.stop()
            out["backends"][backend] = summarize(rows, bv.BS)
            log(f"{backend}: break-even at {out['backends'][backend]['break_even_blocks']} "
                f"blocks")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
