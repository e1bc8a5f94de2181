"""KV events: which blocks an engine holds, per tier, for cache-aware routers.

Opt-in (config ``kv_events_endpoint``). The manager calls
:meth:`KVEventPublisher.publish` when blocks are stored in or removed from a
tier; a router subscribes and follows what each engine holds, as with vLLM's
KV events.

Wire format, one ZeroMQ PUB message per ``publish`` call, three frames::

    topic        bytes (default b"kvcached")
    sequence     8-byte big-endian unsigned int, 1, 2, 3, ... per publisher
    payload      msgpack map {"ts": float (unix time), "kind": "stored" |
                 "removed" | "cleared", "tier": "gpu" | "cpu" | "storage",
                 "block_hashes": [bytes, ...], "source": str}

The sequence number is taken when the event is published, so an event the
publisher had to drop (its queue was full) shows up as a gap: a subscriber
that sees one should resynchronise (treat its view of that engine as stale).
``cleared`` (empty ``block_hashes``) means the whole tier was emptied, e.g.
after a weight update or a sleep that released the host pool.

Threads: ``publish`` only enqueues, so the scheduler never waits on a
socket; one thread owns the PUB socket and sends; a ``None`` sentinel stops
it; the socket closes with ``linger=0``. The socket binds to ``ipc://`` or
loopback TCP only, unless the caller passes ``allow_remote=True``.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq

logger = logging.getLogger(__name__)

KINDS = ("stored", "removed", "cleared")
TIERS = ("gpu", "cpu", "storage")
DEFAULT_TOPIC = b"kvcached"
MAX_PENDING = 65536  # events queued before publish() starts dropping (a gap in seq)
_LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One decoded event, as a subscriber sees it."""

    topic: bytes
    seq: int
    ts: float
    kind: str
    tier: str
    block_hashes: list[bytes]
    source: str = ""


def encode_event(topic: bytes, seq: int, ts: float, kind: str, tier: str,
                 block_hashes: list[bytes], source: str = "") -> list[bytes]:
    """The three frames of one event (see the module docstring)."""
    payload = {"ts": ts, "kind": kind, "tier": tier, "block_hashes": block_hashes,
               "source": source}
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


def decode_event(frames: list[bytes]) -> KVEvent:
    """Decode the frames a SUB socket received; ValueError if they are not an event."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event has 3 frames (topic, 8-byte seq, payload), "
                         f"got {len(frames)} frames")
    try:
        p = msgpack.unpackb(frames[2], raw=False, max_str_len=1 << 16)
    except Exception as e:  # noqa: BLE001 - any parser failure means a bad payload
        raise ValueError(f"KV event payload is not msgpack: {e}") from None
    if not isinstance(p, dict) or p.get("kind") not in KINDS or p.get("tier") not in TIERS:
        raise ValueError(f"KV event payload has no valid kind/tier: {p!r:.200}")
    return KVEvent(bytes(frames[0]), int.from_bytes(frames[1], "big"), float(p.get("ts", 0)),
                   p["kind"], p["tier"], list(p.get("block_hashes", [])),
                   str(p.get("source", "")))


def check_endpoint(endpoint: str, allow_remote: bool = False) -> None:
    """Refuse endpoints other machines could reach, unless ``allow_remote``."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"kv_events_endpoint {endpoint!r}: use ipc://PATH or "
                         "tcp://127.0.0.1:PORT")
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if allow_remote or host in _LOOPBACK_NAMES or _is_loopback(host):
        return
    raise ValueError(f"kv_events_endpoint {endpoint!r} would accept subscribers from other "
                     "machines; bind to tcp://127.0.0.1:PORT or ipc://PATH (remote "
                     "subscribers need allow_remote=True)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a hostname: not provably local


class KVEventPublisher:
    """Publishes block stored/removed events on a ZeroMQ PUB socket (opt-in)."""

    def __init__(self, endpoint: str, topic: bytes = DEFAULT_TOPIC, source: str = "",
                 allow_remote: bool = False, max_pending: int = MAX_PENDING):
        check_endpoint(endpoint, allow_remote)
        self.endpoint = endpoint
        self.topic = topic
        self.source = source
        self.max_pending = max_pending
        self.dropped = 0
        # (seq, ts, kind, tier, hashes); encoded on the sender thread, not the caller's
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._seq = itertools.count(1)
        self._lock = threading.Lock()  # seq order == queue order, whoever publishes
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: Exception | None = None
        self._closed = False

    def start(self, timeout_s: float = 5.0) -> KVEventPublisher:
        """Start the sender thread; returns once the socket is bound (or raises)."""
        self._thread = threading.Thread(target=self._run, name="kvcached-kv-events",
                                        daemon=True)
        self._thread.start()
        if not self._bound.wait(timeout_s):
            raise TimeoutError(f"KV event publisher did not bind {self.endpoint} "
                               f"within {timeout_s}s")
        if self._bind_error is not None:
            raise RuntimeError(f"cannot bind kv_events_endpoint {self.endpoint!r}: "
                               f"{self._bind_error}") from self._bind_error
        logger.info("publishing KV events on %s", self.endpoint)
        return self

    def publish(self, kind: str, tier: str, block_hashes: list[bytes]) -> None:
        """Queue one event; never blocks. Drops (leaving a seq gap) when far behind."""
        if kind not in KINDS or tier not in TIERS:
            raise ValueError(f"KV event kind must be one of {KINDS} and tier one of {TIERS}, "
                             f"got {kind!r}, {tier!r}")
        if self._closed:
            return
        hashes = list(block_hashes)  # the caller may reuse its list
        with self._lock:
            seq = next(self._seq)
            if self._queue.qsize() >= self.max_pending:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 10000 == 0:
                    logger.warning("KV event queue full: %d events dropped", self.dropped)
                return
            self._queue.put((seq, time.time(), kind, tier, hashes))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("KV event thread did not stop within %.1fs", timeout_s)

    def __enter__(self) -> KVEventPublisher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- thread
    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._bind_error = e
            sock.close()
            self._bound.set()
            return
        self._bound.set()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                seq, ts, kind, tier, hashes = item
                frames = encode_event(self.topic, seq, ts, kind, tier,
                                      [bytes(h) for h in hashes], self.source)
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.dropped += 1  # PUB drops at its high-water mark anyway
                except zmq.ZMQError as e:  # log and go on: events are best effort
                    logger.error("KV event send failed: %s", e)
        finally:
            sock.close(linger=0)
