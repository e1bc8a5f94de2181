"""What the vLLM tests share: running ``tests/vllm_app.py``, the prompt sets,
and the run of vLLM without a connector that every test compares against
(one process for the whole session: each vLLM process costs seconds here,
and importing vLLM 9 more, which the fork server pays once).

Prompt specs are ``[seed, length]`` or ``[seed, length, head_seed, head_length]``
(a head shared by every prompt with that head seed; see ``vllm_app.prompts``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

from vllm_forkserver import ForkServer

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
DEADLINE_S = 600

# One prompt at a time: full blocks 21, 15, 31, 2 (a partial block each).
SINGLE = [[1, 700], [2, 500], [3, 1000], [4, 90]]
HEAD = 256  # tokens of a group's shared head (8 blocks)
# 4 groups x 4 prompts, 400-688 tokens, each group sharing a head
GROUPS = [[100 * g + i, 400 + 80 * i + 16 * g, 10 + g, HEAD] for g in range(4) for i in range(4)]
NEW = [[500 + s, n, 20 + (s // 4), HEAD] for s, (_, n, _, _) in enumerate(GROUPS)]  # unseen
AFTER = [[900 + s, n] for s, (_, n, _, _) in enumerate(GROUPS)]
CONTROL = [[700 + s, n, 30 + (s // 4), HEAD] for s, (_, n, _, _) in enumerate(GROUPS)]  # as NEW
PROMPTS = {"p": SINGLE, "g": GROUPS, "new": NEW, "after": AFTER, "control": CONTROL}


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> ForkServer:
    """The session's fork server (``tests/vllm_forkserver.py``), started on first use."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = ForkServer()
            atexit.register(_SERVER.close)
        return _SERVER


def fork_server() -> ForkServer:
    """The session's fork server: also for a test's own children (``start``)."""
    return _server()


def vllm_env(env: dict | None = None) -> dict:
    """The environment of a vLLM process a test starts: the test's own, and
    vLLM's cache directory shared by the session unless one is set. (Each test
    has a cache directory of its own, XDG_CACHE_HOME; in an empty one vLLM
    inspects the model class in a new process: 8 s here.)"""
    cache = os.environ.get("VLLM_CACHE_ROOT") or _server().vllm_cache
    return {**os.environ, "VLLM_CACHE_ROOT": cache, **(env or {})}


def run_app(spec: dict, env: dict | None = None, check: bool = True) -> dict | subprocess.CompletedProcess:
    """One vLLM process through ``spec``'s steps (forked by the session's fork
    server, which paid for importing vLLM once); its result (or, with
    ``check=False``, the finished process)."""
    with tempfile.TemporaryDirectory(prefix="kvcached-vllm-app-") as tmp:
        result = Path(tmp) / "result.json"
        res = _server().run([json.dumps(spec), str(result)], vllm_env(env), timeout=DEADLINE_S)
        if not check:
            return res
        assert res.returncode == 0 and result.is_file(), \
            f"vLLM run failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        return json.loads(result.read_text())


def run_script(script: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python script argv... --fork-server SOCKET``, forked by the session's
    fork server, like ``subprocess.run(capture_output=True, text=True)``: a
    benchmark's smoke run, whose own vLLM processes the server forks too
    (``scripts/_bench_util.run_child``): none of them imports vLLM again."""
    server = _server()
    return server.run([*argv, "--fork-server", server.socket_path()], vllm_env(), timeout,
                      script=str(script))


def generated(result: dict) -> list[dict]:
    return [s for s in result["steps"] if s["step"][0] == "generate"]


def by_set(result: dict) -> dict[str, dict]:
    """The last ``generate`` step of each prompt set."""
    return {s["step"][1]: s for s in generated(result)}


def served_share(step: dict, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the share of its full blocks (those vLLM may take from a
    cache: one token is always computed) that came cached."""
    out = []
    for spec, cached in zip(prompts, step["cached"], strict=True):
        full = (spec[1] - 1) // BLOCK * BLOCK
        out.append(cached / full if full else 1.0)
    return out


def status_of(result: dict) -> dict:
    """The last ``status`` step's ``kvcached status --json``."""
    return next(s["status"] for s in reversed(result["steps"]) if s["step"][0] == "status")
