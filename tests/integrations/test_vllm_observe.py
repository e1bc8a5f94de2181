"""What vLLM's observability gets from kvcached (``integrations/vllm/observe.py``):
hit sources, the stats payload and its Prometheus series, KV events. Against
vLLM's real classes; tests/integrations/test_vllm.py reads the same through a running vLLM."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import msgpack
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")
import prometheus_client  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvcached.integrations.vllm import observe  # noqa: E402
from kvcached.integrations.vllm.connector import KvcachedConnector  # noqa: E402


def stats(**counts) -> observe.KvcachedStats:
    s = observe.KvcachedStats()
    for name, n in counts.items():
        s.count(name, n)
    return s


def test_hit_sources_name_the_tier_as_vllm_does():
    disk = observe.storage_source("file")
    assert observe.hit_sources(64, 32, disk) == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 32}
    remote = observe.storage_source("redis")
    assert observe.hit_sources(0, 32, remote) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 32}
    assert observe.hit_sources(0, 0, disk) == {}  # vLLM's form: non-zero counts only


def test_stats_aggregate_reduce_and_travel_as_plain_data():
    a = stats(hit_tokens_cpu=64, saved_blocks=3)
    a.load_took(0.002)
    b = stats(hit_tokens_cpu=32, hit_tokens_storage=96, load_failed_blocks=1)
    b.load_took(0.004)
    # vLLM sends the payload between processes (to_dict), then rebuilds it
    wire = msgpack.unpackb(msgpack.packb(b.to_dict()))
    rebuilt = KvcachedConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, observe.KvcachedStats)
    total = a.aggregate(rebuilt)
    got = total.reduce()
    assert got["hit_tokens_cpu"] == 96 and got["hit_tokens_storage"] == 96
    assert got["saved_blocks"] == 3 and got["load_failed_blocks"] == 1
    assert got["loads"] == 2 and got["load_ms_median"] == pytest.approx(3.0)
    assert "saves_dropped" not in got  # zero counters stay out of the log line


def test_empty_stats_and_unknown_counters():
    s = observe.KvcachedStats()
    assert s.is_empty() and KvcachedConnector.build_kv_connector_stats().is_empty()
    s.count("saves_dropped")
    assert not s.is_empty()
    assert stats().aggregate(observe.KvcachedStats()).is_empty()
    with pytest.raises(KeyError, match="hit_token_cpu"):
        s.count("hit_token_cpu")


@pytest.fixture
def registry():
    return prometheus_client.CollectorRegistry()


def prom(registry) -> observe.KvcachedPromMetrics:
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prometheus_client.Gauge, prometheus_client.Counter,
                         prometheus_client.Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads
    return KvcachedConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"],
                                                {0: ["m", "0"], 1: ["m", "1"]})


def test_prometheus_series_per_engine_and_tier(registry):
    metrics = prom(registry)
    s = stats(hit_tokens_cpu=64, hit_tokens_storage=32, loaded_bytes_cpu=4096,
              saved_blocks=5, saves_dropped=2)
    s.load_took(0.003)
    s.load_took(0.3)
    metrics.observe(s.to_dict(), engine_idx=1)
    one = {"model_name": "m", "engine": "1"}

    def value(name, **labels):
        return registry.get_sample_value(name, {**one, **labels})
    assert value("vllm:kvcached_hit_tokens_total", tier="cpu") == 64
    assert value("vllm:kvcached_hit_tokens_total", tier="storage") == 32
    assert value("vllm:kvcached_loaded_bytes_total", tier="cpu") == 4096
    assert value("vllm:kvcached_saved_blocks_total") == 5
    assert value("vllm:kvcached_saves_dropped_total") == 2
    assert value("vllm:kvcached_load_seconds_count") == 2
    assert value("vllm:kvcached_load_seconds_bucket", le="0.005") == 1
    assert registry.get_sample_value("vllm:kvcached_hit_tokens_total",
                                     {"model_name": "m", "engine": "0", "tier": "cpu"}) is None


def test_kv_events_group_runs_and_name_the_medium():
    h = [bytes([i + 1]) * 32 for i in range(5)]
    events = observe.kv_events([(True, "cpu", h[0]), (True, "cpu", h[1]),
                                (True, "storage", h[0]), (False, "cpu", h[2]),
                                (False, "cpu", h[3]), (True, "cpu", h[4])])
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in events] == [
        ("BlockStored", "CPU", 2), ("BlockStored", "STORAGE", 1), ("BlockRemoved", "CPU", 2),
        ("BlockStored", "CPU", 1)]
    # as vLLM names its own blocks in events (by default the hash's low 64 bits)
    assert events[0].block_hashes == [maybe_convert_block_hash(x) for x in h[:2]]
    assert isinstance(events[0], BlockStored) and isinstance(events[2], BlockRemoved)
    # they travel as vLLM's own batch does
    import msgspec
    batch = KVEventBatch(ts=0.0, events=events)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    assert back.events == events
    assert observe.kv_events([]) == []
