"""A restarted worker serves the engine's current weights and storage, not its
start-up config (update_weights and attach_storage survive a worker
restart). Real worker processes; what a worker serves is read from the
file store it writes to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import tiny_config, toks
from helpers import wait_for

from kvcached import CacheManager
from kvcached.storage.objects import storage_namespace
from kvcached.transfer.endpoints import CONFIG_FILE

FAST = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=2.0,
            engine_timeout_s=5.0, task_timeout_s=10.0, worker_start_timeout_s=60.0,
            tp_size=1, num_gpu_blocks=16, num_cpu_blocks=16, model_id="m")


def objects(store: Path, version: str) -> int:
    """Objects the store holds under model m's namespace for ``version``."""
    ns_dir = store / storage_namespace("m", version, "")
    return sum(1 for p in ns_dir.rglob("*") if p.is_file()) if ns_dir.is_dir() else 0


def compute(mgr, rid: str, blocks: list[int]) -> None:
    """A request whose full blocks are committed (and so written through)."""
    prompt = toks(*blocks, tail=1)
    mgr.allocate(rid, prompt).wait(10)
    mgr.commit(rid, prompt, len(prompt))
    mgr.free(rid)
    # Write-through is asynchronous: wait until its store tasks are done.
    wait_for(lambda: (t := mgr.stats().transfers.get("store", {})).get("done", 0)
             + t.get("failed", 0) == t.get("submitted", 0), 10, "the stores to finish")


def restart_rank0(mgr) -> None:
    pid = mgr.stats().workers[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (w := mgr.stats().workers[0])["pid"] != pid and w["state"] == "ready",
             30, "rank 0 to come back")


def test_a_restarted_worker_serves_the_current_weights(tmp_path):
    store = tmp_path / "store"
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), storage_backend="file",
                      storage_url=str(store))
    with CacheManager(cfg) as mgr:
        compute(mgr, "a", [1, 2])
        assert objects(store, "0") == 2
        mgr.update_weights("v2")
        written = json.loads((mgr.run_dir / CONFIG_FILE).read_text())
        assert written["weight_version"] == "v2"  # what a restarted worker loads
        restart_rank0(mgr)
        compute(mgr, "b", [3, 4, 5])
        assert objects(store, "v2") == 3  # not under the start-up weights
        assert objects(store, "0") == 2
        assert mgr.stats().storage.get("store_failed", 0) == 0


def test_a_restarted_worker_keeps_storage_attached_at_run_time(tmp_path):
    store = tmp_path / "store"
    cfg = tiny_config(**FAST, run_dir=str(tmp_path / "run"), storage_backend="none")
    with CacheManager(cfg) as mgr:
        assert mgr.attach_storage("file", str(store))["changed"]
        restart_rank0(mgr)
        compute(mgr, "a", [1, 2])
        st = mgr.stats().storage
        assert st.get("stored") == 2 and st.get("store_failed", 0) == 0
        assert objects(store, "0") == 2
        mgr.detach_storage()
        assert json.loads((mgr.run_dir / CONFIG_FILE).read_text())["storage_backend"] is None


def test_a_launched_worker_adopts_the_engines_current_config(tmp_path):
    """A `kvcached launch` worker starts from the TOML file: at the handshake it
    takes the engine's current weights from run_dir/config.json."""
    store, run_dir = tmp_path / "store", tmp_path / "run"
    toml = tmp_path / "kv.toml"
    values = {**FAST, "storage_backend": "file", "storage_url": str(store),
              "spawn_workers": False, "num_layers": 1, "num_kv_heads": 1, "head_dim": 4,
              "block_size": 4, "create_cache": True, "run_dir": str(run_dir)}
    toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    cmd = [sys.executable, "-m", "kvcached", "worker", "--rank", "0", "--run-dir",
           str(run_dir), "--config", str(toml)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    mgr = CacheManager(tiny_config(**values))
    try:
        mgr.start()
        mgr.update_weights("v2")
        procs[0].kill()
        procs[0].wait()
        wait_for(lambda: mgr.stats().workers[0]["state"] == "lost", 10, "the loss")
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        assert mgr.transfer.wait_ready(60)
        compute(mgr, "a", [1, 2])
        assert objects(store, "v2") == 2 and objects(store, "0") == 0
        log = (run_dir / "logs" / "worker-rank0.log").read_text()
        assert "serving the engine's current {'weight_version': 'v2'}" in log
    finally:
        mgr.close()  # tells the worker to leave
        for p in procs:
            p.kill()
            p.wait()
