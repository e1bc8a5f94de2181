"""CacheManager: the engine-side prefix cache over GPU and CPU tiers and storage.

The engine's scheduler calls ``allocate`` / ``extend`` / ``commit`` /
``free``. The manager is a facade over three parts it owns:

- the native core (``kvcached.core._core``): the prefix tree, both block
  pools and both tiers' evictable leaves, and every state transition;
- the planner (``kvcached.core.planner``): turns the core's plans into
  transfer tasks and lands their results;
- the transfer: in-process copies, or one worker process per TP rank.

Every call runs under one lock, on the caller's thread; completions the
transfer queued are applied at the start of the next call or in
``Allocation.wait``.

This class starts no process services: the engine log file, the control
socket, metrics and KV events are wired on top of it by
:mod:`kvcached.ops.wiring`, whose subclass is the public ``kvcached.CacheManager``.
"""

from __future__ import annotations

import collections
import logging
import shutil
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcached.config import CacheConfig
from kvcached.core import _core
from kvcached.core.hashing import engine_key, extra_bytes, namespace_hash, token_input
from kvcached.core.invariants import check
from kvcached.core.planner import CPU, GPU, Planner
from kvcached.core.request import RunningRequest
from kvcached.core.snapshot import CacheSnapshot, RequestView
from kvcached.core.stats import Counters
from kvcached.errors import CacheAsleep, NoFreeBlocks
from kvcached.memory.hostpool import HostPool
from kvcached.memory.kvshare import allocate_kv_cache, rank_device, release_kv_cache
from kvcached.memory.rundir import cleanup_stale_run_dirs, create_run_dir
from kvcached.memory.shm import cleanup_stale_segments
from kvcached.tasks import Task, TaskHandle, TaskResult
from kvcached.transfer.base import Transfer
from kvcached.transfer.factory import make_transfer
from kvcached.types import Allocation, CacheStats, HitInfo

logger = logging.getLogger(__name__)

_NO_HIT = HitInfo()  # an allocation's hit until it is known (immutable: one serves all)
_TIER_NAMES = ("gpu", "cpu", "storage")  # KV event tiers, by the core's numbers


@dataclass(slots=True)
class EngineLoad:
    """Blocks ``start..stop-1`` of an engine's request on their way into its
    blocks ``device_ids[start:stop]``: a swap-in from the CPU tier (the blocks
    up to ``n_cpu``) and a load from storage (``nodes``); ``missing`` are the
    engine blocks nothing could be planned for (a miss: recompute)."""

    creq: object
    start: int
    stop: int
    device_ids: list[int]
    n_cpu: int
    tasks: list[Task] = field(default_factory=list)  # [swap_in], [load to host], [load]
    nodes: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)


@dataclass
class EngineSave:
    """A save of engine blocks into the CPU tier, in flight: one swap_out task
    (``handle``) for (request, nodes, positions) ``plans``."""

    handle: TaskHandle | None = None
    plans: list[tuple[object, list[int], list[int]]] = field(default_factory=list)

    def done(self) -> bool:
        return self.handle.done()


class CacheManager:
    """Prefix-cache manager (see DESIGN.md §10 for the contract)."""

    def __init__(self, cfg: CacheConfig, transfer: Transfer | None = None):
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.run_dir, self._own_run_dir = create_run_dir(cfg.run_dir)
        # With an external GPU tier the engine's block ids are its own: no GPU pool.
        self.core = _core.Core(0 if cfg.external_gpu_tier else cfg.num_gpu_blocks,
                               cfg.num_cpu_blocks, cfg.block_size, memo=cfg.hash_memo,
                               external=cfg.external_gpu_tier, policy=cfg.eviction_policy)
        self._counters = Counters()
        self.planner = Planner(self.core, cfg, self._counters)
        self._ns = namespace_hash(cfg.model_id, cfg.weight_version, cfg.salt)
        self._reqs: dict[Hashable, RunningRequest] = {}
        self._engine_reqs: dict[int, object] = {}  # id -> an engine request not released
        self._lock = threading.RLock()
        self._transfer = transfer
        self._events = None  # where KV events go, once set_event_sink gave one
        self._kept_events: list | None = None  # for take_kv_events, once kept
        self._host_pools: list[HostPool] = []
        self._created_planes: list[int] = []
        self._started = False
        self._closed = False
        self._asleep = False
        self._draining = False  # sleep(drain=True) waits: allocate raises CacheAsleep
        self._drained = threading.Condition(self._lock)  # notified when the last request frees
        self._host_released = False
        # Seconds an engine's scheduler spent in kvcached per step (a connector)
        # (wall, CPU) seconds an engine's scheduler spent in kvcached, per step
        self._step_times: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> CacheManager:
        """Attach (or spawn) the transfer; returns when every rank is ready."""
        if self._started:
            return self
        self._create_shared_memory()
        if self._transfer is None:
            self._transfer = make_transfer(self.cfg, self.run_dir)
        try:
            self._transfer.start()
        except BaseException:
            self._release_shared_memory()
            raise
        self.planner.transfer = self._transfer
        self._started = True
        logger.info("kvcached started: run_dir=%s gpu=%d cpu=%d blocks of %d tokens",
                    self.run_dir, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks,
                    self.block_size)
        return self

    def set_event_sink(self, sink) -> None:
        """Publish KV events to ``sink``: its ``publish(kind, tier, hashes)`` is
        called with "stored", "removed" or "cleared", "gpu" or "cpu", and the
        block hashes. The core starts recording events from now on."""
        with self._lock:
            self._events = sink
            self.core.set_events(True)

    def close(self) -> None:
        """Finish what is in flight, stop the transfer, remove run files."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                if self._transfer is not None:
                    try:  # pending stores finish first: they are what survives a restart
                        self.planner.wait_background(self.cfg.task_timeout_s + 5.0)
                    except TimeoutError as e:
                        logger.warning("close: %s", e)
                    self._transfer.close()
            finally:  # the host pools go whatever the transfer did: gigabytes of shm
                self._release_shared_memory()
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _create_shared_memory(self) -> None:
        """Host pools (and, with create_cache, the KV planes) belong to the engine
        process, so they outlive a crashed worker; stale ones of dead runs go first."""
        cleanup_stale_segments()
        cleanup_stale_run_dirs()
        cfg, layout = self.cfg, self.cfg.layout
        try:
            for rank in range(cfg.tp_size):
                if cfg.num_cpu_blocks:
                    self._host_pools.append(HostPool.create(
                        self.run_dir, rank, cfg.num_cpu_blocks, layout.block_bytes))
                if cfg.create_cache:
                    allocate_kv_cache(layout, cfg.num_gpu_blocks, rank, self.run_dir,
                                      device=rank_device(cfg.device, rank))
                    self._created_planes.append(rank)
        except BaseException:
            self._release_shared_memory()
            raise

    def _release_shared_memory(self) -> None:
        for pool in self._host_pools:
            pool.remove()
        self._host_pools.clear()
        for rank in self._created_planes:
            release_kv_cache(self.run_dir, rank)
        self._created_planes.clear()

    def __enter__(self) -> CacheManager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def transfer(self) -> Transfer | None:
        return self._transfer

    @property
    def cpu_enabled(self) -> bool:
        """False once the CPU tier was switched off (workers lost for good)."""
        return self.planner.cpu_enabled

    # ------------------------------------------------------------- allocate
    def allocate(self, request_id: Hashable, token_ids: Sequence[int], extra_key=None,
                 reserve_tokens: int = 0) -> Allocation:
        """Match the cached prefix, plan swap-ins, and give the request its GPU blocks.

        At least one prompt token is always left to compute (the engine needs
        its logits), so ``num_cached_tokens <= len(token_ids) - 1``.
        Raises NoFreeBlocks, with the state unchanged, when eviction cannot
        make room.
        """
        with self._lock:
            self._check_serving()
            if self._draining:
                raise CacheAsleep("kvcached is draining to sleep: running requests finish, "
                                  "new ones wait for wakeup()")
            self.planner.reap()
            if request_id in self._reqs:
                raise ValueError(f"request {request_id!r} is already allocated; free() it first")
            n = len(token_ids)
            if n < 1 or reserve_tokens < 0:
                raise ValueError(f"allocate needs >= 1 token and reserve_tokens >= 0, "
                                 f"got {n} tokens, reserve_tokens={reserve_tokens}")
            bs, core = self.block_size, self.core
            creq = core.request(self._ns, token_input(token_ids), extra_bytes(extra_key))
            # While paused a CPU hit is a miss: its swap-in would wait for resume.
            n_gpu, n_matched, blocks = core.match(creq, (n - 1) // bs, not self.planner.paused)
            need = -(-(n + reserve_tokens) // bs) - n_gpu
            avail = core.gpu_free + core.gpu_idle
            if need > avail:
                core.undo_match(creq)
                self._counters.no_free_blocks += 1
                raise NoFreeBlocks(need, avail)
            # Each matched node counts a use (the selective write policy's evidence),
            # and under the adaptive policy its tier a hit.
            core.hit(creq)
            core.tick()
            if need > core.gpu_free:
                try:
                    self.planner.make_room(need)
                except BaseException:
                    core.unref_path(creq)
                    raise
            blocks += core.alloc(GPU, need)
            alloc = self._finish_allocate(RunningRequest(request_id, creq, blocks, n), n_gpu,
                                          n_matched)
            self._publish_events()
            return alloc

    def _finish_allocate(self, req: RunningRequest, n_gpu: int, n_matched: int) -> Allocation:
        """The allocation: GPU hits, then CPU hits (swap-in), then storage hits
        (load), then fresh blocks to compute into."""
        bs = self.block_size
        if n_matched > n_gpu or self.cfg.storage_backend:
            req.alloc = alloc = Allocation(req.rid, req.blocks, 0, _NO_HIT, [],
                                           self._wait_allocation)
            n_swap, n_load = self.planner.plan_fetches(req, n_gpu, n_matched)
            alloc.hit = HitInfo(n_gpu * bs, n_swap * bs, n_load * bs)
            alloc.num_cached_tokens = req.core.n_path * bs
        else:  # GPU hits only (most requests): nothing to fetch, nothing to wait for
            req.alloc = alloc = Allocation(req.rid, req.blocks, n_gpu * bs, HitInfo(n_gpu * bs),
                                           [], self._wait_allocation)
        self._reqs[req.rid] = req
        self._counters.count_request(req.num_tokens, alloc.hit)
        return alloc

    # --------------------------------------------------------------- extend
    def extend(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Make room for ``num_tokens`` more tokens; returns the appended block ids."""
        with self._lock:
            self._check_serving()
            self.planner.reap()
            req = self._get(request_id)
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
            total = req.num_tokens + num_tokens
            need = -(-total // self.block_size) - len(req.blocks)
            if need > 0:
                avail = self.core.gpu_free + self.core.gpu_idle
                if need > avail:
                    self._counters.no_free_blocks += 1
                    raise NoFreeBlocks(need, avail)
                self.planner.make_room(need)
            new = self.core.alloc(GPU, max(need, 0))
            req.blocks.extend(new)
            req.num_tokens = total
            self._publish_events()
            return new

    # --------------------------------------------------------------- commit
    def commit(self, request_id: Hashable, token_ids: Sequence[int],
               num_computed_tokens: int) -> list[int]:
        """Cache the request's newly computed full blocks; returns its block ids.

        A block another request cached first is deduplicated: this request's
        copy goes back to the pool and its block table points at the cached one.
        """
        with self._lock:
            self.planner.reap()
            req = self._get(request_id)
            if req.alloc._handles and not req.alloc.ready:
                raise RuntimeError(f"request {request_id!r} still has transfers in flight; "
                                   "call Allocation.wait() before computing and committing")
            bs = self.block_size
            if not 0 <= num_computed_tokens <= len(token_ids):
                raise ValueError(f"num_computed_tokens must be in 0..{len(token_ids)} "
                                 f"(len(token_ids)), got {num_computed_tokens}")
            if num_computed_tokens > len(req.blocks) * bs:
                raise ValueError(
                    f"request {request_id!r} has blocks for {len(req.blocks) * bs} tokens, "
                    f"num_computed_tokens={num_computed_tokens}; call extend() first")
            full = num_computed_tokens // bs
            creq = req.core
            if creq.chain_open and full > creq.n_path:
                if creq.n_hashes < full:
                    self.core.extend_hashes(creq, token_input(token_ids), full)
                start = creq.n_path
                self.core.insert(creq, req.blocks, full)
                if self.cfg.storage_backend:
                    self.planner.write_through(req, start)
                self._publish_events()
            return req.blocks

    # ----------------------------------------------------------------- free
    def free(self, request_id: Hashable) -> None:
        """The request is done; its cached blocks stay in the tree, evictable."""
        with self._lock:
            req = self._get(request_id)
            if req.alloc._handles:
                self.planner.await_all(req.alloc._handles, self.cfg.task_timeout_s + 5.0)
            self.planner.reap()
            del self._reqs[request_id]
            self.core.tick()
            held = req.core.n_path
            if self.cfg.storage_backend:
                self.planner.store_reused(req.core)
            self.planner.stale.discard(id(req.core))
            self.core.unref_path(req.core)
            private = req.blocks[held:]
            if private:
                self.core.free(GPU, private[::-1])  # tail first, as vLLM does
            self._publish_events()
            if self._draining and not self._reqs:
                self._drained.notify_all()

    # ------------------------------------------------------------ transfers
    def _wait_allocation(self, alloc: Allocation, timeout: float | None) -> None:
        if alloc._handles:  # else nothing is in flight for it: nothing to wait for or apply
            limit = self.cfg.task_timeout_s + 5.0 if timeout is None else timeout
            self.planner.await_all(alloc._handles, limit)
            with self._lock:
                self.planner.reap()
                self._publish_events()
        if alloc.error is not None:
            raise alloc.error

    def _publish_events(self) -> None:
        """KV events: the blocks that became usable in, or left, a tier."""
        if self._events is None and self._kept_events is None:
            return
        for stored, tier, h in self.core.drain_events():
            if self._events is not None:
                self._events.publish("stored" if stored else "removed", _TIER_NAMES[tier], [h])
            if self._kept_events is not None and tier != 0:
                self._kept_events.append((bool(stored), _TIER_NAMES[tier], h))

    def keep_kv_events(self) -> None:
        """Keep the KV events of the CPU tier and storage for
        :meth:`take_kv_events` (an engine that publishes them itself, as vLLM
        does; its GPU tier's events are the engine's own)."""
        with self._lock:
            self._kept_events = []
            self.core.set_events(True)

    def take_kv_events(self) -> list[tuple[bool, str, bytes]]:
        """The (stored, tier, block hash) records since the last call."""
        with self._lock:
            if self._kept_events is None:
                return []
            self.planner.reap()  # finished stores mark their blocks stored
            self._publish_events()
            out, self._kept_events = self._kept_events, []
            return out

    # -------------------------------------------------------------- helpers
    def _get(self, request_id: Hashable) -> RunningRequest:
        req = self._reqs.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r} (not allocated, or already freed)")
        return req

    def _check_serving(self) -> None:
        if not self._started:
            raise RuntimeError("CacheManager.start() must be called before allocating")
        if self._closed:
            raise RuntimeError("CacheManager is closed")
        if self._asleep:
            raise CacheAsleep("kvcached is asleep; call wakeup() before allocating")

    # -------------------------------------------------------------- control
    def pause(self) -> dict:
        """Hold transfers (in-flight ones finish); GPU hits keep being served.

        From the moment it is called nothing new that would wait on a transfer
        is planned: no swap-outs, no storage reads or writes, and a prefix in
        the CPU tier is served as a miss (recomputed), so no request waits for
        resume. The ranks then drain without the manager lock held, so the
        engine's calls and `kvcached status` are answered meanwhile. A pause
        that times out stays in force (the coordinator holds tasks): resume()
        undoes it.
        """
        with self._lock:
            changed = not self.planner.paused
            self.planner.paused = True
        res = self._control("pause")
        return {**res, "changed": changed, "paused": True}

    def resume(self) -> dict:
        """Run held transfers, in order."""
        with self._lock:
            changed = self.planner.paused and not self._asleep
            if self._asleep:
                raise CacheAsleep("kvcached is asleep: wakeup() resumes it")
            res = self._control("resume")
            self.planner.paused = False
            return {**res, "changed": changed, "paused": False}

    def sleep(self, release_host_pool: bool = False, drain: bool = False,
              drain_timeout_s: float = 60.0) -> dict:
        """Pause and detach from the engine's KV planes (the engine may free them).

        The GPU tier's contents are forgotten (blocks with a CPU copy stay in
        the CPU tier); with ``release_host_pool`` the CPU tier is emptied and
        its shared memory released too. ``allocate`` raises CacheAsleep until
        ``wakeup``. Running requests must be freed first; with ``drain``,
        ``allocate`` raises CacheAsleep at once while the running requests
        finish (up to ``drain_timeout_s``: then TimeoutError, nothing changed).
        """
        if not drain:
            return self._sleep(release_host_pool)
        with self._lock:
            if self._asleep:
                return {"changed": False, "asleep": True}
            self._draining = True
        try:
            self._wait_drained(drain_timeout_s)
            return self._sleep(release_host_pool)
        finally:
            with self._lock:
                self._draining = False

    def _wait_drained(self, timeout_s: float) -> None:
        """Wait until no request runs (the wait releases the lock: the engine frees)."""
        deadline = time.monotonic() + timeout_s
        with self._drained:
            while self._reqs:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"sleep --drain: {len(self._reqs)} requests still running after "
                        f"{timeout_s:.1f}s; nothing changed, new requests are served again")
                self._drained.wait(left)

    def _sleep(self, release_host_pool: bool) -> dict:
        with self._lock:
            if self._asleep:
                return {"changed": False, "asleep": True}
            self.planner.reap()
            if self._reqs:
                raise RuntimeError(f"{len(self._reqs)} requests are still running; "
                                   "free them before sleep()")
            self.planner.wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("sleep")
            self.planner.paused = self._asleep = True
            self.core.drop_gpu_tier()
            if release_host_pool and self.cpu_enabled:
                self.core.drop_cpu_tier()
                for pool in self._host_pools:
                    pool.remove()
                self._host_pools.clear()
                self._host_released = True
            self._publish_events()
            return {"changed": True, "asleep": True, "ranks": res.get("ranks", {})}

    def wakeup(self) -> dict:
        """Re-create a released host pool, re-attach every rank, resume."""
        with self._lock:
            if not self._asleep:
                return {"changed": False, "asleep": False}
            if self._host_released:
                for rank in range(self.cfg.tp_size):
                    self._host_pools.append(HostPool.create(
                        self.run_dir, rank, self.cfg.num_cpu_blocks, self.cfg.layout.block_bytes))
                self._host_released = False
            res = self._control("wakeup")
            self.planner.paused = self._asleep = False
            return {"changed": True, "asleep": False, "ranks": res.get("ranks", {})}

    def restart_workers(self) -> dict:
        """Restart transfer workers that gave up (their crash count starts over)
        and, once every rank is ready, turn the CPU tier back on (it comes back
        empty: switching it off dropped its blocks); storage follows it."""
        res = self._transfer.restart_workers(self.cfg.worker_start_timeout_s)  # no lock held
        with self._lock:
            back = (not self.cpu_enabled and self.cfg.num_cpu_blocks > 0 and not self._closed
                    and self._transfer.healthy)
            if back:
                self.planner.cpu_enabled = True
                logger.warning("transfer workers are back: CPU tier on again")
            return {**res, "changed": bool(res.get("changed") or back),
                    "cpu_tier": self.cpu_enabled}

    def update_weights(self, version: str) -> dict:
        """Switch to the namespace of weight ``version``: nothing computed with
        other weights is matched again, in any tier (old blocks age out by LRU)."""
        version = str(version)
        if not version:
            raise ValueError("update_weights needs a non-empty version")
        with self._lock:
            if version == self.cfg.weight_version:
                return {"changed": False, "version": version}
            # Stores in flight land in the old version's namespace (their blocks
            # were hashed under it); the requests running now store nothing more.
            self.planner.wait_background(self.cfg.task_timeout_s + 5.0)
            self.planner.stale.update(id(r.core) for r in self._reqs.values())
            self.planner.stale.update(self._engine_reqs)
            res = self._control("update_weights", version=version)
            self._set_cfg(self.cfg.replace(weight_version=version))
            self._ns = namespace_hash(self.cfg.model_id, version, self.cfg.salt)
            if self._events is not None:  # routers: nothing from before matches any more
                for tier in _TIER_NAMES:
                    self._events.publish("cleared", tier, [])
            logger.info("weights updated to version %s: new cache namespace", version)
            return {"changed": True, "version": version, "ranks": res.get("ranks", {})}

    def attach_storage(self, backend: str, url: str = "") -> dict:
        """Attach a storage backend at run time (every rank opens it)."""
        with self._lock:
            cfg = self.cfg.replace(storage_backend=backend, storage_url=url)  # validates
            if (cfg.storage_backend, cfg.storage_url) == (self.cfg.storage_backend,
                                                          self.cfg.storage_url):
                return {"changed": False, "backend": backend}
            self.planner.wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("attach_storage", backend=backend, url=url)
            self._set_cfg(cfg)
            return {"changed": True, "backend": backend, "ranks": res.get("ranks", {})}

    def detach_storage(self) -> dict:
        """Detach the storage backend: ranks close it, the tree forgets what it held."""
        with self._lock:
            if not self.cfg.storage_backend:
                return {"changed": False}
            self.planner.wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("detach_storage")
            self._set_cfg(self.cfg.replace(storage_backend=None))
            self.core.forget_storage()
            return {"changed": True, "ranks": res.get("ranks", {})}

    def _set_cfg(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self.planner.set_cfg(cfg)

    def status(self) -> dict:
        """Everything `kvcached status` shows, JSON-friendly."""
        st = self.stats()
        transfer = self._transfer.stats() if self._transfer else {}
        return {"run_dir": str(self.run_dir), "log_dir": str(self.log_dir),
                "paused": self.planner.paused, "asleep": self._asleep,
                "draining": self._draining,
                "cpu_tier": self.cpu_enabled, "weight_version": self.cfg.weight_version,
                "transfer_mode": self.cfg.transfer_mode, "tp_size": self.cfg.tp_size,
                "stats": st.to_dict(), "workers": st.workers,
                "transfer": {k: v for k, v in transfer.items() if k != "workers"},
                **self._step_time_summary()}

    def record_engine_step(self, seconds: float, cpu_seconds: float | None = None) -> None:
        """The time an engine's scheduler spent in kvcached during one step: wall
        time, and the CPU time of that thread (the difference is time it waited:
        for a core, or for the GIL while another thread of the process ran)."""
        self._step_times.append((seconds, seconds if cpu_seconds is None else cpu_seconds))

    def _step_time_summary(self) -> dict:
        if not self._step_times:
            return {}
        wall, cpu = (sorted(x) for x in zip(*self._step_times, strict=True))

        def at(times: list[float], q: float) -> float:
            return round(times[min(len(times) - 1, int(q * len(times)))] * 1e6, 1)
        return {"scheduler_step_us": {"steps": len(wall), "p50": at(wall, 0.5),
                                      "p99": at(wall, 0.99), "max": at(wall, 1.0),
                                      "cpu_p50": at(cpu, 0.5), "cpu_p99": at(cpu, 0.99)}}

    @property
    def log_dir(self) -> Path:
        return Path(self.cfg.log_dir or self.run_dir / "logs")

    def _control(self, op: str, **args) -> dict:
        res = self._transfer.control(op, args, timeout_s=self.cfg.task_timeout_s)
        if not res.get("ok", False) and res.get("lost"):
            # A lost rank restarts in the default state; the others applied it.
            logger.warning("%s: %s (the rank restarts)", op, res.get("error"))
        elif not res.get("ok", False):
            raise TimeoutError(f"{op} did not complete on every rank: {res.get('error')} "
                               f"(silent ranks: {res.get('silent_ranks', [])})")
        return res

    # ------------------------------------------- external GPU tier (connectors)
    # With ``external_gpu_tier`` the engine owns the GPU tier (vLLM's block
    # pool and prefix cache) and kvcached the CPU tier and storage: a request
    # is known by the engine's block hashes, loads go into the engine's block
    # ids and saves come from them (kvcached.integrations.vllm drives this).
    def engine_request(self, engine_hashes: list[bytes]):
        """A request whose blocks the engine hashed; the keys fold in this cache's
        namespace (model, weights, salt)."""
        self._check_external()
        with self._lock:
            creq = self.core.request_hashes(self._ns, engine_hashes)
            self._engine_reqs[id(creq)] = creq  # until engine_release (update_weights)
            return creq

    def engine_probe(self, engine_hashes: list[bytes]):
        """A request of engine block hashes only to look with (``engine_cpu_prefix``,
        ``engine_storage_lookups``): never loaded or saved, so not kept for
        ``update_weights`` and never released."""
        self._check_external()
        with self._lock:
            return self.core.request_hashes(self._ns, engine_hashes)

    def engine_keys(self, engine_hashes: list[bytes]) -> list[bytes]:
        """kvcached's keys of engine block hashes: the hashes its KV events name."""
        ns = self._ns
        return [engine_key(ns, h) for h in engine_hashes]

    def add_engine_hashes(self, creq, engine_hashes: list[bytes]) -> None:
        with self._lock:
            self.core.add_hashes(creq, engine_hashes)

    def engine_cpu_prefix(self, creq, limit: int) -> tuple[int, bool]:
        """How many of the request's first ``limit`` blocks the CPU tier holds, and
        whether the next one is on its way in or out of it (a fetch or a save of
        another request: ask again once it lands). Changes nothing; no I/O.
        While paused: 0 (a hit would wait for resume)."""
        with self._lock:
            self.planner.reap()
            if self.planner.paused or not self.cpu_enabled:
                return 0, False
            return self.core.cpu_prefix(creq, limit)

    def engine_storage_lookups(self, runs: list[tuple[object, int, int]]) -> TaskHandle | None:
        """Start looking up blocks ``start..limit-1`` of each request in storage,
        all in one task (one storage round trip; a lookup on every rank): its
        result's ``prefixes`` counts, per run, the leading blocks every rank
        has. None when storage is off or unusable; callers skip runs shorter
        than ``storage_min_load_blocks`` (:meth:`storage_lookup_wanted`)."""
        with self._lock:
            if not runs or not self.planner.storage_usable():
                return None
            keys, lengths = [], []
            for creq, start, limit in runs:
                keys += [h.hex() for h in creq.hashes(start, limit)]
                lengths.append(limit - start)
            return self.planner.submit(Task("lookup", [], [], {"keys": keys,
                                                               "lengths": lengths}))

    def storage_lookup_wanted(self, start: int, limit: int) -> bool:
        """Whether blocks ``start..limit-1`` are worth asking storage for."""
        with self._lock:
            return (self.planner.storage_usable()
                    and limit - start >= max(1, self.cfg.storage_min_load_blocks))

    def engine_load(self, creq, start: int, stop: int, device_ids: list[int]) -> EngineLoad:
        """Pin the request's cached prefix and plan copying blocks ``start..stop-1``
        into the engine's ``device_ids`` (the request's whole block table): from
        the CPU tier, then from storage. Storage blocks before ``start`` (the
        engine has them, the CPU tier does not) come into host blocks only. The
        tasks are the caller's to submit; what could not be planned any more
        is named in ``EngineLoad.missing``."""
        with self._lock:
            _, n_cpu, _ = self.core.match(creq, stop)
            self.core.hit(creq)
            load = EngineLoad(creq, start, stop, device_ids, n_cpu)
            if n_cpu > start:
                cpus = self.core.path_blocks(creq, start, n_cpu, CPU)
                load.tasks.append(Task("swap_in", cpus, device_ids[start:n_cpu]))
            if stop > n_cpu:
                nodes, cpus, _ = self.core.plan_load(creq, n_cpu, stop - n_cpu, [])
                self.planner.flush_writebacks()
                load.nodes = nodes
                keys = [h.hex() for h in creq.hashes(n_cpu, n_cpu + len(nodes))]
                split = min(max(start - n_cpu, 0), len(nodes))  # host only, then to the engine
                if split:
                    load.tasks.append(Task("load", [], cpus[:split], {"keys": keys[:split]}))
                if len(nodes) > split:
                    load.tasks.append(Task("load", [], cpus[split:], {
                        "keys": keys[split:], "device_ids": device_ids[n_cpu + split:
                                                                       n_cpu + len(nodes)]}))
            load.missing = device_ids[max(start, creq.n_path):stop]
            return load

    def engine_finish_load(self, load: EngineLoad, results: list[TaskResult]) -> list[int]:
        """Land what a load brought (``results``: its tasks', in order); returns the
        engine block ids that did not get their KV (the engine recomputes them)."""
        with self._lock:
            bad = set(load.missing)
            res = iter(results)
            if load.n_cpu > load.start and not next(res).ok:  # the swap-in
                bad.update(load.device_ids[load.start:load.n_cpu])
            if load.nodes:
                ok, ran = 0, True  # blocks that arrived in order; whether the short task ran
                for task in load.tasks[1 if load.n_cpu > load.start else 0:]:
                    r = next(res)
                    got = min(len(task.dst), int(r.result.get("prefix", 0))) if r.ok else 0
                    ok += got
                    if got < len(task.dst):  # nothing may hang under a gap
                        ran = r.ok
                        break
                self.core.finish_fetch(load.creq, load.n_cpu, load.nodes, ok, True, ran)
                first = max(load.n_cpu + ok, load.start)
                bad.update(load.device_ids[first:load.n_cpu + len(load.nodes)])
            self._publish_events()
            return sorted(bad)

    def engine_save(self, saves: list[tuple[object, int, list[int]]]) -> EngineSave | None:
        """Start saving the engine's computed blocks into the CPU tier: for each
        (request, blocks, device_ids), blocks ``0..blocks-1`` that the CPU tier
        lacks are copied from the engine's blocks, all in one swap_out task.
        Returns the save in flight (None: nothing to copy); the engine keeps the
        blocks unchanged until it completes, then calls ``engine_finish_save``."""
        with self._lock:
            self.planner.reap()
            if self.planner.paused or not self.cpu_enabled:
                return None
            save = EngineSave()
            src, dst = [], []
            for creq, blocks, device_ids in saves:
                nodes, cpus, positions = self.core.ext_save(creq, blocks)
                if nodes:
                    save.plans.append((creq, nodes, positions))
                    src += [device_ids[k] for k in positions]
                    dst += cpus
            self.planner.flush_writebacks()  # taking host blocks may have held victims
            if not save.plans:
                return None
            save.handle = self.planner.submit(Task("swap_out", src, dst))
            return save

    def engine_finish_save(self, save: EngineSave) -> int:
        """Land a save whose task completed (the copies become CPU-tier blocks,
        written through to storage) or failed (a counter; nothing is cached).
        Returns how many blocks were saved."""
        with self._lock:
            ok = save.handle.result is not None and save.handle.result.ok
            for creq, nodes, positions in save.plans:
                self.core.ext_finish_save(creq, nodes, positions, ok)
            n = len(save.handle.task.src)
            self._counters.storage["saves" if ok else "saves_failed"] += n
            if ok and self.planner.storage_usable():
                self.planner.store_engine_blocks([creq for creq, _, _ in save.plans], n)
            self._publish_events()
            return n if ok else 0

    def engine_release(self, creq) -> None:
        """The engine is done with the request (finished, or preempted: it starts over)."""
        with self._lock:
            self.core.tick()
            if self.cfg.storage_backend:
                self.planner.store_reused(creq)
            self.core.unref_path(creq)
            self._engine_reqs.pop(id(creq), None)
            self.planner.stale.discard(id(creq))
            self._publish_events()

    def count_engine_request(self, prompt_tokens: int, gpu_tokens: int, cpu_tokens: int,
                             storage_tokens: int) -> None:
        """Count a request the engine admitted, with the tokens each tier gave it
        (``gpu_tokens``: the engine's own prefix cache)."""
        with self._lock:
            self._counters.count_request(prompt_tokens,
                                         HitInfo(gpu_tokens, cpu_tokens, storage_tokens))

    def count_storage(self, event: str) -> None:
        """Count a storage event the engine saw (``kvcached status`` shows them)."""
        with self._lock:
            self._counters.storage[event] += 1

    def submit(self, task: Task) -> TaskHandle:
        """Submit a task (counted in the stats); its completion is the caller's."""
        with self._lock:
            return self.planner.submit(task)

    def flush_submitted(self, timeout_s: float) -> bool:
        """Wait until the tasks submitted so far are on their way to the ranks
        (see ``Transfer.flush``); True at once without a transfer."""
        transfer = self._transfer
        return transfer.flush(timeout_s) if transfer is not None else True

    def _check_external(self) -> None:
        if not self.cfg.external_gpu_tier:
            raise RuntimeError("engine_* calls need external_gpu_tier = true (the engine "
                               "owns the GPU tier); this manager allocates GPU blocks itself")

    # ---------------------------------------------------------------- stats
    def stats(self) -> CacheStats:
        """A snapshot of tiers, hits, evictions and transfers."""
        with self._lock:
            self.planner.reap()
            workers = self._transfer.stats().get("workers", []) if self._transfer else []
            private = sum(len(r.blocks) - r.core.n_path for r in self._reqs.values())
            return self._counters.snapshot(self.core, len(self._reqs), private,
                                           self.cfg.layout.block_bytes * self.cfg.tp_size,
                                           workers)

    def snapshot(self) -> CacheSnapshot:
        """Every node, leaf heap, free list, running request and store in flight,
        as plain data (O(cached blocks): for checks and tests)."""
        with self._lock:
            self.planner.reap()
            requests = [RequestView(r.rid, tuple(r.blocks), tuple(r.core.path()))
                        for r in self._reqs.values()]
            stores = [list(p.nodes) for p in self.planner.pending.values()
                      if p.kind.startswith("store")]
            return CacheSnapshot.from_core(self.core.snapshot(), self._ns, requests, stores)

    def check_invariants(self) -> None:
        """Raise InvariantError on the first broken invariant (kvcached.core.invariants)."""
        check(self.snapshot())


__all__ = ["CacheManager", "CPU", "GPU"]
