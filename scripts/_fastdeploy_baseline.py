"""Run FastDeploy's prefix-cache manager on kvcached's chat workload, in this process.

The manager's speed target is relative: kvcached's allocate+commit+free should cost
an order of magnitude less per block than FastDeploy's manager. Quoting a
number measured elsewhere is not a measurement, so this module loads
FastDeploy's own ``prefix_cache_manager.py`` (the Apache-2.0 file in
``shared/reference``; it is executed, not copied into kvcached) and replays the
same requests through it, the way FastDeploy's V1 scheduler drives it:
``request_match_blocks`` (match + swap-in), ``can_allocate_gpu_blocks`` /
``allocate_gpu_blocks`` (eviction), ``update_cache_blocks`` (commit),
``release_block_ids`` + recycling the uncached tail (free).

What the file imports from the rest of FastDeploy is stood in for here,
following the facts in shared/reference/README.md: ``BlockNode`` and
``CacheStatus`` (same ordering and leaf rules), metrics and logging that do
nothing, and a transfer queue that completes each swap task at once in the
calling thread (so a swap costs FastDeploy no copy, while kvcached's
in-process copies are timed). Its eviction runs on its own thread pool and the engine
polls it with 1 ms sleeps, as in FastDeploy; that wait is FastDeploy's real
cost per call, and is reported separately (``poll_sleeps``) so a reader can
discount it.
"""

from __future__ import annotations

import enum
import logging
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

REFERENCE = (Path(__file__).resolve().parents[2] / "shared" / "reference"
             / "fastdeploy_prefix_cache_manager.py.txt")


class CacheStatus(enum.Enum):
    GPU = 0
    SWAP2CPU = 1
    SWAP2GPU = 2
    CPU = 3


class BlockNode:
    """One cached block as FastDeploy's manager expects it (identity-hashed)."""

    def __init__(self, node_id, input_ids, input_hash_value, depth, block_id, token_num,
                 hash_value, last_used_time, parent=None, shared_count=1,
                 reverved_dec_block_ids=None, cache_status=CacheStatus.GPU,
                 is_persistent=False):
        self.node_id = node_id
        self.input_ids = input_ids
        self.input_hash_value = input_hash_value
        self.depth = depth
        self.block_id = block_id
        self.token_num = token_num
        self.hash_value = hash_value
        self.last_used_time = last_used_time
        self.parent = parent
        self.shared_count = shared_count
        self.reverved_dec_block_ids = reverved_dec_block_ids or []
        self.cache_status = cache_status
        self.is_persistent = is_persistent
        self.children = {}
        self.req_id_set = set()

    def __lt__(self, other):
        # Older first; on a tie the deeper node is older, so leaves go first.
        if self.last_used_time != other.last_used_time:
            return self.last_used_time < other.last_used_time
        return self.depth > other.depth

    def increment_shared_count(self):
        self.shared_count += 1

    def decrement_shared_count(self):
        self.shared_count -= 1

    @property
    def has_in_gpu(self):
        return self.cache_status == CacheStatus.GPU

    @property
    def is_gpu_leaf_node(self):
        if not self.has_in_gpu:
            return False
        return not any(c.has_in_gpu for c in self.children.values())

    @property
    def is_cpu_leaf_node(self):
        return self.cache_status == CacheStatus.CPU and not self.children


class _Gauge:
    def set(self, _value):
        pass


class _Metrics:
    """FastDeploy's CacheMetrics, reduced to counters."""

    def __init__(self):
        self.req_count = self.hit_req_count = 0
        self.gpu_tokens = self.cpu_tokens = self.total_tokens = 0

    def calculate_hit_metrics(self, _req_id, cpu_tokens, gpu_tokens, total_tokens):
        self.cpu_tokens += cpu_tokens
        self.gpu_tokens += gpu_tokens
        self.total_tokens += total_tokens

    def _update_history_hit_metrics(self):
        pass

    def reset_metrics(self):
        pass


class _InlineQueue:
    """The transfer queue: a swap task completes at once, in the issuing thread."""

    def __init__(self):
        self.mgr = None

    def put_transfer_task(self, task):
        node_ids, gpu_ids, cpu_ids, event_type, task_id = task
        for node_id, gpu_id, cpu_id in zip(node_ids, gpu_ids, cpu_ids):
            self.mgr._handle_swap_result(node_id, gpu_id, cpu_id, event_type)
        self.mgr.task_swapping_event[task_id].set()


def _install_stand_ins() -> None:
    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    quiet = logging.getLogger("fastdeploy-baseline")
    quiet.setLevel(logging.WARNING)
    metrics = SimpleNamespace(free_gpu_block_num=_Gauge(), available_gpu_resource=_Gauge(),
                              max_gpu_block_num=_Gauge())
    module("fastdeploy", envs=SimpleNamespace(ENABLE_V1_KVCACHE_SCHEDULER=1))
    module("fastdeploy.cache_manager")
    module("fastdeploy.cache_manager.cache_data", BlockNode=BlockNode, CacheStatus=CacheStatus)
    module("fastdeploy.cache_manager.cache_metrics", CacheMetrics=_Metrics)
    module("fastdeploy.inter_communicator", EngineCacheQueue=object, IPCSignal=object)
    module("fastdeploy.metrics")
    module("fastdeploy.metrics.metrics", main_process_metrics=metrics)
    module("fastdeploy.utils", get_logger=lambda *_a, **_k: quiet)


def load(path: Path = REFERENCE) -> type:
    """FastDeploy's ``PrefixCacheManager`` class, executed from ``path``."""
    _install_stand_ins()
    mod = types.ModuleType("fastdeploy_prefix_cache_manager")
    mod.__file__ = str(path)
    lines = path.read_text().splitlines(keepends=True)
    if lines and lines[0].strip().endswith(".py"):  # the file's own path, as a header
        lines[0] = "\n"
    exec(compile("".join(lines), str(path), "exec"), mod.__dict__)
    return mod.PrefixCacheManager


def _unlocked_eviction(cls: type) -> type:
    """``cls`` with one deadlock of that version worked around.

    ``request_match_blocks`` holds ``request_release_lock`` (a plain Lock) when
    it asks ``can_allocate_gpu_blocks`` for room for its CPU hits, and the
    eviction that call runs takes the same lock again: with CPU hits and a
    full GPU tier the engine hangs. Here the lock is let go around that one
    call, which is what a fixed FastDeploy would have to do too.
    """
    class Patched(cls):
        _matching = False

        def request_match_blocks(self, task, block_size, *args):
            self._matching = True
            try:
                return super().request_match_blocks(task, block_size, *args)
            finally:
                self._matching = False

        def can_allocate_gpu_blocks(self, num_blocks):
            if not (self._matching and len(self.gpu_free_block_list) < num_blocks):
                return super().can_allocate_gpu_blocks(num_blocks)
            self.request_release_lock.release()
            try:
                return super().can_allocate_gpu_blocks(num_blocks)
            finally:
                self.request_release_lock.acquire()

    return Patched


def make(cls: type, gpu_blocks: int, cpu_blocks: int):
    cls = _unlocked_eviction(cls)
    cache = SimpleNamespace(total_block_num=gpu_blocks, prefill_kvcache_block_num=gpu_blocks,
                            num_cpu_blocks=cpu_blocks, enable_prefix_caching=True,
                            enable_hierarchical_cache=cpu_blocks > 0,
                            bytes_per_layer_per_block=128)
    mgr = cls(SimpleNamespace(cache_config=cache, speculative_config=None), 1)
    queue = _InlineQueue()
    queue.mgr = mgr
    mgr.cache_task_queue = queue
    return mgr


class _PollTimer:
    """Counts and times the engine thread's 1 ms polls while FastDeploy's
    eviction runs on its own thread."""

    def __init__(self):
        self.sleeps = 0
        self.slept_s = 0.0
        self._sleep = time.sleep

    def __enter__(self):
        def sleep(s):
            t0 = time.perf_counter()
            self._sleep(s)
            self.slept_s += time.perf_counter() - t0
            self.sleeps += 1
        time.sleep = sleep
        return self

    def __exit__(self, *exc):
        time.sleep = self._sleep


def replay(mgr, requests, block_size: int, on_progress=None) -> dict:
    """Serve ``requests`` through FastDeploy's manager; the same accounting as
    ``kvcached.tools.workload.replay`` (wall microseconds per op, prompt blocks, hits),
    plus the process CPU time of the timed calls (``cpu_s``: FastDeploy's eviction
    thread included, its engine thread's sleeps not) and those sleeps."""
    res = {"requests": 0, "served": 0, "rejected": 0, "prompt_tokens": 0, "prompt_blocks": 0,
           "hit_tokens": {"gpu": 0, "cpu": 0}, "allocate_us": [], "commit_us": [],
           "free_us": [], "cpu_s": 0.0, "poll_sleeps": 0, "poll_s": 0.0}
    with _PollTimer() as polls:
        for req in requests:
            res["requests"] += 1
            _serve(mgr, req, block_size, res)
            if on_progress is not None:
                on_progress(res["requests"], res)
    res["poll_sleeps"], res["poll_s"] = polls.sleeps, polls.slept_s
    return res


def _serve(mgr, req, block_size: int, res: dict) -> None:
    """One request as FastDeploy's V1 scheduler runs it: match (and swap in),
    allocate the rest (evicting), cache every computed block, release."""
    clock, cpu = time.perf_counter, time.process_time
    task = SimpleNamespace(request_id=req.request_id, prompt_token_ids=req.prompt,
                           output_token_ids=[], block_tables=[], cached_block_num=0)
    total = len(req.prompt) + len(req.output)
    c0, t0 = cpu(), clock()
    common, _, hit = mgr.request_match_blocks(task, block_size)
    need = -(-total // block_size) - len(common)
    if not mgr.can_allocate_gpu_blocks(need):
        mgr.release_block_ids(task)
        res["rejected"] += 1
        res["cpu_s"] += cpu() - c0
        return
    task.block_tables = common + mgr.allocate_gpu_blocks(need)
    t1 = clock()
    task.output_token_ids = req.output  # the engine's list, built outside the clock
    mgr.update_cache_blocks(task, block_size, total)
    t2 = clock()
    mgr.release_block_ids(task)
    mgr.recycle_gpu_blocks(task.block_tables[task.cached_block_num:])
    t3 = clock()
    res["cpu_s"] += cpu() - c0
    res["served"] += 1
    res["prompt_tokens"] += len(req.prompt)
    res["prompt_blocks"] += -(-len(req.prompt) // block_size)
    res["hit_tokens"]["gpu"] += hit["gpu_cache_blocks"] * block_size
    res["hit_tokens"]["cpu"] += hit["cpu_cache_blocks"] * block_size
    for key, s in zip(("allocate_us", "commit_us", "free_us"), (t1 - t0, t2 - t1, t3 - t2)):
        res[key].append(s * 1e6)
