"""Storage backend interface, circuit breaker and counters.

Every backend exposes the same batch calls (``exists``, ``get_into``,
``put_from``, ``delete``, ``clear``, ``healthy``, ``stats``, ``close``). The
public calls never raise on backend trouble: a dead server, a timeout or an I/O
error becomes misses / failed puts and a counter, because a cache that is down
must slow the engine down, not crash it. Programming errors (mismatched list
lengths) still raise ``ValueError``.

A buffer is either one writable/readable buffer (``memoryview``, ``bytearray``,
numpy array) or a list of them: the object is their concatenation. The
``BlockStore`` passes ``[header, payload]`` so the payload is read straight
into the host block and the header into a small separate buffer.

Remote backends share a :class:`CircuitBreaker`: after ``threshold``
consecutive failures calls fail fast for ``cooldown_s``, then one call is let
through as a probe; its outcome closes or re-opens the breaker.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Buffer = Any  # a buffer-protocol object or a list of them (scatter / gather)

# get_into's result for an object larger than its buffers: nothing was read (and
# nothing allocated for it), the BlockStore counts it as reason ``oversize``.
OVERSIZE = -2


class BackendError(Exception):
    """The backend as a whole failed (unreachable, protocol error): trips the breaker."""


class BackendTimeout(BackendError):
    """The backend did not answer in time."""


# ---------------------------------------------------------------- breaker
class CircuitBreaker:
    """Fail fast after ``threshold`` consecutive failures, probe after ``cooldown_s``.

    States: ``closed`` (calls go through), ``open`` (calls fail fast until the
    cool-down ends), ``half_open`` (one probe call in flight; others fail fast).
    """

    def __init__(self, threshold: int = 3, cooldown_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown_s < 0:
            raise ValueError(f"breaker needs threshold >= 1 and cooldown_s >= 0, "
                             f"got {threshold}, {cooldown_s}")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = "closed"
        self._failures = 0
        self._open_until = 0.0
        self.opens = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        with self._lock:
            if self._state == "open" and self._clock() >= self._open_until:
                return "half_open"  # the next allow() becomes the probe
            return self._state

    @property
    def probing(self) -> bool:
        """True while the one probe call of the half-open state is out."""
        with self._lock:
            return self._state == "half_open"

    def allow(self) -> bool:
        """May a call go out now? In the half-open state only one probe may."""
        with self._lock:
            if self._state == "closed":
                return True
            if self._state == "open" and self._clock() >= self._open_until:
                self._state = "half_open"
                return True
            return False

    def record_success(self) -> None:
        """A call succeeded: close the breaker."""
        with self._lock:
            if self._state != "closed":
                logger.info("storage breaker closed: backend answers again")
            self._state = "closed"
            self._failures = 0

    def record_failure(self) -> bool:
        """A call failed; returns True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state == "half_open" or (
                    self._state == "closed" and self._failures >= self.threshold):
                self._state = "open"
                self._open_until = self._clock() + self.cooldown_s
                self.opens += 1
                return True
            return False


# --------------------------------------------------------------- counters
class Counters:
    """Thread-safe named integer counters."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(names, 0)

    def inc(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (created at 0 when new)."""
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def declare(self, *names: str) -> None:
        """Make counters show up (at 0) before their first increment."""
        with self._lock:
            for n in names:
                self._c.setdefault(n, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._c)


# ---------------------------------------------------------------- buffers
def as_parts(buf: Buffer) -> list[memoryview]:
    """Normalise one buffer or a list of buffers to flat byte memoryviews."""
    items = buf if isinstance(buf, (list, tuple)) else [buf]
    out = []
    for b in items:
        mv = b if isinstance(b, memoryview) else memoryview(b)
        if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
            mv = mv.cast("B")
        out.append(mv)
    return out


def parts_len(parts: Sequence[memoryview]) -> int:
    """Total bytes of a list of parts."""
    return sum(p.nbytes for p in parts)


def copy_into_parts(data, parts: Sequence[memoryview]) -> int:
    """Scatter ``data`` over ``parts``; returns the bytes copied (``len(data)``)."""
    src = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    pos = 0
    for p in parts:
        n = min(p.nbytes, src.nbytes - pos)
        if n <= 0:
            break
        p[:n] = src[pos:pos + n]
        pos += n
    return pos


# ---------------------------------------------------------------- backend
_READ_STATS = ("gets", "hits", "misses", "bytes_read", "puts", "puts_ok",
               "puts_failed", "bytes_written", "exists_calls", "deletes", "errors",
               "timeouts", "fast_fails")


class StorageBackend(ABC):
    """Base of all backends: guards every call with error handling and the breaker.

    Subclasses implement ``_exists``, ``_get_into``, ``_put_from``, ``_delete``,
    ``_clear``, ``_ping`` and optionally ``_close``, ``_extra_stats`` and
    ``register_memory``. They raise :class:`BackendError` /
    :class:`BackendTimeout` (or let any exception escape) when the whole call
    failed; per-key trouble is reported in the returned lists.
    """

    kind = "base"

    def __init__(self, breaker: CircuitBreaker | None = None) -> None:
        self.breaker = breaker
        self.counters = Counters(*_READ_STATS)
        self._closed = False
        self._last_error = ""
        self._log_lock = threading.Lock()
        self._logged_down = False
        self._logged_open = False

    # ------------------------------------------------------------ public
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is there an object (it may still fail verification)."""
        keys = list(keys)
        self.counters.inc("exists_calls")
        res = self._guarded(self._exists, keys, fallback=[False] * len(keys))
        return [bool(x) for x in res]

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """Read each object into its buffer(s); bytes read per key, -1 for a miss,
        :data:`OVERSIZE` for an object larger than its buffers (not read)."""
        keys = list(keys)
        _same_len(keys, buffers, "buffers")
        parts = [as_parts(b) for b in buffers]
        self.counters.inc("gets", len(keys))
        res = self._guarded(self._get_into, keys, parts, fallback=[-1] * len(keys))
        hits = [n for n in res if n >= 0]
        self.counters.inc("hits", len(hits))
        self.counters.inc("misses", len(keys) - len(hits))
        self.counters.inc("bytes_read", sum(hits))
        return res

    def put_from(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[bool]:
        """Write each buffer (list) as one object; True per key that is now stored."""
        keys = list(keys)
        _same_len(keys, buffers, "buffers")
        parts = [as_parts(b) for b in buffers]
        self.counters.inc("puts", len(keys))
        res = self._guarded(self._put_from, keys, parts, fallback=[False] * len(keys))
        ok = [bool(x) for x in res]
        self.counters.inc("puts_ok", sum(ok))
        self.counters.inc("puts_failed", len(ok) - sum(ok))
        written = sum(parts_len(p) for p, o in zip(parts, ok, strict=True) if o)
        self.counters.inc("bytes_written", written)
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        """Remove objects (missing ones are ignored)."""
        keys = list(keys)
        self.counters.inc("deletes", len(keys))
        self._guarded(self._delete, keys, fallback=None)

    def clear(self) -> None:
        """Remove every object this backend stored (its prefix / directory)."""
        self._guarded(self._clear, fallback=None)

    def healthy(self) -> bool:
        """True when the breaker is not open and the backend answers a ping."""
        return bool(self._guarded(self._ping, fallback=False))

    def stats(self) -> dict:
        """Counters plus breaker state and backend-specific numbers."""
        out: dict[str, Any] = {"kind": self.kind, **self.counters.snapshot()}
        if self.breaker is not None:
            out["breaker_state"] = self.breaker.state
            out["breaker_opens"] = self.breaker.opens
        out["last_error"] = self._last_error
        out.update(self._extra_stats())
        return out

    def register_memory(self, buf) -> None:  # noqa: B027 (optional hook)
        """Hint: ``buf`` will be used for zero-copy I/O (Mooncake registers it)."""

    def unregister_memory(self, buf) -> None:  # noqa: B027 (optional hook)
        """Undo :meth:`register_memory` before ``buf`` is freed."""

    def close(self) -> None:
        """Release connections / handles; further calls fail as misses."""
        if not self._closed:
            self._closed = True
            try:
                self._close()
            except Exception as e:  # closing must never raise at shutdown
                logger.warning("closing %s storage backend: %s", self.kind, e)

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ guard
    def _guarded(self, fn: Callable, *args, fallback):
        if self._closed:
            self.counters.inc("fast_fails")
            return fallback
        if self.breaker is not None and not self.breaker.allow():
            self.counters.inc("fast_fails")
            return fallback
        try:
            result = fn(*args)
        except BackendTimeout as e:
            self.counters.inc("timeouts")
            self._failed(fn, e)
            return fallback
        except Exception as e:  # any backend trouble is a miss, never the caller's crash
            self.counters.inc("errors")
            self._failed(fn, e)
            return fallback
        if self.breaker is not None:
            self.breaker.record_success()
        if self._logged_down:
            with self._log_lock:
                self._logged_down = self._logged_open = False
        return result

    def _failed(self, fn: Callable, e: Exception) -> None:
        self._last_error = self._redact(f"{fn.__name__.lstrip('_')}: {type(e).__name__}: {e}")
        opened = self.breaker.record_failure() if self.breaker is not None else False
        with self._log_lock:  # warn on the first failure and first open of an outage only
            first, self._logged_down = not self._logged_down, True
            first_open = opened and not self._logged_open
            self._logged_open = self._logged_open or opened
        if first or first_open:
            logger.warning("%s storage %s%s", self.kind, self._last_error,
                           "; breaker open, failing fast" if opened else "")
        else:
            logger.debug("%s storage %s", self.kind, self._last_error)

    # ------------------------------------------------------------ hooks
    @abstractmethod
    def _exists(self, keys: list[str]) -> list[bool]:
        """Backend-specific; errors raised here are counted by the wrapper."""

    @abstractmethod
    def _get_into(self, keys: list[str], parts: list[list[memoryview]]) -> list[int]:
        """Backend-specific; errors raised here are counted by the wrapper."""

    @abstractmethod
    def _put_from(self, keys: list[str], parts: list[list[memoryview]]) -> list[bool]:
        """Backend-specific; errors raised here are counted by the wrapper."""

    @abstractmethod
    def _delete(self, keys: list[str]) -> None:
        """Backend-specific; errors raised here are counted by the wrapper."""

    @abstractmethod
    def _clear(self) -> None:
        """Backend-specific; errors raised here are counted by the wrapper."""

    def _ping(self) -> bool:
        return True

    def _close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        pass

    def _extra_stats(self) -> dict:
        return {}

    def _redact(self, text: str) -> str:
        """Hide credentials in an error text (stats' last_error, logs)."""
        return text


def redact_url(url: str) -> str:
    """``url`` with its password (``scheme://user:PASSWORD@host``) replaced by ``***``,
    for stats, errors and logs."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(url)
        if u.password is None:
            return url
        user = u.username or ""
        host = u.netloc.rpartition("@")[2]
        return urlunsplit(u._replace(netloc=f"{user}:***@{host}"))
    except ValueError:  # unparsable: hide whatever may sit before an '@'
        return "***@" + url.rpartition("@")[2] if "@" in url else url


def _same_len(keys: list, buffers: Sequence, what: str) -> None:
    if len(keys) != len(buffers):
        raise ValueError(f"got {len(keys)} keys but {len(buffers)} {what}")
