"""Authenticated storage objects: a keyed MAC from a fleet secret.

With a fleet secret (``storage_secret_file`` / ``storage_secret_env``), every
object carries a 128-bit tag over its header, its key and its payload, so
whoever can write to the storage (the directory, the Redis, the Mooncake
Store) but does not hold the secret cannot make an instance load KV of their
choosing: a forged object, an object moved to another key, or one replayed
from another namespace (model, weight version, salt) fails its tag and is a
miss (reason ``bad_mac``).

Construction (per object, see ``objects.py`` for where the fields live)::

    master  = BLAKE2b-256(secret, person="kvcached-master")
    key_id  = BLAKE2b-64(secret, person="kvcached-keyid")   (in the header)
    salt    = 16 random bytes                                 (in the header)
    k_obj   = BLAKE2b-256(key=master, person="kvcached-mac-v2",
                          u16 len(key) || key || header[0:112])
    tag     = AES-256-GMAC(k_obj, nonce=0, aad=payload)

``header[0:112]`` holds the salt, the key id and every field a reader checks
(layout, block hash, rank, TP size, payload length), and the object's key
names the namespace, so the derived key ``k_obj`` is bound to all of them and
is used for one object only (the random salt makes it unique even when a
block is written again): GMAC with a one-time key needs no nonce management,
and a tag under it authenticates the payload together with every header field
and the key (changing any of them changes ``k_obj``).
AES-GMAC runs at ~20 GB/s on a core with VAES/VPCLMULQDQ (BLAKE3 keyed ~6,
Poly1305 ~12, keyed BLAKE2b ~0.9, measured on 1 MiB payloads; see
``scripts/bench_storage_mac.py``), so a verified hit costs little more than a
checksummed one (the MAC replaces the xxh3 checksum).

Encryption at rest (``storage_encrypt = true``): the same ``k_obj`` encrypts
the payload with AES-256-GCM (nonce 0: the key is used once) instead of
authenticating it as associated data::

    ciphertext || tag = AES-256-GCM(k_obj, nonce=0, plaintext=payload)

The header's flags (signed, so part of ``k_obj``) say which of the two an
object is. So one derivation and one AEAD call serve both modes: the key is
derived from the secret and the object's key (its namespace: model, weight
version, salt), a copy of the store reveals no KV, and a failed tag is a miss
(``bad_mac``) either way. A load reads the ciphertext into the host block and
decrypts it there (one copy of the block into a scratch buffer; see
:meth:`ObjectAuth.open`).

Rotation: several secrets may be configured; the first signs, every one of
them verifies (the header's key id picks the secret without trying each).
"""

from __future__ import annotations

import hmac
import os
import struct
import threading
from hashlib import blake2b

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcached.config import MIN_STORAGE_SECRET_BYTES

MIN_SECRET_BYTES = MIN_STORAGE_SECRET_BYTES
KEY_ID_SIZE = 8
SALT_SIZE = 16
TAG_SIZE = 16
_ZERO_NONCE = bytes(12)
_LEN = struct.Struct("<H")


def key_id(secret: bytes) -> bytes:
    """The 8-byte public identifier of ``secret`` written into each object it signs."""
    return blake2b(secret, digest_size=KEY_ID_SIZE, person=b"kvcached-keyid").digest()


class ObjectAuth:
    """Signs objects with the first of ``secrets`` and verifies with any of them;
    with ``encrypt`` the payloads are encrypted too (see the module docstring).

    The secrets never leave this object (``repr`` shows key ids only)."""

    def __init__(self, secrets: list[bytes], encrypt: bool = False) -> None:
        if not secrets:
            raise ValueError("ObjectAuth needs at least one secret")
        for s in secrets:
            if len(s) < MIN_SECRET_BYTES:
                raise ValueError(f"a storage secret must be at least {MIN_SECRET_BYTES} "
                                 f"bytes, got one of {len(s)}")
        self._masters: dict[bytes, bytes] = {}
        for s in secrets:
            self._masters.setdefault(key_id(s), blake2b(s, digest_size=32,
                                                        person=b"kvcached-master").digest())
        self.signing_key_id = key_id(secrets[0])
        self.encrypt = bool(encrypt)
        self._scratch = threading.local()  # per thread: open() of an encrypted object

    def __repr__(self) -> str:
        ids = ", ".join(k.hex() for k in self._masters)
        mode = "encrypts, " if self.encrypt else ""
        return f"ObjectAuth({mode}signs with {self.signing_key_id.hex()}, verifies {ids})"

    @property
    def key_ids(self) -> list[str]:
        """Hex ids of the secrets that verify (the first one signs)."""
        return [k.hex() for k in self._masters]

    def knows(self, kid: bytes) -> bool:
        """Whether ``kid`` is the key id of one of this fleet's secrets."""
        return bytes(kid) in self._masters

    def new_salt(self) -> bytes:
        return os.urandom(SALT_SIZE)

    def _aead(self, kid: bytes, key: str, signed) -> AESGCM | None:
        """AES-GCM under the object's one-time key ``k_obj`` (None: ``kid`` is not ours)."""
        master = self._masters.get(bytes(kid))
        if master is None:
            return None
        kb = key.encode()
        h = blake2b(key=master, digest_size=32, person=b"kvcached-mac-v2")
        h.update(_LEN.pack(len(kb)))
        h.update(kb)
        h.update(signed)
        return AESGCM(h.digest())

    def tag(self, kid: bytes, key: str, signed, payload) -> bytes | None:
        """The MAC-only tag of an object under the secret ``kid`` (None: not ours).

        ``signed`` is the header's authenticated part (bytes 0..111)."""
        aead = self._aead(kid, key, signed)
        # AES-GCM of no plaintext is GMAC of the associated data: the payload.
        return None if aead is None else aead.encrypt(_ZERO_NONCE, b"", payload)[:TAG_SIZE]

    def check(self, kid: bytes, key: str, signed, payload, tag) -> bool:
        """Whether ``tag`` is the object's MAC-only tag (constant-time compare)."""
        want = self.tag(kid, key, signed, payload)
        return want is not None and hmac.compare_digest(want, bytes(tag))

    def seal(self, key: str, signed, payload, sealed=None) -> bytes:
        """The tag of a new object (signed with the first secret). Encrypting,
        ``sealed`` (``len(payload) + TAG_SIZE`` writable bytes) receives the
        ciphertext and the tag, and the ciphertext is what gets stored."""
        if not self.encrypt:
            return self.tag(self.signing_key_id, key, signed, payload)
        n = len(payload)
        if sealed is None or len(sealed) != n + TAG_SIZE:
            raise ValueError(f"an encrypted object needs a buffer of {n + TAG_SIZE} bytes")
        self._aead(self.signing_key_id, key, signed).encrypt_into(_ZERO_NONCE, payload, b"",
                                                                  sealed)
        return bytes(sealed[n:])

    def open(self, kid: bytes, key: str, signed, payload, tag) -> bool:
        """Verify an object read into ``payload``; encrypting, also decrypt it there.
        False (a miss) when the tag fails or ``kid`` is not ours; ``payload`` is then
        garbage (the caller treats it so)."""
        if not self.encrypt:
            return self.check(kid, key, signed, payload, tag)
        aead = self._aead(kid, key, signed)
        if aead is None:
            return False
        n = len(payload)
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < n + TAG_SIZE:
            scratch = self._scratch.buf = bytearray(n + TAG_SIZE)
        ct = memoryview(scratch)[:n + TAG_SIZE]
        ct[:n] = payload  # AES-GCM wants ciphertext || tag in one buffer
        ct[n:] = tag
        try:
            aead.decrypt_into(_ZERO_NONCE, ct, b"", payload)
        except InvalidTag:
            return False
        return True
