"""Shared fixtures: tiny configs, managers that always close, clean env."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest
from hypothesis import settings

from kvcached import CacheConfig, CacheManager

# Every run checks the same examples, with or without CI=true: a red run must
# be reproducible, and step counts (test_manager_property) must not depend on
# luck. `pytest --hypothesis-profile=explore` tries new examples instead and
# keeps any failure in .hypothesis/.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("fixed")

TINY = dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_gpu_blocks=8,
            num_cpu_blocks=0, transfer_mode="inprocess", create_cache=True, dtype="float32",
            storage_backend="none", model_id="kvcached-test")


def tiny_config(**overrides) -> CacheConfig:
    """A 64-byte-per-plane layout: scenario tests reason about ids, not bytes."""
    return CacheConfig.load(**{**TINY, **overrides})


def toks(*blocks: int, bs: int = 4, tail: int = 0) -> list[int]:
    """Tokens made of whole blocks: block ``b`` is ``bs`` copies of ``b``; plus ``tail`` extra."""
    out = [b for b in blocks for _ in range(bs)]
    return out + [9999] * tail


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path_factory):
    """A developer's KVCACHED_* settings must not change test outcomes, and no
    test shares storage with another test, another run or the user: the file
    store's default directory (under XDG_CACHE_HOME) is private to each test
    and to the worker processes it starts."""
    for key in list(os.environ):
        if key.startswith("KVCACHED_") and key not in ("KVCACHED_CACHE_DIR", "KVCACHED_LOG_LEVEL"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="session", autouse=True)
def _vllm_rendezvous_files():
    """vLLM leaves a rendezvous file (``vllm_dist_<uuid>``, torch's FileStore)
    in the temp dir for every engine it starts, and never removes it; the
    session removes the ones its engines left, so a run leaves nothing."""
    start = time.time()
    yield
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")):
        try:
            if os.path.getmtime(path) >= start:
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture
def chan(tmp_path):
    """A step progress channel: (the engine's reader, a transfer worker's writer)."""
    from kvcached.memory.progress import StepProgress, progress_path
    path = progress_path(tmp_path, 0)
    reader = StepProgress.create(path)
    writer = StepProgress.open(path)
    writer.attach_writer()
    yield reader, writer
    writer.close()
    reader.close()


@pytest.fixture
def make_manager(tmp_path):
    """Build started in-process managers on tiny configs; all are closed at teardown."""
    made: list[CacheManager] = []

    def make(transfer=None, **overrides) -> CacheManager:
        """``transfer``: an optional factory ``(cfg, run_dir) -> Transfer``."""
        overrides.setdefault("run_dir", str(tmp_path / f"run{len(made)}"))
        cfg = tiny_config(**overrides)
        mgr = CacheManager(cfg, transfer=transfer(cfg, cfg.run_dir) if transfer else None)
        made.append(mgr)
        return mgr.start()

    yield make
    for mgr in made:
        mgr.close()


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> str:
    """Where the vLLM tests' small random Llama lives (made by the first run)."""
    return str(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def vllm_plain(vllm_model) -> dict:
    """vLLM without a connector, every prompt set of ``vllm_runs`` (each in one
    ``generate``): what the connector's runs must reproduce token for token."""
    from vllm_runs import PROMPTS, by_set, run_app
    res = run_app({"model": vllm_model, "extra": None, "prompts": PROMPTS,
                   "steps": [["generate", name] for name in PROMPTS]})
    return by_set(res)

