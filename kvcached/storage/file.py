"""File backend: one file per object in a directory, with an LRU size cap.

Layout: ``<root>/<namespace>/<fan>/<rest of key>`` (key parts percent-encoded,
``fan`` = two hex digits spreading a namespace over 256 directories), plus a
marker file ``KVCACHED_STORE`` that identifies the directory as ours: the
backend refuses a non-empty directory without it, so a mistyped
``storage_url`` never gets someone's files evicted.

Writes go to a temporary file in the target directory and are renamed into
place, so a reader sees a whole object or none; a failed write leaves nothing
visible. There is no fsync: after a power loss a torn file fails its checksum
and is a miss, which is all a cache needs.

Several processes may write one directory: the TP ranks of an engine (each
indexes only the keys it is told it owns, ``index_suffix``, and enforces its
own share of the cap) and several engines (a fleet). The bytes held, per
suffix, are a :class:`~kvcached.storage.ledger.SharedLedger` next to the
objects: a writer renames its object into place, adds its size and evicts
under the ledger's lock, so the cap holds for all writers together.
Eviction takes the least recently used objects of an in-memory index (key ->
size, in access order) built at open from file modification times (hits
touch the file's mtime, so the order survives restarts); the index is
rebuilt from the directory once a quarter of the cap was written since the
last scan, or when it holds nothing else to evict, so one writer's cleanup
reaches the other writers' objects too. Without an explicit cap
(``max_bytes=0``) a ``disk_fraction`` > 0 sets one at open: that share of the
free disk space plus what this store holds already (so the cap does not
shrink as the store fills the disk). ``exists`` always asks the file
system, so no process answers from a stale index.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import shutil
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote, unquote

from kvcached.storage.base import OVERSIZE, BackendError, StorageBackend, parts_len
from kvcached.storage.ledger import SharedLedger

logger = logging.getLogger(__name__)

MARKER = "KVCACHED_STORE"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 300.0  # a temp file this old belongs to a crashed writer
_counter = itertools.count()


def _enc(part: str) -> str:
    enc = quote(part, safe="@+-_~.")
    return "%2E" + enc[1:] if enc.startswith(".") else enc  # never a hidden/temp name


class FileBackend(StorageBackend):
    """Objects as files under ``root``; ``max_bytes`` > 0 caps their total size (LRU)."""

    kind = "file"

    def __init__(self, root: str | os.PathLike, max_bytes: int = 0,
                 index_suffix: str | None = None, io_threads: int = 1,
                 disk_fraction: float = 0.0) -> None:
        super().__init__(breaker=None)  # local disk: errors are per call, nothing to trip
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not 0.0 <= disk_fraction <= 1.0:
            raise ValueError(f"disk_fraction must be in [0, 1], got {disk_fraction}")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.index_suffix = index_suffix
        # io_threads > 1 overlaps per-file syscalls (the GIL is released in os.open,
        # readv, writev): worth it with spare cores and a fast disk; on 2 busy cores
        # it measured slower, hence the default of 1.
        self.io_threads = max(1, int(io_threads))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # oldest access first
        self._used = 0  # bytes of the indexed objects (the ledger has everyone's)
        self._written = 0  # bytes this process wrote since its last scan
        self._dirs: set[str] = set()
        self.counters.declare("evictions", "io_errors", "oversize_objects")
        self._open_root()
        self._ledger = SharedLedger(self.root / _ledger_name(index_suffix))
        with self._ledger.locked():
            self._ledger.write(self._scan())  # a recount: drift of crashed writers goes
        logger.info("file storage %s: %d objects, %d bytes indexed", self.root,
                    len(self._index), self._used)
        if not self.max_bytes and disk_fraction:
            free = shutil.disk_usage(self.root).free
            self.max_bytes = max(1, int(disk_fraction * (free + self._used)))
            logger.info("file storage %s: cap %d bytes (%.0f%% of the free disk and what "
                        "the store holds)", self.root, self.max_bytes, 100 * disk_fraction)
        self._settle(0)

    # ------------------------------------------------------------ paths
    def _path(self, key: str) -> str:
        ns, sep, rest = key.partition("/")
        if not ns or not sep or not rest:
            raise ValueError(f"file storage key must look like <namespace>/<name>, got {key!r}")
        fan = format(zlib.crc32(rest.encode()) & 0xFF, "02x")
        return os.path.join(self.root, _enc(ns), fan, _enc(rest))

    @staticmethod
    def _key_of(ns_dir: str, name: str) -> str:
        return f"{unquote(ns_dir)}/{unquote(name)}"

    # ------------------------------------------------------------ open
    def _open_root(self) -> None:
        try:
            # 0700: cached KV can reveal prompts, so other users get no access.
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"storage_url for file: cannot create directory "
                             f"{str(self.root)!r}: {e}") from e
        marker = self.root / MARKER
        if marker.exists():
            return
        others = [e.name for e in _scandir(self.root) if e.name != MARKER]
        # Re-check: another rank may have created the marker and its first objects
        # between our two looks.
        if others and not marker.exists():
            raise ValueError(
                f"storage_url for file: {str(self.root)!r} is a non-empty directory "
                f"that is not a kvcached store (no {MARKER} file); use a new or empty "
                "directory")
        marker.write_text("kvcached storage v1\n")  # same content from every writer

    def _scan(self) -> int:
        """Rebuild the index from the directory, oldest modification first; returns
        the bytes found (hold the ledger's lock: no writer renames meanwhile)."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for ns_entry in _scandir(self.root):
            if not ns_entry.is_dir() or ns_entry.name.startswith("."):
                continue
            for fan in _scandir(ns_entry.path):
                if fan.is_dir():
                    self._scan_fan(ns_entry.name, fan.path, found, now)
        with self._lock:
            # File times tick in jiffies (ms): objects of one tick keep this
            # process' order of use, unknown ones go first.
            pos = {k: i for i, k in enumerate(self._index)}
            found.sort(key=lambda f: (f[0], pos.get(f[1], -1)))
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._used = sum(size for _, _, size in found)
            self._written = 0
            return self._used

    def _scan_fan(self, ns_name: str, path: str, found: list, now: float) -> None:
        for f in _scandir(path):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if f.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(f.path)  # left by a writer that crashed mid-write
                continue
            key = self._key_of(ns_name, f.name)
            if self.index_suffix is None or key.endswith(self.index_suffix):
                found.append((st.st_mtime, key, st.st_size))

    # ------------------------------------------------------------ ops
    def _exists(self, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            try:
                st = os.stat(self._path(key))
            except FileNotFoundError:
                self._forget(key)
                out.append(False)
                continue
            self._remember(key, st.st_size, touch=False)
            out.append(True)
        return out

    def _get_into(self, keys: list[str], parts: list[list[memoryview]]) -> list[int]:
        return self._map(self._get_one, keys, parts)

    def _get_one(self, key: str, parts: list[memoryview]) -> int:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)
            return -1
        except OSError as e:
            self._io_error("read", key, e)
            return -1
        try:
            size = os.fstat(fd).st_size
            if size > parts_len(parts):
                self.counters.inc("oversize_objects")
                return OVERSIZE
            n = _readv_all(fd, parts)
            _touch(fd)
        except OSError as e:
            self._io_error("read", key, e)
            return -1
        finally:
            os.close(fd)
        self._remember(key, size, touch=True)
        return n

    def _put_from(self, keys: list[str], parts: list[list[memoryview]]) -> list[bool]:
        # One ledger wait per batch: a holder that stopped (SIGSTOP) fails the
        # batch after timeout_s, not each of its objects after timeout_s in turn.
        deadline = time.monotonic() + self._ledger.timeout_s
        return self._map(functools.partial(self._put_one, deadline=deadline), keys, parts)

    def _map(self, fn, keys: list[str], parts: list[list[memoryview]]) -> list:
        if self.io_threads == 1 or len(keys) < 4:
            return [fn(k, p) for k, p in zip(keys, parts, strict=True)]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads,
                                                thread_name_prefix="kvcached-file-io")
            pool = self._pool
        return list(pool.map(fn, keys, parts))

    def _put_one(self, key: str, parts: list[memoryview], deadline: float) -> bool:
        size = parts_len(parts)
        if self.max_bytes and size > self.max_bytes:
            self.counters.inc("oversize_objects")
            return False
        path = self._path(key)
        tmp = os.path.join(os.path.dirname(path),
                           f"{TMP_PREFIX}{os.getpid()}-{next(_counter)}")
        try:
            self._write_tmp(tmp, parts)
            with self._ledger.locked(deadline):
                old = _size_of(path)
                os.rename(tmp, path)  # atomic: readers see the old object, the new one, or none
                self._remember(key, size, touch=True)
                self._written += size
                self._settle(size - old)
        except OSError as e:  # TimeoutError (the ledger) included
            _unlink(tmp)
            self._io_error("write", key, e)
            return False
        return True

    def _write_tmp(self, tmp: str, parts: list[memoryview]) -> None:
        d = os.path.dirname(tmp)
        if d not in self._dirs:
            os.makedirs(d, mode=0o700, exist_ok=True)
            self._dirs.add(d)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the directory was removed (clear() elsewhere)
            os.makedirs(d, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _writev_all(fd, parts)
        finally:
            os.close(fd)

    def _delete(self, keys: list[str]) -> None:
        with self._ledger.locked():
            freed = 0
            for key in keys:
                freed += _unlink_size(self._path(key))
                self._forget(key)
            self._ledger.write(self._ledger.read() - freed)

    def _clear(self) -> None:
        with self._ledger.locked():
            with self._lock:
                self._index.clear()
                self._used = 0
                self._dirs.clear()
            for entry in _scandir(self.root):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
            self._ledger.write(self._scan())  # other suffixes' objects went too

    def _close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._ledger.close()

    def _ping(self) -> bool:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise BackendError(f"{self.root} is not writable")
        return True

    def _extra_stats(self) -> dict:
        """``bytes_used``: every writer's objects (the ledger); ``objects``: those
        this process knows of."""
        with self._lock:
            return {"bytes_used": self._ledger.read(), "objects": len(self._index),
                    "max_bytes": self.max_bytes, "root": str(self.root)}

    # ------------------------------------------------------------ index
    def _remember(self, key: str, size: int, touch: bool) -> None:
        if self.index_suffix is not None and not key.endswith(self.index_suffix):
            return
        with self._lock:
            old = self._index.get(key)
            if old is None:
                self._index[key] = size
                self._used += size
                return
            self._used += size - old
            self._index[key] = size
            if touch:
                self._index.move_to_end(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _settle(self, delta: int) -> None:
        """Add ``delta`` bytes to the ledger and evict down to the cap (hold its lock)."""
        total = self._ledger.read() + delta
        if self.max_bytes and total > self.max_bytes:
            total = self._evict(total)
        self._ledger.write(total)

    def _evict(self, total: int) -> int:
        """Unlink least recently used objects until ``total`` is under the cap (never
        the newest); returns the new total. The index is rebuilt from the directory
        first when a quarter of the cap was written since the last scan (others'
        objects join the order), and when nothing else of this process is left."""
        scanned = False
        if self._written > self.max_bytes // 4:
            total, scanned = self._scan(), True
        evicted = 0
        while total > self.max_bytes:
            with self._lock:
                victim = self._index.popitem(last=False) if len(self._index) > 1 else None
                if victim is not None:
                    self._used -= victim[1]
            if victim is None:
                if scanned:
                    break
                total, scanned = self._scan(), True
                continue
            total -= _unlink_size(self._path(victim[0]))  # 0: another writer evicted it
            evicted += 1
        if evicted:
            self.counters.inc("evictions", evicted)
        return total

    def _io_error(self, what: str, key: str, e: OSError) -> None:
        self.counters.inc("io_errors")
        self._last_error = f"{what} {key}: {e}"
        logger.debug("file storage %s %s failed: %s", what, key, e)


# ------------------------------------------------------------------ helpers
def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _ledger_name(index_suffix: str | None) -> str:
    """The ledger of the objects with ``index_suffix`` (each rank has its own share)."""
    return ".usage" + ("-" + quote(index_suffix, safe="") if index_suffix else "")


def _size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _unlink_size(path: str) -> int:
    """Unlink ``path``; its size, or 0 when it was gone already (counted by whoever
    removed it)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except FileNotFoundError:
        return 0
    except OSError as e:
        logger.debug("unlink %s: %s", path, e)
        return 0


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.debug("unlink %s: %s", path, e)


def _touch(fd: int) -> None:
    try:
        os.utime(fd)  # keeps the LRU order across restarts
    except OSError:
        pass


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if n:
        views = [views[0][n:], *views[1:]]
    return views


def _readv_all(fd: int, parts: list[memoryview]) -> int:
    """readv until EOF or the buffers are full; returns bytes read."""
    views, done = [p for p in parts if p.nbytes], 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        done += n
        views = _advance(views, n)
    return done


def _writev_all(fd: int, parts: list[memoryview]) -> None:
    """writev until every byte is written (short writes happen on signals / full disks)."""
    views = [p for p in parts if p.nbytes]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        views = _advance(views, n)
