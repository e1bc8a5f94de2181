"""Redis backend (standalone or Redis Cluster) through the ``redis`` package.

Objects are plain string values under ``<prefix><key>``. Batches go out in
shallow chunks (a few MB / a few dozen keys per round trip) so one slow batch
never holds a connection for long, with short socket timeouts and no client
retries: a dead server costs one failed round trip, then the circuit breaker
fails calls fast until a probe finds the server back.

Cluster mode is detected on first contact (``INFO cluster``) unless forced
with ``cluster=``; reads then use ``mget_nonatomic`` (cross-slot batches are
split per slot) and writes a non-transactional cluster pipeline.

Redis evicts by its own policy: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` to cap its size.

Reads ask for at most one byte more than the block's object (``GETRANGE``), so
a value that someone made huge never lands in this process: it is a miss
(``OVERSIZE``). The password of ``redis://user:password@host`` never leaves the
client: stats, errors and logs show ``redis://user:***@host``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from kvcached.storage.base import (
    OVERSIZE,
    BackendError,
    BackendTimeout,
    CircuitBreaker,
    StorageBackend,
    copy_into_parts,
    parts_len,
    redact_url,
)

logger = logging.getLogger(__name__)


def _import_redis():
    try:
        import redis
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as e:
        raise ImportError(
            "storage_backend='redis' needs the 'redis' package: "
            f"pip install 'kvcached[redis]' (import failed: {e})") from e
    return redis, Retry, NoBackoff


class RedisBackend(StorageBackend):
    """Objects as Redis string values; see the module docstring."""

    kind = "redis"

    def __init__(self, url: str, cluster: bool | None = None, prefix: str = "kvcached/",
                 socket_timeout_s: float = 1.0, connect_timeout_s: float = 0.5,
                 chunk_bytes: int = 4 << 20, chunk_keys: int = 64, ttl_s: int = 0,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 2.0) -> None:
        super().__init__(CircuitBreaker(breaker_threshold, breaker_cooldown_s))
        self._redis, self._Retry, self._NoBackoff = _import_redis()
        self.url = url
        self.prefix = prefix
        self.want_cluster = cluster
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.chunk_bytes = max(1, chunk_bytes)
        self.chunk_keys = max(1, chunk_keys)
        self.ttl_s = ttl_s
        self._client = None
        self._is_cluster = False
        self._client_lock = threading.Lock()
        self.counters.declare("key_errors", "oversize_objects")

    # ------------------------------------------------------------ client
    def _conn(self):
        """The client, created (and cluster mode detected) on first use."""
        with self._client_lock:
            if self._client is None:
                self._client, self._is_cluster = self._make_client()
            return self._client

    def _make_client(self):
        common = dict(socket_timeout=self.socket_timeout_s,
                      socket_connect_timeout=self.connect_timeout_s,
                      retry=self._Retry(self._NoBackoff(), 0))
        plain = self._redis.Redis.from_url(self.url, health_check_interval=0, **common)
        cluster = self.want_cluster
        if cluster is None:
            try:
                info = self._call(plain.info, "cluster")
            except BackendError as e:
                if isinstance(e.__cause__, self._redis.exceptions.ResponseError):
                    info = {}  # INFO disabled / renamed: assume a standalone server
                else:
                    raise
            cluster = bool(info.get("cluster_enabled"))
        if not cluster:
            return plain, False
        plain.close()
        rc = self._call(self._redis.cluster.RedisCluster.from_url, self.url, **common)
        logger.info("redis storage: cluster mode, %d primaries", len(rc.get_primaries()))
        return rc, True

    def _call(self, fn, *args, **kwargs):
        """Run a redis call, turning its errors into BackendError / BackendTimeout."""
        r = self._redis
        try:
            return fn(*args, **kwargs)
        except (r.exceptions.TimeoutError, TimeoutError) as e:
            raise BackendTimeout(str(e) or "timeout") from e
        except (r.exceptions.RedisError, OSError) as e:
            self._drop_client_on(e)
            raise BackendError(f"{type(e).__name__}: {e}") from e

    def _drop_client_on(self, e: Exception) -> None:
        # A cluster client keeps a topology that may be stale after a restart.
        if self._is_cluster and isinstance(e, self._redis.exceptions.ConnectionError):
            with self._client_lock:
                client, self._client = self._client, None
            if client is not None:
                try:
                    client.close()
                except Exception:
                    pass

    # ------------------------------------------------------------ chunks
    def _chunks(self, n: int, sizes: list[int] | None = None) -> Iterator[range]:
        """Index ranges of at most chunk_keys keys and about chunk_bytes bytes."""
        start = 0
        while start < n:
            end, nbytes = start, 0
            while end < n and end - start < self.chunk_keys:
                nbytes += sizes[end] if sizes else 0
                end += 1
                if nbytes >= self.chunk_bytes:
                    break
            yield range(start, end)
            start = end

    # ------------------------------------------------------------ ops
    def _exists(self, keys: list[str]) -> list[bool]:
        c = self._conn()
        out: list[bool] = []
        for rng in self._chunks(len(keys)):
            pipe = c.pipeline(transaction=False)
            for i in rng:
                pipe.exists(self.prefix + keys[i])
            res = self._call(pipe.execute, raise_on_error=False)
            out.extend(self._ok(r) and bool(r) for r in res)
        return out

    def _get_into(self, keys: list[str], parts: list[list[memoryview]]) -> list[int]:
        c = self._conn()
        sizes = [parts_len(p) for p in parts]
        out: list[int] = []
        for rng in self._chunks(len(keys), sizes):
            pipe = c.pipeline(transaction=False)
            for i in rng:  # at most size + 1 bytes: enough to tell an oversize value
                pipe.getrange(self.prefix + keys[i], 0, sizes[i])
            values = self._call(pipe.execute, raise_on_error=False)
            for i, v in zip(rng, values, strict=True):
                out.append(self._deliver(v, parts[i], sizes[i]) if self._ok(v) else -1)
        return out

    def _deliver(self, value, parts: list[memoryview], size: int) -> int:
        if not value:  # a missing key reads as b"" (no object is empty)
            return -1
        if len(value) > size:
            self.counters.inc("oversize_objects")
            return OVERSIZE
        return copy_into_parts(value, parts)

    def _put_from(self, keys: list[str], parts: list[list[memoryview]]) -> list[bool]:
        c = self._conn()
        sizes = [parts_len(p) for p in parts]
        ex = self.ttl_s or None
        out: list[bool] = []
        for rng in self._chunks(len(keys), sizes):
            pipe = c.pipeline(transaction=False)
            for i in rng:
                # One part goes out as is (redis-py sends memoryviews without a copy).
                value = parts[i][0] if len(parts[i]) == 1 else b"".join(parts[i])
                pipe.set(self.prefix + keys[i], value, ex=ex)
            res = self._call(pipe.execute, raise_on_error=False)
            out.extend(self._ok(r) and r is True for r in res)
        return out

    def _ok(self, result) -> bool:
        if isinstance(result, Exception):
            self.counters.inc("key_errors")
            logger.debug("redis storage: per-key error %s", result)
            return False
        return True

    def _delete(self, keys: list[str]) -> None:
        c = self._conn()
        for rng in self._chunks(len(keys)):
            pipe = c.pipeline(transaction=False)
            for i in rng:
                pipe.unlink(self.prefix + keys[i])
            self._call(pipe.execute, raise_on_error=False)

    def _clear(self) -> None:
        c = self._conn()
        pattern = _glob_escape(self.prefix) + "*"
        batch: list = []
        for k in self._call(lambda: list(c.scan_iter(match=pattern, count=1000))):
            batch.append(k)
            if len(batch) >= 512:
                self._unlink_raw(c, batch)
                batch = []
        if batch:
            self._unlink_raw(c, batch)

    def _unlink_raw(self, c, raw_keys: list) -> None:
        pipe = c.pipeline(transaction=False)
        for k in raw_keys:
            pipe.unlink(k)
        self._call(pipe.execute, raise_on_error=False)

    def _ping(self) -> bool:
        self._call(self._conn().ping)
        return True

    def _close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _extra_stats(self) -> dict:
        return {"url": redact_url(self.url), "cluster": self._is_cluster, "prefix": self.prefix}

    def _redact(self, text: str) -> str:
        password = _password(self.url)
        text = text.replace(self.url, redact_url(self.url))
        return text.replace(password, "***") if len(password) >= 4 else text


def _password(url: str) -> str:
    from urllib.parse import unquote, urlsplit

    try:
        pw = urlsplit(url).password
    except ValueError:
        return ""
    return unquote(pw) if pw else ""


def _glob_escape(s: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in s)
