#!/usr/bin/env python
"""Resident memory per cached block of the cache core.

Distinct prompts of 64-token blocks (random token ids below 32,000, as a
real vocabulary's) are allocated, committed and freed through the public
API until the GPU tier caches ``--blocks`` blocks (in-process transfer on a
tiny plane layout, so KV bytes do not count); the process's resident set
before and after, divided by the cached blocks, is the cost of one: its
node, its hash-memo record, children tables and pool entries, allocator
overhead included.

    python scripts/bench_memory.py [--blocks N]

The last line on stdout is JSON ``{"bench": "memory", ...}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import log  # noqa: E402

from kvcached import CacheConfig, CacheManager  # noqa: E402

BLOCK, PER_PROMPT = 64, 32


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=200_000, help="blocks to cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CacheConfig.load(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK,
                               dtype="float32", num_gpu_blocks=args.blocks + PER_PROMPT,
                               num_cpu_blocks=0, transfer_mode="inprocess", create_cache=True,
                               storage_backend="none", run_dir=f"{tmp}/run",
                               check_host_memory=False)
        rng = random.Random(0)
        with CacheManager(cfg).start() as mgr:
            gc.collect()
            before = rss_bytes()
            for i in range(args.blocks // PER_PROMPT):
                toks = [rng.randrange(32000) for _ in range(BLOCK * PER_PROMPT + 1)]
                mgr.allocate(i, toks)
                mgr.commit(i, toks, len(toks))
                mgr.free(i)
            gc.collect()
            grown = rss_bytes() - before
            cached = mgr.stats().cached_nodes
    per = grown / cached
    log(f"{cached} cached blocks: resident set +{grown / 2**20:.1f} MiB, {per:.0f} B per block")
    print(json.dumps({"bench": "memory", "cached_blocks": cached, "block_tokens": BLOCK,
                      "rss_growth_bytes": grown, "bytes_per_cached_block": round(per)}))


if __name__ == "__main__":
    main()
