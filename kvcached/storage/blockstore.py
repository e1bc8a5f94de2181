"""BlockStore: the per-rank, worker-side API of the storage tier.

It turns block hashes into keys, writes ``header + host block`` objects and
reads them back straight into host blocks, verifying each one. A load returns
the length of the contiguous prefix that arrived intact; blocks after the
first miss are never reported as loaded (their host blocks may have been
written and must be treated as garbage by the caller).

Headers live in small arenas next to the payloads (scatter / gather I/O), so
the payload is never copied on the way to or from the backend where the
backend can do vectored I/O (file: readv/writev; Mooncake: multi-buffer
transfers into the registered host pool).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvcached.storage.backends import open_backend
from kvcached.storage.base import OVERSIZE, Counters, StorageBackend
from kvcached.storage.objects import (
    MISS_REASONS,
    header_size,
    mac_namespace,
    object_key,
    pack_header_into,
    signed_by_other,
    storage_namespace,
    verify_object,
)

logger = logging.getLogger(__name__)

# Reasons that mean "this object is damaged": delete it so a later store can
# rewrite it (Mooncake never overwrites). A layout or version mismatch may be
# another deployment's valid object and is left alone, as is an object too large
# to be ours. A failed MAC is damage (or forgery) when the object names one of
# our secrets, else it is another fleet's object (see _verify_prefix).
_DAMAGED = {"short_read", "bad_magic", "bad_header_crc", "length_mismatch",
            "checksum_mismatch", "wrong_block"}


# Keys of other secrets' objects a BlockStore remembers (8 MB at most).
FOREIGN_MAX = 1 << 16

# storage_encrypt: a store encrypts at most this many bytes of blocks at a time
# (the ciphertext's buffers), then writes them.
ENCRYPT_BATCH_BYTES = 16 << 20

# storage_max_bytes = 0: the file store may take this share of the free disk.
DEFAULT_DISK_FRACTION = 0.1


def default_file_dir() -> str:
    """Where the file backend lives when ``storage_url`` is empty."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcached", "storage")


class BlockStore:
    """Stores and loads one rank's blocks through a :class:`StorageBackend`.

    With ``auth`` (an :class:`~kvcached.storage.auth.ObjectAuth` from the fleet
    secret) objects are signed on store and verified on load (see
    ``objects.py``); their keys live under ``<namespace>@mac``. If ``auth``
    encrypts (``storage_encrypt``), payloads are stored encrypted and decrypted
    into the host blocks on load; keys under ``<namespace>@enc``."""

    def __init__(self, backend: StorageBackend, layout_digest: str, rank: int,
                 tp_size: int, namespace: str, auth=None, writes: bool = True) -> None:
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
        self.backend = backend
        self.layout_digest = layout_digest
        self.rank = rank
        self.tp_size = tp_size
        self.namespace = namespace
        self.auth = auth
        self.writes = writes  # False: another rank writes the one copy (MLA)
        self.header_size = header_size(auth)
        self.counters = Counters("blocks_stored", "blocks_already_stored",
                                 "blocks_store_failed", "blocks_loaded",
                                 "load_misses", "lookups", "lookup_hits", "damaged_deleted",
                                 "foreign_remembered",
                                 *(f"miss_{r}" for r in MISS_REASONS))
        self._lock = threading.Lock()
        self._free_arenas: list[np.ndarray] = []
        self._pools: dict[tuple[int, int], memoryview] = {}
        self._warned: set[str] = set()
        # Keys of objects signed with a secret this fleet does not hold (another
        # fleet's, or a retired secret's): left alone, and from then on misses
        # at lookup, so that no request is promised a hit that cannot load.
        # Insertion-ordered, the oldest forgotten first past FOREIGN_MAX.
        self._foreign: dict[str, None] = {}

    @classmethod
    def from_config(cls, cfg, rank: int) -> BlockStore | None:
        """The BlockStore of ``rank`` for a ``CacheConfig`` (None without storage)."""
        kind = cfg.storage_backend
        if not kind:
            return None
        opts: dict = {}
        url = cfg.storage_url
        # MLA's latent is the same on every TP rank: one copy, written by rank 0
        # under keys without the TP size (an instance of any TP size shares
        # it), read by every rank.
        key_rank, key_tp = (0, 1) if cfg.mla else (rank, cfg.tp_size)
        if kind == "file":
            url = url or default_file_dir()
            # Every rank's process shares the directory: each enforces its share
            # of the cap over the objects of its own rank.
            cap = cfg.storage_max_bytes
            opts = {"max_bytes": max(cap // key_tp, 1) if cap > 0 else 0,
                    "disk_fraction": DEFAULT_DISK_FRACTION / key_tp if cap == 0 else 0.0,
                    "index_suffix": f"/{key_rank}of{key_tp}"}
        secrets = cfg.storage_secrets()
        auth = None
        if secrets:
            from kvcached.storage.auth import ObjectAuth
            auth = ObjectAuth(secrets, encrypt=cfg.storage_encrypt)
        elif cfg.storage_encrypt:
            raise ValueError("storage_encrypt = true needs a fleet secret "
                             "(storage_secret_file or storage_secret_env)")
        backend = open_backend(kind, url, **opts)
        ns = storage_namespace(cfg.model_id, cfg.weight_version, cfg.salt)
        return cls(backend, cfg.layout.digest, key_rank, key_tp, ns, auth=auth,
                   writes=rank == key_rank)

    # ------------------------------------------------------------ keys
    def set_namespace(self, namespace: str) -> None:
        """Switch to another namespace (e.g. after ``update_weights``)."""
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        self.namespace = namespace

    def keys(self, hashes: Sequence[bytes], namespace: str | None = None) -> list[str]:
        """Backend keys of ``hashes`` for this rank."""
        ns = namespace or self.namespace
        if self.auth is not None:
            ns = mac_namespace(ns, self.auth.encrypt)
        return [object_key(ns, h, self.rank, self.tp_size) for h in hashes]

    # ------------------------------------------------------------ API
    def store(self, hashes: Sequence[bytes], host_pool: torch.Tensor,
              host_ids: Sequence[int]) -> list[bool]:
        """Write host blocks ``host_ids`` as the objects of ``hashes``; ok per block.
        Objects storage already holds are not written again (a fleet computes and
        evicts the same blocks on several instances): they count as stored."""
        _same_len(hashes, host_ids)
        if not hashes or not self.writes:
            return [True] * len(hashes)  # the writing rank's answer decides
        view, bb = self._pool_view(host_pool, host_ids)
        keys = self.keys(hashes)
        have = self.backend.exists(keys)
        todo = [i for i, h in enumerate(have) if not h]
        self.counters.inc("blocks_already_stored", len(keys) - len(todo))
        ok = [True] * len(keys)
        if todo:
            wrote = self._put([hashes[i] for i in todo], [host_ids[i] for i in todo],
                              [keys[i] for i in todo], view, bb)
            for i, w in zip(todo, wrote, strict=True):
                ok[i] = w
        return ok

    def _put(self, hashes: Sequence[bytes], host_ids: Sequence[int], keys: list[str],
             view: memoryview, bb: int) -> list[bool]:
        if self.auth is not None and self.auth.encrypt:
            # The ciphertext needs buffers of its own: batches of at most
            # ENCRYPT_BATCH_BYTES bound them.
            step = max(1, ENCRYPT_BATCH_BYTES // (bb + 16))
            ok = []
            for s in range(0, len(hashes), step):
                ok += self._put_batch(hashes[s:s + step], host_ids[s:s + step],
                                      keys[s:s + step], view, bb)
        else:
            ok = self._put_batch(hashes, host_ids, keys, view, bb)
        self.counters.inc("blocks_stored", sum(ok))
        self.counters.inc("blocks_store_failed", len(ok) - sum(ok))
        return ok

    def _put_batch(self, hashes: Sequence[bytes], host_ids: Sequence[int], keys: list[str],
                   view: memoryview, bb: int) -> list[bool]:
        hs = self.header_size
        sealed = None
        if self.auth is not None and self.auth.encrypt:
            sealed = memoryview(np.empty(len(hashes) * (bb + 16), dtype=np.uint8))
        with self._arena(len(hashes)) as hdrs:
            bufs = []
            for i, (h, hid) in enumerate(zip(hashes, host_ids, strict=True)):
                payload = view[hid * bb:(hid + 1) * bb]
                hdr = hdrs[i * hs:(i + 1) * hs]
                out = None if sealed is None else sealed[i * (bb + 16):(i + 1) * (bb + 16)]
                pack_header_into(hdr, layout_digest=self.layout_digest, block_hash=h,
                                 rank=self.rank, tp_size=self.tp_size, payload=payload,
                                 auth=self.auth, key=keys[i], sealed=out)
                bufs.append([hdr, payload if out is None else out[:bb]])
            return self.backend.put_from(keys, bufs)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Length of the contiguous prefix of ``hashes`` whose objects exist."""
        self.counters.inc("lookups")
        if not hashes:
            return 0
        keys = self.keys(hashes)
        n = _prefix(self._ours(keys, self.backend.exists(keys)))
        self.counters.inc("lookup_hits", n)
        return n

    def lookup_many(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        """:meth:`lookup` of several runs of hashes in one backend call (one
        round trip for a whole scheduler step's requests)."""
        self.counters.inc("lookups", len(runs))
        keys = self.keys([h for run in runs for h in run])
        found = self._ours(keys, self.backend.exists(keys)) if keys else []
        out, at = [], 0
        for run in runs:
            out.append(_prefix(found[at:at + len(run)]))
            at += len(run)
        self.counters.inc("lookup_hits", sum(out))
        return out

    def load(self, hashes: Sequence[bytes], host_pool: torch.Tensor,
             host_ids: Sequence[int]) -> int:
        """Read objects into host blocks; the length of the intact contiguous prefix."""
        _same_len(hashes, host_ids)
        if not hashes:
            return 0
        view, bb = self._pool_view(host_pool, host_ids)
        keys = self.keys(hashes)
        with self._arena(len(hashes)) as hdrs:
            hs = self.header_size
            hdr_views = [hdrs[i * hs:(i + 1) * hs] for i in range(len(keys))]
            payloads = [view[hid * bb:(hid + 1) * bb] for hid in host_ids]
            bufs = [[h, p] for h, p in zip(hdr_views, payloads, strict=True)]
            nread = self.backend.get_into(keys, bufs)
            n, damaged = self._verify_prefix(hashes, keys, hdr_views, payloads, nread)
        self.counters.inc("blocks_loaded", n)
        if damaged:
            self.backend.delete([keys[n]])
            self.counters.inc("damaged_deleted")
        return n

    def _verify_prefix(self, hashes, keys, hdrs, payloads, nread) -> tuple[int, bool]:
        """Count intact objects from the start; stop at the first bad one."""
        for i, h in enumerate(hashes):
            if nread[i] == OVERSIZE:  # larger than a block: the backend read nothing
                self._rejected(h, "oversize")
                return i, False
            if nread[i] < 0:
                self.counters.inc("load_misses")
                return i, False
            reason = verify_object(hdrs[i], payloads[i], nread=nread[i],
                                   layout_digest=self.layout_digest, block_hash=h,
                                   rank=self.rank, tp_size=self.tp_size, auth=self.auth,
                                   key=keys[i])
            if reason is not None:
                self._rejected(h, reason)
                if reason == "bad_mac" and signed_by_other(hdrs[i], self.auth):
                    self._remember_foreign(keys[i])  # left alone: not ours to delete
                    return i, False
                return i, reason in _DAMAGED or reason == "bad_mac"
        return len(hashes), False

    def _ours(self, keys: list[str], found: Sequence[bool]) -> list[bool]:
        """``found`` less the objects known to be another secret's."""
        if not self._foreign:
            return list(found)
        with self._lock:
            return [f and k not in self._foreign for k, f in zip(keys, found, strict=True)]

    def _remember_foreign(self, key: str) -> None:
        with self._lock:
            self._foreign[key] = None
            if len(self._foreign) > FOREIGN_MAX:
                del self._foreign[next(iter(self._foreign))]
        self.counters.inc("foreign_remembered")

    def _rejected(self, block_hash: bytes, reason: str) -> None:
        self.counters.inc(f"miss_{reason}")
        with self._lock:  # warn once per reason: a mismatch storm must not flood logs
            first = reason not in self._warned
            self._warned.add(reason)
        key = self.keys([block_hash])[0]
        (logger.warning if first else logger.debug)(
            "storage object %s rejected (%s); treated as a miss", key, reason)

    def delete(self, hashes: Sequence[bytes]) -> None:
        """Remove this rank's objects of ``hashes``."""
        if hashes:
            self.backend.delete(self.keys(hashes))

    def healthy(self) -> bool:
        """Whether the backend answers (and its breaker is closed)."""
        return self.backend.healthy()

    def stats(self) -> dict:
        """BlockStore counters, with the backend's under ``backend``."""
        return {**self.counters.snapshot(), "namespace": self.namespace,
                "backend": self.backend.stats()}

    def health(self) -> dict:
        """What `kvcached status` shows of this rank's storage: traffic, space (file
        store), objects rejected on read by reason (each a miss), backend errors."""
        c, b = self.counters.snapshot(), self.backend.stats()
        out = {"kind": b.get("kind", "?"), "lookups": c["lookups"],
               "found": c["lookup_hits"], "loaded": c["blocks_loaded"],
               "stored": c["blocks_stored"], "already_stored": c["blocks_already_stored"],
               "store_failed": c["blocks_store_failed"],
               "load_misses": c["load_misses"], "damaged_deleted": c["damaged_deleted"],
               "rejected": {r: c[f"miss_{r}"] for r in MISS_REASONS if c[f"miss_{r}"]},
               "errors": b.get("errors", 0), "timeouts": b.get("timeouts", 0),
               "breaker": b.get("breaker_state", ""), "authenticated": self.auth is not None,
               "encrypted": self.auth is not None and self.auth.encrypt}
        if "bytes_used" in b:
            out.update(used_bytes=b["bytes_used"], max_bytes=b.get("max_bytes", 0),
                       objects=b.get("objects", 0))
        return out

    def release_host_pool(self) -> None:
        """Forget cached host pool views (call before the pool is freed, e.g. sleep)."""
        with self._lock:
            views, self._pools = list(self._pools.values()), {}
        for view in views:
            self.backend.unregister_memory(view)

    def close(self) -> None:
        """Release the host pool views and close the backend."""
        self.release_host_pool()
        self.backend.close()

    # ------------------------------------------------------------ memory
    def _pool_view(self, pool: torch.Tensor, host_ids: Sequence[int]) -> tuple[memoryview, int]:
        """A flat byte view of the host pool (registered once with the backend)."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.device.type != "cpu":
            raise ValueError("host pool must be a CPU uint8 tensor [num_blocks, block_bytes], "
                             f"got {pool.dtype} {tuple(pool.shape)} on {pool.device}")
        if not pool.is_contiguous():
            raise ValueError("host pool must be contiguous")
        nblocks, bb = pool.shape
        for hid in host_ids:
            if not 0 <= hid < nblocks:
                raise ValueError(f"host block id {hid} out of range [0, {nblocks})")
        key = (pool.data_ptr(), pool.numel())
        view = self._pools.get(key)
        if view is None:
            view = memoryview(pool.numpy().reshape(-1))
            self.backend.register_memory(view)
            with self._lock:
                self._pools[key] = view
        return view, bb

    @contextmanager
    def _arena(self, n: int):
        """Header buffers for ``n`` objects, reused across calls (and registered)."""
        with self._lock:
            fits = [a for a in self._free_arenas if a.nbytes >= n * self.header_size]
            arena = fits[0] if fits else None
            if arena is not None:
                self._free_arenas.remove(arena)
        if arena is None:
            arena = np.zeros(max(n, 256) * self.header_size, dtype=np.uint8)
            self.backend.register_memory(memoryview(arena))
        try:
            yield memoryview(arena)
        finally:
            with self._lock:
                self._free_arenas.append(arena)


def _prefix(flags: Sequence[bool]) -> int:
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def _same_len(hashes: Sequence, host_ids: Sequence) -> None:
    if len(hashes) != len(host_ids):
        raise ValueError(f"got {len(hashes)} hashes but {len(host_ids)} host ids")
