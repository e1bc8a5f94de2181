"""Storage load policies against a slow backend: best_effort, timeout and
wait_complete must load different amounts, as documented (best_effort and
timeout send different deadlines).

The backend is the file store with every read made slow (READ_S per batch
of up to LOAD_CHUNK blocks): the prompt's 64 stored blocks take four reads.
"""

from __future__ import annotations

import time

import pytest
from conftest import tiny_config

from kvcached import CacheManager
from kvcached.storage import file as file_mod
from kvcached.transfer.executor import LOAD_CHUNK

BS = 4
PROMPT = [(i * 7919) % 5000 for i in range(64 * BS + 1)]  # 64 full blocks + 1 token
READ_S = 0.4  # one slow read
DEADLINE_S = 1.0  # the timeout policy: reads 1 and 2 start before it, read 3 ends after


def cfg(tmp_path, name: str, **kw):
    return tiny_config(run_dir=str(tmp_path / name), block_size=BS, num_gpu_blocks=80,
                       num_cpu_blocks=80, storage_backend="file",
                       storage_url=str(tmp_path / "store"), **kw)


@pytest.fixture
def stored(tmp_path):
    """The prompt's blocks in the file store (computed by a first engine life)."""
    with CacheManager(cfg(tmp_path, "first")) as mgr:
        mgr.allocate("r", PROMPT).wait(10)
        mgr.commit("r", PROMPT, len(PROMPT))
        mgr.free("r")
        assert mgr.stats().storage["stored"] == 64
    return tmp_path


@pytest.fixture
def slow_reads(monkeypatch):
    """Every batch read from the file store takes READ_S; returns their start times."""
    starts: list[float] = []
    real = file_mod.FileBackend._get_into

    def slow(self, keys, parts):
        starts.append(time.monotonic())
        time.sleep(READ_S)
        return real(self, keys, parts)

    monkeypatch.setattr(file_mod.FileBackend, "_get_into", slow)
    return starts


def load_with(tmp_path, policy: str) -> tuple[int, float]:
    """Storage tokens a new engine life gets for the prompt, and how long the
    request waited for them (allocate to wait, the load runs in between)."""
    with CacheManager(cfg(tmp_path, policy, storage_load_policy=policy,
                          storage_load_timeout_s=DEADLINE_S)) as mgr:
        t0 = time.monotonic()
        a = mgr.allocate("again", PROMPT)
        a.wait(30)
        waited = time.monotonic() - t0
        mgr.check_invariants()
        mgr.free("again")
        return a.hit.storage_tokens, waited


def test_best_effort_uses_the_first_read_and_never_waits_for_more(stored, slow_reads):
    tokens, _ = load_with(stored, "best_effort")
    assert tokens == LOAD_CHUNK * BS  # one read's blocks; the rest is recomputed
    assert len(slow_reads) == 1


def test_timeout_reads_until_the_deadline(stored, slow_reads):
    tokens, _ = load_with(stored, "timeout")
    # Reads end at ~0.4 s, ~0.8 s (before the deadline: go on) and ~1.2 s (past
    # it: stop), so three of the four reads land.
    assert tokens == 3 * LOAD_CHUNK * BS
    assert len(slow_reads) == 3


def test_wait_complete_loads_every_block(stored, slow_reads):
    tokens, waited = load_with(stored, "wait_complete")
    assert tokens == 64 * BS
    assert len(slow_reads) == 4 and waited >= 4 * READ_S * 0.9
