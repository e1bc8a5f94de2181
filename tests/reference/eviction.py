"""The reference eviction and node bookkeeping (tests only), a part of the
reference ``CacheManager``.

GPU eviction takes least recently used GPU leaves: a leaf with a CPU backup
just drops its GPU copy; otherwise, with a CPU tier, it is swapped out
(synchronously: its GPU block is reused only after the copy finished on every
rank); without one, or when the copy fails, it is dropped. CPU eviction drops
least recently used CPU leaves; a node whose last copy goes leaves the tree
unless storage still holds it.

``_set`` / ``_ref`` / ``_unref`` are the only places that change a node's
state, copies or references: they keep the parent counters, the idle count and
the LRU sets exact, which ``check_invariants`` verifies from scratch.
"""

from __future__ import annotations

import logging

from kvcached.errors import TransferFailed
from kvcached.tasks import Task
from reference.fetch import task_error
from reference.tree import CPU, GPU, STORAGE, SWAP_IN, SWAP_OUT, Node, Tier

logger = logging.getLogger(__name__)


class EvictionMixin:
    """Eviction across tiers and the bookkeeping every transition goes through."""

    # ------------------------------------------------------------- eviction
    def _make_room(self, need: int) -> None:
        deficit = need - self.gpu_pool.num_free
        if deficit <= 0:
            return
        # Swap-outs are waited for; while paused they would only wait for resume.
        swap = self.cpu_enabled and self._transfer.healthy and not self._paused
        try:
            self._evict_gpu(deficit, swap)
        except TransferFailed as e:
            # The victims were rolled back onto the GPU: drop them instead, so
            # a broken CPU tier costs hits, never the ability to serve.
            logger.warning("swap_out failed (%s); evicting by dropping instead", e)
            self._evict_gpu(need - self.gpu_pool.num_free, swap=False)

    def _evict_gpu(self, count: int, swap: bool) -> None:
        """Free ``count`` GPU blocks from LRU leaves (the caller checked they exist).

        Victims leave in one swap_out batch; a victim that already has a CPU
        backup joins the batch without a copy, so that a failed batch rolls
        every victim back together (a parent never leaves the GPU before its
        child has).
        """
        batch: list[Node] = []
        copies: list[Node] = []
        freed = 0
        lru = self.tree.gpu_lru
        leaf = None  # the last victim's parent when it became a GPU leaf, not yet listed
        while freed < count:
            node, leaf = lru.push_pop(leaf), None
            if node is None:
                # Idle blocks still being written through to storage: let them land.
                if self._wait_background(self.cfg.task_timeout_s + 5.0):
                    continue
                raise AssertionError("GPU eviction found no leaf although blocks were idle")
            cpu = None  # a victim with a backup needs no copy: it holds the bytes
            if node.cpu < 0:
                cpu = self._take_cpu_block() if swap else None
                if cpu is None and batch:
                    # The CPU leaves may be this batch's own victims: land them
                    # first so they become evictable, then retry this node.
                    self._refresh(node)
                    self._swap_out(batch, copies)
                    batch, copies = [], []
                    continue
                if cpu is None:
                    leaf = self._drop_gpu_leaf(node)
                    freed += 1
                    continue
                copies.append(node)
            leaf = self._begin_swap_out(node, cpu)
            batch.append(node)
            freed += 1
        if leaf is not None:
            lru.add(leaf)
        if batch:
            self._swap_out(batch, copies)

    def _swap_out(self, batch: list[Node], copies: list[Node]) -> None:
        """Move ``batch`` to the CPU tier, copying ``copies``; their GPU blocks are
        reused only once the copy finished on every rank."""
        if copies:
            h = self._submit(Task("swap_out", [n.gpu for n in copies], [n.cpu for n in copies]))
            res = self._await([h], self.cfg.task_timeout_s + 5.0)[0]
            if not res.ok:
                self._rollback_swap_out(batch, copies)
                raise task_error(res, "swap_out")
        self._land_swap_out(batch)
        self._counters.evictions["gpu_to_cpu"] += len(copies)
        if len(batch) > len(copies):
            self._counters.evictions["gpu_to_cpu_backup"] += len(batch) - len(copies)

    def _begin_swap_out(self, node: Node, cpu: int | None) -> Node | None:
        """``_set(node, SWAP_OUT, cpu=cpu)`` for a leaf just popped off the GPU LRU
        (state GPU, unreferenced, no GPU child): the eviction hot path, with
        ``_refresh`` of the parent reduced to what can change. ``cpu`` is the
        new host block, or None when a backup already holds the bytes.

        Returns the parent when it just became a GPU leaf: the caller lists it
        (``LeafLRU.push_pop`` when it evicts on, else ``add``)."""
        if node.gpu_key is not None:  # re-listed when taking its host block dropped a CPU child
            self.tree.gpu_lru.discard(node)
        if cpu is None:
            if node.cpu_key is not None:
                self.tree.cpu_lru.discard(node)  # a backup in flight is not evictable
        else:
            node.cpu = cpu
        node.state = SWAP_OUT
        self._n_gpu_idle -= 1
        if self._events is not None:
            self._publish_change(node, GPU, cpu is None)
        parent = node.parent  # holds a GPU block: GPU is prefix-closed
        parent.n_gpu_children -= 1  # a SWAP_OUT child no longer keeps it on GPU
        if cpu is not None:
            parent.n_cpu_children += 1
            if parent.cpu_key is not None:
                self.tree.cpu_lru.discard(parent)  # no longer a CPU leaf
        return parent if _new_gpu_leaf(parent) else None

    def _land_swap_out(self, batch: list[Node]) -> None:
        """Every rank holds ``batch`` in host blocks: SWAP_OUT -> CPU, GPU blocks freed
        (``_release_gpu(n, CPU)`` per node, with the LRU test inlined)."""
        cpu_lru, events = self.tree.cpu_lru, self._events
        free_one = self.gpu_pool.free_one
        for n in batch:
            free_one(n.gpu)
            n.gpu = -1
            n.state = CPU
            if not (n.n_cpu_children or n.busy or n.ref or n.n_gpu_children):
                cpu_lru.add(n)  # a CPU leaf now
            if events is not None:
                self._publish_change(n, SWAP_OUT, True)

    def _rollback_swap_out(self, batch: list[Node], copies: list[Node]) -> None:
        cpus = [n.cpu for n in copies]
        copied = set(copies)
        for n in reversed(batch):  # the blocks stay on GPU; new CPU blocks go back
            self._set(n, GPU, cpu=-1 if n in copied else None)
        self.cpu_pool.free(cpus, front=True)

    def _take_cpu_block(self) -> int | None:
        if self.cpu_pool.num_free == 0:
            node = self.tree.cpu_lru.pop()
            if node is None:
                return None
            if node.state is CPU:
                self._drop_cpu_leaf(node)
            else:
                self._drop_cpu(node)  # a GPU node's backup
        return self.cpu_pool.allocate_one()

    def _release_gpu(self, node: Node, state: Tier) -> None:
        gpu = node.gpu
        self._set(node, state, gpu=-1)
        self.gpu_pool.free_one(gpu)

    def _drop_gpu(self, node: Node) -> None:
        """Forget the GPU copy; the node survives only if storage still has it."""
        self._release_gpu(node, STORAGE)
        self._counters.evictions["gpu_dropped"] += 1
        if not node.in_storage:
            self._remove(node)
        elif node.n_cpu_children:
            self._drop_cpu_below(node)

    def _drop_gpu_leaf(self, node: Node) -> Node | None:
        """``_drop_gpu`` for a leaf just popped off the GPU LRU, with no CPU copy
        (the eviction hot path without a CPU tier). Returns the parent when it
        just became a GPU leaf, as ``_begin_swap_out`` does."""
        if node.gpu_key is not None:  # re-listed meanwhile (see _begin_swap_out)
            self.tree.gpu_lru.discard(node)
        self.gpu_pool.free_one(node.gpu)
        node.gpu = -1
        node.state = STORAGE
        self._n_gpu_idle -= 1
        if self._events is not None:
            self._publish_change(node, GPU, False)
        self._counters.evictions["gpu_dropped"] += 1
        parent = node.parent
        parent.n_gpu_children -= 1
        if not node.in_storage:
            if node.n_children:
                self._remove(node)
            else:  # tree.remove for a leaf in no LRU (no CPU copy: never in the CPU one)
                parent.unlink_child(node.hash)
                self.tree.num_nodes -= 1
        elif node.n_cpu_children:
            self._drop_cpu_below(node)
        return parent if _new_gpu_leaf(parent) else None

    def _drop_cpu_below(self, node: Node) -> None:
        """``node`` just lost its last local copy but stays for storage: the CPU
        copies below it are unreachable now (a match stops at a STORAGE node),
        so they go too, deepest first (a parent after its children)."""
        below = [n for n in _subtree(node) if n is not node and n.cpu >= 0]
        for n in sorted(below, key=deepest_first):
            self._drop_cpu(n)

    def _remove(self, node: Node) -> None:
        """Unlink a node that holds no copy; CPU copies below it (unreachable
        without it) are dropped with it."""
        if not node.n_children:  # the common case: a leaf
            self.tree.remove(node)
            return
        cpus = []
        for n in sorted(_subtree(node), key=deepest_first):
            if n.cpu >= 0:
                cpus.append(n.cpu)
                n.cpu = -1
                self._counters.evictions["cpu_dropped"] += 1
        self.tree.remove(node)
        if cpus:
            self.cpu_pool.free(cpus)

    def _drop_cpu(self, node: Node) -> None:
        cpu = node.cpu
        if node.state is GPU:
            self._set(node, GPU, cpu=-1)  # only a backup goes
        else:
            self._set(node, STORAGE, cpu=-1)
            if not node.in_storage:
                self._remove(node)
        self.cpu_pool.free([cpu])
        self._counters.evictions["cpu_dropped"] += 1

    def _drop_cpu_leaf(self, node: Node) -> None:
        """``_drop_cpu`` for a CPU-only leaf just popped off the CPU LRU (state
        CPU, unreferenced, no child holding a block, in no LRU now): the CPU
        eviction hot path, with ``_set`` reduced to what can change. Only the
        parent's CPU-leaf status can: it lost a CPU child, not a GPU one."""
        cpu = node.cpu
        node.cpu = -1
        node.state = STORAGE
        if self._events is not None:
            self._publish_change(node, CPU, True)
        parent = node.parent
        parent.n_cpu_children -= 1
        if not parent.n_cpu_children and parent.cpu >= 0:
            self._refresh(parent)  # a CPU leaf now, unless held
        if not node.in_storage:
            self._remove(node)
        self.cpu_pool.free_one(cpu)
        self._counters.evictions["cpu_dropped"] += 1

    def _disable_cpu_tier(self) -> None:
        """The workers are gone for good: forget every CPU copy, serve GPU-only."""
        used = self.cpu_pool.num_used
        self._drop_cpu_tier()  # deepest first: a parent goes after its children
        self.cpu_enabled = False
        logger.error("transfer workers cannot be restarted: CPU tier switched off "
                     "(%d blocks dropped); serving GPU-only", used)

    def _drop_gpu_tier(self) -> None:
        """Forget every GPU copy (the planes may be freed while asleep)."""
        for n in sorted((n for n in self.tree.walk() if n.state is GPU), key=deepest_first):
            if n.cpu >= 0:
                self._release_gpu(n, CPU)
            else:
                self._drop_gpu(n)

    def _drop_cpu_tier(self) -> None:
        for n in sorted((n for n in self.tree.walk() if n.cpu >= 0), key=deepest_first):
            if n.cpu >= 0:
                self._drop_cpu(n)

    # ------------------------------------------------------ node bookkeeping
    def _set(self, node: Node, state: Tier, gpu: int | None = None,
             cpu: int | None = None) -> None:
        """Change a node's state/copies and keep counters and LRU sets exact."""
        old_state = node.state
        old_g = node.state is GPU or node.state is SWAP_IN
        old_c = node.cpu >= 0
        old_idle = node.state is GPU and node.ref == 0
        node.state = state
        if gpu is not None:
            node.gpu = gpu
        if cpu is not None:
            node.cpu = cpu
        new_g = state is GPU or state is SWAP_IN
        new_c = node.cpu >= 0
        if self._events is not None:
            self._publish_change(node, old_state, old_c)
        self._n_gpu_idle += (state is GPU and node.ref == 0) - old_idle
        parent = node.parent
        if new_g != old_g or new_c != old_c:
            parent.n_gpu_children += new_g - old_g
            parent.n_cpu_children += new_c - old_c
            self._refresh(parent)
        self._refresh(node)

    def _publish_change(self, node: Node, old_state: Tier, old_cpu: bool) -> None:
        """KV events: a block became usable in, or left, the GPU or CPU tier."""
        usable_cpu = (GPU, CPU)
        was_g, is_g = old_state is GPU, node.state is GPU
        was_c = old_cpu and old_state in usable_cpu
        is_c = node.cpu >= 0 and node.state in usable_cpu
        for tier, was, now in (("gpu", was_g, is_g), ("cpu", was_c, is_c)):
            if was != now:
                self._events.publish("stored" if now else "removed", tier, [node.hash])

    def _ref(self, node: Node) -> None:
        node.ref += 1
        if node.ref == 1:  # referenced nodes leave the GPU LRU (and a CPU-only one the CPU LRU)
            if node.state is GPU:
                self._n_gpu_idle -= 1
                self.tree.gpu_lru.discard(node)
            elif node.state is CPU:
                self.tree.cpu_lru.discard(node)

    def _unref(self, node: Node) -> None:
        node.ref -= 1
        node.last_access = self._clock
        if node.ref == 0:
            if node.state is GPU:
                self._n_gpu_idle += 1
            self._refresh(node)
        elif node.cpu >= 0:  # still referenced: only a backup's LRU key moves
            self._refresh(node)

    def _unref_path(self, nodes: list[Node]) -> None:
        """``_unref`` over a path, deepest first (the per-block hot loop of free;
        ``unref_path``: in C for native nodes)."""
        idle, changed = _UNREF_PATH(nodes, self._clock, GPU)
        refresh = self._refresh
        for n in changed:
            refresh(n)
        self._n_gpu_idle += idle

    def _refresh(self, n: Node) -> None:
        """Put ``n`` in exactly the LRU sets it is evictable from (hot: predicates
        and discards inlined; see ``gpu_evictable`` / ``cpu_evictable``)."""
        if n.parent is None:
            return  # the root is never evicted
        tree = self.tree
        state = n.state
        if state is GPU and not (n.ref or n.n_gpu_children or n.busy):
            tree.gpu_lru.add(n)
        elif n.gpu_key is not None:
            n.gpu_key = None
            tree.gpu_lru.size -= 1
        if n.cpu >= 0 and not (n.n_cpu_children or n.busy) and (
                state is GPU
                or (state is CPU and not (n.ref or n.n_gpu_children))):
            tree.cpu_lru.add(n)
        elif n.cpu_key is not None:
            n.cpu_key = None
            tree.cpu_lru.size -= 1


def unref_path_py(nodes: list[Node], clock: int, GPU: Tier) -> tuple[int, list[Node]]:
    """``EvictionMixin._unref_path``'s loop in Python: the reference, and what runs
    for PyNode (``tree.native_unref_path`` is the same in C). Deepest first,
    ``ref -= 1`` and ``last_access = clock`` on each node; returns how many GPU
    nodes became unreferenced, and the nodes whose LRU membership may change
    (for ``_refresh``, which reads only the node's own fields, so it may run
    after the loop), deepest first."""
    idle = 0
    changed = []
    for n in reversed(nodes):
        n.ref -= 1
        n.last_access = clock
        if n.ref:
            if n.cpu < 0 or n.n_cpu_children or n.busy:
                continue  # still held, and no backup in the CPU LRU to re-key
        else:
            if n.state is GPU:
                idle += 1
            if n.n_gpu_children and (n.cpu < 0 or n.n_cpu_children):
                continue  # an inner node: in no LRU, before or after
        changed.append(n)
    return idle, changed


_UNREF_PATH = unref_path_py


def _new_gpu_leaf(parent: Node) -> bool:
    """Whether ``parent``, which just lost a GPU child, is now an evictable GPU
    leaf (``gpu_evictable``, knowing it holds a GPU block; never the root)."""
    return not (parent.n_gpu_children or parent.ref or parent.busy) \
        and parent.state is GPU and parent.parent is not None


def deepest_first(n: Node) -> tuple[int, bytes]:
    """The order whole-subtree and whole-tier drops take nodes in: deepest first
    (a parent after its children), then by hash (any fixed order of the
    same-depth nodes would do; the native core uses this one)."""
    return -n.depth, n.hash


def _subtree(node: Node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.child_nodes())


def gpu_evictable(n: Node) -> bool:
    """An unreferenced GPU node with no child on GPU."""
    return n.state is GPU and n.ref == 0 and n.n_gpu_children == 0 and n.busy == 0


def cpu_evictable(n: Node) -> bool:
    """A CPU copy that no CPU child depends on; a backup of a GPU node always qualifies."""
    if n.cpu < 0 or n.n_cpu_children or n.busy:
        return False
    if n.state is GPU:
        return True
    return n.state is CPU and n.ref == 0 and n.n_gpu_children == 0
