#!/usr/bin/env python
"""A slice of a Mooncake trace replayed through vLLM's OpenAI server, with
kvcached's CPU tier under each eviction policy and with LMCache, beside what
a replay through kvcached's manager predicts.

vLLM's client replays Mooncake traces itself (``vllm bench serve
--dataset-name timed_trace --timed-trace-chunk-hash-size 512``: each hash
id becomes 512 tokens drawn from a generator seeded with Python's ``hash()``
of the id, requests sent at the trace's timestamps). The client runs in
this process as ``scripts/bench_serve.py`` runs it, against that script's
server (its random Llama and word-level tokenizer), so this process pins
``PYTHONHASHSEED`` (it re-executes itself with ``--hash-seed``, 0 by
default): every mode gets the same prompts, and so does the prediction.

The slice (``--slice A:B`` of ``--trace``) is cut to fit the tiny model:
prompts to ``--max-prompt`` tokens (their hash ids with them), outputs to
``--max-output``, timestamps from the slice's first and divided by
``--speedup``. Its working set is the distinct full 32-token blocks of its
prompts; the CPU tier is sized at each ``--sizes`` share of it, in
kvcached's blocks (storage off) and in LMCache's L1 bytes (its
multi-process server, ``bench_vllm.LMCacheServer``, LRU).

Modes, each a fresh server, in this order: ``plain`` (vLLM's prefix cache
only), then per size ``lru-P``, ``adaptive-P`` (kvcached with that
``eviction_policy``) and, with ``--lmcache-python PY``, ``lmcache-P``.
Per mode, over the replay (the server's ``/metrics`` before and after):

- ``cpu_tier_tokens``: prompt tokens kvcached loaded from its CPU tier
  (``vllm:kvcached_hit_tokens{tier="cpu"}``); for LMCache its external hits;
- ``external_tokens``: ``vllm:prompt_tokens_by_source{source=
  "external_kv_transfer"}`` (any connector), ``local_hit_tokens`` (vLLM's own
  prefix cache) and ``computed_tokens`` (``source="local_compute"``, the
  prefill computed);
- TTFT p50/p99 (the client's).

The prediction: the same prompts, in order, through a two-tier
``CacheManager`` (vLLM's KV space as the GPU tier, the CPU tier as the
second, 32-token blocks, each request allocated, committed and freed before
the next). It differs from vLLM: vLLM's prefix cache is its own LRU and
holds the blocks of running requests; the manager's GPU tier runs the
policy too and holds one request at a time.

Targets (the issue's): at the 20% size ``adaptive`` serves >= 1.5x the CPU
tier tokens of ``lru``; kvcached (adaptive) computes fewer prefill tokens
than LMCache at every size. The last line on stdout is JSON
``{"bench": "serve_trace", ...}``; progress goes to stderr.

    python scripts/bench_serve_trace.py [--lmcache-python PY] [--quick]

By default requests 1-600 of ``../shared/traces/mooncake_conversation.jsonl``,
prompts cut to 2,048 tokens, outputs to 8, 3x the trace's clock, vLLM's KV
space 8,192 tokens (~13 minutes with LMCache on 2 cores). ``--quick``: 40
requests, 1,024-token prompts, plain and the 20% size: a smoke run of a few
minutes, checking the machinery (those requests reuse nothing past vLLM's
own cache). ``--predict-only``: the prediction alone, in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import ROOT, emit, load_script, log  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
CHUNK = 512  # tokens per hash id in Mooncake's traces
FULL = dict(slice="1:600", max_prompt=2048, max_output=8, speedup=3.0, kv_tokens=8192,
            sizes=(0.2, 0.5), max_num_seqs=16, layers=2, hidden=128)
QUICK = dict(slice="1:40", max_prompt=1024, max_output=4, speedup=8.0, kv_tokens=4096,
             sizes=(0.2,), max_num_seqs=8, layers=2, hidden=128)
MAX_POSITIONS = 8192  # bench_vllm.make_model's max_position_embeddings
ADAPTIVE_OVER_LRU = 1.5  # CPU-tier tokens at the 20% size
CPU = 'vllm:kvcached_hit_tokens_total{tier="cpu"}'
BY_SOURCE = 'vllm:prompt_tokens_by_source_total{{source="{}"}}'


# ------------------------------------------------------------------ trace
def pin_hash_seed(seed: str) -> None:
    """Re-execute this script with ``PYTHONHASHSEED=seed`` unless it already runs
    so: vLLM's timed_trace dataset draws each block's tokens from ``hash()``."""
    if os.environ.get("PYTHONHASHSEED") != seed:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "PYTHONHASHSEED": seed})


def cut_slice(reqs: list, max_prompt: int, max_output: int, speedup: float) -> list[dict]:
    """Trace requests as the rows vLLM's client replays: prompts cut to
    ``max_prompt`` tokens (and their hash ids to the blocks left), outputs to
    ``max_output`` (at least 1), timestamps (ms) from the first request's,
    divided by ``speedup``."""
    if max_prompt < 1 or max_output < 1 or speedup <= 0:
        raise ValueError("--max-prompt and --max-output must be >= 1 and --speedup > 0")
    t0 = reqs[0].timestamp
    rows = []
    for r in reqs:
        n = min(r.input_length, max_prompt)
        rows.append({"timestamp": (r.timestamp - t0) / speedup, "input_length": n,
                     "output_length": max(1, min(r.output_length, max_output)),
                     "hash_ids": list(r.hash_ids[:-(-n // CHUNK)])})
    return rows


def client_prompts(path: Path, model: str, n: int) -> list[list[int]]:
    """The token ids vLLM's client sends for the rows in ``path`` (its own
    dataset class, with its defaults and this process's hash seed)."""
    from vllm.benchmarks.datasets.datasets import TimedTrace
    from vllm.tokenizers import get_tokenizer
    with contextlib.redirect_stdout(sys.stderr):  # it prints its settings
        ds = TimedTrace(dataset_path=str(path), timed_trace_chunk_hash_size=CHUNK,
                        timed_trace_sec_multiplier=0.001,
                        timed_trace_label_timestamp="timestamp",
                        timed_trace_label_input_length="input_length",
                        timed_trace_label_output_length="output_length",
                        timed_trace_label_hash_ids="hash_ids")
        return [s.prompt for s in ds.sample(get_tokenizer(model), n)]


def working_set_blocks(prompts: list[list[int]], block_size: int) -> int:
    """Distinct full blocks over all prompts (chained hashes: a block is its prefix)."""
    from kvcached.core.hashing import block_hashes
    seen: set[bytes] = set()
    for p in prompts:
        seen.update(block_hashes(bytes(16), p, block_size))
    return len(seen)


# -------------------------------------------------------------- prediction
def predict(prompts: list[list[int]], outputs: list[int], block_size: int, gpu_blocks: int,
            cpu_blocks: int, policy: str) -> dict:
    """The prompts in order through a two-tier ``CacheManager`` (in-process
    copies of a tiny layout): hit tokens per tier and the tokens left to compute.
    The first prompt goes once more before them all, as vLLM's client sends it
    (its ready check, which the server counts too)."""
    from kvcached import CacheManager
    from kvcached.tools.trace import trace_config

    hit = {"gpu": 0, "cpu": 0}
    with tempfile.TemporaryDirectory(prefix="kvc-predict-", dir="/tmp") as run_dir:
        cfg = trace_config(block_size=block_size, num_gpu_blocks=gpu_blocks,
                           num_cpu_blocks=cpu_blocks, eviction_policy=policy,
                           check_host_memory=False, control_socket=False, run_dir=run_dir)
        with CacheManager(cfg).start() as mgr:
            for i, (tokens, out) in enumerate(zip([prompts[0], *prompts],
                                                  [outputs[0], *outputs], strict=True)):
                a = mgr.allocate(i, tokens, reserve_tokens=out)
                a.wait()
                mgr.commit(i, tokens, len(tokens))
                mgr.free(i)
                hit["gpu"] += a.hit.gpu_tokens
                hit["cpu"] += a.hit.cpu_tokens
    total = len(prompts[0]) + sum(map(len, prompts))
    return {"gpu_tokens": hit["gpu"], "cpu_tier_tokens": hit["cpu"],
            "computed_tokens": total - hit["gpu"] - hit["cpu"]}


# ------------------------------------------------------------------ serving
@contextlib.contextmanager
def watching(srv, what: str, total: int, every_s: float = 20.0):
    """Log the server's finished requests and computed tokens every ``every_s``."""
    stop = threading.Event()

    def loop() -> None:
        t0 = time.monotonic()
        while not stop.wait(every_s):
            m = srv.metrics()
            log(f"  {what}: {m.get('vllm:request_success_total', 0):.0f}/{total} requests "
                f"done, {m.get(BY_SOURCE.format('local_compute'), 0):.0f} tokens computed, "
                f"{time.monotonic() - t0:.0f}s")
    t = threading.Thread(target=loop, name="progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def settled_metrics(srv, timeout: float = 30.0) -> dict[str, float]:
    """``/metrics`` once two scrapes a second apart agree (the connector's stats
    reach the server a step after the last response); the last one at ``timeout``."""
    deadline, last = time.monotonic() + timeout, srv.metrics()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = srv.metrics()
        if all(now.get(k) == last.get(k) for k in (CPU, BY_SOURCE.format("local_compute"),
                                                    BY_SOURCE.format("external_kv_transfer"))):
            return now
        last = now
    log(f"/metrics still moving after {timeout:.0f}s; using the last scrape")
    return last


def serve(serve_mod, name: str, model: str, work: Path, p: dict, data: Path, n: int,
          connector: dict | None = None, env: dict | None = None) -> dict:
    """One mode: a fresh server, the slice replayed by vLLM's client; its numbers.
    The server's temp dir is in ``work`` (vLLM leaves a file and its IPC sockets
    in it at every start; kvcached's run dir is there too)."""
    tmp = work / "t"  # short: kvcached's sockets live below it (~100 characters at most)
    tmp.mkdir(exist_ok=True)
    srv = serve_mod.ApiServer(model, work / f"{name}.log", p["kv_mb"], connector,
                              p["max_num_seqs"], env={**(env or {}), "TMPDIR": str(tmp)},
                              max_model_len=p["max_model_len"])
    try:
        up = srv.wait_ready()
        log(f"{name}: server up in {up:.0f}s on port {srv.port}; replaying {n} requests")
        srv.complete("w1 w2 w3", 2)  # the first forward passes, outside the replay
        before = srv.metrics()
        with watching(srv, name, n + 1):
            r = serve_mod.bench_client(srv, work, [
                "--dataset-name", "timed_trace", "--dataset-path", str(data),
                "--num-prompts", str(n), "--timed-trace-chunk-hash-size", str(CHUNK),
                "--timed-trace-sec-multiplier", "0.001"])  # ms, sped up already
        after = settled_metrics(srv)
    finally:
        srv.stop("SIGINT")
    d = lambda key: after.get(key, 0.0) - before.get(key, 0.0)  # noqa: E731
    out = {**r, **serve_mod.computed(before, after),
           "external_tokens": d(BY_SOURCE.format("external_kv_transfer")),
           "local_hit_tokens": d(BY_SOURCE.format("local_cache_hit")),
           # kvcached's own count; another connector's external hits are its CPU tier's
           "cpu_tier_tokens": d(CPU) if connector and "kvcached" in connector["kv_connector"]
           .lower() else d(BY_SOURCE.format("external_kv_transfer")),
           "load_avg_1m_after": os.getloadavg()[0]}
    log(f"{name}: {out.get('completed')} ok ({out.get('failed', 0)} failed), computed "
        f"{out['computed_tokens']:.0f}/{out['prompt_tokens']:.0f}, CPU tier "
        f"{out['cpu_tier_tokens']:.0f}, vLLM's cache {out['local_hit_tokens']:.0f} tokens, "
        f"TTFT p50 {out.get('ttft_p50_ms', 0):.0f} ms p99 {out.get('ttft_p99_ms', 0):.0f} ms")
    return out


def modes(tags, lmcache: bool) -> list[str]:
    """Mode names in run order: plain, then per size (its tag) lru, adaptive[, lmcache]."""
    out = ["plain"]
    for tag in tags:
        out += [f"lru-{tag}", f"adaptive-{tag}"] + ([f"lmcache-{tag}"] if lmcache else [])
    return out


# ------------------------------------------------------------------ report
def targets(measured: dict, sizes: dict[str, int]) -> dict:
    """The issue's targets, met or not (absent where a mode was not run)."""
    out = {}
    first = next(iter(sizes))
    lru, ada = measured.get(f"lru-{first}"), measured.get(f"adaptive-{first}")
    if lru and ada:
        out[f"adaptive_cpu_tokens_ge_{ADAPTIVE_OVER_LRU}x_lru_at_{first}"] = (
            ada["cpu_tier_tokens"] > 0  # not met vacuously, where nothing came back
            and ada["cpu_tier_tokens"] >= ADAPTIVE_OVER_LRU * lru["cpu_tier_tokens"])
    for tag in sizes:
        ada, lmc = measured.get(f"adaptive-{tag}"), measured.get(f"lmcache-{tag}")
        if ada and lmc:
            out[f"kvcached_computes_less_than_lmcache_at_{tag}"] = (
                ada["computed_tokens"] < lmc["computed_tokens"])
    return out


def print_table(measured: dict, predicted: dict) -> None:
    """A markdown table on stderr (the docs' table)."""
    log("| mode | CPU tier tokens (predicted) | vLLM prefix cache | prefill computed "
        "(predicted) | TTFT p50 / p99 |")
    log("| --- | --- | --- | --- | --- |")
    for name, m in measured.items():
        pr = predicted.get(name, {})
        cpu, comp = (f"{pr[k]:,}" if k in pr else "-" for k in ("cpu_tier_tokens",
                                                               "computed_tokens"))
        log(f"| {name} | {m['cpu_tier_tokens']:,.0f} ({cpu}) | "
            f"{m['local_hit_tokens']:,.0f} | {m['computed_tokens']:,.0f} "
            f"({comp}) | {m.get('ttft_p50_ms', 0):,.0f} / "
            f"{m.get('ttft_p99_ms', 0):,.0f} ms |")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format trace")
    ap.add_argument("--slice", metavar="A:B", help=f"its requests A..B, 1-based ({FULL['slice']})")
    ap.add_argument("--max-prompt", type=int, help=f"prompt tokens kept ({FULL['max_prompt']})")
    ap.add_argument("--max-output", type=int, help=f"output tokens ({FULL['max_output']})")
    ap.add_argument("--speedup", type=float,
                    help=f"the trace's clock divided by this ({FULL['speedup']})")
    ap.add_argument("--kv-tokens", type=int, help=f"vLLM's KV space ({FULL['kv_tokens']})")
    ap.add_argument("--sizes", type=float, nargs="+",
                    help="CPU tier sizes, shares of the working set (0.2 0.5)")
    ap.add_argument("--modes", nargs="+", metavar="MODE",
                    help="run only these (plain, lru-20, adaptive-20, lmcache-20, ...)")
    ap.add_argument("--lmcache-python", metavar="PY",
                    help="LMCache's environment's interpreter (scripts/setup_lmcache_env.sh)")
    ap.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of every mode's client")
    ap.add_argument("--quick", action="store_true", help="a smoke run (a few minutes)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server logs)")
    ap.add_argument("--predict-only", action="store_true",
                    help="the manager's prediction only (no server; seconds)")
    args = ap.parse_args()
    base = QUICK if args.quick else FULL
    for key in ("slice", "max_prompt", "max_output", "speedup", "kv_tokens", "sizes"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if any(not 0 < s <= 1 for s in args.sizes):
        ap.error("--sizes are shares of the working set, in (0, 1]")
    if not args.trace.is_file():
        ap.error(f"--trace {args.trace}: no such file")
    if args.max_prompt + args.max_output > MAX_POSITIONS:
        ap.error(f"--max-prompt + --max-output must fit the model's {MAX_POSITIONS} positions")
    if args.kv_tokens < args.max_prompt + args.max_output:
        ap.error(f"--kv-tokens {args.kv_tokens} holds no request of --max-prompt + "
                 f"--max-output tokens (vLLM would not start)")
    known = modes(size_tags(args.sizes), bool(args.lmcache_python))
    if set(args.modes or ()) - set(known):
        ap.error(f"--modes: {sorted(set(args.modes) - set(known))} unknown; these run: {known}")
    return args


def predictions(prompts: list[list[int]], outputs: list[int], bs: int, gpu_blocks: int,
                sizes: dict[str, int]) -> dict:
    """The manager's prediction for every mode but LMCache's (plain: no CPU tier)."""
    out = {"plain": predict(prompts, outputs, bs, gpu_blocks, 0, "lru")}
    for tag, cpu in sizes.items():
        for pol in ("lru", "adaptive"):
            out[f"{pol}-{tag}"] = predict(prompts, outputs, bs, gpu_blocks, cpu, pol)
    for name, r in out.items():
        log(f"predicted {name}: CPU tier {r['cpu_tier_tokens']:,}, GPU tier "
            f"{r['gpu_tokens']:,}, computed {r['computed_tokens']:,} tokens")
    return out


def main() -> None:
    args = parse_args()
    pin_hash_seed(args.hash_seed)
    serve_mod, policy_mod = load_script("bench_serve"), load_script("bench_policy")
    from kvcached.tools.trace import load_trace

    p = dict(QUICK if args.quick else FULL)
    bs, per_token = serve_mod.BS, serve_mod.kv_bytes_per_token(p["layers"], p["hidden"])
    p["kv_mb"] = -(-args.kv_tokens * per_token // (1 << 20))
    p["max_model_len"] = args.max_prompt + args.max_output
    gpu_blocks = (p["kv_mb"] << 20) // (per_token * bs) - 1  # vLLM's null block
    everything = load_trace(args.trace)
    a, b = policy_mod.parse_slice(args.slice, len(everything))
    rows = cut_slice(everything[a:b], args.max_prompt, args.max_output, args.speedup)
    work = Path(tempfile.mkdtemp(prefix="kvcached-st-", dir="/tmp"))
    try:
        data = work / "slice.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        model = serve_mod.make_model(str(work / "model"), p["layers"], p["hidden"])
        prompts = client_prompts(data, model, len(rows))
        ws = working_set_blocks(prompts, bs)
        sizes = {tag: max(1, round(s * ws)) for tag, s in zip(size_tags(args.sizes),
                                                              args.sizes, strict=True)}
        log(f"{args.trace.name} requests {a + 1}-{b}: {sum(map(len, prompts)):,} prompt "
            f"tokens, working set {ws:,} blocks of {bs}; vLLM's KV {gpu_blocks:,} blocks; CPU "
            f"tier {', '.join(f'{t}%: {c:,}' for t, c in sizes.items())} blocks; "
            f"{rows[-1]['timestamp'] / 1000:.0f}s of replay")
        predicted = predictions(prompts, [r["output_length"] for r in rows], bs, gpu_blocks,
                                sizes)
        measured = {} if args.predict_only else run_modes(
            args, serve_mod, model, work, p, data, len(rows), sizes, per_token * bs)
    finally:
        if args.keep:
            log(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_table(measured, predicted)
    total = sum(map(len, prompts))
    emit({"bench": "serve_trace", "quick": bool(args.quick), "trace": args.trace.name,
          "slice": f"{a + 1}:{b}", "requests": len(rows), "hash_seed": args.hash_seed,
          "max_prompt": args.max_prompt, "max_output": args.max_output,
          "speedup": args.speedup, "replay_s": rows[-1]["timestamp"] / 1000,
          "model": f"random Llama {p['layers']}x{p['hidden']} float32", "block_size": bs,
          "prompt_tokens": total, "working_set_blocks": ws, "vllm_kv_blocks": gpu_blocks,
          "cpu_blocks": sizes,
          # the server saw exactly these prompts (and the first once more: the client's
          # ready check)
          "client_prompts_match": all(m["prompt_tokens"] == total + len(prompts[0])
                                      for m in measured.values()) if measured else None,
          "measured": measured, "predicted": predicted, "targets": targets(measured, sizes)})


def size_tags(sizes: list[float]) -> list[str]:
    """A size's name in the modes: its percentage (0.2 -> "20")."""
    return [f"{round(s * 100)}" for s in sizes]


def run_modes(args, serve_mod, model: str, work: Path, p: dict, data: Path, n: int,
              sizes: dict[str, int], block_bytes: int) -> dict:
    """Every mode in turn (``--modes`` picks); their numbers by name."""
    out = {}
    for name in modes(sizes, bool(args.lmcache_python)):
        if args.modes and name not in args.modes:
            continue
        kind, _, tag = name.partition("-")
        if kind == "plain":
            out[name] = serve(serve_mod, name, model, work, p, data, n)
        elif kind == "lmcache":
            lmc_dir = work / name
            lmc_dir.mkdir()
            gb = sizes[tag] * block_bytes / (1 << 30)
            with load_script("bench_vllm").LMCacheServer(args.lmcache_python, lmc_dir,
                                                         gb) as lmc:
                out[name] = serve(serve_mod, name, model, work, p, data, n, lmc.connector(),
                                  lmc.env())
        else:
            conn = serve_mod.kvcached_connector(work / "store", sizes[tag],
                                                storage_backend="none", storage_url="",
                                                eviction_policy=kind)
            out[name] = serve(serve_mod, name, model, work, p, data, n, conn)
    return out


if __name__ == "__main__":
    main()
