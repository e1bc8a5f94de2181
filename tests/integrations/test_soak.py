"""The soak of vLLM's OpenAI server with kvcached (``scripts/soak.py``), short:
a steady load through the CPU tier and capped file storage, every request
answered, sampled answers identical to the same prompt computed without
cache, RSS/fds/threads flat, storage within its cap, and after SIGINT to the
server's process group nothing of the run left (processes, /dev/shm
segments, run dir)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_runs import fork_server, vllm_env

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.mark.timeout(600)  # the server's start alone can take minutes on a loaded machine
def test_soak_short_sigint(vllm_model, tmp_path):
    """~12 s of load (the server's start takes longer here). One prompt length
    (a head and 192 tokens): vLLM's own CPU worker grows with each new batch
    shape for a while, with or without kvcached, and is reported, not judged
    (the long run in docs/benchmarks.md judges it)."""
    model = vllm_model if (Path(vllm_model) / "config.json").exists() else None
    cmd = [sys.executable, str(SOAK), "--seconds", "12", "--signals", "SIGINT",
           "--suffix", "192", "193", "--verify-every", "5", "--progress-s", "5",
           "--rss-exempt", "VLLM::Worker", "--keep", str(tmp_path / "logs"),
           # the server forked by the session's fork server (vLLM imported once)
           "--fork-server", fork_server().socket_path()]
    if model:
        cmd += ["--model", model]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=vllm_env())
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-5000:]
    out = json.loads(lines[-1])
    run = out["runs"][0]
    summary = {k: v for k, v in run.items() if k not in ("curves", "storage")}
    assert res.returncode == 0 and out["ok"], (out["checks"], summary, res.stderr[-3000:])
    assert run["completed"] == run["requests"] > 0 and run["verified"] > 0
    assert run["requests_with_cached_tokens"] > 0  # the tiers served
    assert run["storage"]["max_bytes"] > 0
    assert run["left"] == {"processes": [], "shm": [], "run_dir": []}
    # what the soak watched: the server, its engine core, a transfer worker, the janitor
    seen = {p.rsplit(":", 1)[0] for p in run["processes_seen"]}
    assert {"api_server", "engine_core", "transfer_worker_r0", "janitor"} <= seen, seen
    assert run["segments_seen"], "no kvcached shared-memory segment was seen"
