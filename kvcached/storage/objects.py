"""Storage object format and keys.

One object holds one block of one TP rank: a fixed 64-byte header followed by
the block's host span (all planes, ``KVLayout.block_bytes`` bytes). The key is
``<namespace>/<block hash hex>/<rank>of<tp>``; the namespace folds in the model
id and the weight version, so ``update_weights`` switches to fresh keys.

Header (little-endian)::

    0   4s  magic b"KVCB"
    4   H   format version
    6   B   checksum kind (1 = zlib.crc32, 2 = xxh3_64)
    7   B   flags (0)
    8   H   rank
    10  H   tp size
    12  Q   payload length
    20  Q   payload checksum
    28  16s layout digest (ASCII, zero padded)
    44  16s block hash (zero padded)
    60  I   crc32 of bytes 0..59

With a fleet secret (:mod:`kvcached.storage.auth`) objects are written as
format version 2, ``flags`` bit 0 set, checksum kind 0 (none: the MAC covers
the payload) and a 128-byte header, the first 64 bytes as above, then::

    64  8s  key id of the secret that signed it
    72  16s salt (random per object)
    88  24s zero
    112 16s tag: AES-GMAC of the payload under a key derived per object from
            the secret, the object's key (its namespace: model, weight
            version, salt) and bytes 0..111 (see auth.py)

and the key's namespace gets the suffix ``@mac``, so authenticated and
unauthenticated objects never share a key (a store used before the secret was
set serves nothing old, and blocks nothing from being written again).

With ``storage_encrypt`` too, ``flags`` has bit 1 set as well, the payload is
the AES-GCM ciphertext of the block (same length), the tag at 112 is its
AES-GCM tag under the same per-object key, and the namespace suffix is
``@enc`` (encrypted and plaintext objects never share a key either: turning
encryption on never leaves a plaintext object standing in for an encrypted one).
Without a secret, objects are version 1 as they always were; a reader with a
secret rejects them (``bad_mac``), a reader without one rejects version 2
(``bad_version``).

A reader checks every field against what it expects; any difference is a miss
with a reason (see :func:`verify_object`), never data.
"""

from __future__ import annotations

import logging
import struct
import zlib
from hashlib import blake2b
from urllib.parse import quote

logger = logging.getLogger(__name__)

try:  # xxh3 runs at memory speed (~40 GB/s); zlib.crc32 at ~4 GB/s
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

MAGIC = b"KVCB"
FORMAT_VERSION = 1
HEADER_SIZE = 64
MAC_FORMAT_VERSION = 2
MAC_HEADER_SIZE = 128
MAC_NAMESPACE_SUFFIX = "@mac"
ENC_NAMESPACE_SUFFIX = "@enc"
FLAG_MAC = 1
FLAG_ENC = 2  # with FLAG_MAC: the payload is AES-GCM ciphertext
CHECKSUM_NONE = 0  # version 2 only: the MAC covers the payload
CHECKSUM_CRC32 = 1
CHECKSUM_XXH3 = 2
DEFAULT_CHECKSUM = CHECKSUM_XXH3 if _xxhash is not None else CHECKSUM_CRC32

_BODY = struct.Struct("<4sHBBHHQQ16s16s")  # 60 bytes, then the header crc32
_CRC = struct.Struct("<I")
assert _BODY.size + _CRC.size == HEADER_SIZE
_SIGNED = 112  # bytes of a version 2 header the tag covers; the tag follows
_KID = slice(64, 72)
_SALT = slice(72, 88)

# Reasons a read is rejected; each one is a stats counter in BlockStore.
MISS_REASONS = ("short_read", "bad_magic", "bad_version", "bad_header_crc",
                "unknown_checksum", "layout_mismatch", "wrong_block",
                "length_mismatch", "checksum_mismatch", "bad_mac", "oversize")


def checksum(data, kind: int = DEFAULT_CHECKSUM) -> int:
    """Checksum of ``data`` (any buffer) with algorithm ``kind``."""
    if kind == CHECKSUM_XXH3:
        if _xxhash is None:
            raise ValueError("checksum kind xxh3_64 needs the 'xxhash' package")
        return _xxhash.xxh3_64_intdigest(data)
    if kind == CHECKSUM_CRC32:
        return zlib.crc32(data)
    raise ValueError(f"unknown checksum kind {kind}")


def checksum_available(kind: int) -> bool:
    """Whether this process can verify objects written with checksum ``kind``."""
    return kind == CHECKSUM_CRC32 or (kind == CHECKSUM_XXH3 and _xxhash is not None)


def _field16(value: bytes) -> bytes:
    if len(value) > 16:
        # Longer identifiers are folded to 16 bytes: still a strict equality check.
        return blake2b(value, digest_size=16).digest()
    return value


def digest_field(layout_digest: str) -> bytes:
    """The 16-byte header field for a layout digest string."""
    return _field16(layout_digest.encode()).ljust(16, b"\0")


def hash_field(block_hash: bytes) -> bytes:
    """The 16-byte header field for a block hash."""
    return _field16(bytes(block_hash)).ljust(16, b"\0")


def header_size(auth=None) -> int:
    """Header bytes of the objects written (and read) with ``auth`` (or without)."""
    return MAC_HEADER_SIZE if auth is not None else HEADER_SIZE


def pack_header_into(buf, *, layout_digest: str, block_hash: bytes, rank: int,
                     tp_size: int, payload, kind: int = DEFAULT_CHECKSUM,
                     auth=None, key: str = "", sealed=None) -> None:
    """Write the header describing ``payload`` into the first
    ``header_size(auth)`` bytes of ``buf``. With ``auth`` (an
    :class:`~kvcached.storage.auth.ObjectAuth`) the object is signed for ``key``;
    if ``auth`` encrypts, ``sealed`` (``len(payload) + 16`` bytes) receives the
    ciphertext (then its tag), and its first ``len(payload)`` bytes are the
    object's payload."""
    if auth is None:
        body = _BODY.pack(MAGIC, FORMAT_VERSION, kind, 0, rank, tp_size, len(payload),
                          checksum(payload, kind), digest_field(layout_digest),
                          hash_field(block_hash))
        buf[:_BODY.size] = body
        buf[_BODY.size:HEADER_SIZE] = _CRC.pack(zlib.crc32(body))
        return
    if not key:
        raise ValueError("an authenticated object needs its key")
    flags = FLAG_MAC | (FLAG_ENC if auth.encrypt else 0)
    body = _BODY.pack(MAGIC, MAC_FORMAT_VERSION, CHECKSUM_NONE, flags, rank, tp_size,
                      len(payload), 0, digest_field(layout_digest), hash_field(block_hash))
    signed = bytearray(_SIGNED)
    signed[:_BODY.size] = body
    signed[_BODY.size:HEADER_SIZE] = _CRC.pack(zlib.crc32(body))
    signed[_KID] = auth.signing_key_id
    signed[_SALT] = auth.new_salt()
    buf[:_SIGNED] = signed
    buf[_SIGNED:MAC_HEADER_SIZE] = auth.seal(key, signed, payload, sealed)


def pack_header(**kwargs) -> bytes:
    """The header as bytes (see :func:`pack_header_into` for arguments)."""
    buf = bytearray(header_size(kwargs.get("auth")))
    pack_header_into(buf, **kwargs)
    return bytes(buf)


def verify_object(header, payload, *, nread: int, layout_digest: str,
                  block_hash: bytes, rank: int, tp_size: int, auth=None,
                  key: str = "") -> str | None:
    """Check a read object; ``None`` when it is intact, else the miss reason.

    ``nread`` is how many bytes the backend delivered (header + payload).
    ``payload`` is the buffer the payload was read into; its length is the
    expected payload length. With ``auth`` the object must be a version 2
    object whose tag verifies for ``key`` (else ``bad_mac``); the cheap
    checks come first, so a rejected header costs no pass over the payload.
    If ``auth`` encrypts, the object must be encrypted, and ``payload`` (the
    ciphertext as read) is decrypted in place.
    """
    hsize = header_size(auth)
    if nread < hsize:  # the header buffer may hold a previous object's bytes
        return "short_read"
    raw = bytes(header[:hsize])
    (magic, version, kind, flags, h_rank, h_tp, length, csum, digest,
     bhash) = _BODY.unpack_from(raw)
    if magic != MAGIC:
        return "bad_magic"
    if auth is not None and version == FORMAT_VERSION:
        return "bad_mac"  # unauthenticated (the documented format, forgeable by anyone)
    if version != (FORMAT_VERSION if auth is None else MAC_FORMAT_VERSION):
        return "bad_version"
    if nread != hsize + len(payload):
        return "short_read" if nread < hsize + len(payload) else "length_mismatch"
    if _CRC.unpack_from(raw, _BODY.size)[0] != zlib.crc32(raw[:_BODY.size]):
        return "bad_header_crc"
    if digest != digest_field(layout_digest):
        return "layout_mismatch"
    if bhash != hash_field(block_hash) or (h_rank, h_tp) != (rank, tp_size):
        return "wrong_block"
    if length != len(payload):
        return "length_mismatch"
    if auth is not None:
        want = FLAG_MAC | (FLAG_ENC if auth.encrypt else 0)
        if flags & (FLAG_MAC | FLAG_ENC) != want or not auth.open(
                raw[_KID], key, raw[:_SIGNED], payload, raw[_SIGNED:MAC_HEADER_SIZE]):
            return "bad_mac"
        return None
    if not checksum_available(kind):
        return "unknown_checksum"
    if checksum(payload, kind) != csum:
        return "checksum_mismatch"
    return None


def signed_by_other(header, auth) -> bool:
    """Whether a header is a version 2 object signed with a secret ``auth`` does
    not hold (another fleet's, or a retired secret's): a failed tag then is no
    sign of damage, and the object is left alone. A failed tag of an object that
    names one of our secrets, or of an unsigned one, is damage or forgery."""
    raw = bytes(header[:MAC_HEADER_SIZE])
    return (len(raw) == MAC_HEADER_SIZE and raw[:4] == MAGIC
            and _BODY.unpack_from(raw)[1] == MAC_FORMAT_VERSION and not auth.knows(raw[_KID]))


# ------------------------------------------------------------------- keys
_SAFE = "-._~"
_MAX_COMPONENT = 80


def _component(value: str) -> str:
    """Percent-encode so that distinct values never map to the same namespace."""
    enc = quote(value, safe=_SAFE)
    if len(enc) > _MAX_COMPONENT:  # keep keys short enough for file names
        tail = blake2b(value.encode(), digest_size=8).hexdigest()
        enc = f"{enc[:_MAX_COMPONENT - 17]}~{tail}"
    return enc


def storage_namespace(model_id: str, weight_version: str, salt: str = "") -> str:
    """Key namespace for one (model, weight version, salt), e.g. ``kvcached-demo@0``.

    The salt is hashed (it may be a tenant secret) and appended as ``+<hex>``.
    """
    if not model_id:
        raise ValueError("storage_namespace needs a non-empty model_id")
    ns = f"{_component(model_id)}@{_component(str(weight_version))}"
    if salt:
        ns += "+" + blake2b(salt.encode(), digest_size=6).hexdigest()
    return ns


def mac_namespace(namespace: str, encrypt: bool = False) -> str:
    """The key namespace of authenticated objects (``@mac`` appended, ``@enc`` for
    encrypted ones: ``@`` never occurs in a namespace's escaped components, so no
    other namespace ends so)."""
    return namespace + (ENC_NAMESPACE_SUFFIX if encrypt else MAC_NAMESPACE_SUFFIX)


def object_key(namespace: str, block_hash: bytes, rank: int, tp_size: int) -> str:
    """``<namespace>/<block hash hex>/<rank>of<tp>``."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
    return f"{namespace}/{bytes(block_hash).hex()}/{rank}of{tp_size}"
