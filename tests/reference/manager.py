"""The reference CacheManager (tests only): the Python loops over ``PyNode``s that
the native core (kvcached/native/core) replaced, kept as the oracle the
differential tests compare the real manager with, step by step.

CacheManager: the engine-side prefix cache over GPU and CPU tiers.

The engine's scheduler calls ``allocate`` / ``extend`` / ``commit`` / ``free``;
the manager decides which blocks are cached where and plans the moves
(``swap_out``, ``swap_in``) that a ``Transfer`` executes. All tree
transitions happen on the caller's thread, under one lock: completions from
the transfer are queued and applied at the start of the next call or in
``Allocation.wait``.

Eviction keeps the GPU pool able to serve: with a CPU tier, the least
recently used GPU leaf is swapped out (synchronously, so its GPU block is
reused only after the copy finished) or simply dropped when a CPU backup
already holds the same bytes; without one it is dropped.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path

from kvcached.config import CacheConfig
from kvcached.errors import CacheAsleep, NoFreeBlocks
from kvcached.memory.rundir import cleanup_stale_run_dirs, create_run_dir
from kvcached.tasks import Task, TaskHandle, TaskResult
from kvcached.transfer.base import Transfer
from kvcached.types import Allocation, CacheStats, HitInfo
from reference.eviction import EvictionMixin, cpu_evictable, deepest_first, gpu_evictable
from reference.fetch import FetchMixin
from reference.hashing import block_hashes, namespace_hash
from reference.pool import BlockPool
from reference.stats import Counters
from reference.tree import CPU, GPU, STORAGE, BlockTree, Node, Tier

logger = logging.getLogger(__name__)


class _Request:
    """A running request. ``blocks[i]`` is ``nodes[i].gpu`` for i < len(nodes); the
    rest are the request's private blocks (not in the tree)."""

    __slots__ = ("rid", "extra", "blocks", "nodes", "hashes", "inputs", "keys", "num_tokens",
                 "alloc", "chain_open")

    def __init__(self, rid, extra, hashed: tuple, num_tokens: int):
        self.rid = rid
        self.extra = extra
        self.blocks: list[int] = []
        self.nodes: list[Node] = []
        # Block hashes, and the inputs / memo keys new nodes are remembered by
        # (None on the Python hashing path): block_hashes_memo's three lists.
        self.hashes, self.inputs, self.keys = hashed
        self.num_tokens = num_tokens
        self.alloc: Allocation | None = None
        # False once a block this request computed could not join the tree
        # (its twin was in flight): later blocks stay private, never misplaced.
        self.chain_open = True

    def memo_entry(self, i: int) -> tuple[bytes | None, int | None]:
        """Block ``i``'s input and memo key, for ``BlockTree.add_child``."""
        if self.keys is None:
            return None, None
        return self.inputs[i], self.keys[i]


class CacheManager(EvictionMixin, FetchMixin):
    """Prefix-cache manager (see DESIGN.md §10 for the contract)."""

    def __init__(self, cfg: CacheConfig, transfer: Transfer | None = None):
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.run_dir, self._own_run_dir = create_run_dir(cfg.run_dir)
        self.gpu_pool = BlockPool("gpu", cfg.num_gpu_blocks)
        self.cpu_pool = BlockPool("cpu", cfg.num_cpu_blocks)
        self.cpu_enabled = cfg.num_cpu_blocks > 0
        self.tree = BlockTree()
        self._ns = namespace_hash(cfg.model_id, cfg.weight_version, cfg.salt)
        self._hashes = _hashes_without_memo  # the reference hashes every block
        self._reqs: dict[Hashable, _Request] = {}
        # task id -> (kind, request, nodes, handle) of fetches and stores in flight
        self._pending: dict[int, tuple] = {}
        self._clock = 0
        self._n_gpu_idle = 0  # nodes in state GPU with ref 0: what eviction can free
        self._lock = threading.RLock()
        self._counters = Counters()
        self._transfer = transfer
        self._log_file: Path | None = None
        self._ops: list = []  # control server, metrics server, event publisher
        self._events = None  # KVEventPublisher when kv_events_endpoint is set
        self.metrics = None
        self._host_pools: list = []
        self._created_planes: list[int] = []
        self._started = False
        self._closed = False
        self._asleep = False
        self._paused = False
        self._host_released = False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> CacheManager:
        """Attach (or spawn) the transfer; returns when every rank is ready."""
        if self._started:
            return self
        from kvcached.ops.logs import setup_process_logging
        self._log_file = setup_process_logging(self.log_dir, "engine")
        self._create_shared_memory()
        if self._transfer is None:
            from kvcached.transfer.factory import make_transfer
            self._transfer = make_transfer(self.cfg, self.run_dir)
        try:
            self._transfer.start()
        except BaseException:
            self._release_shared_memory()
            raise
        self._started = True
        try:
            self._start_ops()
        except BaseException:
            self.close()
            raise
        logger.info("kvcached started: run_dir=%s gpu=%d cpu=%d blocks of %d tokens",
                    self.run_dir, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks,
                    self.block_size)
        return self

    def _start_ops(self) -> None:
        """The control socket (`kvcached ctl`), metrics and KV events, as configured."""
        cfg = self.cfg
        if cfg.control_socket:
            from kvcached.ops.ctlserver import ControlServer
            self._ops.append(ControlServer(self).start())
        if cfg.metrics_port:
            from kvcached.ops.metrics import MetricsServer
            self.metrics = MetricsServer(self, cfg.metrics_host, cfg.metrics_port).start()
            self._ops.append(self.metrics)
        if cfg.kv_events_endpoint:
            from kvcached.ops.events import KVEventPublisher
            self._events = KVEventPublisher(cfg.kv_events_endpoint,
                                            source=str(self.run_dir)).start()
            self._ops.append(self._events)

    def close(self) -> None:
        """Finish what is in flight, stop the transfer, remove run files."""
        if self._closed:
            return
        self._closed = True
        for op in reversed(self._ops):  # no more control requests while closing
            op.close()
        self._ops.clear()
        with self._lock:
            if self._transfer is not None:
                try:  # pending stores finish first: they are what survives a restart
                    self._wait_background(self.cfg.task_timeout_s + 5.0)
                except TimeoutError as e:
                    logger.warning("close: %s", e)
                self._transfer.close()
            self._release_shared_memory()
        if self._log_file is not None:
            from kvcached.ops.logs import stop_process_logging
            stop_process_logging(self._log_file)
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _create_shared_memory(self) -> None:
        """Host pools (and, with create_cache, the KV planes) belong to the engine
        process, so they outlive a crashed worker; stale ones of dead runs go first."""
        from kvcached.memory.hostpool import HostPool
        from kvcached.memory.kvshare import allocate_kv_cache
        from kvcached.memory.shm import cleanup_stale_segments
        cleanup_stale_segments()
        cleanup_stale_run_dirs()
        cfg, layout = self.cfg, self.cfg.layout
        try:
            for rank in range(cfg.tp_size):
                if cfg.num_cpu_blocks:
                    self._host_pools.append(HostPool.create(
                        self.run_dir, rank, cfg.num_cpu_blocks, layout.block_bytes))
                if cfg.create_cache and cfg.device == "cpu":
                    allocate_kv_cache(layout, cfg.num_gpu_blocks, rank, self.run_dir)
                    self._created_planes.append(rank)
        except BaseException:
            self._release_shared_memory()
            raise

    def _release_shared_memory(self) -> None:
        from kvcached.memory.kvshare import release_kv_cache
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
            self._reap()
            if request_id in self._reqs:
                raise ValueError(f"request {request_id!r} is already allocated; free() it first")
            n = len(token_ids)
            if n < 1 or reserve_tokens < 0:
                raise ValueError(f"allocate needs >= 1 token and reserve_tokens >= 0, "
                                 f"got {n} tokens, reserve_tokens={reserve_tokens}")
            bs = self.block_size
            req = _Request(request_id, extra_key, self._hashes(
                self._ns, token_ids, bs, extra_key, self.tree.memo_root), n)
            matched, n_gpu, unlisted, gpu_ids = self._match_ref(req.hashes, (n - 1) // bs)
            if self._paused and len(matched) > n_gpu:  # a swap-in would wait for resume
                unlisted = self._unmatch_cpu(matched, n_gpu, unlisted)
            need = -(-(n + reserve_tokens) // bs) - n_gpu
            avail = self.gpu_pool.num_free + self._n_gpu_idle
            if need > avail:
                self._undo_match_ref(matched, unlisted)
                self._counters.no_free_blocks += 1
                raise NoFreeBlocks(need, avail)
            self._clock += 1
            if need > self.gpu_pool.num_free:
                try:
                    self._make_room(need)
                except BaseException:
                    self._unref_path(matched)
                    raise
            gpu_ids.extend(self.gpu_pool.allocate(need))
            return self._finish_allocate(req, matched, n_gpu, gpu_ids)

    def _match_ref(self, hashes: list[bytes], limit: int) -> tuple[list[Node], int, tuple,
                                                                   list[int]]:
        """Reference the longest prefix of ready nodes: GPU nodes, then CPU nodes
        (GPU is prefix-closed); stops at in-flight nodes. The per-block hot loop
        of allocate (``match_ref``: in C for native nodes).

        Returns the nodes, how many are on GPU, the ``(node, key)`` pairs of
        nodes taken off the GPU and the CPU LRU (at most the deepest GPU and
        the deepest CPU node: every other node has a child on the path), for
        the undo, and the GPU nodes' block ids. (Hot: a request's glue, kept
        to a few steps; 24 in-process replay pairs put this wrapper's old
        comprehensions at ~2% of a resident request.)"""
        tree = self.tree
        out, n_gpu, idle, gpu_unlisted, cpu_unlisted, gpu_ids = match_ref_py(
            tree.root, hashes, limit, GPU, CPU)
        self._n_gpu_idle -= idle
        tree.gpu_lru.size -= len(gpu_unlisted)
        tree.cpu_lru.size -= len(cpu_unlisted)
        return out, n_gpu, (gpu_unlisted, cpu_unlisted), gpu_ids

    def _undo_match_ref(self, nodes: list[Node], unlisted: tuple) -> None:
        """Exactly undo ``_match_ref``: the LRU heaps still hold the old keys
        (lazy deletion, and nothing was added since), so restoring them puts
        every node back in its place."""
        for n in nodes:
            n.ref -= 1
            if n.ref == 0 and n.state is GPU:
                self._n_gpu_idle += 1
        for lru, pairs in zip((self.tree.gpu_lru, self.tree.cpu_lru), unlisted):
            for n, key in pairs:
                setattr(n, lru.slot, key)
                lru.size += 1

    def _unmatch_cpu(self, matched: list[Node], n_gpu: int, unlisted: tuple) -> tuple:
        """While paused, serve the CPU part of a match as a miss (the request
        recomputes it): undo ``_match_ref`` for ``matched[n_gpu:]`` exactly as
        ``_undo_match_ref`` does, and return ``unlisted`` without those nodes."""
        for n in matched[n_gpu:]:
            n.ref -= 1
        lru = self.tree.cpu_lru
        for n, key in unlisted[1]:
            setattr(n, lru.slot, key)
            lru.size += 1
        del matched[n_gpu:]
        return unlisted[0], []

    def _finish_allocate(self, req: _Request, matched: list[Node], n_gpu: int,
                         blocks: list[int]) -> Allocation:
        """Build the block table: GPU hits, then CPU hits (swap-in), then storage
        hits (load), then fresh blocks to compute into (``blocks``: the GPU hits'
        ids, then the new blocks)."""
        bs = self.block_size
        req.blocks = blocks
        req.nodes = matched  # the request owns the list from here on
        if len(matched) > n_gpu or self.cfg.storage_backend:
            req.alloc = alloc = Allocation(req.rid, blocks, 0, _NO_HIT, [],
                                           self._wait_allocation)
            n_swap, n_load = self._plan_fetches(req, n_gpu)
            alloc.hit = HitInfo(n_gpu * bs, n_swap * bs, n_load * bs)
            alloc.num_cached_tokens = len(req.nodes) * bs
        else:  # GPU hits only (most requests): nothing to fetch, nothing to wait for
            req.alloc = alloc = Allocation(req.rid, blocks, n_gpu * bs, HitInfo(n_gpu * bs),
                                           [], self._wait_allocation)
        self._reqs[req.rid] = req
        self._counters.count_request(req.num_tokens, alloc.hit)
        return alloc

    def _plan_fetches(self, req: _Request, n_gpu: int) -> tuple[int, int]:
        """Swap-ins for the CPU hits after the ``n_gpu`` GPU hits, then loads of
        what storage holds next; returns how many blocks of each."""
        swap = req.nodes[n_gpu:]
        new = req.blocks[n_gpu:]
        if swap:
            self._plan_swap_in(req, swap, new[:len(swap)])
        if not self.cfg.storage_backend:
            return len(swap), 0
        start = len(req.nodes)
        parent = req.nodes[-1] if start else self.tree.root
        limit = (req.num_tokens - 1) // self.block_size
        loads = self._plan_load(req, parent, start, limit, new[len(swap):])
        req.nodes.extend(loads)
        return len(swap), len(loads)

    # --------------------------------------------------------------- extend
    def extend(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Make room for ``num_tokens`` more tokens; returns the appended block ids."""
        with self._lock:
            self._check_serving()
            self._reap()
            req = self._get(request_id)
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
            total = req.num_tokens + num_tokens
            need = -(-total // self.block_size) - len(req.blocks)
            if need > 0:
                avail = self.gpu_pool.num_free + self._n_gpu_idle
                if need > avail:
                    self._counters.no_free_blocks += 1
                    raise NoFreeBlocks(need, avail)
                self._make_room(need)
            new = self.gpu_pool.allocate(max(need, 0))
            req.blocks.extend(new)
            req.num_tokens = total
            return new

    # --------------------------------------------------------------- commit
    def commit(self, request_id: Hashable, token_ids: Sequence[int],
               num_computed_tokens: int) -> list[int]:
        """Cache the request's newly computed full blocks; returns its block ids.

        A block another request cached first is deduplicated: this request's
        copy goes back to the pool and its block table points at the cached one.
        """
        with self._lock:
            self._reap()
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
            if req.chain_open and full > len(req.nodes):
                self._extend_hashes(req, token_ids, full)
                start = len(req.nodes)
                self._insert(req, full)
                if self.cfg.storage_backend:
                    self._write_through(req.nodes[start:])
            return req.blocks

    def _extend_hashes(self, req: _Request, token_ids: Sequence[int], full: int) -> None:
        have = len(req.hashes)
        if have < full:
            parent = req.hashes[-1] if have else self._ns
            # Blocks past the prompt's hashed ones sit under nodes not in the
            # tree yet: no memo walk (they are new, and hashed).
            memo = self.tree.memo_root if have == 0 else None
            hashes, inputs, keys = self._hashes(parent, token_ids, self.block_size,
                                                req.extra, memo, have, full)
            req.hashes.extend(hashes)
            if inputs is None:  # hashed on the Python path: no memo for this request
                req.inputs = req.keys = None
            elif req.inputs is not None:
                req.inputs.extend(inputs)
                req.keys.extend(keys)

    def _insert(self, req: _Request, full: int) -> None:
        """Put blocks ``len(req.nodes)..full-1`` of the request in the tree: new
        nodes for new blocks (in C over native nodes: ``insert_new``, whose
        reference is this loop), and for a block already cached, dedup onto
        it, adopt this request's copy, or, when it is in flight, stop."""
        parent = req.nodes[-1] if req.nodes else self.tree.root
        i = len(req.nodes)
        fast = None  # the reference inserts in Python
        while i < full:
            if fast is not None:
                made = len(req.nodes)
                try:
                    parent, i = fast(parent, req.hashes, req.inputs, req.keys, req.blocks, i,
                                     full, GPU, req.nodes)
                finally:  # counted even if it stopped on an error midway
                    self.tree.num_nodes += len(req.nodes) - made
                if i == full:
                    return
            h = req.hashes[i]
            node = parent.child(h)
            if node is None:
                node = self._new_gpu_node(parent, h, req.blocks[i], req, i)
            elif node.state is GPU:
                if node.gpu != req.blocks[i]:
                    self.gpu_pool.free([req.blocks[i]])
                    req.blocks[i] = node.gpu
                    self._counters.dedup_blocks += 1
                self._ref(node)
            elif node.state is CPU or node.state is STORAGE:
                node.ref += 1  # adopt our copy: no swap-in needed for it any more
                self._set(node, GPU, gpu=req.blocks[i])
            else:
                req.chain_open = False
                return
            req.nodes.append(node)
            parent = node
            i += 1

    def _new_gpu_node(self, parent: Node, h: bytes, gpu: int, req: _Request, i: int) -> Node:
        """A node for block ``i`` that ``req`` just computed (``_set(GPU)`` inlined: it
        is referenced, so in no LRU, and so is its parent, the request's previous
        node or the root, so its parent's LRU membership does not change)."""
        node = self.tree.add_child(parent, h, *req.memo_entry(i))
        node.ref = 1
        node.state = GPU
        node.gpu = gpu
        parent.n_gpu_children += 1
        if self._events is not None:
            self._publish_change(node, STORAGE, False)
        return node

    # ----------------------------------------------------------------- free
    def free(self, request_id: Hashable) -> None:
        """The request is done; its cached blocks stay in the tree, evictable."""
        with self._lock:
            req = self._get(request_id)
            if req.alloc._handles:
                self._await(req.alloc._handles, self.cfg.task_timeout_s + 5.0)
            self._reap()
            del self._reqs[request_id]
            self._clock += 1
            self._unref_path(req.nodes)
            private = req.blocks[len(req.nodes):]
            if private:
                self.gpu_pool.free(private[::-1])  # tail first, as vLLM does

    # ------------------------------------------------------------ transfers
    def _submit(self, task: Task) -> TaskHandle:
        h = self._transfer.submit(task)
        self._counters.task_submitted(task)
        return h

    def _await(self, handles: list[TaskHandle], timeout: float) -> list[TaskResult]:
        if not handles:
            return []
        deadline = time.monotonic() + timeout
        for h in handles:
            if not h.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{h.task.kind} task {h.task.task_id} did not finish "
                                   f"within {timeout:.1f}s")
        return [h.result for h in handles]

    def _reap(self) -> None:
        """Apply completions the transfer queued (swap-outs are handled inline)."""
        q = self._transfer.completed if self._transfer else ()
        while q:
            h = q.popleft()
            self._counters.task_done(h.task, h.result)
            ctx = self._pending.pop(h.task.task_id, None)
            if ctx is None:
                continue  # swap-outs and lookups are handled where they are waited for
            kind, req, nodes, _ = ctx
            if kind == "store":
                self._finish_store(nodes, h.result)
            else:
                self._finish_fetch(kind, req, nodes, h.result)
        if self.cpu_enabled and not self._pending and not self._transfer.healthy:
            self._disable_cpu_tier()

    def _wait_allocation(self, alloc: Allocation, timeout: float | None) -> None:
        if alloc._handles:  # else nothing is in flight for it: nothing to wait for or apply
            limit = self.cfg.task_timeout_s + 5.0 if timeout is None else timeout
            self._await(alloc._handles, limit)
            with self._lock:
                self._reap()
        if alloc.error is not None:
            raise alloc.error

    # -------------------------------------------------------------- helpers
    def _get(self, request_id: Hashable) -> _Request:
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
        is planned (no swap-outs, no storage reads); the ranks then drain
        without the manager lock held, so the engine's calls and `kvcached
        status` are answered meanwhile. A pause that times out stays in force
        (the coordinator holds tasks): resume() undoes it.
        """
        with self._lock:
            changed = not self._paused
            self._paused = True
        res = self._control("pause")
        return {**res, "changed": changed, "paused": True}

    def resume(self) -> dict:
        """Run held transfers, in order."""
        with self._lock:
            changed = self._paused and not self._asleep
            if self._asleep:
                raise CacheAsleep("kvcached is asleep: wakeup() resumes it")
            res = self._control("resume")
            self._paused = False
            return {**res, "changed": changed, "paused": False}

    def sleep(self, release_host_pool: bool = False) -> dict:
        """Pause and detach from the engine's KV planes (the engine may free them).

        The GPU tier's contents are forgotten (blocks with a CPU copy stay in
        the CPU tier); with ``release_host_pool`` the CPU tier is emptied and
        its shared memory released too. ``allocate`` raises CacheAsleep until
        ``wakeup``. Running requests must be freed first.
        """
        with self._lock:
            if self._asleep:
                return {"changed": False, "asleep": True}
            self._reap()
            if self._reqs:
                raise RuntimeError(f"{len(self._reqs)} requests are still running; "
                                   "free them before sleep()")
            self._wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("sleep")
            self._paused = self._asleep = True
            self._drop_gpu_tier()
            if release_host_pool and self.cpu_enabled:
                self._drop_cpu_tier()
                for pool in self._host_pools:
                    pool.remove()
                self._host_pools.clear()
                self._host_released = True
            return {"changed": True, "asleep": True, "ranks": res.get("ranks", {})}

    def wakeup(self) -> dict:
        """Re-create a released host pool, re-attach every rank, resume."""
        with self._lock:
            if not self._asleep:
                return {"changed": False, "asleep": False}
            if self._host_released:
                from kvcached.memory.hostpool import HostPool
                for rank in range(self.cfg.tp_size):
                    self._host_pools.append(HostPool.create(
                        self.run_dir, rank, self.cfg.num_cpu_blocks, self.cfg.layout.block_bytes))
                self._host_released = False
            res = self._control("wakeup")
            self._paused = self._asleep = False
            return {"changed": True, "asleep": False, "ranks": res.get("ranks", {})}

    def update_weights(self, version: str) -> dict:
        """Switch to the namespace of weight ``version``: nothing computed with
        other weights is matched again, in any tier (old blocks age out by LRU)."""
        version = str(version)
        if not version:
            raise ValueError("update_weights needs a non-empty version")
        with self._lock:
            if version == self.cfg.weight_version:
                return {"changed": False, "version": version}
            res = self._control("update_weights", version=version)
            self.cfg = self.cfg.replace(weight_version=version)
            self._ns = namespace_hash(self.cfg.model_id, version, self.cfg.salt)
            if self._events is not None:  # routers: nothing from before matches any more
                for tier in ("gpu", "cpu", "storage"):
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
            self._wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("attach_storage", backend=backend, url=url)
            self.cfg = cfg
            return {"changed": True, "backend": backend, "ranks": res.get("ranks", {})}

    def detach_storage(self) -> dict:
        """Detach the storage backend: ranks close it, the tree forgets what it held."""
        with self._lock:
            if not self.cfg.storage_backend:
                return {"changed": False}
            self._wait_background(self.cfg.task_timeout_s + 5.0)
            res = self._control("detach_storage")
            self.cfg = self.cfg.replace(storage_backend=None)
            self._forget_storage()
            return {"changed": True, "ranks": res.get("ranks", {})}

    def _forget_storage(self) -> None:
        for n in sorted(self.tree.walk(), key=deepest_first):
            n.in_storage = False
            if n.state is STORAGE and not n.n_children:
                self.tree.remove(n)

    def _wait_background(self, timeout_s: float) -> bool:
        """Wait for every task in flight and apply it; False if there was none."""
        handles = [ctx[3] for ctx in self._pending.values()]
        if handles:
            self._await(handles, timeout_s)
            self._reap()
        return bool(handles)

    def status(self) -> dict:
        """Everything `kvcached status` shows, JSON-friendly."""
        st = self.stats()
        transfer = self._transfer.stats() if self._transfer else {}
        return {"run_dir": str(self.run_dir), "log_dir": str(self.log_dir),
                "paused": self._paused, "asleep": self._asleep,
                "cpu_tier": self.cpu_enabled, "weight_version": self.cfg.weight_version,
                "transfer_mode": self.cfg.transfer_mode, "tp_size": self.cfg.tp_size,
                "stats": st.to_dict(), "workers": st.workers,
                "transfer": {k: v for k, v in transfer.items() if k != "workers"}}

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

    # ---------------------------------------------------------------- stats
    def stats(self) -> CacheStats:
        """A snapshot of tiers, hits, evictions and transfers."""
        with self._lock:
            self._reap()
            workers = self._transfer.stats().get("workers", []) if self._transfer else []
            return self._counters.snapshot(self, workers)

    def check_invariants(self) -> None:
        """Raise InvariantError on the first broken invariant (see kvcached.core.invariants)."""
        from kvcached.core.invariants import check
        with self._lock:
            self._reap()
            check(self)


def match_ref_py(root: Node, hashes: list[bytes], limit: int, GPU: Tier, CPU: Tier
                 ) -> tuple[list[Node], int, int, list, list, list[int]]:
    """``CacheManager._match_ref``'s loop in Python: the reference, and what runs
    for PyNode (``tree.native_match_ref`` is the same in C). Returns the nodes,
    how many are on GPU, how many GPU nodes were idle (ref 0), the ``(node,
    key)`` taken off the GPU and the CPU LRU, and the GPU nodes' block ids."""
    out: list[Node] = []
    gpu_ids: list[int] = []
    gpu_unlisted, cpu_unlisted = [], []
    idle = 0
    node = root
    hashes = hashes[:limit]
    for h in hashes:
        child = node.child(h)
        if child is None or child.state is not GPU:
            break
        if not child.ref:
            idle += 1
            if child.gpu_key is not None:
                gpu_unlisted.append((child, child.gpu_key))
                child.gpu_key = None
        child.ref += 1
        out.append(child)
        gpu_ids.append(child.gpu)
        node = child
    n_gpu = len(out)
    for h in hashes[n_gpu:]:
        node = node.child(h)
        if node is None or node.state is not CPU:
            break
        if node.cpu_key is not None:
            cpu_unlisted.append((node, node.cpu_key))
            node.cpu_key = None
        node.ref += 1
        out.append(node)
    return out, n_gpu, idle, gpu_unlisted, cpu_unlisted, gpu_ids


_NO_HIT = HitInfo()  # an allocation's hit until it is known (immutable: one serves all)


def _hashes_without_memo(parent: bytes, token_ids: Sequence[int], block_size: int,
                         extra_key, memo, start: int = 0, stop: int | None = None
                         ) -> tuple[list[bytes], None, None]:
    """``block_hashes_memo`` for ``hash_memo = false``: every block is hashed and
    no input is kept (the memo stays empty)."""
    return block_hashes(parent, token_ids, block_size, extra_key, start, stop), None, None


__all__ = ["CacheManager", "cpu_evictable", "gpu_evictable"]  # noqa: F822
