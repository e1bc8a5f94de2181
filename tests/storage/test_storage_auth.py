"""Authenticated storage objects (a fleet secret): attacks on the file and Redis
backends, rotation, config errors, and credentials kept out of stats and errors.

Each attack is what someone who can write to the store but holds no secret can
do: forge objects in the documented format (checksums recomputed over their
bytes), move objects between keys, replay them from another namespace (weight
version, tenant salt), truncate them, grow them, or make a header claim a huge
payload. Every one must be a miss with its reason, never data, and nothing may
be allocated beyond a block.
"""

from __future__ import annotations

import struct
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest_storage import (  # noqa: E402
    LAYOUT,
    NO_REDIS_REASON,
    REDIS_SERVER,
    RedisServer,
    make_hashes,
    make_pool,
)

from kvcached.config import CacheConfig  # noqa: E402
from kvcached.storage import BlockStore, open_backend, storage_namespace  # noqa: E402
from kvcached.storage import objects as obj  # noqa: E402
from kvcached.storage.auth import ObjectAuth  # noqa: E402

SECRET_A = b"a" * 16 + bytes(range(48, 64))  # 32 bytes
SECRET_B = b"b" * 40
NS0 = storage_namespace("kvcached-demo", "0")
NS1 = storage_namespace("kvcached-demo", "1")
N = 4


# ------------------------------------------------------------------ backends
class FileRaw:
    """Raw object access to a file store (what an attacker with the directory has)."""

    def __init__(self, tmp_path):
        self.backend = open_backend("file", str(tmp_path / "store"))

    def get(self, key: str) -> bytes:
        return Path(self.backend._path(key)).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        p = Path(self.backend._path(key))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


class RedisRaw:
    """Raw object access to a Redis store (what an attacker with the server has)."""

    def __init__(self, srv):
        import redis

        self.backend = open_backend("redis", srv.url, socket_timeout_s=1.0)
        self.raw = redis.Redis(host="127.0.0.1", port=srv.port)

    def get(self, key: str) -> bytes:
        return self.raw.get("kvcached/" + key)

    def put(self, key: str, data: bytes) -> None:
        self.raw.set("kvcached/" + key, data)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_REASON)
    pytest.importorskip("redis")
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(params=["file", "redis"])
def raw(request, tmp_path):
    if request.param == "file":
        yield FileRaw(tmp_path)
        return
    srv = request.getfixturevalue("redis_server")
    r = RedisRaw(srv)
    r.raw.flushdb()
    yield r
    r.backend.close()


def store(raw, ns=NS0, secrets=(SECRET_A,)) -> BlockStore:
    auth = ObjectAuth(list(secrets)) if secrets else None
    return BlockStore(raw.backend, LAYOUT.digest, 0, 1, ns, auth=auth)


def filled(raw, ns=NS0, secrets=(SECRET_A,), seed=7):
    bs = store(raw, ns, secrets)
    pool, hashes = make_pool(N, seed=seed), make_hashes(N, seed=seed)
    assert all(bs.store(hashes, pool, list(range(N))))
    return bs, pool, hashes


def load_stops_at(bs, hashes, at, reason, pool=None):
    out = torch.zeros((N, LAYOUT.block_bytes), dtype=torch.uint8)
    assert bs.load(hashes, out, list(range(N))) == at
    if pool is not None:
        assert torch.equal(out[:at], pool[:at])
    stats = bs.stats()
    assert stats[f"miss_{reason}"] == 1, {k: v for k, v in stats.items() if v}
    return stats


# ------------------------------------------------------------------ format
def test_signed_roundtrip_and_header():
    auth = ObjectAuth([SECRET_A])
    payload = bytearray(range(256)) * 4
    args = dict(layout_digest="abcd", block_hash=bytes(range(16)), rank=1, tp_size=2)
    hdr = obj.pack_header(payload=payload, auth=auth, key="ns@mac/k/1of2", **args)
    assert len(hdr) == obj.MAC_HEADER_SIZE and hdr[:4] == obj.MAGIC
    assert struct.unpack_from("<H", hdr, 4)[0] == obj.MAC_FORMAT_VERSION
    n = len(hdr) + len(payload)
    ok = dict(nread=n, auth=auth, key="ns@mac/k/1of2", **args)
    assert obj.verify_object(hdr, payload, **ok) is None
    assert obj.verify_object(hdr, payload, **{**ok, "key": "ns@mac/k/0of2"}) == "bad_mac"
    assert obj.verify_object(hdr, payload, **{**ok, "auth": ObjectAuth([SECRET_B])}) == "bad_mac"
    # Without a secret, a signed object is another format (left alone), never data.
    assert obj.verify_object(hdr[:64], payload, nread=64 + len(payload),
                             **args) == "bad_version"
    for pos in (64, 80, 100, 112, 127):  # key id, salt, reserved, tag: all covered
        bad = bytearray(hdr)
        bad[pos] ^= 1
        assert obj.verify_object(bad, payload, **ok) == "bad_mac", pos
    flipped = bytearray(payload)
    flipped[999] ^= 0x80
    assert obj.verify_object(hdr, flipped, **ok) == "bad_mac"
    # Two writes of one block differ (random salt): no derived key is used twice.
    assert obj.pack_header(payload=payload, auth=auth, key="k", **args) != \
        obj.pack_header(payload=payload, auth=auth, key="k", **args)


def test_secret_never_in_repr():
    auth = ObjectAuth([SECRET_A, SECRET_B])
    assert SECRET_A.decode() not in repr(auth) and SECRET_B.decode() not in repr(auth)
    assert len(auth.key_ids) == 2


# ------------------------------------------------------------------ attacks
def test_honest_objects_load(raw):
    bs, pool, hashes = filled(raw)
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)
    assert bs.keys(hashes)[0].startswith(NS0 + "@mac/")
    assert bs.health()["authenticated"] is True


def test_forged_unsigned_object_documented_format(raw):
    """The attack of issue 40: the documented (version 1) format with checksums
    recomputed over attacker bytes, at the key of a real block."""
    bs, pool, hashes = filled(raw)
    evil = torch.full((LAYOUT.block_bytes,), 0x41, dtype=torch.uint8).numpy()
    hdr = obj.pack_header(payload=memoryview(evil), layout_digest=LAYOUT.digest,
                          block_hash=hashes[1], rank=0, tp_size=1)
    key = bs.keys([hashes[1]])[0]
    raw.put(key, hdr + evil.tobytes())
    load_stops_at(bs, hashes, 1, "bad_mac", pool)
    assert bs.stats()["damaged_deleted"] == 1  # unsigned at a signed key: deleted, rewritable
    assert all(bs.store(hashes, pool, list(range(N))))
    assert bs.load(hashes, torch.zeros_like(pool), list(range(N))) == N


def test_forged_signed_object_with_recomputed_header(raw):
    """A real signed header kept, the payload replaced (its header crc still holds),
    or the attacker's own key id and tag: a failed tag either way."""
    bs, pool, hashes = filled(raw)
    key = bs.keys([hashes[2]])[0]
    real = raw.get(key)
    hs = obj.MAC_HEADER_SIZE
    raw.put(key, real[:hs] + bytes(len(real) - hs))
    load_stops_at(bs, hashes, 2, "bad_mac", pool)
    # Signed with a secret the fleet does not hold: a miss, and left alone (another
    # fleet's object, or a retired secret's), not deleted.
    other = store(raw, NS1, secrets=(SECRET_B,))
    assert other.store(hashes[3:], pool, [3]) == [True]
    raw.put(bs.keys([hashes[3]])[0], raw.get(other.keys([hashes[3]])[0]))
    bs2 = store(raw)
    out = torch.zeros_like(pool)
    assert bs2.load(hashes[3:], out, [0]) == 0
    assert bs2.stats()["miss_bad_mac"] == 1 and bs2.stats()["damaged_deleted"] == 0


def test_object_moved_between_keys(raw):
    bs, pool, hashes = filled(raw)
    k0, k1 = bs.keys(hashes[:2])
    moved = raw.get(k0)
    raw.put(k1, moved)  # as is: the header names another block
    load_stops_at(bs, hashes, 1, "wrong_block", pool)
    # The header patched to name the target block (and its crc recomputed): only
    # the tag, bound to the key, catches it.
    bs, pool, hashes = filled(raw, seed=8)
    k0, k1 = bs.keys(hashes[:2])
    patched = bytearray(raw.get(k0))
    patched[44:60] = obj.hash_field(hashes[1])
    patched[60:64] = struct.pack("<I", zlib.crc32(bytes(patched[:60])))
    raw.put(k1, bytes(patched))
    load_stops_at(bs, hashes, 1, "bad_mac", pool)


@pytest.mark.parametrize("other_ns", [NS1, storage_namespace("kvcached-demo", "0", "tenant-b")],
                         ids=["weight_version", "salt"])
def test_replay_from_another_namespace(raw, other_ns):
    """Objects of weight version 0 (or tenant A) copied under version 1's (tenant
    B's) keys: headers identical, so only the MAC, bound to the key, tells."""
    bs0, pool, hashes = filled(raw, NS0)
    bs1 = store(raw, other_ns)
    for k0, k1 in zip(bs0.keys(hashes), bs1.keys(hashes), strict=True):
        raw.put(k1, raw.get(k0))
    assert bs1.lookup(hashes) == N  # present ...
    load_stops_at(bs1, hashes, 0, "bad_mac")  # ... but never data


def test_replay_without_a_secret_is_accepted(raw):
    """What no secret trusts: the same replay is data (the README says so)."""
    bs0, pool, hashes = filled(raw, NS0, secrets=())
    bs1 = store(raw, NS1, secrets=())
    for k0, k1 in zip(bs0.keys(hashes), bs1.keys(hashes), strict=True):
        raw.put(k1, raw.get(k0))
    out = torch.zeros_like(pool)
    assert bs1.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)


def test_truncated_object(raw):
    bs, pool, hashes = filled(raw)
    key = bs.keys([hashes[1]])[0]
    raw.put(key, raw.get(key)[:obj.MAC_HEADER_SIZE + 100])
    load_stops_at(bs, hashes, 1, "short_read", pool)
    raw.put(key, raw.get(bs.keys([hashes[0]])[0])[:10])  # not even a header
    bs2 = store(raw)
    load_stops_at(bs2, hashes, 1, "short_read", pool)


def _peak_during(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_oversized_object_is_never_read(raw):
    bs, pool, hashes = filled(raw)
    key = bs.keys([hashes[1]])[0]
    raw.put(key, raw.get(key) + bytes(32 << 20))  # 32 MiB more than a block
    out = torch.zeros_like(pool)
    peak = _peak_during(lambda: bs.load(hashes, out, list(range(N))))
    assert peak < 2 * (obj.MAC_HEADER_SIZE + LAYOUT.block_bytes) + (1 << 20), peak
    assert bs.stats()["miss_oversize"] == 1 and bs.stats()["blocks_loaded"] == 1


def test_header_claiming_a_huge_payload(raw):
    """A header whose length field says 2**60 (crc recomputed): rejected from the
    header, nothing sized by it."""
    bs, pool, hashes = filled(raw)
    key = bs.keys([hashes[1]])[0]
    forged = bytearray(raw.get(key))
    forged[12:20] = struct.pack("<Q", 1 << 60)
    forged[60:64] = struct.pack("<I", zlib.crc32(bytes(forged[:60])))
    raw.put(key, bytes(forged))
    out = torch.zeros_like(pool)
    peak = _peak_during(lambda: bs.load(hashes, out, list(range(N))))
    assert peak < 2 * (obj.MAC_HEADER_SIZE + LAYOUT.block_bytes) + (1 << 20), peak
    assert bs.stats()["miss_length_mismatch"] == 1 and bs.stats()["blocks_loaded"] == 1


def test_unsigned_store_is_not_served_to_a_signed_fleet(raw):
    """Objects written before the secret was set live under other keys: a cold
    cache, no rejections, and nothing stops the signed objects being written."""
    old, pool, hashes = filled(raw, secrets=())
    bs = store(raw)
    assert bs.lookup(hashes) == 0
    assert all(bs.store(hashes, pool, list(range(N))))
    assert bs.load(hashes, torch.zeros_like(pool), list(range(N))) == N


# ------------------------------------------------------------------ rotation
def test_rotation_first_signs_all_verify(raw):
    a, pool, hashes = filled(raw, secrets=(SECRET_A,))
    ab = store(raw, secrets=(SECRET_B, SECRET_A))  # step 2 of a rotation: B signs
    out = torch.zeros_like(pool)
    assert ab.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)
    hashes_b = make_hashes(N, seed=99)
    assert all(ab.store(hashes_b, pool, list(range(N))))
    assert store(raw, secrets=(SECRET_A, SECRET_B)).load(hashes_b, out, list(range(N))) == N
    only_b = store(raw, secrets=(SECRET_B,))  # step 3: A retired
    assert only_b.load(hashes_b, out, list(range(N))) == N
    assert only_b.load(hashes, out, list(range(N))) == 0
    assert only_b.stats()["miss_bad_mac"] == 1 and only_b.stats()["damaged_deleted"] == 0


def test_another_secrets_objects_are_misses_at_lookup_once_seen(raw, monkeypatch):
    """An object signed with a secret this fleet does not hold fails its tag
    once, is left alone (it is another fleet's), and from then on is a miss at
    lookup: no request is promised a hit that cannot load. The memory of such
    keys is bounded (the oldest forgotten first)."""
    import kvcached.storage.blockstore as bsmod

    _, pool, hashes = filled(raw, secrets=(SECRET_A,))
    b = store(raw, secrets=(SECRET_B,))
    assert b.lookup(hashes) == N  # the objects exist: only a read tells whose they are
    assert b.load(hashes[1:], torch.zeros_like(pool), list(range(N - 1))) == 0
    assert b.lookup(hashes) == 1 and b.lookup_many([hashes, hashes[2:]]) == [1, 2]
    assert b.stats()["miss_bad_mac"] == 1 and b.stats()["damaged_deleted"] == 0
    # the owner still reads its object, and another instance of fleet B finds
    # it until it reads it itself
    assert store(raw, secrets=(SECRET_A,)).lookup(hashes) == N
    assert store(raw, secrets=(SECRET_B,)).lookup(hashes) == N
    monkeypatch.setattr(bsmod, "FOREIGN_MAX", 1)
    b.load(hashes[2:], torch.zeros_like(pool), list(range(N - 2)))
    assert b.lookup(hashes) == 2  # hashes[1] forgotten, hashes[2] remembered


# ------------------------------------------------------------------ encryption
def enc_store(raw, ns=NS0, secrets=(SECRET_A,)) -> BlockStore:
    return BlockStore(raw.backend, LAYOUT.digest, 0, 1, ns,
                      auth=ObjectAuth(list(secrets), encrypt=True))


def test_encrypted_objects_reveal_no_kv(raw, monkeypatch):
    """storage_encrypt: what the store holds is ciphertext (no 64-byte run of the
    block in it), a load decrypts it back into the host block, and a store larger
    than ENCRYPT_BATCH_BYTES goes out in batches."""
    import kvcached.storage.blockstore as bsmod

    monkeypatch.setattr(bsmod, "ENCRYPT_BATCH_BYTES", 2 * (LAYOUT.block_bytes + 16))
    bs = enc_store(raw)
    # Blocks with structure (repeated 64-byte runs) that a plaintext copy would show.
    pool = make_pool(N, seed=3)
    pool[:, :LAYOUT.block_bytes // 2] = 7
    hashes = make_hashes(N, seed=3)
    assert all(bs.store(hashes, pool, list(range(N))))
    key = bs.keys(hashes)[0]
    assert key.startswith(NS0 + "@enc/")
    stored = raw.get(key)
    assert len(stored) == obj.MAC_HEADER_SIZE + LAYOUT.block_bytes
    assert stored[6:8] == bytes([obj.CHECKSUM_NONE, obj.FLAG_MAC | obj.FLAG_ENC])
    ct = stored[obj.MAC_HEADER_SIZE:]
    plain = pool[0].numpy().tobytes()
    assert plain[:64] not in ct and plain[-64:] not in ct and bytes(64) not in ct
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)
    assert bs.health()["encrypted"] is True and bs.health()["authenticated"] is True
    # A signing-only instance of the fleet looks elsewhere (@mac): a cold cache.
    assert store(raw).lookup(hashes) == 0


def test_encrypted_tampering_is_a_miss(raw):
    bs = enc_store(raw)
    pool, hashes = make_pool(N, seed=4), make_hashes(N, seed=4)
    assert all(bs.store(hashes, pool, list(range(N))))
    key = bs.keys([hashes[1]])[0]
    flipped = bytearray(raw.get(key))
    flipped[obj.MAC_HEADER_SIZE + 5000] ^= 1  # one ciphertext bit
    raw.put(key, bytes(flipped))
    load_stops_at(bs, hashes, 1, "bad_mac", pool)
    # A signed plaintext object (same secret) put at an encrypted key: its flags
    # say plaintext, and the flags are bound to the key: a miss, never data.
    mac = store(raw)
    assert all(mac.store(hashes, pool, list(range(N))))
    bs2 = enc_store(raw)
    raw.put(bs2.keys([hashes[0]])[0], raw.get(mac.keys([hashes[0]])[0]))
    load_stops_at(bs2, hashes, 0, "bad_mac")
    # Replayed from another tenant's namespace (same secret): the key differs.
    src, hashes = enc_store(raw), make_hashes(N, seed=6)
    assert all(src.store(hashes, pool, list(range(N))))
    bs3 = enc_store(raw, storage_namespace("kvcached-demo", "0", "tenant-b"))
    for k_src, k_dst in zip(src.keys(hashes), bs3.keys(hashes), strict=True):
        raw.put(k_dst, raw.get(k_src))
    load_stops_at(bs3, hashes, 0, "bad_mac")


def test_encrypted_rotation(raw):
    a = enc_store(raw, secrets=(SECRET_A,))
    pool, hashes = make_pool(N, seed=5), make_hashes(N, seed=5)
    assert all(a.store(hashes, pool, list(range(N))))
    out = torch.zeros_like(pool)
    ba = enc_store(raw, secrets=(SECRET_B, SECRET_A))
    assert ba.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)
    only_b = enc_store(raw, secrets=(SECRET_B,))
    assert only_b.load(hashes, out, list(range(N))) == 0
    assert only_b.stats()["miss_bad_mac"] == 1 and only_b.stats()["damaged_deleted"] == 0


def test_encrypt_needs_a_secret(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="storage_encrypt = true needs a fleet secret"):
        _cfg(storage_encrypt=True)
    monkeypatch.setenv("KVCACHED_STORAGE_ENCRYPT", "true")
    with pytest.raises(ValueError, match="storage_encrypt = true needs a fleet secret"):
        _cfg(storage_backend="file", storage_url=str(tmp_path / "s"), model_id="m")
    monkeypatch.setenv("KV_FLEET_SECRET", SECRET_A.decode())
    cfg = _cfg(storage_backend="file", storage_url=str(tmp_path / "s"), model_id="m",
               num_cpu_blocks=4, storage_secret_env="KV_FLEET_SECRET")
    bs = BlockStore.from_config(cfg, 0)
    assert bs.auth.encrypt and "encrypts" in repr(bs.auth)
    assert SECRET_A.decode() not in repr(bs.auth)
    bs.close()


# ------------------------------------------------------------------ config
def _cfg(**kw):
    return CacheConfig.load(check_host_memory=False, **kw)


def test_config_secret_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_bytes(b"# fleet secrets, newest first\n" + SECRET_B + b"\n\n" + SECRET_A + b"\n")
    assert _cfg(storage_secret_file=str(f)).storage_secrets() == [SECRET_B, SECRET_A]
    monkeypatch.setenv("KV_FLEET_SECRET", SECRET_A.decode())
    cfg = _cfg(storage_secret_env="KV_FLEET_SECRET")
    assert cfg.storage_secrets() == [SECRET_A]
    assert SECRET_A.decode() not in repr(cfg) and SECRET_A.decode() not in str(cfg.to_dict())
    assert _cfg().storage_secrets() == []


def test_blockstore_from_config_signs(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_FLEET_SECRET", SECRET_A.decode())
    cfg = _cfg(storage_backend="file", storage_url=str(tmp_path / "s"), model_id="m",
               num_cpu_blocks=4, storage_secret_env="KV_FLEET_SECRET")
    bs = BlockStore.from_config(cfg, 0)
    assert bs.auth is not None and bs.header_size == obj.MAC_HEADER_SIZE
    bs.close()


@pytest.mark.parametrize("case,match", [
    ("missing_file", "storage_secret_file .* cannot be read"),
    ("unreadable_file", "storage_secret_file .* cannot be read"),
    ("empty_file", "storage_secret_file .* holds no secret"),
    ("short_secret", "secret #2 is 10 bytes, shorter than 32"),
    ("env_unset", "storage_secret_env .* not set"),
    ("env_empty", "storage_secret_env .* holds no secret"),
    ("env_is_a_secret", "storage_secret_env .value not shown.* not the secret itself"),
    ("both", "both set: set one"),
])
def test_config_secret_errors(tmp_path, monkeypatch, case, match):
    f = tmp_path / "secret"
    monkeypatch.setenv("KV_EMPTY_SECRET", "  ")
    kw = {
        "missing_file": dict(storage_secret_file=str(tmp_path / "nope")),
        "unreadable_file": dict(storage_secret_file=str(tmp_path)),  # a directory
        "empty_file": dict(storage_secret_file=str(f)),
        "short_secret": dict(storage_secret_file=str(f)),
        "env_unset": dict(storage_secret_env="KV_NO_SUCH_SECRET_VAR"),
        "env_empty": dict(storage_secret_env="KV_EMPTY_SECRET"),
        "env_is_a_secret": dict(storage_secret_env="3f2a-" + "9" * 40),
        "both": dict(storage_secret_file=str(f), storage_secret_env="KV_EMPTY_SECRET"),
    }[case]
    f.write_bytes({"short_secret": SECRET_A + b"\n0123456789\n"}.get(case, b"# none yet\n"))
    with pytest.raises(ValueError, match=match) as e:
        _cfg(**kw)
    assert SECRET_A.decode() not in str(e.value) and "9" * 40 not in str(e.value)


# ------------------------------------------------------------------ redis password
def test_redis_password_never_surfaces(redis_server):
    import redis

    from kvcached.storage.base import redact_url

    pw = "s3cret-Passw0rd"
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    admin.config_set("requirepass", pw)
    try:
        url = f"redis://default:{pw}@127.0.0.1:{redis_server.port}/0"
        be = open_backend("redis", url, socket_timeout_s=1.0)
        assert be.put_from(["ns/a"], [b"hello"]) == [True]
        st = be.stats()
        assert pw not in repr(st) and st["url"] == f"redis://default:***@127.0.0.1:{redis_server.port}/0"
        be.close()
        wrong = f"redis://default:{pw}-wrong@127.0.0.1:{redis_server.port}/0"
        be = open_backend("redis", wrong, socket_timeout_s=1.0, breaker_threshold=1)
        assert be.get_into(["ns/a"], [bytearray(5)]) == [-1]
        st = be.stats()
        assert st["errors"] >= 1 and st["last_error"], st
        assert pw not in repr(st), st
        be.close()
        with pytest.raises(ValueError) as e:
            open_backend("redis", f"redis://default:{pw}@127.0.0.1")  # no port
        assert pw not in str(e.value) and "***" in str(e.value)
        assert redact_url(f"rediss://u:{pw}@h:1/0") == "rediss://u:***@h:1/0"
        assert redact_url("redis://h:1") == "redis://h:1"
    finally:
        redis.Redis(host="127.0.0.1", port=redis_server.port, password=pw).config_set(
            "requirepass", "")
