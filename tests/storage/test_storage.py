"""Storage tier: object format, circuit breaker, file backend, BlockStore, factory."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest_storage import (  # noqa: E402
    LAYOUT,
    NS,
    check_damaged,
    check_namespace_isolation,
    check_partial_batch,
    check_restart,
    check_wrong_layout,
    make_hashes,
    make_pool,
    make_store,
)

from kvcached.config import CacheConfig  # noqa: E402
from kvcached.storage import (  # noqa: E402
    HEADER_SIZE,
    BlockStore,
    CircuitBreaker,
    object_key,
    open_backend,
    storage_namespace,
)
from kvcached.storage import objects as obj  # noqa: E402
from kvcached.storage.base import OVERSIZE  # noqa: E402
from kvcached.storage.file import MARKER, FileBackend  # noqa: E402


# ------------------------------------------------------------------ objects
def test_namespace_and_key_format():
    assert storage_namespace("kvcached-demo", "0") == "kvcached-demo@0"
    assert storage_namespace("kvcached-demo", "1") != storage_namespace("kvcached-demo", "0")
    salted = storage_namespace("kvcached-demo", "0", salt="tenant-a")
    assert salted.startswith("kvcached-demo@0+") and "tenant-a" not in salted
    # Escaping keeps distinct model ids distinct and keys free of extra slashes.
    a, b = storage_namespace("org/model", "0"), storage_namespace("org_model", "0")
    assert a != b and "/" not in a
    assert len(storage_namespace("m" * 500, "0")) < 100
    h = bytes(range(16))
    assert object_key(NS, h, 1, 2) == f"kvcached-demo@0/{h.hex()}/1of2"
    with pytest.raises(ValueError):
        object_key(NS, h, 2, 2)


@pytest.mark.parametrize("kind", [obj.CHECKSUM_CRC32, obj.DEFAULT_CHECKSUM])
def test_header_roundtrip_and_every_rejection(kind):
    payload = bytearray(os.urandom(1000))
    h = bytes(range(16))
    args = dict(layout_digest="abcd", block_hash=h, rank=1, tp_size=2)
    hdr = bytearray(obj.pack_header(payload=payload, kind=kind, **args))
    assert len(hdr) == HEADER_SIZE and hdr[:4] == obj.MAGIC
    n = HEADER_SIZE + len(payload)
    assert obj.verify_object(hdr, payload, nread=n, **args) is None

    def reason(header=hdr, data=payload, nread=n, **over):
        return obj.verify_object(header, data, nread=nread, **{**args, **over})

    assert reason(nread=n - 1) == "short_read"
    assert reason(layout_digest="other") == "layout_mismatch"
    assert reason(block_hash=bytes(16)) == "wrong_block"
    assert reason(rank=0) == "wrong_block"
    flipped = bytearray(payload)
    flipped[500] ^= 1
    assert reason(data=flipped) == "checksum_mismatch"
    for pos, why in ((0, "bad_magic"), (4, "bad_version"), (30, "bad_header_crc")):
        bad = bytearray(hdr)
        bad[pos] ^= 0xFF
        assert reason(header=bad) == why


@settings(max_examples=60, deadline=None)
@given(pos=st.integers(0, HEADER_SIZE + 255), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(pos, bit):
    payload = bytearray(range(256))
    args = dict(layout_digest=LAYOUT.digest, block_hash=bytes(16), rank=0, tp_size=1)
    obj_bytes = bytearray(obj.pack_header(payload=payload, **args)) + payload
    obj_bytes[pos] ^= 1 << bit
    hdr, data = obj_bytes[:HEADER_SIZE], obj_bytes[HEADER_SIZE:]
    assert obj.verify_object(hdr, data, nread=len(obj_bytes), **args) is not None


# ------------------------------------------------------------------ breaker
def test_circuit_breaker_opens_fails_fast_and_probes():
    now = [0.0]
    br = CircuitBreaker(threshold=2, cooldown_s=5.0, clock=lambda: now[0])
    assert br.allow() and br.state == "closed"
    assert not br.record_failure()
    assert br.record_failure() and br.state == "open" and br.opens == 1
    assert not br.allow()
    now[0] = 5.0
    assert br.state == "half_open"
    assert br.allow()          # the one probe
    assert not br.allow()      # others still fail fast while it is out
    br.record_failure()        # probe failed: open again
    assert br.state == "open" and br.opens == 2
    now[0] = 10.0
    assert br.allow()
    br.record_success()
    assert br.state == "closed" and br.allow()


# ------------------------------------------------------------------ file backend
def _file(tmp_path, **kw) -> FileBackend:
    return open_backend("file", str(tmp_path / "store"), **kw)


@pytest.mark.parametrize("io_threads", [1, 3])
def test_file_restart_finds_every_object(tmp_path, io_threads):
    check_restart(lambda: _file(tmp_path, io_threads=io_threads))


def test_file_backend_raw_api(tmp_path):
    be = _file(tmp_path)
    keys = ["ns/a", "ns/b"]
    assert be.put_from(keys, [b"hello", [b"wor", bytearray(b"ld")]]) == [True, True]
    assert be.exists(keys + ["ns/c"]) == [True, True, False]
    a, b = bytearray(8), [bytearray(2), bytearray(6)]
    assert be.get_into(keys + ["ns/c"], [a, b, bytearray(4)]) == [5, 5, -1]
    assert bytes(a[:5]) == b"hello" and bytes(b[0]) + bytes(b[1][:3]) == b"world"
    assert be.get_into(["ns/a"], [bytearray(3)]) == [OVERSIZE]  # larger than the buffer: not read
    be.delete(["ns/a", "ns/zz"])
    assert be.exists(keys) == [False, True]
    be.clear()
    assert be.exists(keys) == [False, False]
    assert (tmp_path / "store" / MARKER).exists()
    s = be.stats()
    assert s["kind"] == "file" and s["hits"] == 2 and s["misses"] == 2 and s["objects"] == 0
    assert be.healthy()
    be.close()
    assert be.exists(keys) == [False, False]  # closed: fails fast, no exception


def test_file_refuses_foreign_directory(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a kvcached store"):
        open_backend("file", str(tmp_path / "home"))


def test_file_partial_batch(tmp_path):
    check_partial_batch(make_store(_file(tmp_path)))


def test_file_namespace_isolation(tmp_path):
    check_namespace_isolation(_file(tmp_path))


def test_file_wrong_layout_is_a_miss(tmp_path):
    check_wrong_layout(_file(tmp_path))


def _object_path(be: FileBackend, key: str) -> str:
    return be._path(key)


@pytest.mark.parametrize("pos,reason", [(HEADER_SIZE + 777, "miss_checksum_mismatch"),
                                        (0, "miss_bad_magic"),
                                        (40, "miss_bad_header_crc")])
def test_file_corrupt_object_is_a_counted_miss(tmp_path, pos, reason):
    be = _file(tmp_path)

    def flip(key):
        with open(_object_path(be, key), "r+b") as f:
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x40]))

    check_damaged(make_store(be), flip, reason)


def test_file_truncated_object_is_a_miss(tmp_path):
    be = _file(tmp_path)

    def truncate(key):
        os.truncate(_object_path(be, key), HEADER_SIZE + LAYOUT.block_bytes // 2)

    check_damaged(make_store(be), truncate, "miss_short_read")


def test_file_failed_put_is_never_visible(tmp_path, monkeypatch):
    be = _file(tmp_path)
    bs = make_store(be)
    pool, hashes = make_pool(3), make_hashes(3)
    real_writev = os.writev

    def half_then_enospc(fd, bufs):
        real_writev(fd, [bytes(100)])  # a torn write...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk is full

    monkeypatch.setattr(os, "writev", half_then_enospc)
    assert bs.store(hashes, pool, [0, 1, 2]) == [False, False, False]
    monkeypatch.undo()
    assert bs.lookup(hashes) == 0
    assert be.exists(bs.keys(hashes)) == [False] * 3
    leftovers = [p for p in (tmp_path / "store").rglob("*")
                 if p.is_file() and p.name not in (MARKER, ".usage")]  # .usage: the ledger
    assert leftovers == []  # no temp file left behind either
    st = be.stats()
    assert st["puts_failed"] == 3 and st["io_errors"] == 3 and "No space" in st["last_error"]
    # A fresh instance does not see them either.
    assert make_store(_file(tmp_path)).lookup(hashes) == 0


def test_file_failed_rename_is_never_visible(tmp_path, monkeypatch):
    be = _file(tmp_path)
    bs = make_store(be)
    pool, hashes = make_pool(2), make_hashes(2)

    def readonly(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "rename", readonly)
    assert bs.store(hashes, pool, [0, 1]) == [False, False]
    monkeypatch.undo()
    assert bs.lookup(hashes) == 0
    assert [p for p in (tmp_path / "store").rglob(".tmp-*")] == []


def test_file_size_cap_evicts_least_recently_used(tmp_path):
    obj_bytes = HEADER_SIZE + LAYOUT.block_bytes
    be = _file(tmp_path, max_bytes=4 * obj_bytes)
    bs = make_store(be)
    pool, hashes = make_pool(6), make_hashes(6)
    assert all(bs.store(hashes[:4], pool, [0, 1, 2, 3]))
    # Touch block 0 so block 1 becomes the least recently used.
    assert bs.load(hashes[:1], pool, [0]) == 1
    assert all(bs.store(hashes[4:6], pool, [4, 5]))
    present = be.exists(bs.keys(hashes))
    assert present == [True, False, False, True, True, True]
    assert be.stats()["bytes_used"] <= 4 * obj_bytes and be.stats()["evictions"] == 2
    # The order survives a restart (mtimes are touched on hits).
    be2 = _file(tmp_path, max_bytes=4 * obj_bytes)
    assert be2.stats()["objects"] == 4
    bs2 = make_store(be2)
    assert bs2.load([hashes[3]], pool, [3]) == 1  # 3 is now the most recent
    assert all(bs2.store([hashes[1]], pool, [1]))  # evicts the oldest: block 0
    assert be2.exists(bs.keys([hashes[0], hashes[3], hashes[1]])) == [False, True, True]


def test_file_object_larger_than_cap_is_refused(tmp_path):
    be = _file(tmp_path, max_bytes=1000)
    assert be.put_from(["ns/big"], [bytes(2000)]) == [False]
    assert be.exists(["ns/big"]) == [False]


def test_file_index_suffix_counts_only_own_rank(tmp_path):
    obj_bytes = HEADER_SIZE + LAYOUT.block_bytes
    pool, hashes = make_pool(4), make_hashes(4)
    r0 = make_store(_file(tmp_path, index_suffix="/0of2"), rank=0, tp=2)
    r1 = make_store(_file(tmp_path, max_bytes=2 * obj_bytes, index_suffix="/1of2"), rank=1, tp=2)
    assert all(r0.store(hashes, pool, [0, 1, 2, 3]))
    assert all(r1.store(hashes[:2], pool, [0, 1]))
    # Rank 1 stays within its own share and never evicts rank 0's objects.
    assert r0.lookup(hashes) == 4 and r1.lookup(hashes) == 2
    assert r1.backend.stats()["evictions"] == 0


# ------------------------------------------------------------------ BlockStore
def test_blockstore_argument_checks(tmp_path):
    bs = make_store(_file(tmp_path))
    pool = make_pool(2)
    with pytest.raises(ValueError, match="hashes"):
        bs.store(make_hashes(2), pool, [0])
    with pytest.raises(ValueError, match="out of range"):
        bs.load(make_hashes(1), pool, [2])
    with pytest.raises(ValueError, match="uint8"):
        bs.store(make_hashes(1), pool.float(), [0])
    with pytest.raises(ValueError):
        BlockStore(bs.backend, LAYOUT.digest, 2, 2, NS)
    assert bs.store([], pool, []) == [] and bs.load([], pool, []) == 0 and bs.lookup([]) == 0


def test_blockstore_from_config(tmp_path):
    cfg = CacheConfig.load(storage_backend="file", storage_url=str(tmp_path / "s"),
                           storage_max_bytes=1 << 30, tp_size=2, num_cpu_blocks=8,
                           num_gpu_blocks=8, model_id="kvcached-demo")
    bs = BlockStore.from_config(cfg, rank=1)
    assert bs.namespace == "kvcached-demo@0" and bs.rank == 1 and bs.tp_size == 2
    assert bs.backend.max_bytes == (1 << 30) // 2
    assert BlockStore.from_config(cfg.replace(storage_backend=None), rank=0) is None


def test_mla_latent_is_one_copy_every_tp_size_shares(tmp_path):
    """MLA's latent is the same on every rank: rank 0 writes it under keys
    without the TP size, every rank of an instance of any TP size reads it."""
    mla = dict(storage_backend="file", storage_url=str(tmp_path / "s"), num_cpu_blocks=8,
               num_gpu_blocks=8, model_id="m", mla=True, num_kv_heads=1, head_dim=576,
               block_size=16)
    tp2 = [BlockStore.from_config(CacheConfig.load(**mla, tp_size=2), rank=r) for r in (0, 1)]
    tp1 = BlockStore.from_config(CacheConfig.load(**mla, tp_size=1), rank=0)
    assert tp2[0].keys(make_hashes(2)) == tp2[1].keys(make_hashes(2)) == tp1.keys(make_hashes(2))
    layout = CacheConfig.load(**mla).layout
    pool, hashes = make_pool(2, layout=layout), make_hashes(2)
    assert tp2[1].store(hashes, pool, [0, 1]) == [True, True]  # rank 1 leaves it to rank 0
    assert tp1.lookup(hashes) == 0
    assert tp2[0].store(hashes, pool, [0, 1]) == [True, True]
    for reader in (tp1, tp2[1]):  # a TP=1 instance, the other rank
        out = torch.zeros_like(pool)
        assert reader.load(hashes, out, [0, 1]) == 2 and torch.equal(out, pool)
    plain = CacheConfig.load(**{**mla, "mla": False, "num_kv_heads": 2}, tp_size=2)
    assert BlockStore.from_config(plain, rank=1).rank == 1  # other models: a copy per rank


def test_blockstore_loads_into_pool_without_copies(tmp_path):
    """Payloads land in the host pool's own memory (readv into a view of it)."""
    bs = make_store(_file(tmp_path))
    pool, hashes = make_pool(4), make_hashes(4)
    assert all(bs.store(hashes, pool, [0, 1, 2, 3]))
    target = torch.zeros_like(pool)
    ptr = target.data_ptr()
    assert bs.load(hashes, target, [3, 2, 1, 0]) == 4
    assert target.data_ptr() == ptr and torch.equal(target.flip(0), pool)


def test_blockstore_does_not_write_what_storage_holds(tmp_path):
    """A block another writer (here: another BlockStore on the same directory)
    already stored is not written again, and counts as stored."""
    a, b = make_store(_file(tmp_path)), make_store(_file(tmp_path))
    pool, hashes = make_pool(6), make_hashes(6)
    assert a.store(hashes[:4], pool, [0, 1, 2, 3]) == [True] * 4
    path = _object_path(a.backend, a.keys(hashes[:1])[0])
    before = os.stat(path).st_mtime_ns
    other = make_pool(6, seed=9)  # same keys, other bytes: a rewrite would show
    assert b.store(hashes, other, [0, 1, 2, 3, 4, 5]) == [True] * 6
    h = b.health()
    assert (h["stored"], h["already_stored"]) == (2, 4)
    assert os.stat(path).st_mtime_ns == before
    target = torch.zeros_like(pool)
    assert a.load(hashes, target, list(range(6))) == 6
    assert torch.equal(target[:4], pool[:4]) and torch.equal(target[4:], other[4:])


# ------------------------------------------------------------------ factory
@pytest.mark.parametrize("kind,url,match", [
    ("redis", "127.0.0.1:6379", "redis://127.0.0.1:6379"),
    ("redis", "http://x:1", "redis://127.0.0.1:6379"),
    ("redis", "redis://host", "redis://127.0.0.1:6379"),
    ("mooncake", "redis://127.0.0.1:1", "127.0.0.1:50051"),
    ("mooncake", "127.0.0.1", "127.0.0.1:50051"),
    ("file", "", "directory"),
    ("s3", "x", "must be one of"),
])
def test_open_backend_rejects_bad_urls(kind, url, match):
    with pytest.raises(ValueError, match=match):
        open_backend(kind, url)


def test_open_backend_rejects_unknown_options(tmp_path):
    with pytest.raises(ValueError, match="allowed"):
        open_backend("file", str(tmp_path), max_byte=3)


def test_file_concurrent_opens_of_a_new_directory(tmp_path):
    """All ranks open the same fresh directory at once: none may reject it."""
    import threading

    errors = []

    def open_it():
        try:
            _file(tmp_path).put_from(["ns/x"], [b"1"])
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    path = _object_path(_file(tmp_path), "ns/x")
    assert os.stat(path).st_mode & 0o777 == 0o600  # KV can reveal prompts


def test_blockstore_concurrent_store_and_load(tmp_path):
    """Header arenas are per call: parallel stores/loads never mix headers."""
    from concurrent.futures import ThreadPoolExecutor

    bs = make_store(_file(tmp_path))
    pool, hashes = make_pool(32), make_hashes(32)

    def roundtrip(i):
        sl = slice(i * 4, i * 4 + 4)
        ids = list(range(32))[sl]
        assert all(bs.store(hashes[sl], pool, ids))
        out = torch.zeros_like(pool)
        assert bs.load(hashes[sl], out, ids) == 4
        assert torch.equal(out[sl], pool[sl])

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(roundtrip, range(8)))
    assert bs.stats()["blocks_loaded"] == 32


def test_file_store_is_capped_by_default(tmp_path, monkeypatch):
    """storage_max_bytes = 0 (the default) caps the store at a tenth of the free
    disk (each rank its share), not unlimited."""
    import collections

    from kvcached.storage import file as file_mod
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(file_mod.shutil, "disk_usage", lambda path: usage(0, 0, 10_000_000))
    base = dict(storage_backend="file", tp_size=2, num_cpu_blocks=8, num_gpu_blocks=8,
                model_id="m")
    cfg = CacheConfig.load(**base, storage_url=str(tmp_path / "auto"))
    assert cfg.storage_max_bytes == 0
    assert BlockStore.from_config(cfg, rank=0).backend.max_bytes == 500_000  # 10% / 2 ranks
    explicit = cfg.replace(storage_max_bytes=4000, storage_url=str(tmp_path / "x"))
    assert BlockStore.from_config(explicit, rank=1).backend.max_bytes == 2000
    unlimited = cfg.replace(storage_max_bytes=-1, storage_url=str(tmp_path / "u"))
    assert BlockStore.from_config(unlimited, rank=1).backend.max_bytes == 0


def test_default_cap_counts_what_the_store_holds_and_evicts_at_open(tmp_path, monkeypatch):
    import collections

    from kvcached.storage import file as file_mod
    be = _file(tmp_path)
    be.put_from([f"ns/{i:02x}/0of1" for i in range(10)], [bytearray(1000)] * 10)
    assert be.stats()["bytes_used"] == 10_000
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(file_mod.shutil, "disk_usage", lambda path: usage(0, 0, 40_000))
    again = file_mod.FileBackend(tmp_path / "store", disk_fraction=0.1)
    assert again.max_bytes == 5_000  # 10% of (40_000 free + 10_000 held)
    assert again.stats()["bytes_used"] <= 5_000 and again.stats()["evictions"] == 5
    with pytest.raises(ValueError, match="disk_fraction must be in"):
        file_mod.FileBackend(tmp_path / "other", disk_fraction=1.5)
