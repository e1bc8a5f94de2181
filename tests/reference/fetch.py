"""The reference fetches (tests only), a part of the reference ``CacheManager``.

Moving cached blocks up to the GPU (swap-in, storage load) and down to
storage (write-through), as a part of ``CacheManager``.

Every move is a task; a node changes tier only when its task completed on
every rank. A failed or short fetch rolls its nodes back and hands their GPU
blocks to the request as private blocks to recompute into.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvcached.errors import TransferFailed, WorkerLost
from kvcached.tasks import Task, TaskResult
from kvcached.types import HitInfo
from reference.tree import CPU, GPU, STORAGE, SWAP_IN, Node

if TYPE_CHECKING:
    from reference.manager import _Request

logger = logging.getLogger(__name__)


def task_error(res: TaskResult, kind: str) -> TransferFailed:
    cls = WorkerLost if res.lost else TransferFailed
    return cls(f"{kind} task {res.task_id} failed: {res.error}")


class FetchMixin:
    """Swap-in / load / write-through; uses the manager's bookkeeping helpers."""

    # ------------------------------------------------------------- swap-in
    def _plan_swap_in(self, req: _Request, nodes: list[Node], gpu_ids: list[int]) -> None:
        """``_set(nd, SWAP_IN, gpu=g)`` per node, inlined: the nodes are a chain of
        CPU nodes this request references, so none is in an LRU, before or after,
        and only the first node's parent sees a new GPU child from outside."""
        events = self._events
        for nd, g in zip(nodes, gpu_ids):
            nd.state = SWAP_IN
            nd.gpu = g
            nd.parent.n_gpu_children += 1
            if events is not None:
                self._publish_change(nd, CPU, True)
        self._refresh(nodes[0].parent)
        h = self._submit(Task("swap_in", [nd.cpu for nd in nodes], gpu_ids))
        self._pending[h.task.task_id] = ("swap_in", req, nodes, h)
        req.alloc._handles.append(h)

    # ---------------------------------------------------------------- load
    def _storage_usable(self) -> bool:
        return bool(self.cfg.storage_backend) and self.cpu_enabled and not self._paused \
            and self._transfer.healthy

    def _plan_load(self, req: _Request, parent: Node, start: int, limit: int,
                   gpu_ids: list[int]) -> list[Node]:
        """Look the blocks after ``parent`` up in storage and start loading the
        contiguous prefix every rank has; returns the nodes being loaded."""
        want = min(limit - start, len(gpu_ids))
        if want <= 0 or not self.cfg.storage_backend:
            return []
        # Why a read did not happen is counted: `kvcached status` shows it.
        skipped = self._counters.storage
        if not self._storage_usable():
            skipped["skip_paused_or_no_cpu_tier"] += 1
            return []
        if want < self.cfg.storage_min_load_blocks:
            skipped["skip_below_min_load_blocks"] += 1
            return []
        hashes = req.hashes[start:start + want]
        n = self._lookup(hashes)
        if n < max(1, self.cfg.storage_min_load_blocks):
            skipped["skip_not_in_storage"] += 1
            return []
        cpus = self._take_cpu_blocks(n)
        if len(cpus) < n:
            skipped["short_of_cpu_blocks"] += 1
        nodes = self._storage_nodes(req, parent, start, len(cpus))
        if len(cpus) > len(nodes):
            self.cpu_pool.free(cpus[len(nodes):], front=True)
        if not nodes:
            return []
        for nd, g, c in zip(nodes, gpu_ids, cpus):
            nd.in_storage = True
            nd.ref += 1
            self._set(nd, SWAP_IN, gpu=g, cpu=c)
        args = {"keys": [nd.hash.hex() for nd in nodes], "device_ids": gpu_ids[:len(nodes)]}
        if self.cfg.storage_load_policy != "wait_complete":
            args["deadline_s"] = self.cfg.storage_load_timeout_s
        h = self._submit(Task("load", [], [nd.cpu for nd in nodes], args))
        self._pending[h.task.task_id] = ("load", req, nodes, h)
        req.alloc._handles.append(h)
        return nodes

    def _lookup(self, hashes: list[bytes]) -> int:
        """Blocks of ``hashes`` (a prefix) that every rank has in storage; 0 on trouble."""
        h = self._submit(Task("lookup", [], [], {"keys": [x.hex() for x in hashes]}))
        if not h.wait(self.cfg.storage_load_timeout_s) or not h.result.ok:
            self._counters.storage["lookup_failed"] += 1
            return 0
        return int(h.result.result.get("prefix", 0))

    def _take_cpu_blocks(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            c = self._take_cpu_block()
            if c is None:
                break
            out.append(c)
        return out

    def _storage_nodes(self, req: _Request, parent: Node, start: int, n: int) -> list[Node]:
        """Existing STORAGE nodes or new ones for ``req``'s blocks ``start..start+n-1``
        under ``parent``; stops at a busy node."""
        out, node = [], parent
        for i in range(start, start + n):
            h = req.hashes[i]
            child = node.child(h)
            if child is None:
                child = self.tree.add_child(node, h, *req.memo_entry(i))
            elif child.state is not STORAGE:
                break  # another request is fetching it: stop here
            out.append(child)
            node = child
        return out

    # ---------------------------------------------------------- completion
    def _finish_fetch(self, kind: str, req: _Request, nodes: list[Node],
                      res: TaskResult) -> None:
        """Land the fetched prefix; roll back the rest (see module docstring)."""
        alive = set(req.nodes)
        ok = len(nodes) if res.ok else 0
        if res.ok and kind == "load":
            ok = min(ok, int(res.result.get("prefix", 0)))
        ok = next((i for i, nd in enumerate(nodes[:ok]) if nd not in alive), ok)
        self._land_fetch(nodes[:ok])
        if ok == len(nodes):
            return
        failed = nodes[ok:]
        if failed[0] in alive:
            self._truncate(req, req.nodes.index(failed[0]), kind,
                           task_error(res, kind) if not res.ok else None)
        self._roll_back(kind, failed, missing=res.ok)

    def _land_fetch(self, nodes: list[Node]) -> None:
        """SWAP_IN -> GPU for nodes the request still references (``_set`` inlined:
        no parent counter changes, no GPU LRU); the host copy stays as a backup."""
        events, refresh = self._events, self._refresh
        for nd in nodes:
            nd.state = GPU
            if events is not None:
                self._publish_change(nd, SWAP_IN, True)
            if not (nd.n_cpu_children or nd.busy):
                refresh(nd)  # the backup may be a CPU leaf now

    def _roll_back(self, kind: str, nodes: list[Node], missing: bool) -> None:
        """Undo unfinished fetches; their GPU blocks already belong to the request."""
        if kind == "swap_in":
            for nd in reversed(nodes):
                self._set(nd, CPU, gpu=-1)
            return
        cpus = [nd.cpu for nd in nodes]
        for nd in reversed(nodes):
            self._set(nd, STORAGE, gpu=-1, cpu=-1)
        self.cpu_pool.free(cpus)
        if missing:  # the object is gone or bad: storage no longer has this prefix
            for nd in nodes:
                nd.in_storage = False
            if nodes[0].ref == 0:
                self._remove(nodes[0])

    def _truncate(self, req: _Request, first: int, kind: str,
                  error: Exception | None) -> None:
        """Cut the request's cached prefix at ``first``: from there on it recomputes."""
        bs = self.block_size
        cut = req.nodes[first:]
        del req.nodes[first:]
        for nd in reversed(cut):
            if nd.state is GPU:  # fetched fine but after the gap: its block is ours now
                self._set(nd, CPU if nd.cpu >= 0 else STORAGE, gpu=-1)
            self._unref(nd)
        a = req.alloc
        lost = a.num_cached_tokens - first * bs
        gpu = min(a.hit.gpu_tokens, first * bs)
        cpu = min(a.hit.cpu_tokens, first * bs - gpu)
        storage = first * bs - gpu - cpu
        for tier, before, after in (("cpu", a.hit.cpu_tokens, cpu),
                                    ("storage", a.hit.storage_tokens, storage)):
            self._counters.hit_tokens[tier] -= before - after
        a.hit = HitInfo(gpu, cpu, storage)
        a.num_cached_tokens = first * bs
        if error is not None and a.error is None:
            a.error = error
        logger.warning("%s for request %r %s; %d tokens will be recomputed", kind, req.rid,
                       f"failed: {error}" if error else "came back short", lost)

    # ------------------------------------------------------- write-through
    def _write_through(self, nodes: list[Node]) -> None:
        """Stage new GPU blocks into host blocks and store them (one task)."""
        if not self._storage_usable():
            return
        todo = [n for n in nodes if n.state is GPU and n.cpu < 0 and n.busy == 0
                and not n.in_storage]
        cpus = self._take_cpu_blocks(len(todo))
        todo = todo[:len(cpus)]
        if not todo:
            return
        for n, c in zip(todo, cpus):
            n.busy += 1  # neither tier may evict it while the task reads it
            self._set(n, GPU, cpu=c)
        h = self._submit(Task("store", cpus, [], {"keys": [n.hash.hex() for n in todo],
                                                  "device_ids": [n.gpu for n in todo]}))
        self._pending[h.task.task_id] = ("store", None, todo, h)

    def _finish_store(self, nodes: list[Node], res: TaskResult) -> None:
        stored = res.result.get("stored", []) if res.ok else []
        for i, n in enumerate(nodes):
            n.busy -= 1
            if res.ok:
                n.in_storage = bool(i < len(stored) and stored[i])
                if n.in_storage and self._events is not None:
                    self._events.publish("stored", "storage", [n.hash])
            else:  # the staging copy may be torn: do not keep it as a backup
                cpu = n.cpu
                self._set(n, n.state, cpu=-1)
                self.cpu_pool.free([cpu])
            self._refresh(n)
        self._counters.storage["stored"] += sum(stored)
        self._counters.storage["store_failed"] += len(nodes) - sum(stored)
