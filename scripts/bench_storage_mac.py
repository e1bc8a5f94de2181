#!/usr/bin/env python
"""What a fleet secret costs a storage hit: MAC primitives, object verification
and BlockStore loads, with vs without ``storage_secret_*``.

Three parts, each best of ``--reps`` on one core:

- ``primitives``: GB/s of candidate MACs over 1 and 4 MiB (xxh3 — today's
  checksum —, keyed BLAKE2b, keyed BLAKE3 when the ``blake3`` package imports,
  Poly1305, AES-GMAC, and the per-object AES-GMAC kvcached uses, key derivation
  included), and AEAD encryption for reference (AES-GCM, ChaCha20-Poly1305).
- ``verify``: ``objects.verify_object`` over objects already in memory (the
  CPU work a hit adds to its read): microseconds per object and the ratio
  signed / unsigned, per block size; ``encrypted`` (``storage_encrypt``)
  verifies and decrypts in place (the time to put the ciphertext back before
  each pass is measured apart and subtracted).
- ``load``: ``BlockStore.load`` of ``--blocks`` blocks from a file store in
  the page cache (read + verify [+ decrypt]): GB/s unsigned, signed and
  encrypted, and the ratios unsigned / signed and unsigned / encrypted;
  ``store``: ``BlockStore.store`` of the same blocks into it (objects deleted
  first, the delete not timed).

The last line printed is the JSON summary ``{"bench": "storage_mac", ...}``.

Usage: python scripts/bench_storage_mac.py [--reps 5] [--blocks 64]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import emit, log  # noqa: E402

from kvcached.layout import KVLayout  # noqa: E402
from kvcached.storage import BlockStore, open_backend, storage_namespace  # noqa: E402
from kvcached.storage import objects as obj  # noqa: E402
from kvcached.storage.auth import ObjectAuth  # noqa: E402

SECRET = hashlib.sha256(b"bench").hexdigest().encode()  # 64 bytes, a bench-only secret
# 128 KiB (the default layout) and 1 MiB blocks (16 layers x 8 KV heads x 128 x 16
# tokens of bfloat16, K and V: an 8B model's block per 2 ranks' worth of layers).
LAYOUTS = {"128KiB": KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16,
                              dtype="float32"),
           "1MiB": KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16,
                            dtype="bfloat16")}


def best_s(fn, reps: int, inner: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


# ------------------------------------------------------------------ primitives
def primitives(reps: int) -> dict:
    import xxhash
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    key = os.urandom(32)
    nonce = os.urandom(12)
    auth = ObjectAuth([SECRET])
    signed = bytes(112)
    cands = {
        "xxh3_64 (unsigned checksum)": xxhash.xxh3_64_intdigest,
        "blake2b keyed": lambda d: hashlib.blake2b(d, key=key, digest_size=16).digest(),
        "poly1305": lambda d: Poly1305.generate_tag(key, d),
        "aes_gmac": lambda d: AESGCM(key).encrypt(nonce, b"", d),
        "aes_gmac per object (kvcached)": lambda d: auth.tag(auth.signing_key_id, "ns@mac/k/0of1",
                                                             signed, d),
        "aes_gcm encrypt": lambda d: AESGCM(key).encrypt(nonce, d, None),
        "chacha20_poly1305 encrypt": lambda d: ChaCha20Poly1305(key).encrypt(nonce, d, None),
    }
    try:
        import blake3
        cands["blake3 keyed"] = lambda d: blake3.blake3(d, key=key).digest(16)
    except ImportError:
        log("blake3 not importable: skipped")
    out: dict = {}
    for size in (1 << 20, 4 << 20):
        data = memoryview(np.random.randint(0, 256, size, dtype=np.uint8))
        row = {}
        for name, fn in cands.items():
            if "encrypt" in name and isinstance(data, memoryview):
                d = bytes(data)  # AEAD encrypt wants bytes in; the copy is not timed
            else:
                d = data
            s = best_s(lambda fn=fn, d=d: fn(d), reps, inner=max(1, (64 << 20) // size))
            row[name] = round(size / s / 1e9, 2)
        out[f"{size >> 20}MiB_gbps"] = row
        log(f"primitives {size >> 20} MiB: {row}")
    return out


# ------------------------------------------------------------------ verify
def verify(reps: int, n: int = 64) -> dict:
    auths = {"unsigned": None, "signed": ObjectAuth([SECRET]),
             "encrypted": ObjectAuth([SECRET], encrypt=True)}
    out = {}
    for name, layout in LAYOUTS.items():
        pool = np.random.randint(0, 256, (n, layout.block_bytes), dtype=np.uint8)
        hashes = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]
        res = {}
        for label, a in auths.items():
            keys = [obj.object_key("ns@mac" if a else "ns", h, 0, 1) for h in hashes]
            stored = pool.copy()  # what is read: the block, or its ciphertext
            sealed = np.empty(layout.block_bytes + 16, dtype=np.uint8)
            hdrs = []
            for i, (h, k) in enumerate(zip(hashes, keys, strict=True)):
                hdrs.append(obj.pack_header(layout_digest=layout.digest, block_hash=h,
                                            rank=0, tp_size=1, payload=memoryview(pool[i]),
                                            auth=a, key=k, sealed=memoryview(sealed)))
                if a is not None and a.encrypt:
                    stored[i] = sealed[:layout.block_bytes]
            nread = obj.header_size(a) + layout.block_bytes
            buf = stored.copy()  # decrypted in place: refilled from `stored` before a pass
            refill = a is not None and a.encrypt

            def run(a=a, keys=keys, hdrs=hdrs, nread=nread, layout=layout, buf=buf,
                    hashes=hashes, refill=refill, stored=stored, check=True):
                if refill:
                    np.copyto(buf, stored)
                if not check:
                    return
                for i in range(n):
                    r = obj.verify_object(hdrs[i], memoryview(buf[i]), nread=nread,
                                          layout_digest=layout.digest, block_hash=hashes[i],
                                          rank=0, tp_size=1, auth=a, key=keys[i])
                    assert r is None, r
            t = best_s(run, reps)
            if refill:
                assert np.array_equal(buf, pool)  # the last pass decrypted every block
                t -= best_s(lambda run=run: run(check=False), reps)
            res[f"{label}_us_per_object"] = round(t / n * 1e6, 2)
        for label in ("signed", "encrypted"):
            res[f"{label}_over_unsigned"] = round(res[f"{label}_us_per_object"]
                                                  / res["unsigned_us_per_object"], 2)
        out[name] = res
        log(f"verify {name}: {res}")
    return out


# ------------------------------------------------------------------ load
def load(reps: int, n: int) -> dict:
    auths = {"unsigned": None, "signed": ObjectAuth([SECRET]),
             "encrypted": ObjectAuth([SECRET], encrypt=True)}
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-mac-") as d:
        backend = open_backend("file", d)
        try:
            for name, layout in LAYOUTS.items():
                pool = torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8)
                dst = torch.zeros_like(pool)
                ids = list(range(n))
                hashes = [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest()
                          for i in range(n)]
                stores = {}
                for label, a in auths.items():
                    stores[label] = BlockStore(backend, layout.digest, 0, 1,
                                               storage_namespace("bench", name), auth=a)
                best = dict.fromkeys(stores, float("inf"))
                best_store = dict.fromkeys(stores, float("inf"))
                for _ in range(reps + 1):  # interleaved: all see the same machine
                    for label, bs in stores.items():
                        bs.delete(hashes)
                        t0 = time.perf_counter()
                        assert all(bs.store(hashes, pool, ids))
                        best_store[label] = min(best_store[label], time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        assert bs.load(hashes, dst, ids) == n
                        best[label] = min(best[label], time.perf_counter() - t0)
                        assert torch.equal(dst, pool)
                        dst.zero_()
                res = {f"{k}_gbps": round(n * layout.block_bytes / v / 1e9, 2)
                       for k, v in best.items()}
                res["unsigned_over_signed"] = round(res["unsigned_gbps"] / res["signed_gbps"], 3)
                res["unsigned_over_encrypted"] = round(res["unsigned_gbps"]
                                                       / res["encrypted_gbps"], 3)
                res["store_gbps"] = {k: round(n * layout.block_bytes / v / 1e9, 2)
                                     for k, v in best_store.items()}
                out[name] = res
                log(f"load {n} x {name} from the page cache: {res}")
                backend.clear()
        finally:
            backend.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64)
    args = ap.parse_args()
    result = {"bench": "storage_mac", "primitives": primitives(args.reps),
              "verify": verify(args.reps), "load": load(args.reps, args.blocks)}
    emit(result)


if __name__ == "__main__":
    main()
