"""A model of the cache manager's observable state machine (tests only).

The differential tests (tests/core/test_core_differential.py,
tests/core/test_manager_property.py) drive the real ``CacheManager`` and
this model with the same calls and compare their states after every call
(``reference.compare``). The model is written from the manager's contract,
as plain data and explicit transitions: one thread, no I/O, no locks.

What is modelled
  - The prefix tree: one ``Node`` per cached block, keyed by its chained hash,
    in one of five states (GPU, SWAP_OUT, CPU, SWAP_IN, STORAGE) with the
    block ids it holds, its references, last access, storage flag and
    write-through count (``busy``).
  - Both tiers' free lists, in allocation order (oldest freed id first; an
    undone allocation goes back to the front).
  - Both tiers' evictable leaves, in eviction order: least recently used
    first, a deeper node before a shallower one, then first listed first.
  - The public calls: allocate (match, make room, plan swap-ins and storage
    loads), extend, commit (insert, dedup, write-through), free, pause,
    resume, sleep, wakeup, update_weights, and the counters ``stats`` shows.
  - Transfers: a task's outcome is fixed when it is submitted (it fails if
    its kind is in ``fail_kinds``, with ``lost`` choosing WorkerLost); a
    swap-out and a storage lookup are waited for at once, fetches and stores
    land in submission order at the next ``reap`` (every public call and
    ``Allocation.wait`` reap first, as the manager does with its transfer's
    completion queue).
  - Storage: a set of block hashes per weight version; a store adds its
    blocks to the current version's set when it is submitted, a lookup or
    load finds the leading blocks that set holds. ``update_weights`` lands
    what is in flight first; a request that runs across it (hashed under
    the old version, computed with both) stores nothing more.

What is not
  - Eviction policies other than LRU (tests/reference/policy.py models the
    adaptive one), storage write policies other than ``write_through``, an
    external GPU tier (connectors), KV events, the hash memo, attaching or
    detaching storage at run time, a transfer that becomes unhealthy,
    timeouts, and anything about bytes: no KV is copied.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvcached.config import CacheConfig
from kvcached.errors import NoFreeBlocks, TransferFailed, WorkerLost
from reference.hashing import block_hashes, namespace_hash

# Node states, numbered as kvcached.core.snapshot.Tier numbers them.
GPU, SWAP_OUT, CPU, SWAP_IN, STORAGE = range(5)
ON_GPU = (GPU, SWAP_IN)  # a child in these states keeps its parent on the GPU


@dataclass(eq=False)
class Node:
    """One cached block: its chained hash names it (and its whole prefix)."""

    hash: bytes
    parent: Node | None = field(repr=False)
    depth: int
    state: int = STORAGE
    gpu: int = -1
    cpu: int = -1
    in_storage: bool = False
    ref: int = 0
    last_access: int = 0
    busy: int = 0
    children: dict[bytes, Node] = field(default_factory=dict, repr=False)

    def has_gpu_child(self) -> bool:
        return any(c.state in ON_GPU for c in self.children.values())

    def has_cpu_child(self) -> bool:
        return any(c.cpu >= 0 for c in self.children.values())

    def subtree(self) -> list[Node]:
        out, stack = [], [self]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


def deepest_first(n: Node) -> tuple[int, bytes]:
    """The order whole subtrees and tiers are dropped in: children before their
    parent; same-depth nodes by hash."""
    return -n.depth, n.hash


def gpu_evictable(n: Node) -> bool:
    """An unused GPU copy that no GPU copy below depends on."""
    return n.state == GPU and n.ref == 0 and not n.busy and not n.has_gpu_child()


def cpu_evictable(n: Node) -> bool:
    """A CPU copy that no CPU copy below depends on: any GPU node's backup, or an
    unused CPU-only node."""
    if n.cpu < 0 or n.busy or n.has_cpu_child():
        return False
    return n.state == GPU or (n.state == CPU and n.ref == 0 and not n.has_gpu_child())


class FreeList:
    """A tier's free block ids: allocation takes the oldest freed id first."""

    def __init__(self, n: int) -> None:
        self.ids = deque(range(n))
        self.total = n

    def take(self, n: int) -> list[int]:
        assert n <= len(self.ids)
        return [self.ids.popleft() for _ in range(n)]

    def give(self, ids: Sequence[int]) -> None:
        assert not set(ids) & set(self.ids), f"double free of {ids}"
        self.ids.extend(ids)

    def undo_take(self, ids: Sequence[int]) -> None:
        """Put ids just taken back at the front, in their order."""
        self.ids.extendleft(reversed(ids))


class Leaves:
    """A tier's evictable nodes. A node is listed with the key
    (last access, -depth, listing number); it keeps its key while it stays
    listed and its last access does not change."""

    def __init__(self, evictable) -> None:
        self.evictable = evictable
        self.keys: dict[Node, tuple[int, int, int]] = {}
        self.listed = 0

    def update(self, n: Node) -> None:
        if n.parent is None or not self.evictable(n):
            self.keys.pop(n, None)
            return
        key = self.keys.get(n)
        if key is None or key[0] != n.last_access:
            self.listed += 1
            self.keys[n] = (n.last_access, -n.depth, self.listed)

    def forget(self, n: Node) -> None:
        self.keys.pop(n, None)

    def order(self) -> list[Node]:
        return sorted(self.keys, key=self.keys.get)

    def oldest(self) -> Node | None:
        return min(self.keys, key=self.keys.get, default=None)


@dataclass(eq=False)
class Request:
    """A running request: its block hashes, block table and the path it holds."""

    rid: Hashable
    hashes: list[bytes]
    num_tokens: int
    extra_key: object
    blocks: list[int] = field(default_factory=list)  # the block table
    path: list[Node] = field(default_factory=list)  # blocks[i] is path[i]'s, i < len(path)
    chain_open: bool = True  # False once a computed block's twin was in flight
    hit: tuple[int, int, int] = (0, 0, 0)  # tokens from GPU, CPU, storage
    cached_tokens: int = 0
    error: Exception | None = None
    ns: bytes = b""  # the namespace its hashes are made under: the root of its chain
    stale: bool = False  # it ran across update_weights: stores nothing more


@dataclass(eq=False)
class Task:
    """A fetch or store whose outcome is known, waiting to be reaped."""

    kind: str  # "swap_in", "load" or "store"
    req: Request | None
    nodes: list[Node]
    ok: bool
    lost: bool
    arrived: int = 0  # a load: how many leading blocks storage delivered


class Allocation:
    """What ``allocate`` returns: the block table, the cached tokens, the hit."""

    def __init__(self, model: Model, req: Request) -> None:
        self._model, self._req = model, req
        self.block_ids = req.blocks

    @property
    def num_cached_tokens(self) -> int:
        return self._req.cached_tokens

    @property
    def hit(self) -> tuple[int, int, int]:
        return self._req.hit

    def wait(self, timeout: float | None = None) -> None:
        self._model.reap()
        if self._req.error is not None:
            raise self._req.error


class Model:
    """The manager's state machine (see the module docstring)."""

    def __init__(self, cfg: CacheConfig) -> None:
        assert cfg.eviction_policy == "lru" and cfg.storage_write_policy == "write_through"
        self.cfg = cfg
        self.bs = cfg.block_size
        self.root = Node(b"", None, 0, state=GPU)  # holds every tier: never evicted
        self.nodes: dict[bytes, Node] = {}
        self.gpu_free = FreeList(cfg.num_gpu_blocks)
        self.cpu_free = FreeList(cfg.num_cpu_blocks)
        self.gpu_leaves = Leaves(gpu_evictable)
        self.cpu_leaves = Leaves(cpu_evictable)
        # Storage keeps each weight version's objects apart: a store goes to, and a
        # lookup or load reads, the namespace of the version current at the time.
        self.storage: dict[str, set[bytes]] = {}
        self.storage_on = bool(cfg.storage_backend)
        self.cpu_on = cfg.num_cpu_blocks > 0
        self.ns = namespace_hash(cfg.model_id, cfg.weight_version, cfg.salt)
        self.version = cfg.weight_version
        self.reqs: dict[Hashable, Request] = {}
        self.pending: list[Task] = []
        self.clock = 0
        self.paused = self.asleep = False
        self.fail_kinds: set[str] = set()  # tasks of these kinds fail...
        self.lost = False  # ...as a lost worker's (WorkerLost) or not
        self.counts: Counter[str] = Counter()  # requests, prompt_tokens, dedup_blocks, ...
        self.hit_tokens = dict.fromkeys(("gpu", "cpu", "storage"), 0)
        self.hit_requests = dict.fromkeys(("gpu", "cpu", "storage"), 0)
        self.evictions: Counter[str] = Counter()
        self.storage_counts: Counter[str] = Counter()

    def start(self) -> Model:
        return self

    def close(self) -> None:
        pass

    # --------------------------------------------------------- node changes
    def _changed(self, n: Node) -> None:
        """``n``'s state, copies or references changed: it and its parent (whose
        leaf status depends on its children) may enter or leave a leaf set."""
        for m in (n, n.parent):
            if m is not None and m.parent is not None:
                self.gpu_leaves.update(m)
                self.cpu_leaves.update(m)

    def _set(self, n: Node, state: int, gpu: int | None = None, cpu: int | None = None) -> None:
        n.state = state
        n.gpu = n.gpu if gpu is None else gpu
        n.cpu = n.cpu if cpu is None else cpu
        self._changed(n)

    def _add_node(self, parent: Node, h: bytes) -> Node:
        n = Node(h, parent, parent.depth + 1)
        parent.children[h] = n
        self.nodes[h] = n
        return n

    def _remove(self, n: Node) -> None:
        """Unlink ``n`` (it holds no copy) with its subtree; CPU copies below it are
        unreachable without it, so they are dropped."""
        below = sorted(n.subtree(), key=deepest_first)
        cpus = [m.cpu for m in below if m.cpu >= 0]
        self.evictions["cpu_dropped"] += len(cpus)
        for m in below:
            assert m.ref == 0 and m.gpu < 0, f"removing a live node {m}"
            del self.nodes[m.hash]
            self.gpu_leaves.forget(m)
            self.cpu_leaves.forget(m)
        del n.parent.children[n.hash]
        self._changed(n.parent)
        self.cpu_free.give(cpus)

    def _ref(self, n: Node) -> None:
        n.ref += 1
        self._changed(n)

    def _unref(self, n: Node) -> None:
        n.ref -= 1
        n.last_access = self.clock
        self._changed(n)

    # ------------------------------------------------------------ dropping
    def _drop_gpu_copy(self, n: Node) -> None:
        """``n`` (state GPU, no GPU child) loses its GPU block: it keeps its CPU
        backup, or lives on in storage only, or leaves the tree."""
        gpu = n.gpu
        if n.cpu >= 0:
            self._set(n, CPU, gpu=-1)
        else:
            self._set(n, STORAGE, gpu=-1)
            self.evictions["gpu_dropped"] += 1
        self.gpu_free.give([gpu])
        if n.state == STORAGE:
            self._after_last_copy(n)

    def _drop_cpu_copy(self, n: Node) -> None:
        """``n`` (no CPU child) loses its CPU block: a GPU node's backup just goes;
        a CPU-only node lives on in storage only, or leaves the tree."""
        cpu = n.cpu
        self._set(n, GPU if n.state == GPU else STORAGE, cpu=-1)
        if n.state == STORAGE and not n.in_storage:
            self._remove(n)
        self.cpu_free.give([cpu])
        self.evictions["cpu_dropped"] += 1

    def _after_last_copy(self, n: Node) -> None:
        """``n`` holds no block any more: it leaves the tree unless storage has it;
        if it stays, the CPU copies below it go (a match stops at it)."""
        if not n.in_storage:
            self._remove(n)
            return
        for m in sorted(n.subtree()[1:], key=deepest_first):
            if m.cpu >= 0:
                self._drop_cpu_copy(m)

    # ------------------------------------------------------------- eviction
    def _take_cpu_block(self) -> int | None:
        """A free CPU block, dropping the least recently used CPU copy if none is."""
        if not self.cpu_free.ids:
            victim = self.cpu_leaves.oldest()
            if victim is None:
                return None
            self._drop_cpu_copy(victim)
        return self.cpu_free.take(1)[0]

    def _make_room(self, need: int) -> None:
        """Evict GPU leaves until ``need`` GPU blocks are free (the caller checked
        that enough are idle). Evicted blocks move to the CPU tier where it can
        take them; if that copy fails they are dropped instead."""
        if need <= len(self.gpu_free.ids):
            return
        swap = self.cpu_on and not self.paused  # a swap-out while paused would wait
        try:
            self._evict_gpu(need - len(self.gpu_free.ids), swap)
        except TransferFailed:
            self._evict_gpu(need - len(self.gpu_free.ids), swap=False)

    def _evict_gpu(self, count: int, swap: bool) -> None:
        """Oldest GPU leaf first. A leaf with a CPU backup just becomes CPU; one
        without is copied to a new CPU block when swapping and one can be had,
        else dropped. Swapped-out leaves move together (one copy task) when no
        CPU block is left for the next one, and at the end."""
        batch: list[tuple[Node, bool]] = []  # (victim, copied)
        freed = 0
        while freed < count:
            n = self.gpu_leaves.oldest()
            if n is None:
                raise AssertionError("GPU eviction found no leaf although blocks were idle")
            if n.cpu >= 0:
                self._set(n, SWAP_OUT)
                batch.append((n, False))
            else:
                cpu = self._take_cpu_block() if swap else None
                if cpu is None and batch:
                    # The CPU leaves may be this batch's victims: land them, retry.
                    self._swap_out(batch)
                    batch = []
                    continue
                if cpu is None:
                    self._drop_gpu_copy(n)
                else:
                    self._set(n, SWAP_OUT, cpu=cpu)
                    batch.append((n, True))
            freed += 1
        if batch:
            self._swap_out(batch)

    def _swap_out(self, batch: list[tuple[Node, bool]]) -> None:
        """Copy the batch to its CPU blocks (synchronously); landed, every victim is
        CPU and its GPU block free; failed, every victim is back on GPU."""
        copied = [n for n, c in batch if c]
        if copied and "swap_out" in self.fail_kinds:
            cpus = [n.cpu for n in copied]
            for n, c in reversed(batch):
                self._set(n, GPU, cpu=-1 if c else None)
            self.cpu_free.undo_take(cpus)
            raise self._error("swap_out")
        for n, _ in batch:
            gpu = n.gpu
            self._set(n, CPU, gpu=-1)
            self.gpu_free.give([gpu])
        self.evictions["gpu_to_cpu"] += len(copied)
        self.evictions["gpu_to_cpu_backup"] += len(batch) - len(copied)

    # ------------------------------------------------------------ allocate
    def allocate(self, rid: Hashable, token_ids: Sequence[int], extra_key=None,
                 reserve_tokens: int = 0) -> Allocation:
        """Match the cached prefix (leaving at least one prompt token to compute),
        make room, give the request its GPU blocks and plan its fetches. Raises
        NoFreeBlocks, changing nothing but that count, when eviction cannot
        make room: so the check comes before any reference is taken."""
        self.reap()
        assert rid not in self.reqs and token_ids and not self.asleep
        n = len(token_ids)
        req = Request(rid, block_hashes(self.ns, token_ids, self.bs, extra_key), n, extra_key,
                      ns=self.ns)
        on_gpu, on_cpu = self._match(req.hashes[:(n - 1) // self.bs])
        need = -(-(n + reserve_tokens) // self.bs) - len(on_gpu)
        idle = sum(1 for m in self.nodes.values()
                   if m.state == GPU and m.ref == 0 and m not in on_gpu)
        if need > len(self.gpu_free.ids) + idle:
            self.counts["no_free_blocks"] += 1
            raise NoFreeBlocks(need, len(self.gpu_free.ids) + idle)
        self.clock += 1
        for m in on_gpu + on_cpu:
            self._ref(m)
        self._make_room(need)
        req.path = on_gpu + on_cpu
        req.blocks = [m.gpu for m in on_gpu] + self.gpu_free.take(need)
        n_load = self._plan_fetches(req, len(on_gpu), len(on_cpu))
        req.hit = (len(on_gpu) * self.bs, len(on_cpu) * self.bs, n_load * self.bs)
        req.cached_tokens = len(req.path) * self.bs
        self.reqs[rid] = req
        self._count_request(n, req.hit)
        return Allocation(self, req)

    def _match(self, hashes: list[bytes]) -> tuple[list[Node], list[Node]]:
        """The longest cached prefix: nodes on GPU, then nodes only on CPU (none
        while paused: their swap-in would wait for resume). Anything in flight
        or only in storage ends it."""
        on_gpu, on_cpu, parent = [], [], self.root
        for h in hashes:
            n = parent.children.get(h)
            if n is not None and n.state == GPU and not on_cpu:
                on_gpu.append(n)
            elif n is not None and n.state == CPU and not self.paused:
                on_cpu.append(n)
            else:
                break
            parent = n
        return on_gpu, on_cpu

    def _count_request(self, prompt_tokens: int, hit: tuple[int, int, int]) -> None:
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += prompt_tokens
        for tier, tokens in zip(("gpu", "cpu", "storage"), hit):
            if tokens:
                self.hit_tokens[tier] += tokens
                self.hit_requests[tier] += 1

    # -------------------------------------------------------------- fetches
    def _plan_fetches(self, req: Request, n_gpu: int, n_cpu: int) -> int:
        """Swap in the CPU hits into the request's next blocks, then load what
        storage holds after them; returns how many blocks load."""
        if n_cpu:
            nodes = req.path[n_gpu:]
            for n, gpu in zip(nodes, req.blocks[n_gpu:]):
                self._set(n, SWAP_IN, gpu=gpu)
            self._submit(Task("swap_in", req, nodes, *self._outcome("swap_in")))
        if not self.storage_on:
            return 0
        start = n_gpu + n_cpu
        want = min((req.num_tokens - 1) // self.bs - start, len(req.blocks) - start)
        if want <= 0:
            return 0
        if not self.cpu_on or self.paused:  # a load goes through CPU blocks, and waits
            self.storage_counts["skip_paused_or_no_cpu_tier"] += 1
            return 0
        if want < self.cfg.storage_min_load_blocks:
            self.storage_counts["skip_below_min_load_blocks"] += 1
            return 0
        found = self._in_storage(req.hashes[start:start + want])
        if found < max(1, self.cfg.storage_min_load_blocks):
            self.storage_counts["skip_not_in_storage"] += 1
            return 0
        return self._plan_load(req, start, found)

    def _in_storage(self, hashes: list[bytes]) -> int:
        """How many leading blocks of ``hashes`` storage holds."""
        found = 0
        stored = self.storage.get(self.version, set())
        while found < len(hashes) and hashes[found] in stored:
            found += 1
        return found

    def _plan_load(self, req: Request, start: int, found: int) -> int:
        """Load blocks ``start..start+found-1`` through new CPU blocks into the
        request's GPU blocks: as many as CPU blocks can be had, up to the first
        block some other request is fetching."""
        cpus = []
        while len(cpus) < found and (c := self._take_cpu_block()) is not None:
            cpus.append(c)
        if len(cpus) < found:
            self.storage_counts["short_of_cpu_blocks"] += 1
        nodes, parent = [], req.path[-1] if req.path else self.root
        for h in req.hashes[start:start + len(cpus)]:
            n = parent.children.get(h) or self._add_node(parent, h)
            if n.state != STORAGE:
                break
            nodes.append(n)
            parent = n
        self.cpu_free.undo_take(cpus[len(nodes):])
        for n, gpu, cpu in zip(nodes, req.blocks[start:], cpus):
            n.in_storage = True
            n.ref += 1
            self._set(n, SWAP_IN, gpu=gpu, cpu=cpu)
        if not nodes:
            return 0
        req.path += nodes
        ok, lost = self._outcome("load")
        arrived = self._in_storage([n.hash for n in nodes]) if ok else 0
        self._submit(Task("load", req, nodes, ok, lost, arrived))
        return len(nodes)

    def _outcome(self, kind: str) -> tuple[bool, bool]:
        """(ok, lost) of a task of ``kind`` submitted now."""
        return kind not in self.fail_kinds, self.lost

    def _submit(self, task: Task) -> None:
        self.pending.append(task)

    def reap(self) -> None:
        """Land every task submitted so far, in order."""
        while self.pending:
            task = self.pending.pop(0)
            if task.kind == "store":
                self._finish_store(task)
            else:
                self._finish_fetch(task)

    def _finish_fetch(self, task: Task) -> None:
        """The blocks that arrived, up to the first the request no longer holds,
        land on GPU (keeping their CPU copy as a backup); the request is cut at
        the first that did not and recomputes from there; the rest roll back."""
        req, nodes = task.req, task.nodes
        arrived = len(nodes) if task.kind == "swap_in" and task.ok else task.arrived
        held = 0
        while held < arrived and nodes[held] in req.path:
            held += 1
        for n in nodes[:held]:
            self._set(n, GPU)
        failed = nodes[held:]
        if not failed:
            return
        if failed[0] in req.path:
            self._cut(req, req.path.index(failed[0]),
                      None if task.ok else self._error(task.kind, task.lost))
        # A load that ran lacked in storage what did not arrive; what arrived
        # after the request was cut is still there.
        gone = nodes[arrived:] if task.kind == "load" and task.ok else []
        self._roll_back(task, failed, gone)

    def _roll_back(self, task: Task, failed: list[Node], gone: list[Node]) -> None:
        """Fetched nodes that did not land go back where they came from; their GPU
        blocks stay the request's (it recomputes into them). Those ``gone`` from
        storage are no longer marked stored, and leave the tree if unheld."""
        if task.kind == "swap_in":
            for n in reversed(failed):
                self._set(n, CPU, gpu=-1)
            return
        cpus = [n.cpu for n in failed]
        for n in reversed(failed):
            self._set(n, STORAGE, gpu=-1, cpu=-1)
        self.cpu_free.give(cpus)
        for n in gone:
            n.in_storage = False
        if gone and gone[0].ref == 0:
            self._remove(gone[0])

    def _error(self, kind: str, lost: bool | None = None) -> TransferFailed:
        lost = self.lost if lost is None else lost
        return (WorkerLost if lost else TransferFailed)(f"{kind} task failed")

    def _cut(self, req: Request, first: int, error: Exception | None) -> None:
        """The request keeps its first ``first`` blocks cached; the rest of its
        path lets go (a block that arrived after the gap becomes its own)."""
        cut = req.path[first:]
        del req.path[first:]
        for n in reversed(cut):
            if n.state == GPU:
                self._set(n, CPU if n.cpu >= 0 else STORAGE, gpu=-1)
            self._unref(n)
        gpu, cpu, storage = req.hit
        tokens = first * self.bs
        new_gpu = min(gpu, tokens)
        new_cpu = min(cpu, tokens - new_gpu)
        new_storage = tokens - new_gpu - new_cpu
        self.hit_tokens["cpu"] -= cpu - new_cpu
        self.hit_tokens["storage"] -= storage - new_storage
        req.hit = (new_gpu, new_cpu, new_storage)
        req.cached_tokens = tokens
        if req.error is None:
            req.error = error

    # ------------------------------------------------------- extend, commit
    def extend(self, rid: Hashable, num_tokens: int) -> list[int]:
        """Room for ``num_tokens`` more tokens: the new block ids."""
        self.reap()
        req = self.reqs[rid]
        total = req.num_tokens + num_tokens
        need = max(0, -(-total // self.bs) - len(req.blocks))
        idle = sum(1 for m in self.nodes.values() if m.state == GPU and m.ref == 0)
        if need > len(self.gpu_free.ids) + idle:
            self.counts["no_free_blocks"] += 1
            raise NoFreeBlocks(need, len(self.gpu_free.ids) + idle)
        self._make_room(need)
        new = self.gpu_free.take(need)
        req.blocks += new
        req.num_tokens = total
        return new

    def commit(self, rid: Hashable, token_ids: Sequence[int], num_computed: int) -> list[int]:
        """Cache the request's newly computed full blocks; returns its block table."""
        self.reap()
        req = self.reqs[rid]
        assert num_computed <= min(len(token_ids), len(req.blocks) * self.bs)
        full = num_computed // self.bs
        if not req.chain_open or full <= len(req.path):
            return req.blocks
        have = len(req.hashes)
        if have < full:
            req.hashes += block_hashes(req.hashes[-1] if have else req.ns, token_ids, self.bs,
                                       req.extra_key, have, full)
        start = len(req.path)
        self._insert(req, full)
        if self.storage_on:
            self._write_through(req.path[start:], req.stale)
        return req.blocks

    def _insert(self, req: Request, full: int) -> None:
        """Blocks ``len(path)..full-1`` join the tree. A block already cached on GPU
        is shared (the request's copy is freed); one cached only on CPU or in
        storage takes the request's copy as its GPU copy; one in flight ends
        the request's chain (its later blocks stay private)."""
        parent = req.path[-1] if req.path else self.root
        for i in range(len(req.path), full):
            n = parent.children.get(req.hashes[i])
            if n is None:
                n = self._add_node(parent, req.hashes[i])
                n.ref = 1
                self._set(n, GPU, gpu=req.blocks[i])
            elif n.state == GPU:
                if n.gpu != req.blocks[i]:
                    self.gpu_free.give([req.blocks[i]])
                    req.blocks[i] = n.gpu
                    self.counts["dedup_blocks"] += 1
                self._ref(n)
            elif n.state in (CPU, STORAGE):
                n.ref += 1
                self._set(n, GPU, gpu=req.blocks[i])
            else:
                req.chain_open = False
                return
            req.path.append(n)
            parent = n

    def _write_through(self, nodes: list[Node], stale: bool) -> None:
        """Stage the new GPU blocks that storage lacks into CPU blocks (kept as
        backups) and store them: one task, busy until it is reaped. A ``stale``
        request's blocks are not stored (counted)."""
        if not self.cpu_on or self.paused:  # staged through CPU blocks; would wait
            return
        if stale:
            self.storage_counts["write_skipped_version"] += len(nodes)
            return
        todo = [n for n in nodes
                if n.state == GPU and n.cpu < 0 and not n.busy and not n.in_storage]
        cpus = []
        while len(cpus) < len(todo) and (c := self._take_cpu_block()) is not None:
            cpus.append(c)
        todo = todo[:len(cpus)]
        if not todo:
            return
        for n, cpu in zip(todo, cpus):
            n.busy += 1
            self._set(n, GPU, cpu=cpu)
        ok, lost = self._outcome("store")
        if ok:
            self.storage.setdefault(self.version, set()).update(n.hash for n in todo)
        self._submit(Task("store", None, todo, ok, lost))

    def _finish_store(self, task: Task) -> None:
        """Stored blocks are marked in storage; a failed store's staging copies may
        be torn, so they are not kept as backups."""
        for n in task.nodes:
            n.busy -= 1
            if task.ok:
                n.in_storage = True
                self._changed(n)
            else:
                cpu = n.cpu
                self._set(n, n.state, cpu=-1)
                self.cpu_free.give([cpu])
        stored = len(task.nodes) if task.ok else 0
        self.storage_counts["stored"] += stored
        self.storage_counts["store_failed"] += len(task.nodes) - stored

    # ----------------------------------------------------------------- free
    def free(self, rid: Hashable) -> None:
        """The request lets go of its path (touched now, deepest first); its
        private blocks go back to the pool, tail first."""
        self.reap()
        req = self.reqs.pop(rid)
        self.clock += 1
        for n in reversed(req.path):
            self._unref(n)
        self.gpu_free.give(req.blocks[len(req.path):][::-1])

    # -------------------------------------------------------------- control
    def pause(self) -> dict:
        changed, self.paused = not self.paused, True
        return {"changed": changed, "paused": True}

    def resume(self) -> dict:
        changed, self.paused = self.paused, False
        return {"changed": changed, "paused": False}

    def sleep(self, release_host_pool: bool = False) -> dict:
        """Forget the GPU tier (a node with a CPU copy keeps it) and, with
        ``release_host_pool``, the CPU tier; paused until wakeup."""
        if self.asleep:
            return {"changed": False, "asleep": True}
        self.reap()
        assert not self.reqs, "free every request before sleep()"
        self.paused = self.asleep = True
        for n in sorted([n for n in self.nodes.values() if n.state == GPU], key=deepest_first):
            self._drop_gpu_copy(n)
        if release_host_pool and self.cpu_on:
            for n in sorted([n for n in self.nodes.values() if n.cpu >= 0], key=deepest_first):
                if n.hash in self.nodes:  # not removed with a node dropped before it
                    self._drop_cpu_copy(n)
        return {"changed": True, "asleep": True}

    def wakeup(self) -> dict:
        changed = self.asleep
        self.paused = self.asleep = False
        return {"changed": changed, "asleep": False}

    def update_weights(self, version: str) -> dict:
        """A new namespace: nothing cached under other weights matches any more."""
        version = str(version)
        if version == self.version:
            return {"changed": False, "version": version}
        self.reap()  # what is in flight lands first: its stores in the old version's set
        for req in self.reqs.values():
            req.stale = True
        self.version = version
        self.ns = namespace_hash(self.cfg.model_id, version, self.cfg.salt)
        return {"changed": True, "version": version}

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        self.reap()
        private = sum(len(r.blocks) - len(r.path) for r in self.reqs.values())
        gpu_used = self.gpu_free.total - len(self.gpu_free.ids)
        cpu_used = self.cpu_free.total - len(self.cpu_free.ids)
        return {
            "requests": self.counts["requests"], "running": len(self.reqs),
            "prompt_tokens": self.counts["prompt_tokens"],
            "hit_tokens": dict(self.hit_tokens), "hit_requests": dict(self.hit_requests),
            "tiers": {"gpu": (gpu_used, len(self.gpu_free.ids), gpu_used - private),
                      "cpu": (cpu_used, len(self.cpu_free.ids), cpu_used)},
            "evictions": {k: v for k, v in self.evictions.items() if v},
            "dedup_blocks": self.counts["dedup_blocks"],
            "no_free_blocks": self.counts["no_free_blocks"],
            "storage": {k: v for k, v in self.storage_counts.items() if v},
            "cached_nodes": len(self.nodes),
        }
