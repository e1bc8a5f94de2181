"""Replay a request trace (Mooncake format) through the manager: hit rates per tier.

The public Mooncake traces have one JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}

``hash_ids`` name the 512-token blocks of the prompt: equal ids mean equal
tokens (and, as ids are given per prefix, an equal prefix). The replay turns
every id into 512 synthetic tokens, so kvcached's own chained hashes find
exactly the sharing the trace describes at any ``block_size``, and drives
``allocate`` / ``wait`` / ``commit`` / ``free`` per request, in file order,
with no model and in-process copies on a tiny layout. It reports the hit
rate per tier, the prefill tokens saved and the manager's time per request,
then one JSON line (``{"bench": "trace", ...}``).

    kvcached bench trace --trace FILE.jsonl [--gpu-blocks N ...] [--cpu-blocks N]

``bench`` is a click group; the CLI adds it with ``main.add_command(bench)``.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from kvcached.config import CacheConfig
from kvcached.errors import NoFreeBlocks, TransferFailed

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake traces
MAX_HASH_ID = 1 << 40  # keeps id * TRACE_BLOCK + offset far inside int64
PAD_BASE = 1 << 52  # tokens past the trace's hash ids: unique to their request

# A tiny layout (copies are cheap) and capacities for requests of a few
# thousand tokens; every key can be overridden.
TRACE_DEFAULTS = dict(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                      block_size=64, num_gpu_blocks=1024, num_cpu_blocks=0,
                      transfer_mode="inprocess", create_cache=True, storage_backend=None,
                      tp_size=1, model_id="trace-replay")  # storage (--storage-dir) needs it


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# ------------------------------------------------------------------ parse
def _int_field(obj: dict, name: str, where: str, minimum: int) -> int:
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{where}: {name} must be an integer, got {v!r}")
    if v < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {v}")
    return v


def parse_line(line: str, where: str) -> TraceRequest | None:
    """One trace line (``None`` for a blank one); ValueError naming ``where`` otherwise."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"{where}: timestamp must be a number, got {ts!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(
            isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < MAX_HASH_ID
            for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers in 0..{MAX_HASH_ID - 1}")
    return TraceRequest(ts, _int_field(obj, "input_length", where, 1),
                        _int_field(obj, "output_length", where, 0), tuple(ids))


def load_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRequest]:
    """Parse a whole trace first, so a bad line fails before any replay work."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            req = parse_line(line, f"{path} line {lineno}")
            if req is not None:
                out.append(req)
                if max_requests is not None and len(out) >= max_requests:
                    break
    if not out:
        raise ValueError(f"{path}: no requests in the trace")
    return out


def trace_tokens(req: TraceRequest, index: int) -> list[int]:
    """Synthetic tokens: id ``h`` becomes ``h*512 .. h*512+511``; a prompt longer
    than its ids gets tokens no other request has."""
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    toks = (ids[:, None] * TRACE_BLOCK + np.arange(TRACE_BLOCK, dtype=np.int64)).ravel()
    extra = req.input_length - toks.size
    if extra > 0:
        pad = PAD_BASE + index * (1 << 24) + np.arange(extra, dtype=np.int64)
        toks = np.concatenate([toks, pad])
    return toks[:req.input_length].tolist()


IDEAL_NS = bytes(16)  # any fixed 16-byte namespace: only equality matters here


class IdealCache:
    """Hits of an unbounded cache at kvcached's block size: the ceiling of any capacity."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seen: set[bytes] = set()
        self.hit_tokens = 0

    def add(self, tokens: list[int]) -> None:
        """Count the cached prefix of ``tokens`` (as ``allocate`` would), then cache it."""
        from kvcached.core.hashing import block_hashes
        hashes = block_hashes(IDEAL_NS, tokens, self.block_size)
        usable = (len(tokens) - 1) // self.block_size  # one token is always computed
        n = 0
        while n < usable and hashes[n] in self.seen:
            n += 1
        self.hit_tokens += n * self.block_size
        self.seen.update(hashes)


# ----------------------------------------------------------------- replay
def trace_config(**overrides) -> CacheConfig:
    """The replay's CacheConfig: TRACE_DEFAULTS, then ``overrides`` (CacheConfig fields)."""
    return CacheConfig.load(**{**TRACE_DEFAULTS, **overrides})


def replay_trace(path: str | Path, max_requests: int | None = None, **overrides) -> dict:
    """Replay the trace at ``path`` through a fresh CacheManager; returns the report dict.

    ``overrides`` are CacheConfig fields: tier capacities (``num_gpu_blocks``,
    ``num_cpu_blocks``), ``block_size``, storage settings, ...
    """
    from kvcached.core.manager import CacheManager
    reqs = load_trace(path, max_requests)
    cfg = trace_config(**overrides)
    t0 = time.perf_counter()
    with CacheManager(cfg) as mgr:
        run = _Run(cfg.block_size)
        for i, r in enumerate(reqs):
            run.serve(mgr, i, trace_tokens(r, i), r.output_length)
        stats = mgr.stats()
    return run.report(path, cfg, len(reqs), stats, time.perf_counter() - t0)


class _Run:
    """Counters of one replay."""

    def __init__(self, block_size: int) -> None:
        self.ideal = IdealCache(block_size)
        self.hit = {"gpu": 0, "cpu": 0, "storage": 0}
        self.prompt_tokens = self.rejected = self.transfer_failures = 0
        self.times: list[float] = []

    def serve(self, mgr, rid: int, tokens: list[int], output_length: int) -> None:
        """One request as an engine would drive it, minus the model."""
        t0 = time.perf_counter()
        try:
            a = mgr.allocate(rid, tokens, reserve_tokens=output_length)
        except NoFreeBlocks:  # larger than the whole GPU tier: the engine would refuse it
            self.rejected += 1
            return
        try:
            a.wait()
        except TransferFailed:
            self.transfer_failures += 1  # the prefix shrank; the engine recomputes the rest
        mgr.commit(rid, tokens, len(tokens))
        mgr.free(rid)
        self.times.append(time.perf_counter() - t0)
        self.prompt_tokens += len(tokens)
        for tier, n in zip(self.hit, (a.hit.gpu_tokens, a.hit.cpu_tokens, a.hit.storage_tokens)):
            self.hit[tier] += n
        self.ideal.add(tokens)

    def report(self, path, cfg: CacheConfig, requests: int, stats, elapsed: float) -> dict:
        """The JSON line's dict; hit rates are shares of the served prompt tokens."""
        served = len(self.times)
        saved = sum(self.hit.values())
        us = sorted(t * 1e6 for t in self.times)
        rate = (lambda n: round(n / self.prompt_tokens, 4)) if self.prompt_tokens else (
            lambda n: 0.0)
        return {
            "bench": "trace", "trace": str(path), "requests": requests, "served": served,
            "rejected": self.rejected, "transfer_failures": self.transfer_failures,
            "block_size": cfg.block_size, "num_gpu_blocks": cfg.num_gpu_blocks,
            "num_cpu_blocks": cfg.num_cpu_blocks, "storage_backend": cfg.storage_backend,
            "gpu_tokens": cfg.num_gpu_blocks * cfg.block_size,
            "prompt_tokens": self.prompt_tokens, "hit_tokens": dict(self.hit),
            "hit_rate": rate(saved), "hit_rate_gpu": rate(self.hit["gpu"]),
            "hit_rate_cpu": rate(self.hit["cpu"]), "hit_rate_storage": rate(self.hit["storage"]),
            "ideal_hit_rate": rate(self.ideal.hit_tokens),
            "prefill_tokens_saved": saved,
            "manager_us_per_request": {
                "mean": round(sum(us) / served, 1) if served else 0.0,
                "p50": round(us[served // 2], 1) if served else 0.0,
                "p99": round(us[min(served - 1, int(0.99 * served))], 1) if served else 0.0},
            "evictions": stats.evictions, "elapsed_s": round(elapsed, 3),
        }


def summary_line(res: dict) -> str:
    """A human-readable line for one replay."""
    us = res["manager_us_per_request"]
    return (f"trace {Path(res['trace']).name}: {res['served']}/{res['requests']} requests, "
            f"GPU {res['num_gpu_blocks']} x {res['block_size']} tokens, CPU "
            f"{res['num_cpu_blocks']}: hit {res['hit_rate']:.1%} (GPU {res['hit_rate_gpu']:.1%}, "
            f"CPU {res['hit_rate_cpu']:.1%}, storage {res['hit_rate_storage']:.1%}; ideal "
            f"{res['ideal_hit_rate']:.1%}), saved {res['prefill_tokens_saved']} prefill tokens, "
            f"manager {us['mean']:.0f} us/request (p99 {us['p99']:.0f})")


# -------------------------------------------------------------- synthetic
def synthetic_trace(n: int = 200, seed: int = 0) -> list[dict]:
    """A deterministic trace in the Mooncake format: multi-turn sessions over a few
    shared system prompts, plus one-off requests; prompts of 1..16 trace blocks."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [fresh(rng.randint(1, 4)) for _ in range(4)]
    sessions: list[list[int]] = []
    out, ts = [], 0
    for _ in range(n):
        ts += int(rng.expovariate(1 / 400)) + 1
        ids = _next_ids(rng, systems, sessions, fresh)
        length = len(ids) * TRACE_BLOCK - rng.randrange(TRACE_BLOCK)
        out.append({"timestamp": ts, "input_length": length,
                    "output_length": rng.randint(16, 512), "hash_ids": ids})
    return out


def _next_ids(rng: random.Random, systems, sessions: list[list[int]], fresh) -> list[int]:
    """Continue an open session (70%), open one, or send a one-off request."""
    roll = rng.random()
    if sessions and roll < 0.7:
        i = rng.randrange(len(sessions))
        ids = sessions[i] + fresh(rng.randint(1, 2))  # the last turn plus a new message
        if len(ids) > 14:
            sessions.pop(i)  # the conversation ends
        else:
            sessions[i] = ids
        return ids
    ids = rng.choice(systems) + fresh(rng.randint(1, 3))
    if roll < 0.9 and len(sessions) < 12:
        sessions.append(ids)
    return ids


def write_synthetic_trace(path: str | Path, n: int = 200, seed: int = 0) -> Path:
    """Write :func:`synthetic_trace` as JSON lines (how tests/data/synthetic_trace.jsonl
    was made: ``write_synthetic_trace("tests/data/synthetic_trace.jsonl")``)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_trace(n, seed)))
    return path


# -------------------------------------------------------------------- CLI
bench = click.Group("bench", help="Benchmarks; each prints a JSON line at the end.")


@bench.command("trace")
@click.option("--trace", "trace_path", required=True,
              type=click.Path(exists=True, dir_okay=False), help="Mooncake-format JSONL trace")
@click.option("--gpu-blocks", type=int, multiple=True,
              help="GPU tier capacity in blocks; repeat to sweep (one JSON line each)")
@click.option("--cpu-blocks", type=int, default=None, help="CPU tier capacity in blocks")
@click.option("--block-size", type=int, default=None, help="tokens per kvcached block")
@click.option("--storage-dir", default=None,
              help="enable the file storage tier (a fresh subdirectory per replay)")
@click.option("--max-requests", type=int, default=None, help="replay only the first N")
def trace_command(trace_path: str, gpu_blocks: tuple[int, ...], cpu_blocks: int | None,
                  block_size: int | None, storage_dir: str | None,
                  max_requests: int | None) -> None:
    """Replay a request trace through the manager and report hit rates per tier."""
    base: dict = {}
    if cpu_blocks is not None:
        base["num_cpu_blocks"] = cpu_blocks
    if block_size is not None:
        base["block_size"] = block_size
    results = []
    for gpu in gpu_blocks or (None,):
        kw = dict(base, **({"num_gpu_blocks": gpu} if gpu else {}))
        try:
            with _fresh_store(storage_dir) as store:
                if store:
                    kw.update(storage_backend="file", storage_url=store)
                res = replay_trace(trace_path, max_requests=max_requests, **kw)
        except ValueError as e:
            raise click.ClickException(str(e)) from e
        click.echo(summary_line(res))
        results.append(res)
    for res in results:
        click.echo(json.dumps(res))


@contextlib.contextmanager
def _fresh_store(parent: str | None):
    """An empty storage directory under ``parent`` per replay, so that the points of
    a capacity sweep do not hit each other's blocks; removed afterwards."""
    if not parent:
        yield None
        return
    Path(parent).mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="replay-", dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcached.tools.trace --trace FILE ...``: the ``bench trace`` command."""
    try:
        trace_command.main(args=list(argv) if argv is not None else None,
                           prog_name="kvcached bench trace", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.Abort:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
