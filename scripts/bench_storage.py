#!/usr/bin/env python
"""Storage tier benchmark: BlockStore store / load GB/s per backend.

For 16 and 256 blocks of the default layout (128 KiB per block) it measures
``BlockStore.store`` and ``BlockStore.load`` (payload bytes / wall time, best
of a few repetitions) on the file backend (always), Redis (when
``redis-server`` can be started on 127.0.0.1) and Mooncake (when the package
imports and a private network namespace can be made with ``unshare -n``; the
Mooncake part runs in a child process inside it), next to a plain memcpy of
the same bytes measured in the same run. Backends that cannot run are
reported as skipped with the reason. The last line printed is the JSON
summary ``{"bench": "storage", ...}``.

Usage: python scripts/bench_storage.py [--reps 5] [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvcached.layout import KVLayout  # noqa: E402
from kvcached.storage import BlockStore, open_backend, storage_namespace  # noqa: E402

logger = logging.getLogger(__name__)

LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
SIZES = (16, 256)
CHILD_FLAG = "--mooncake-child"


# ------------------------------------------------------------------ helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _hashes(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


# ------------------------------------------------------------------ measuring
def bench_memcpy(n: int, reps: int) -> float:
    """GB/s of one contiguous copy of ``n`` blocks (the same bytes a store moves)."""
    src = torch.randint(0, 256, (n, LAYOUT.block_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):  # the first one warms the pages
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return _gbps(src.numel(), best)


def bench_blockstore(bs: BlockStore, n: int, reps: int, fresh_keys: bool) -> dict:
    """Best-of-``reps`` store and load GB/s for ``n`` blocks."""
    pool = torch.randint(0, 256, (n, LAYOUT.block_bytes), dtype=torch.uint8)
    out = torch.zeros_like(pool)
    ids = list(range(n))
    best_store = best_load = float("inf")
    for rep in range(reps):
        # Fresh keys each time: Mooncake's put does not overwrite (it would be a no-op).
        hashes = _hashes(n, f"{n}/{rep if fresh_keys else 0}")
        t0 = time.perf_counter()
        ok = bs.store(hashes, pool, ids)
        t1 = time.perf_counter()
        got = bs.load(hashes, out, ids)
        t2 = time.perf_counter()
        if not all(ok) or got != n:
            raise RuntimeError(f"store ok {sum(ok)}/{n}, load {got}/{n}: {bs.stats()}")
        best_store, best_load = min(best_store, t1 - t0), min(best_load, t2 - t1)
    if not torch.equal(out, pool):
        raise RuntimeError("loaded bytes differ from stored bytes")
    nbytes = n * LAYOUT.block_bytes
    return {"store_gbps": _gbps(nbytes, best_store), "load_gbps": _gbps(nbytes, best_load)}


def bench_backend(make_backend, reps: int, fresh_keys: bool = True) -> dict:
    """Run both sizes on a fresh backend; clears it between sizes."""
    backend = make_backend()
    bs = BlockStore(backend, LAYOUT.digest, 0, 1, storage_namespace("bench", "0"))
    try:
        out = {}
        for n in SIZES:
            out[str(n)] = bench_blockstore(bs, n, reps, fresh_keys)
            backend.clear()
        return out
    finally:
        bs.close()


# ------------------------------------------------------------------ backends
def run_file(reps: int, base_dir: str | None) -> dict:
    d = tempfile.mkdtemp(prefix="kvcached-bench-", dir=base_dir)
    try:
        res = bench_backend(lambda: open_backend("file", os.path.join(d, "store")), reps)
        res["dir"] = d
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_redis(reps: int) -> dict:
    exe = shutil.which("redis-server")
    if exe is None:
        return {"skipped": "redis-server not installed (scripts/install_services.sh)"}
    try:
        import redis  # noqa: F401
    except ImportError:
        return {"skipped": "the 'redis' package is not installed (pip install 'kvcached[redis]')"}
    port = _free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", d],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait(lambda: proc.poll() is not None or _port_open(port), 10, "redis-server")
            if proc.poll() is not None:
                return {"skipped": f"redis-server exited with {proc.returncode}"}
            return bench_backend(lambda: open_backend("redis", f"redis://127.0.0.1:{port}"), reps)
        finally:
            _stop(proc)


def run_mooncake_parent(reps: int) -> dict:
    """Re-run this script inside ``unshare -n`` for the Mooncake part."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return {"skipped": f"mooncake does not import ({e}); scripts/install_services.sh"}
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return {"skipped": "needs unshare and ip (iproute2) for a private network namespace"}
    inner = f'ip link set lo up && exec "$0" "$1" {CHILD_FLAG} --reps {reps}'
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", inner, sys.executable,
                             str(Path(__file__).resolve())], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return {"skipped": "mooncake benchmark timed out"}
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        return {"skipped": f"private network namespace run failed (rc {proc.returncode}): "
                           f"{last}"}
    return json.loads(out.strip().splitlines()[-1])


def run_mooncake_child(reps: int) -> dict:
    """Inside the private namespace: master + storage node, then the benchmark."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    bindir = Path(sys.executable).parent
    port, node_port = _free_port(), _free_port()
    logs = tempfile.TemporaryDirectory()
    master = node = None
    try:
        with open(os.path.join(logs.name, "master.log"), "w") as log:
            master = subprocess.Popen([str(bindir / "mooncake_master"), f"--rpc_port={port}",
                                       "--rpc_address=127.0.0.1", f"--metrics_port={_free_port()}",
                                       "--metrics_host=127.0.0.1",
                                       "--enable_metric_reporting=false"],
                                      stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: _port_open(port), 15, "mooncake_master")
        with open(os.path.join(logs.name, "node.log"), "w") as log:
            node = subprocess.Popen([str(bindir / "mooncake_client"), "--host=127.0.0.1",
                                     f"--port={node_port}", f"--master_server_address=127.0.0.1:{port}",
                                     "--metadata_server=P2PHANDSHAKE",
                                     "--global_segment_size=1GB", "--protocol=tcp"],
                                    stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: _port_open(node_port), 15, "mooncake_client")

        def make():
            be = open_backend("mooncake", f"127.0.0.1:{port}")
            _wait(lambda: be.put_from(["probe"], [b"x"]) == [True], 20, "mooncake segment")
            return be

        return bench_backend(make, reps)
    finally:
        _stop(node)
        _stop(master)
        logs.cleanup()


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="parent directory for the file backend")
    ap.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.mooncake_child:
        print(json.dumps(run_mooncake_child(args.reps)))
        return
    result = {"bench": "storage", "block_bytes": LAYOUT.block_bytes, "blocks": list(SIZES),
              "reps": args.reps,
              "memcpy_gbps": {str(n): bench_memcpy(n, args.reps) for n in SIZES}}
    for name, fn in (("file", lambda: run_file(args.reps, args.dir)),
                     ("redis", lambda: run_redis(args.reps)),
                     ("mooncake", lambda: run_mooncake_parent(args.reps))):
        try:
            result[name] = fn()
        except Exception as e:  # one backend's trouble must not hide the others
            result[name] = {"skipped": f"{type(e).__name__}: {e}"}
        print(f"{name}: {result[name]}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
