"""The ``kvcached`` command line through click's CliRunner.

`ctl` and `status` talk over a real control socket to a ControlServer whose
manager is a fake that records calls, so every command and error message is
checked without starting workers.
"""

from __future__ import annotations

import json
import threading

import pytest
import zmq
from click.testing import CliRunner

from kvcached.ops.cli import main
from kvcached.ops.ctlserver import ControlServer
from kvcached.transfer.endpoints import control_endpoint

STATUS = {
    "run_dir": "/run/x", "log_dir": "/run/x/logs", "paused": True, "asleep": False,
    "cpu_tier": True, "weight_version": "v7", "transfer_mode": "workers", "tp_size": 2,
    "transfer": {"paused": True, "held": 4, "inflight": 1, "healthy": True},
    "stats": {
        "requests": 10, "running": 1, "prompt_tokens": 200,
        "hit_tokens": {"gpu": 50, "cpu": 30, "storage": 20},
        "tiers": {"gpu": {"total": 64, "used": 40, "free": 24, "cached": 30},
                  "cpu": {"total": 256, "used": 100, "free": 156, "cached": 100}},
        "transfers": {"swap_out": {"submitted": 6, "done": 5, "failed": 1, "blocks": 20,
                                   "bytes": 3 * 2**20, "p50_ms": 1.25, "p99_ms": 4.5}},
        "evictions": {"gpu_to_cpu": 20}, "storage": {"stored": 12, "store_failed": 2},
        "policy": {"name": "adaptive",
                   "gpu": {"ghost_entries": 300, "ghost_slots": 512, "ghost_bytes": 1024,
                           "hits": 90, "ghost_hits": 10, "inserts": 400,
                           "ghost_hit_share": 0.1}},
    },
    "workers": [
        {"rank": 0, "pid": 4242, "state": "ready", "last_seen_s": 0.2, "restarts": 0,
         "queues": {"out": 3, "in": 1, "load": 2, "store": 5, "ctl": 0}, "done": 17, "fast": 15, "failed": 0,
         "storage": {"kind": "file", "loaded": 5, "stored": 12, "already_stored": 4,
                     "used_bytes": 3 * 2**20, "objects": 24, "lookups": 7, "found": 9,
                     "max_bytes": 2**30, "errors": 1, "breaker": "",
                     "rejected": {"checksum_mismatch": 2, "short_read": 1}}},
        {"rank": 1, "pid": 4343, "state": "lost", "last_seen_s": 9.5, "restarts": 2,
         "queues": {}, "lost_reason": "silent for 9.5s"},
    ],
}


class FakeManager:
    """Records control calls; ``block`` makes them wait, ``fail`` makes them raise."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.calls: list[tuple] = []
        self.block: threading.Event | None = None
        self.fail: Exception | None = None

    def _op(self, *call) -> dict:
        self.calls.append(call)
        if self.block is not None:
            self.block.wait(10)
        if self.fail is not None:
            raise self.fail
        return {"changed": True, "ranks": {0: {"changed": True}}}

    def pause(self):
        return self._op("pause")

    def resume(self):
        return self._op("resume")

    def sleep(self, release_host_pool=False):
        return self._op("sleep", release_host_pool)

    def wakeup(self):
        return self._op("wakeup")

    def update_weights(self, version):
        return {**self._op("update_weights", version), "version": version}

    def status(self):
        self.calls.append(("status",))
        return STATUS


@pytest.fixture
def engine(tmp_path):
    """A fake manager behind a real control socket in ``tmp_path``."""
    mgr = FakeManager(tmp_path)
    server = ControlServer(mgr).start()
    yield mgr
    if mgr.block is not None:
        mgr.block.set()
    server.close()


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


# ------------------------------------------------------------------- commands
def test_help_lists_every_command():
    out = run("--help").output
    for name in ("worker", "demo", "launch", "ctl", "status", "build-cuda"):
        assert name in out
    try:
        import kvcached.tools.trace  # noqa: F401
    except ImportError:
        return
    assert "bench" in out


@pytest.mark.parametrize("args, call, text", [
    (["pause"], ("pause",), "pause: ok (changed)"),
    (["resume"], ("resume",), "resume: ok (changed)"),
    (["sleep"], ("sleep", False), "sleep: ok (changed)"),
    (["sleep", "--release-host-pool"], ("sleep", True), "sleep: ok (changed)"),
    (["wakeup"], ("wakeup",), "wakeup: ok (changed)"),
    (["update-weights", "--version", "v8"], ("update_weights", "v8"),
     "update-weights: ok (changed, weights v8)"),
])
def test_ctl_ops_call_the_manager(engine, args, call, text):
    res = run("ctl", *args, "--run-dir", engine.run_dir)
    assert res.exit_code == 0, res.output
    assert engine.calls == [call]
    assert res.output.strip() == text


def test_ctl_json_and_run_dir_from_env(engine):
    res = run("ctl", "pause", "--json", env={"KVCACHED_RUN_DIR": str(engine.run_dir)})
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"changed": True, "ranks": {"0": {"changed": True}}}


def test_ctl_reports_no_change(engine):
    engine.pause = lambda: {"ok": True, "ranks": {0: {"changed": False}}}
    res = run("ctl", "pause", "--run-dir", engine.run_dir)
    assert res.output.strip() == "pause: ok (no change: already in that state)"


def test_update_weights_needs_a_version(engine):
    res = run("ctl", "update-weights", "--run-dir", engine.run_dir)
    assert res.exit_code == 2 and "Missing option '--version'" in res.output
    assert engine.calls == []


def test_status_text_shows_workers_tiers_hits_transfers_storage_logs(engine):
    res = run("status", "--run-dir", engine.run_dir)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "kvcached: PAUSED   run_dir /run/x" in out and "logs: /run/x/logs" in out
    assert "coordinator: 4 tasks held, 1 in flight, healthy" in out
    lines = out.splitlines()
    rank0 = next(line for line in lines if "4242" in line).split()
    assert rank0 == ["0", "4242", "ready", "0.2s", "ago", "3/1/0/2/5/0", "0", "17", "15", "0"]
    assert "silent for 9.5s" in next(line for line in lines if "4343" in line)
    assert next(line for line in lines if line.strip().startswith("cpu")).split() == \
        ["cpu", "256", "100", "156", "100"]
    assert "hit rate: 50.0% of 200 prompt tokens in 10 requests (1 running)" in out
    assert "gpu 25.0%  cpu 15.0%  storage 10.0%" in out
    assert next(line for line in lines if "swap_out" in line).split() == \
        ["swap_out", "6", "5", "1", "20", "3.0", "MiB", "1.25", "4.50"]
    # Storage: every counter explained, and each rank's health (space, rejections).
    assert next(line for line in lines if line.strip().startswith("store_failed")).split()[:2] \
        == ["store_failed", "2"]
    assert "blocks whose write failed" in out
    assert ("rank 0: 24 objects known, 3.0 MiB used of 1.0 GiB cap, 7 lookups found 9 blocks, "
            "loaded 5, stored 12 (+4 already there), rejected 3 "
            "(checksum mismatch 2, short read 1), errors 1") in out
    assert "evictions (blocks): gpu_to_cpu 20" in out
    # The eviction policy, and (adaptive) each tier's ghost and what it remembered.
    assert "eviction policy: adaptive" in out
    assert ("gpu: ghost 300 of 512 entries (1.0 KiB); reuses 90 hits + 10 evicted blocks "
            "back = 10.0% remembered by the ghost") in out
    assert "a larger tier would have served it" in out
    # The columns that are not self-explanatory are explained.
    assert "fast: of those, the ones run on the socket thread" in out


def test_status_json(engine):
    res = run("status", "--json", "--run-dir", engine.run_dir)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["workers"][0]["pid"] == 4242 and got["stats"]["tiers"]["gpu"]["free"] == 24


def test_status_watch_refreshes(engine):
    res = run("status", "--watch", "--interval", "0.1", "--count", "3",
              "--run-dir", engine.run_dir)
    assert res.exit_code == 0, res.output
    assert res.output.count("kvcached: PAUSED") == 3
    assert engine.calls == [("status",)] * 3


# --------------------------------------------------------------------- errors
def test_no_run_directory():
    res = run("status")
    assert res.exit_code == 1
    assert "no run directory: pass --run-dir or set KVCACHED_RUN_DIR" in res.output


def test_run_directory_missing(tmp_path):
    res = run("ctl", "resume", "--run-dir", tmp_path / "gone")
    assert res.exit_code == 1
    assert "does not exist: is the engine running" in res.output


def test_no_control_socket(tmp_path):
    res = run("status", "--run-dir", tmp_path)
    assert res.exit_code == 1
    assert f"no control socket {tmp_path}/ctl.sock: is the engine running" in res.output


def test_engine_that_never_answers(tmp_path):
    """A socket is there but nobody answers: the client's own deadline."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(control_endpoint(tmp_path))
    try:
        res = run("status", "--timeout", "0.2", "--run-dir", tmp_path)
    finally:
        sock.close()
    assert res.exit_code == 1
    assert "no answer from the engine's control socket" in res.output
    assert "is the engine alive?" in res.output


def test_op_past_its_deadline(engine):
    """The engine is stuck in the op: the server answers at the deadline."""
    engine.block = threading.Event()
    res = run("ctl", "pause", "--timeout", "0.3", "--run-dir", engine.run_dir)
    assert res.exit_code == 1
    assert "pause did not finish before its deadline" in res.output


def test_timeout_names_the_silent_ranks(engine):
    engine.fail = TimeoutError("sleep did not complete on every rank: no answer within 5s "
                               "(silent ranks: [1])")
    res = run("ctl", "sleep", "--run-dir", engine.run_dir)
    assert res.exit_code == 1
    assert "silent ranks: [1]" in res.output


def test_manager_error_is_reported(engine):
    engine.fail = RuntimeError("2 requests are still running; free them before sleep()")
    res = run("ctl", "sleep", "--run-dir", engine.run_dir)
    assert res.exit_code == 1
    assert ("sleep failed: RuntimeError: 2 requests are still running; free them before "
            "sleep()") in res.output


# -------------------------------------------------------------- launch & co
def test_launch_needs_an_existing_config(tmp_path):
    res = run("launch", "--config", tmp_path / "nope.toml", "--run-dir", tmp_path)
    assert res.exit_code == 2 and "does not exist" in res.output


def test_launch_needs_a_run_dir(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("num_gpu_blocks = 8\n")
    res = run("launch", "--config", cfg)
    assert res.exit_code == 1
    assert "launch needs the run directory the engine uses" in res.output


def test_launch_rejects_a_bad_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("block_size = 0\n")
    res = run("launch", "--config", cfg, "--run-dir", tmp_path)
    assert res.exit_code == 1 and "block_size must be > 0, got 0" in res.output


def test_build_cuda_calls_the_builder(monkeypatch):
    import kvcached.copy.cuda as cuda
    seen = []
    monkeypatch.setattr(cuda, "main", lambda argv: seen.append(argv) or 0)
    assert run("build-cuda").exit_code == 0
    assert run("build-cuda", "--archs", "80;90").exit_code == 0
    assert seen == [["--build"], ["--build", "--archs", "80;90"]]


def test_worker_command_still_checks_its_arguments(tmp_path):
    res = run("worker", "--rank", "0", "--run-dir", tmp_path)
    assert res.exit_code == 1 and "no config.json in" in res.output
    cfg = tmp_path / "c.toml"
    cfg.write_text("tp_size = 2\n")
    res = run("worker", "--rank", "2", "--run-dir", tmp_path, "--config", cfg)
    assert res.exit_code == 1 and "--rank must be in 0..1" in res.output


def test_demo_command_is_there():
    res = run("demo", "--help")
    assert res.exit_code == 0 and "--requests" in res.output


def test_a_worker_does_not_check_host_memory_the_engine_already_took(tmp_path, monkeypatch):
    """A restarted worker loads a config whose host pools exist already: they
    take the memory the check looks for, and must not count against the worker."""
    import kvcached.config as config_mod
    from kvcached.config import CacheConfig
    from kvcached.ops.cli import _worker_config
    from kvcached.transfer.endpoints import CONFIG_FILE
    cfg = CacheConfig.load(num_cpu_blocks=64)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    toml = tmp_path / "kv.toml"
    toml.write_text("num_cpu_blocks = 64\n")
    monkeypatch.setattr(config_mod, "available_host_memory", lambda: 0)
    with pytest.raises(ValueError, match="host memory"):
        CacheConfig.load(num_cpu_blocks=64)
    assert _worker_config(str(tmp_path), None, CONFIG_FILE).num_cpu_blocks == 64
    assert _worker_config(str(tmp_path), str(toml), CONFIG_FILE).num_cpu_blocks == 64
