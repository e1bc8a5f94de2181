"""Prometheus metrics for one engine's kvcached (opt-in: config ``metrics_port``).

A custom collector reads ``manager.status()`` at scrape time, so nothing is
counted twice and the manager's hot path does no metrics work. Served by a
small threaded HTTP server on ``metrics_host`` (127.0.0.1 by default) at
``/metrics``. Needs the ``prometheus-client`` package
(``pip install 'kvcached[metrics]'``).

Metrics (all prefixed ``kvcached_``):

    hit_rate{tier}                        share of prompt tokens served from the tier
    hit_tokens_total{tier}, prompt_tokens_total, requests_total
    blocks_moved_total{direction}         gpu_to_cpu, cpu_to_gpu, cpu_to_storage, storage_to_cpu
    bytes_moved_total{direction}
    tasks_total{kind, outcome}            outcome: done | failed
    task_latency_seconds{kind}            histogram, when the manager keeps buckets
    task_latency_quantile_seconds{kind, quantile}   p50 / p99 of recent tasks
    tier_blocks{tier, state}              used | free | cached
    evictions_total{kind}
    eviction_policy{policy}               1 for the policy in use (lru | adaptive)
    ghost_entries{tier}, ghost_bytes{tier}   adaptive: the ghost of evicted blocks
    policy_hits_total{tier}               adaptive: reuses of blocks the tier held
    ghost_hits_total{tier}                adaptive: blocks back after eviction, remembered
    ghost_hit_share{tier}                 ghost hits / (hits + ghost hits)
    queue_depth{rank, lane}               tasks waiting or running on a worker lane
    worker_up{rank}, worker_restarts_total{rank}
    storage_ops_total{kind}, storage_errors_total{kind}   from the storage counters
    storage_rejected_total{rank, reason}  stored objects refused on read (each a miss):
                                          checksum_mismatch, bad_magic, short_read, ...
    storage_blocks_total{rank, op}        loaded, stored, store_failed, load_misses
    storage_bytes{rank, kind}             used and cap of the file store
    storage_backend_errors_total{rank, kind}   errors, timeouts
    paused, asleep, draining, up          up is 0 when status() itself failed
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvcached.ops.statusview import storage_health

logger = logging.getLogger(__name__)

PREFIX = "kvcached_"
# Task kind -> the direction its blocks move.
DIRECTIONS = {"swap_out": "gpu_to_cpu", "swap_in": "cpu_to_gpu",
              "swap_in_layers": "cpu_to_gpu", "store": "cpu_to_storage",
              "load": "storage_to_cpu"}
STORAGE_ERROR_WORDS = ("fail", "error", "short", "timeout", "corrupt", "checksum")
MISSING_EXTRA = ("metrics_port is set but the prometheus-client package is not installed: "
                 "pip install 'kvcached[metrics]' (or set metrics_port = 0)")


def _prometheus():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client import core, exposition
    except ImportError as e:
        raise RuntimeError(MISSING_EXTRA) from e
    return core, exposition


class StatusCollector:
    """A prometheus-client collector over ``manager.status()``."""

    def __init__(self, manager):
        self.manager = manager
        self._core, _ = _prometheus()

    def describe(self) -> list:
        return []  # no fixed set: families depend on what the status holds

    def collect(self) -> Iterator[Any]:
        """Called by prometheus-client at every scrape."""
        core = self._core
        try:
            status = self.manager.status()
        except Exception as e:  # a scrape must never take the engine down
            logger.warning("metrics: status() failed: %s", e)
            yield core.GaugeMetricFamily(PREFIX + "up", "status() answered", value=0)
            return
        yield core.GaugeMetricFamily(PREFIX + "up", "status() answered", value=1)
        stats = status.get("stats") or {}
        yield from _flags(core, status)
        yield from _hits(core, stats)
        yield from _tiers(core, stats)
        yield from _policy(core, stats.get("policy") or {})
        yield from _transfers(core, stats.get("transfers") or {})
        yield from _workers(core, status.get("workers") or stats.get("workers") or [])
        yield from _storage(core, status.get("storage") or stats.get("storage") or {})
        yield from _storage_health(core, storage_health(status))


def _flags(core, status: dict) -> Iterator[Any]:
    for name in ("paused", "asleep", "draining"):
        yield core.GaugeMetricFamily(PREFIX + name, f"1 while kvcached is {name}",
                                     value=float(bool(status.get(name))))


def _hits(core, stats: dict) -> Iterator[Any]:
    prompt = stats.get("prompt_tokens", 0) or 0
    hits = stats.get("hit_tokens") or {}
    rate = core.GaugeMetricFamily(PREFIX + "hit_rate",
                                  "share of prompt tokens served from the tier", labels=["tier"])
    tokens = core.CounterMetricFamily(PREFIX + "hit_tokens", "prompt tokens served from the tier",
                                      labels=["tier"])
    for tier, n in sorted(hits.items()):
        rate.add_metric([tier], n / prompt if prompt else 0.0)
        tokens.add_metric([tier], n)
    yield rate
    yield tokens
    yield core.CounterMetricFamily(PREFIX + "prompt_tokens", "prompt tokens seen", value=prompt)
    yield core.CounterMetricFamily(PREFIX + "requests", "requests allocated",
                                   value=stats.get("requests", 0) or 0)
    ev = core.CounterMetricFamily(PREFIX + "evictions", "blocks evicted, by kind",
                                  labels=["kind"])
    for kind, n in sorted((stats.get("evictions") or {}).items()):
        ev.add_metric([kind], n)
    yield ev


def _tiers(core, stats: dict) -> Iterator[Any]:
    fam = core.GaugeMetricFamily(PREFIX + "tier_blocks", "blocks per tier and state",
                                 labels=["tier", "state"])
    for tier, usage in sorted((stats.get("tiers") or {}).items()):
        for state in ("used", "free", "cached", "total"):
            if isinstance(usage, dict) and state in usage:
                fam.add_metric([tier, state], usage[state])
    yield fam


def _policy(core, policy: dict) -> Iterator[Any]:
    """The eviction policy and, adaptive, each tier's ghost (``stats.policy``)."""
    if not policy:
        return
    info = core.GaugeMetricFamily(PREFIX + "eviction_policy", "the eviction policy in use",
                                  labels=["policy"])
    info.add_metric([str(policy.get("name", "?"))], 1.0)
    yield info
    tiers = [(t, policy[t]) for t in ("gpu", "cpu") if isinstance(policy.get(t), dict)]
    if not tiers:
        return
    fams = {
        "ghost_entries": core.GaugeMetricFamily(
            PREFIX + "ghost_entries", "evicted blocks the ghost remembers", labels=["tier"]),
        "ghost_bytes": core.GaugeMetricFamily(
            PREFIX + "ghost_bytes", "memory of the ghost", labels=["tier"]),
        "hits": core.CounterMetricFamily(
            PREFIX + "policy_hits", "reuses of blocks the tier held", labels=["tier"]),
        "ghost_hits": core.CounterMetricFamily(
            PREFIX + "ghost_hits", "blocks back in the tier after eviction, that the ghost "
            "remembered", labels=["tier"]),
        "ghost_hit_share": core.GaugeMetricFamily(
            PREFIX + "ghost_hit_share", "ghost hits / (hits + ghost hits): the reuses that came "
            "after eviction", labels=["tier"]),
    }
    for tier, p in tiers:
        for key, fam in fams.items():
            fam.add_metric([tier], p.get(key, 0))
    yield from fams.values()


def _transfers(core, transfers: dict) -> Iterator[Any]:
    blocks = core.CounterMetricFamily(PREFIX + "blocks_moved", "blocks moved, by direction",
                                      labels=["direction"])
    nbytes = core.CounterMetricFamily(PREFIX + "bytes_moved", "bytes moved, by direction",
                                      labels=["direction"])
    tasks = core.CounterMetricFamily(PREFIX + "tasks", "transfer tasks finished",
                                     labels=["kind", "outcome"])
    quant = core.GaugeMetricFamily(PREFIX + "task_latency_quantile_seconds",
                                   "latency of recent tasks", labels=["kind", "quantile"])
    hist = core.HistogramMetricFamily(PREFIX + "task_latency_seconds",
                                      "task latency (every rank done)", labels=["kind"])
    for kind, t in sorted(transfers.items()):
        direction = DIRECTIONS.get(kind)
        if direction:
            blocks.add_metric([direction], t.get("blocks", 0))
            nbytes.add_metric([direction], t.get("bytes", 0))
        for outcome in ("done", "failed"):
            tasks.add_metric([kind, outcome], t.get(outcome, 0))
        for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
            if key in t:
                quant.add_metric([kind, q], t[key] / 1e3)
        _add_histogram(hist, kind, t.get("histogram"))
    yield from (blocks, nbytes, tasks, quant, hist)


def _add_histogram(fam, kind: str, h: dict | None) -> None:
    """``h``: {"buckets": [[upper bound s, cumulative count], ...], "sum": s}."""
    if not isinstance(h, dict) or not h.get("buckets"):
        return
    buckets = [(_le(le), n) for le, n in h["buckets"]]
    if buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", h.get("count", buckets[-1][1])))
    fam.add_metric([kind], buckets, h.get("sum", 0.0))


def _le(bound) -> str:
    return "+Inf" if bound in (None, "+Inf", float("inf")) else repr(float(bound))


def _workers(core, workers: list) -> Iterator[Any]:
    up = core.GaugeMetricFamily(PREFIX + "worker_up", "1 while the rank's worker is ready",
                                labels=["rank"])
    restarts = core.CounterMetricFamily(PREFIX + "worker_restarts", "worker restarts",
                                        labels=["rank"])
    depth = core.GaugeMetricFamily(PREFIX + "queue_depth", "tasks queued or running per lane",
                                   labels=["rank", "lane"])
    for w in workers:
        rank = str(w.get("rank", "?"))
        up.add_metric([rank], float(w.get("state") == "ready"))
        restarts.add_metric([rank], w.get("restarts", 0))
        for lane, n in sorted((w.get("queues") or {}).items()):
            depth.add_metric([rank, lane], n)
    yield from (up, restarts, depth)


def _storage(core, counts: dict) -> Iterator[Any]:
    """Storage counters (``stats.storage``): every one as an op count, failures also
    as errors."""
    ops = core.CounterMetricFamily(PREFIX + "storage_ops", "storage operations, by outcome",
                                   labels=["kind"])
    errors = core.CounterMetricFamily(PREFIX + "storage_errors",
                                      "failed or short storage operations, by kind",
                                      labels=["kind"])
    for kind, n in sorted(counts.items()):
        if not isinstance(n, (int, float)) or isinstance(n, bool):
            continue
        ops.add_metric([kind], n)
        if any(word in kind for word in STORAGE_ERROR_WORDS):
            errors.add_metric([kind], n)
    yield ops
    yield errors


def _storage_health(core, health: list[tuple[Any, dict]]) -> Iterator[Any]:
    """Each rank's storage health (``kvcached status`` shows the same)."""
    rejected = core.CounterMetricFamily(PREFIX + "storage_rejected",
                                        "stored objects refused on read (each a miss)",
                                        labels=["rank", "reason"])
    blocks = core.CounterMetricFamily(PREFIX + "storage_blocks", "blocks by storage op",
                                      labels=["rank", "op"])
    space = core.GaugeMetricFamily(PREFIX + "storage_bytes", "file store use and cap",
                                   labels=["rank", "kind"])
    errors = core.CounterMetricFamily(PREFIX + "storage_backend_errors",
                                      "failed or timed-out backend calls", labels=["rank", "kind"])
    for rank, h in health:
        r = str(rank)
        for reason, n in sorted((h.get("rejected") or {}).items()):
            rejected.add_metric([r, reason], n)
        for op in ("loaded", "stored", "store_failed", "load_misses"):
            blocks.add_metric([r, op], h.get(op, 0))
        if h.get("used_bytes") is not None:
            space.add_metric([r, "used"], h["used_bytes"])
            space.add_metric([r, "cap"], h.get("max_bytes", 0))
        for kind in ("errors", "timeouts"):
            errors.add_metric([r, kind], h.get(kind, 0))
    yield from (rejected, blocks, space, errors)


class MetricsServer:
    """Serves ``/metrics`` for ``manager`` on ``host:port`` (port 0: any free port)."""

    def __init__(self, manager, host: str = "127.0.0.1", port: int = 0):
        core, self._exposition = _prometheus()  # fail at start, naming the extra
        self.registry = core.CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(manager))
        self.host = host
        self.port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsServer:
        """Bind and serve on a daemon thread; ``self.port`` is the bound port."""
        handler = _make_handler(self.registry, self._exposition)
        try:
            self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        except OSError as e:
            raise RuntimeError(f"cannot serve metrics on {self.host}:{self.port}: {e}; "
                               "choose another metrics_port") from e
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="kvcached-metrics", daemon=True)
        self._thread.start()
        logger.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd = None
        if self._thread is not None:
            self._thread.join(5.0)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _make_handler(registry, exposition) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?")[0] not in ("/", "/metrics"):
                self.send_error(404, "try /metrics")
                return
            body = exposition.generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", exposition.CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            logger.debug("metrics: " + fmt, *args)

    return Handler
