"""What the vLLM tests share: running ``tests/vllm_app.py``, the prompt sets,
and the run of vLLM without a connector that every test compares against
(one process for the whole session: each vLLM process costs tens of seconds
here).

Prompt specs are ``[seed, length]`` or ``[seed, length, head_seed, head_length]``
(a head shared by every prompt with that head seed; see ``vllm_app.prompts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

APP = Path(__file__).with_name("vllm_app.py")
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


def run_app(spec: dict, env: dict | None = None, check: bool = True) -> dict | subprocess.CompletedProcess:
    """One vLLM process through ``spec``'s steps; its result (or, with
    ``check=False``, the finished process)."""
    with tempfile.TemporaryDirectory(prefix="kvcached-vllm-app-") as tmp:
        result = Path(tmp) / "result.json"
        res = subprocess.run([sys.executable, str(APP), json.dumps(spec), str(result)],
                             capture_output=True, text=True, timeout=DEADLINE_S,
                             env={**os.environ, **(env or {})})
        if not check:
            return res
        assert res.returncode == 0 and result.is_file(), \
            f"vLLM run failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        return json.loads(result.read_text())


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
