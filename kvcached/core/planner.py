"""The planner: turns the core's plans into transfer tasks and lands their results.

The native core decides what moves (which leaves to evict, which blocks a
request fetches, which it writes through to storage) and changes node
states; the planner submits each move as a ``Task`` and, when the task has
completed on every rank, tells the core how it went. A node changes tier
only then; a failed or short task rolls its nodes back.

- Eviction (``make_room``) is synchronous: a GPU block is reused only after
  its swap-out finished on every rank, so the engine never writes into a
  block still being copied, and a failed copy rolls back (the victims are
  dropped instead: a broken CPU tier costs hits, never serving).
- Fetches (swap-ins of CPU hits, loads of storage hits) are asynchronous:
  ``Allocation.wait`` blocks on them; a failure cuts the request's cached
  prefix there and the engine recomputes the rest into the same blocks.
- Writes to storage follow ``storage_write_policy``: ``write_through``
  stages a commit's new blocks into host blocks and stores them in one task
  per commit; ``write_through_selective`` stores, when a request lets go of
  its path, the blocks used at least ``storage_write_threshold`` times;
  under it and ``write_back`` the core holds CPU-tier victims that storage
  lacks (``write_back``: all, selective: those reused) instead of dropping
  them, and the planner stores them from their host blocks
  (``flush_writebacks``); landed, they are evicted as clean copies.

Every call happens under the manager's lock, on the caller's thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvcached.config import CacheConfig
from kvcached.core.request import RunningRequest
from kvcached.core.stats import Counters
from kvcached.errors import TransferFailed, WorkerLost
from kvcached.tasks import Task, TaskHandle, TaskResult
from kvcached.transfer.base import Transfer
from kvcached.types import HitInfo

logger = logging.getLogger(__name__)

GPU, CPU = 0, 1  # the core's pool numbers
EVICT_DONE, EVICT_FLUSH, EVICT_EMPTY = 0, 1, 2  # Core.evict's statuses
# Which CPU-tier victims the core holds for write-back (ops.c wants_write_back),
# per storage_write_policy: write_through wrote every block at commit already.
WRITE_BACK_MODE = {"write_through": 0, "write_through_selective": 1, "write_back": 2}


def task_error(res: TaskResult, kind: str) -> TransferFailed:
    cls = WorkerLost if res.lost else TransferFailed
    return cls(f"{kind} task {res.task_id} failed: {res.error}")


@dataclass(slots=True)
class Pending:
    """A fetch or store in flight: which request (None for a store), where its
    nodes start in the request's path, the nodes, and the task's handle."""

    kind: str  # "swap_in", "load", "store" (staged from GPU blocks) or "store_host"
    req: RunningRequest | None
    start: int
    nodes: list[int]
    handle: TaskHandle


class Planner:
    """Executes the core's plans through a Transfer (see the module docstring)."""

    def __init__(self, core, cfg: CacheConfig, counters: Counters) -> None:
        self.core = core
        self.cfg = cfg
        self.counters = counters
        self.transfer: Transfer | None = None
        self.pending: dict[int, Pending] = {}  # task id -> fetch or store in flight
        self.cpu_enabled = cfg.num_cpu_blocks > 0
        self.paused = False
        # ids of requests hashed under a former weight version (running when
        # update_weights switched): none of their blocks goes to storage, whose
        # namespace is the new version's, where no lookup would find them (and
        # some of them were computed with the new weights). The manager keeps
        # each such request alive while its id is here.
        self.stale: set[int] = set()
        self.set_cfg(cfg)

    def set_cfg(self, cfg: CacheConfig) -> None:
        """Take a new config (storage attached or detached: the write-back mode follows)."""
        self.cfg = cfg
        policy = cfg.storage_write_policy if cfg.storage_backend else "write_through"
        self.core.set_write_back(WRITE_BACK_MODE[policy])

    # -------------------------------------------------------------- tasks
    def submit(self, task: Task) -> TaskHandle:
        h = self.transfer.submit(task)
        self.counters.task_submitted(task)
        return h

    def await_all(self, handles: list[TaskHandle], timeout: float) -> list[TaskResult]:
        deadline = time.monotonic() + timeout
        for h in handles:
            if not h.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{h.task.kind} task {h.task.task_id} did not finish "
                                   f"within {timeout:.1f}s")
        return [h.result for h in handles]

    def reap(self) -> None:
        """Apply the completions the transfer queued (swap-outs are waited for inline)."""
        q = self.transfer.completed if self.transfer else ()
        while q:
            h = q.popleft()
            self.counters.task_done(h.task, h.result)
            p = self.pending.pop(h.task.task_id, None)
            if p is None:
                continue  # swap-outs and lookups are handled where they are waited for
            if p.kind.startswith("store"):
                self._finish_store(p, h.result)
            else:
                self._finish_fetch(p, h.result)
        if self.cpu_enabled and not self.pending and not self.transfer.healthy:
            self.disable_cpu_tier()

    def wait_background(self, timeout_s: float) -> bool:
        """Wait for every task in flight and apply it; False if there was none."""
        handles = [p.handle for p in self.pending.values()]
        if handles:
            self.await_all(handles, timeout_s)
            self.reap()
        return bool(handles)

    def disable_cpu_tier(self) -> None:
        """The workers are gone for good: forget every CPU copy, serve GPU-only."""
        used = self.core.cpu_blocks - self.core.cpu_free
        self.core.drop_cpu_tier()
        self.cpu_enabled = False
        logger.error("transfer workers cannot be restarted: CPU tier switched off "
                     "(%d blocks dropped); serving GPU-only", used)

    # ----------------------------------------------------------- eviction
    def make_room(self, need: int) -> None:
        """Evict GPU leaves until ``need`` GPU blocks are free (the caller
        checked that enough are idle)."""
        if need <= self.core.gpu_free:
            return
        # Swap-outs are waited for; while paused they would only wait for resume.
        swap = self.cpu_enabled and self.transfer.healthy and not self.paused
        try:
            self._evict_gpu(need - self.core.gpu_free, swap)
        except TransferFailed as e:
            # The victims were rolled back onto the GPU: drop them instead.
            logger.warning("swap_out failed (%s); evicting by dropping instead", e)
            self._evict_gpu(need - self.core.gpu_free, swap=False)

    def _evict_gpu(self, count: int, swap: bool) -> None:
        freed = 0
        while True:
            status, freed = self.core.evict(count, swap, freed)
            if status == EVICT_FLUSH:  # land the batch: its victims become CPU leaves
                self._swap_out()
                # CPU victims held for write-back: their blocks are free once stored.
                self.flush_writebacks(wait=True)
            elif status == EVICT_EMPTY:
                # Idle blocks still being written through to storage: let them land.
                if not self.wait_background(self.cfg.task_timeout_s + 5.0):
                    raise AssertionError("GPU eviction found no leaf although blocks were idle")
            else:
                break
        if self.core.batch_size:
            self._swap_out()
        self.flush_writebacks()

    def _swap_out(self) -> None:
        """Copy the core's swap-out batch to host blocks and land it; its GPU
        blocks are reused only once the copy finished on every rank."""
        src, dst = self.core.batch_copies()
        if src:
            h = self.submit(Task("swap_out", src, dst))
            res = self.await_all([h], self.cfg.task_timeout_s + 5.0)[0]
            if not res.ok:
                self.core.rollback_swap_out()
                raise task_error(res, "swap_out")
        self.core.land_swap_out()

    # ------------------------------------------------------------ fetches
    def plan_fetches(self, req: RunningRequest, n_gpu: int, n_matched: int) -> tuple[int, int]:
        """Swap-ins of the CPU hits after the ``n_gpu`` GPU hits, then loads of
        what storage holds next; returns how many blocks of each."""
        n_swap = n_matched - n_gpu
        new = req.blocks[n_gpu:]
        if n_swap:
            gpu_ids = new[:n_swap]
            cpus = self.core.plan_swap_in(req.core, n_gpu, gpu_ids)
            nodes = req.core.path()[n_gpu:]
            self._track("swap_in", req, n_gpu, nodes, Task("swap_in", cpus, gpu_ids))
        if not self.cfg.storage_backend:
            return n_swap, 0
        limit = (req.num_tokens - 1) // self.cfg.block_size
        return n_swap, self._plan_load(req, n_matched, limit, new[n_swap:])

    def _track(self, kind: str, req: RunningRequest | None, start: int, nodes: list[int],
               task: Task) -> TaskHandle:
        h = self.submit(task)
        self.pending[h.task.task_id] = Pending(kind, req, start, nodes, h)
        if req is not None:
            req.alloc._handles.append(h)
        return h

    def storage_usable(self) -> bool:
        return bool(self.cfg.storage_backend) and self.cpu_enabled and not self.paused \
            and self.transfer.healthy

    def _plan_load(self, req: RunningRequest, start: int, limit: int,
                   gpu_ids: list[int]) -> int:
        """Look the blocks after the path up in storage and start loading the
        contiguous prefix every rank has; returns how many blocks load."""
        want = min(limit - start, len(gpu_ids))
        if want <= 0:
            return 0
        skipped = self.counters.storage  # why a read did not happen: `kvcached status`
        if not self.storage_usable():
            skipped["skip_paused_or_no_cpu_tier"] += 1
            return 0
        if want < self.cfg.storage_min_load_blocks:
            skipped["skip_below_min_load_blocks"] += 1
            return 0
        hashes = req.core.hashes(start, start + want)
        n = self.lookup(hashes)
        if n < max(1, self.cfg.storage_min_load_blocks):
            skipped["skip_not_in_storage"] += 1
            return 0
        nodes, cpus, got = self.core.plan_load(req.core, start, n, gpu_ids)
        self.flush_writebacks()
        if got < n:
            skipped["short_of_cpu_blocks"] += 1
        if not nodes:
            return 0
        args = {"keys": [h.hex() for h in hashes[:len(nodes)]],
                "device_ids": gpu_ids[:len(nodes)]}
        if self.cfg.storage_load_policy != "wait_complete":
            args["deadline_s"] = self.cfg.storage_load_timeout_s
        self._track("load", req, start, nodes, Task("load", [], cpus, args))
        return len(nodes)

    def lookup(self, hashes: list[bytes]) -> int:
        """Blocks of ``hashes`` (a prefix) that every rank has in storage; 0 on trouble."""
        h = self.submit(Task("lookup", [], [], {"keys": [x.hex() for x in hashes]}))
        if not h.wait(self.cfg.storage_load_timeout_s) or not h.result.ok:
            self.counters.storage["lookup_failed"] += 1
            return 0
        return int(h.result.result.get("prefix", 0))

    def _finish_fetch(self, p: Pending, res: TaskResult) -> None:
        """Land the fetched prefix; cut the request at the first block that did
        not arrive (it recomputes from there); roll back the rest."""
        ok = len(p.nodes) if res.ok else 0
        if res.ok and p.kind == "load":
            ok = min(ok, int(res.result.get("prefix", 0)))
        cut = self.core.finish_fetch(p.req.core, p.start, p.nodes, ok, p.kind == "load", res.ok)
        if cut >= 0:
            self._truncate(p.req, cut, p.kind, None if res.ok else task_error(res, p.kind))

    def _truncate(self, req: RunningRequest, first: int, kind: str,
                  error: Exception | None) -> None:
        """The allocation's side of a cut: fewer cached tokens, fewer hits."""
        bs = self.cfg.block_size
        a = req.alloc
        lost = a.num_cached_tokens - first * bs
        gpu = min(a.hit.gpu_tokens, first * bs)
        cpu = min(a.hit.cpu_tokens, first * bs - gpu)
        storage = first * bs - gpu - cpu
        for tier, before, after in (("cpu", a.hit.cpu_tokens, cpu),
                                    ("storage", a.hit.storage_tokens, storage)):
            self.counters.hit_tokens[tier] -= before - after
        a.hit = HitInfo(gpu, cpu, storage)
        a.num_cached_tokens = first * bs
        if error is not None and a.error is None:
            a.error = error
        logger.warning("%s for request %r %s; %d tokens will be recomputed", kind, req.rid,
                       f"failed: {error}" if error else "came back short", lost)

    # ------------------------------------------------------------ writes
    def writes_at_commit(self, new_blocks: int) -> bool:
        """Whether newly computed blocks go to storage now (write_through); under
        the other policies they are counted as writes the policy skipped."""
        if self.cfg.storage_write_policy == "write_through":
            return True
        self.counters.storage["write_skipped_policy"] += new_blocks
        return False

    def write_through(self, req: RunningRequest, start: int) -> None:
        """Stage the request's new GPU blocks (path from ``start``) into host
        blocks and store them (one task)."""
        if not self.storage_usable() or self._skip_stale(req.core, req.core.n_path - start) \
                or not self.writes_at_commit(req.core.n_path - start):
            return
        self._store_staged(req.core, start, 0)

    def _skip_stale(self, creq, blocks: int) -> bool:
        """A request of a former weight version stores nothing (counted)."""
        if id(creq) not in self.stale:
            return False
        self.counters.storage["write_skipped_version"] += blocks
        return True

    def _store_staged(self, creq, start: int, min_uses: int) -> int:
        """Store the path's GPU blocks from ``start`` used ``min_uses`` times, staged
        through host blocks (one task); returns how many."""
        nodes, cpus, gpus, hashes = self.core.plan_store(creq, start, min_uses)
        self.flush_writebacks()  # taking host blocks may have held victims
        if nodes:
            self._track("store", None, 0, nodes,
                        Task("store", cpus, [], {"keys": [h.hex() for h in hashes],
                                                 "device_ids": gpus}))
        return len(nodes)

    def _store_host(self, creqs: list, min_uses: int) -> int:
        """Store the host copies of these requests' paths used ``min_uses`` times
        that storage lacks, straight from their host blocks (one task)."""
        nodes, cpus, keys = [], [], []
        for creq in creqs:
            if self._skip_stale(creq, 0):
                continue
            n, c, hashes = self.core.plan_store_host(creq, min_uses)
            nodes += n
            cpus += c
            keys += [h.hex() for h in hashes]
        if nodes:
            self._track("store_host", None, 0, nodes, Task("store", cpus, [], {"keys": keys}))
        return len(nodes)

    def store_engine_blocks(self, creqs: list, saved: int) -> None:
        """Write through the CPU copies of these requests' paths that storage lacks
        (an external GPU tier, which just saved ``saved`` blocks into the CPU tier)."""
        if self.writes_at_commit(saved):
            self._store_host(creqs, 0)

    def store_reused(self, creq) -> None:
        """write_through_selective, when a request lets go of its path: store its
        blocks used at least ``storage_write_threshold`` times that storage lacks
        (a reuse is what predicts the next one; most blocks are never reused)."""
        if self.cfg.storage_write_policy != "write_through_selective" or \
                not self.storage_usable() or self._skip_stale(creq, 0):
            return
        t = self.cfg.storage_write_threshold
        n = 0 if self.core.external else self._store_staged(creq, 0, t)
        self.counters.storage["write_selected"] += n + self._store_host([creq], t)

    def flush_writebacks(self, wait: bool = False) -> None:
        """Store the CPU-tier victims the core held for write-back (busy until the
        store lands; then the next eviction drops them as clean copies). With
        ``wait`` the store lands now: an eviction waits for their blocks."""
        nodes, cpus, hashes = self.core.take_writebacks()
        if not nodes:
            return
        if not self.storage_usable():  # not retried: evicted as if written
            self.core.finish_store(nodes, None, False)
            return
        self.counters.storage["write_back"] += len(nodes)
        h = self._track("store_host", None, 0, nodes,
                        Task("store", cpus, [], {"keys": [x.hex() for x in hashes]}))
        if wait:
            self.await_all([h], self.cfg.task_timeout_s + 5.0)
            self.reap()

    def _finish_store(self, p: Pending, res: TaskResult) -> None:
        stored = [bool(s) for s in res.result.get("stored", [])] if res.ok else []
        self.core.finish_store(p.nodes, stored if res.ok else None, p.kind == "store")
        n_stored = sum(stored[:len(p.nodes)])
        self.counters.storage["stored"] += n_stored
        self.counters.storage["store_failed"] += len(p.nodes) - n_stored
