"""Storage health in `kvcached status`, `status --json` and /metrics: objects a
rank refused on read (they were counted, but shown only in worker logs), the
file store's space, and the task latency histogram (always empty before)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import tiny_config
from helpers import metric, scrape, wait_for

from kvcached import CacheManager
from kvcached.core.hashing import block_hashes, namespace_hash
from kvcached.ops.cli import main

BS = 4
PROMPT = [(i * 31) % 977 for i in range(8 * BS + 1)]  # 8 full blocks


def cfg(tmp_path, name: str, **kw):
    return tiny_config(run_dir=str(tmp_path / name), block_size=BS, num_gpu_blocks=16,
                       num_cpu_blocks=16, storage_backend="file",
                       storage_url=str(tmp_path / "store"),
                       storage_load_policy="wait_complete", **kw)


def store_and_corrupt(tmp_path, bad_block: int) -> None:
    """A first engine life stores the prompt; then one object gets a flipped byte."""
    first = cfg(tmp_path, "first")
    with CacheManager(first) as mgr:
        mgr.allocate("r", PROMPT).wait(10)
        mgr.commit("r", PROMPT, len(PROMPT))
        mgr.free("r")
    h = block_hashes(namespace_hash(first.model_id, first.weight_version), PROMPT, BS)[bad_block]
    [path] = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and h.hex() in str(p)]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def rank_health(status: dict) -> dict:
    workers = status["workers"]
    return workers[0]["storage"] if workers else status["transfer"]["storage_ranks"][0]


@pytest.mark.parametrize("mode", ["workers", "inprocess"])
def test_rejected_objects_are_in_status_json_text_and_metrics(tmp_path, mode):
    from kvcached.ops.metrics import MetricsServer
    store_and_corrupt(tmp_path, bad_block=3)
    extra = dict(heartbeat_interval_s=0.1, worker_timeout_s=3.0, engine_timeout_s=5.0,
                 worker_start_timeout_s=60.0) if mode == "workers" else {}
    with CacheManager(cfg(tmp_path, "second", transfer_mode=mode, **extra)) as mgr:
        a = mgr.allocate("again", PROMPT)
        a.wait(10)
        assert a.hit.storage_tokens == 3 * BS  # cut at the damaged object: a miss
        mgr.free("again")
        # Workers report it in their next heartbeat.
        health = wait_for(lambda: (h := rank_health(mgr.status())).get("rejected") and h, 10,
                          "the rejection to reach status")
        assert health["rejected"] == {"checksum_mismatch": 1}
        assert health["loaded"] == 3 and 0 < health["used_bytes"] <= health["max_bytes"]
        # the lookup found every stored block (the damage shows on read only)
        assert health["lookups"] >= 1 and health["found"] >= 4 and health["objects"] >= 4

        res = CliRunner().invoke(main, ["status", "--json", "--run-dir", str(mgr.run_dir)])
        assert res.exit_code == 0, res.output
        assert rank_health(json.loads(res.output))["rejected"] == {"checksum_mismatch": 1}
        text = CliRunner().invoke(main, ["status", "--run-dir", str(mgr.run_dir)]).output
        assert "rank 0: " in text and "rejected 1 (checksum mismatch 1)" in text
        assert "cap" in text  # the file store's use and its cap

        with MetricsServer(mgr) as server:
            m = scrape(server.url)
        assert metric(m, "kvcached_storage_rejected_total", rank="0",
                      reason="checksum_mismatch") == 1
        assert metric(m, "kvcached_storage_blocks_total", rank="0", op="loaded") == 3
        assert metric(m, "kvcached_storage_bytes", rank="0", kind="used") == \
            health["used_bytes"]
        # The latency histogram has every finished task in it.
        loads = mgr.stats().transfers["load"]
        assert loads["histogram"]["count"] == loads["done"] == 1
        assert metric(m, "kvcached_task_latency_seconds_count", kind="load") == 1
        assert metric(m, "kvcached_task_latency_seconds_bucket", kind="load", le="+Inf") == 1
        assert metric(m, "kvcached_task_latency_seconds_sum", kind="load") > 0


def test_the_histogram_is_cumulative_over_its_bounds(make_manager):
    from kvcached.core.stats import LATENCY_BUCKETS
    mgr = make_manager(num_cpu_blocks=8)
    prompt = list(range(4 * 6 + 1))
    for i in range(3):  # swap-outs and swap-ins through the CPU tier
        mgr.allocate(f"a{i}", prompt).wait(5)
        mgr.commit(f"a{i}", prompt, len(prompt))
        mgr.free(f"a{i}")
        big = [1000 + i * 100 + t for t in range(4 * 7 + 1)]
        mgr.allocate(f"b{i}", big)
        mgr.free(f"b{i}")
    for kind, t in mgr.stats().transfers.items():
        h = t["histogram"]
        bounds = [b for b, _ in h["buckets"]]
        counts = [n for _, n in h["buckets"]]
        assert bounds == [*LATENCY_BUCKETS, "+Inf"], kind
        assert counts == sorted(counts) and counts[-1] == h["count"] == t["done"] > 0, kind
        assert h["sum"] == pytest.approx(t["seconds"])
