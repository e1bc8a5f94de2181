"""Eviction policies for one tier of the block tree: the oracle of the native core.

Two policies with one interface: ``LRUPolicy`` (least recently used)
and ``AdaptivePolicy`` (learned hit density). The C core is
written from this docstring and tested against these classes, step by step.

Interface (``Policy``)
======================

The cache calls, for one tier (a block key is an unsigned 64-bit int; in
kvcached the first 8 bytes of the node's hash, little-endian):

- ``on_insert(key, depth, now)``: the block entered the tier (computed and
  committed, or fetched into it). Not yet an evictable leaf: it is
  referenced by the request that brought it.
- ``on_hit(key, now)``: a request used the cached block (matched it at
  allocate, or a commit deduplicated onto it). Called while the request
  references it, so normally not a leaf (handled if it is).
- ``add_leaf(key)``: the block became an evictable leaf of the tier (no child
  in the tier, no reference, not busy). ``remove_leaf(key)``: it stopped
  being one (referenced, got a child). Each exactly once per change.
- ``victim()``: the leaf to evict next, taken out of the leaf set; None when
  there is none. The caller then evicts it and calls ``on_evict(key)``
  (also for a block that leaves the tier otherwise). A parent that became a
  leaf is ``add_leaf``-ed before the next ``victim()``.

``now`` is the manager's clock (non-decreasing; one tick per allocate and
free: two per request, the allocate's matches at ``2 i``, its commit at
``2 i + 1``); ``depth`` the node's depth (root's children: 1). LRU uses both,
the adaptive policy ``now`` (its ages are in these ticks).

In kvcached each tier has its own instance (capacity ``num_gpu_blocks``,
``num_cpu_blocks``), and the calls sit where today's code touches that
tier's ``LeafLRU`` and copies: ``add_leaf``/``remove_leaf`` where it adds
or discards; ``victim`` where it pops (``push_pop`` is ``add_leaf`` then
``victim``); ``on_insert`` where a node gains the tier's copy (GPU: a new
node at commit, an adopted copy, a swap-in or load; CPU: a swap-out, a
write-through staging copy); ``on_evict`` where the copy goes (swapped
out, dropped, or the node removed); ``on_hit`` where a request matches the
node in that tier at allocate, and for the GPU tier where commit
deduplicates onto it. ``simulator.py`` makes exactly these calls for a
GPU-only manager.

LRU
===

``(last access, -depth, insertion order)``, smallest first: kvcached's
``LeafLRU``. Ties on the clock go to the deeper node.

Adaptive (learned hit density)
==============================

Rank each leaf by its expected future hits per unit of cache space-time,
given its *class* (how often it was used) and its *age* (time since its
last use), learned online as in LHD (Beckmann et al., NSDI 2018), and evict
the lowest. What makes it work on chat traffic is the ghost: LRU and LHD
only see reuses that happen while a block is still cached; the ghost
remembers evicted blocks, so a conversation that comes back after its
blocks were dropped still teaches the table that blocks of that class are
reused at that age (and the returning block is promoted, as a hit would).

Everything is integer arithmetic, so a port is exact; all ties have a rule.

Constants (``AdaptiveParams``), for a tier of ``capacity`` blocks::

    CLASSES = 4           class = min(uses, CLASSES - 1); uses counts on_hit
                          calls and ghost returns since the block was new
    BINS = 256            age bins; the last one holds every older age
    WINDOW = max(MIN_WINDOW, capacity // 600) ticks: the width of an age bin
                          (windows_per_capacity = 600), so the horizon,
                          BINS * WINDOW, is about capacity / 4.7 requests
                          (4,200 at 20,000 blocks; the study's is 4,096): a
                          bigger tier keeps blocks longer, in requests
    MIN_WINDOW = 4        ticks (two requests): the tiny synthetic tiers
                          (100-500 blocks) want windows of a few requests
    REBUILD_TICKS = 16    the densities are rebuilt every ceil(16 / WINDOW)
                          windows: a rebuild costs O(CLASSES x BINS), and in
                          a small tier one per window was most of the cost
    GHOST = 8 * capacity  ghost entries (rounded up to whole sets of WAYS)
    WAYS = 8              ghost associativity
    DECAY_SHIFT = 7       the tables keep 1 - 2**-7 of their weight per window
    ONE = 1 << 16         one event, in the tables' fixed point

Clock. ``tick`` is the caller's clock: the latest ``now`` of ``on_insert`` and
``on_hit`` (the manager's: two ticks per request). A block stores
``stamp``, the tick of its last use (insert or hit); ages are in *windows*:
``cur_win = tick // WINDOW``, a block's window is ``win = stamp // WINDOW``
and its age bin ``bin(cur_win - win)``, where ``bin(a) = min(a, BINS - 1)``.
``on_insert`` and ``on_hit`` first move the clock to ``now`` (never back):
each window it passes is one *advance* (below), in order; when it passes
more than BINS windows (an idle tier), ``cur_win`` first jumps to ``target -
BINS`` and the last BINS advances are made (each splices the ring slot of
the window reaching the last bin: BINS of them cover every slot, so every
leaf ends in the old lists; the slot may then hold a window older than that
one). Why requests, not insertions (the clock until issue 41): with ends
counted at eviction (below), an insertion clock lost 9-14% of the hits on
the think workload at its 50% and 75% points (a miss that inserts a long
conversation ages every block as much as dozens of turns); the study ages
in requests.

Per block (node fields in C): ``cls`` (u8) and ``stamp`` (u64), plus its
leaf-list links.

Tables, per class c and age bin b: ``hits[c][b]`` and ``ends[c][b]``
(u64, fixed point). Events:

- hit: ``on_hit`` of a block of class c: ``hits[c][bin(cur_win - win)] +=
  ONE``; then ``cls = min(c + 1, CLASSES - 1)``, ``stamp = tick``.
- end, at eviction: ``on_evict`` of a block of class c: ``ends[c][BINS - 1]
  += ONE`` (not reused within the horizon, until the ghost says otherwise),
  and the ghost remembers it (an entry it overwrites was counted so
  already).
- ghost return: ``on_insert`` of a key the ghost holds with (c, w): the
  entry is cleared; if its age ``a = (cur_win - w) & 0xFFF`` is below BINS -
  1 (reused within the horizon), ``hits[c][a] += ONE`` and ``ends[c][BINS -
  1] -= min(ONE, ends[c][BINS - 1])`` (the end is taken back); the block
  starts with ``cls = min(c + 1, CLASSES - 1)``. Otherwise ``cls = 0``.
  Either way ``stamp = tick``.

This is the study's accounting. Until issue 41 the policy counted an end
only when the ghost forgot an entry (overwrite, or an expiry at twice the
age where its class's reuses ran out), at the entry's age: on the Mooncake
conversation trace a 3,000-request slice ends before many entries are
forgotten, blocks evicted and never back were hardly counted, and the
policy fell to 0.88-0.92x of the study at 55,000 blocks.

Advance (one window): ``cur_win += 1``; the ring slot of the window that
reaches the last bin is spliced into the old lists (Leaf set, below); then,
when ``cur_win % ceil(REBUILD_TICKS / WINDOW) == 0``, the rebuild: every
counter ``x -= x >> DECAY_SHIFT`` as many times as windows since the last
rebuild, then per class the densities, then ``ranks``. Other windows only
reset the cursor (every list moved one bin on). The density of age bin a
is the most hits per unit of space-time over every horizon A at which a
block of age a could be dropped (held until reused or age A)::

    density[c][a] = max over a < A <= BINS - 1 of
                    (sum(hits[c][a:A]) << 32) // (U[A] - U[a])   (0 if U[A] = U[a])

where ``U[A]`` sums, over the bins b < A, the events (hits and ends) at bin
b or later (so ``U[A] - U[a]`` is the space-time, in bins, of holding every
block of age a until its event or age A); and ``density[c][BINS - 1] = 0``
(the last bin lumps every age past the horizon: a leaf there goes first).
The maximum is the slope from point a to the upper hull of the points (U,
prefix hits) past it: built from the last bin down on a stack, popping the
top while the slope from a to it is at most the slope from a to the one
below, O(BINS) per class. In C the sums are ``unsigned __int128``; the
densities, at most 2**32, fit in u64.

``ranks``: every (c, b) sorted by ``(density, -b, c)``: lowest density
first; ties take the older bin, then the lower class. With empty tables
every density is 0, so the order is oldest bin first: LRU at window
granularity.

Leaf set: bucketed lists, each a doubly linked list in C with a head
(oldest) and a tail. ``bucket[c][w]`` holds the class-c leaves of window
``w``, for the ``BINS - 1`` youngest windows (a ring of BINS - 1 lists per
class, slot ``w % (BINS - 1)``); ``old[c]`` holds class c's older leaves.
``add_leaf`` picks ``old[c]`` when ``cur_win - win >= BINS - 1``, else
``bucket[c][win]``, and links the leaf at the tail, unless the list is not
empty and its stamp is at most the tail's: then at the head. (A leaf freed by
a request is the youngest; a parent uncovered by evicting its child is
no younger than what it joins (the same request's blocks share a tick),
and goes next: a branch is evicted tail first, and within a list the order
is LRU's.) ``remove_leaf`` unlinks. When the window advances, the ring
slot of window ``cur_win - (BINS - 1)`` is spliced onto the tail of
``old[c]`` for each c (younger than all of it), before the rebuild. ``victim()`` walks ``ranks`` and unlinks the head of the first
non-empty list (bin b < BINS - 1: ``bucket[c][cur_win - b]``, else
``old[c]``). A cursor makes it O(1) amortised: every rank below ``cursor``
has an empty list; ``add_leaf`` lowers it to the leaf's rank, an advance
resets it to 0, ``victim()`` resumes from it and leaves it at the rank it
took from (``len(ranks)`` when it found nothing). So each operation is
O(1), plus O(CLASSES x BINS) per rebuild and O(ranks) per window (the walk
restarts).

Ghost: ``GHOST / WAYS`` sets of WAYS 32-bit entries, 0 = empty. A key maps
to ``h = splitmix64(key)``, set ``(h >> 32) % sets``, fingerprint
``h & 0xFFFF`` (0 taken as 1); an entry is ``fp << 16 | cls << 12 | (win &
0xFFF)``, and its age in windows is ``(cur_win - win) & 0xFFF``. Lookup
(``on_insert``): the first way with the fingerprint. Insert (``on_evict``):
the first empty way, else the way with the greatest age (first on ties),
which is overwritten (its end was counted at eviction). 4 bytes per entry:
32 bytes per cached block at 8x (plus a count of entries held, and
``ghost_hits``, the inserts the ghost remembered: what status and metrics
show). A false match (~WAYS / 65536 per insert) only adds a spurious hit to
the tables. Ages alias if a set saw no insert for 4096 windows (about 16x
the horizon): in a tier that evicts less than about one block per four
requests, a block back after that long can count as a young reuse, a
spurious hit.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

MASK64 = (1 << 64) - 1


class Policy(Protocol):
    """What a tier's eviction policy is told, and asked (see the module docstring)."""

    def on_insert(self, key: int, depth: int, now: int) -> None: ...
    def on_hit(self, key: int, now: int) -> None: ...
    def add_leaf(self, key: int) -> None: ...
    def remove_leaf(self, key: int) -> None: ...
    def victim(self) -> int | None: ...
    def on_evict(self, key: int) -> None: ...
    def leaves(self) -> set[int]: ...


# --------------------------------------------------------------------- LRU
class LRUPolicy:
    """kvcached's LeafLRU: a heap of ``(last, -depth, seq)`` with lazy deletion."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        self._live: dict[int, tuple] = {}  # leaf -> its heap entry
        self._heap: list[tuple] = []
        self._seq = 0

    def on_insert(self, key: int, depth: int, now: int) -> None:
        self._last[key] = now
        self._depth[key] = depth

    def on_hit(self, key: int, now: int) -> None:
        self._last[key] = now
        if key in self._live:  # re-key a leaf
            self.remove_leaf(key)
            self.add_leaf(key)

    def add_leaf(self, key: int) -> None:
        assert key not in self._live, f"{key:#x} is a leaf already"
        self._seq += 1
        entry = (self._last[key], -self._depth[key], self._seq, key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:  # drop stale entries
            self._heap = [e for e in self._heap if self._live.get(e[3]) is e]
            heapq.heapify(self._heap)

    def remove_leaf(self, key: int) -> None:
        del self._live[key]

    def victim(self) -> int | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry[3]) is entry:
                del self._live[entry[3]]
                return entry[3]
        return None

    def on_evict(self, key: int) -> None:
        del self._last[key], self._depth[key]

    def leaves(self) -> set[int]:
        return set(self._live)


# ---------------------------------------------------------------- adaptive
@dataclass(frozen=True, slots=True)
class AdaptiveParams:
    """The adaptive policy's constants (see the module docstring)."""

    classes: int = 4
    bins: int = 256
    windows_per_capacity: int = 600  # WINDOW = capacity // this clock ticks
    ghost_factor: int = 8  # ghost entries per block of capacity
    ways: int = 8
    decay_shift: int = 7
    ghost_bits: int = 32  # a ghost entry's width: 8, 16 or 32
    ghost_win_bits: int = 12  # of which the window of last use (mod 2**this)
    min_window: int = 4  # the fewest ticks per window (rebuilds are O(classes x bins))

    def __post_init__(self) -> None:
        if not 1 <= self.classes <= 16:
            raise ValueError(f"classes must be in 1..16, got {self.classes}")
        if not 2 <= self.bins <= 2048:
            raise ValueError(f"bins must be in 2..2048, got {self.bins}")
        for name in ("windows_per_capacity", "ways", "decay_shift", "min_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decay_shift > 63:
            raise ValueError(f"decay_shift must be in 1..63, got {self.decay_shift}")
        if self.ghost_factor < 0:
            raise ValueError(f"ghost_factor must be >= 0, got {self.ghost_factor}")
        if self.ghost_bits not in (8, 16, 32):
            raise ValueError(f"ghost_bits must be 8, 16 or 32, got {self.ghost_bits}")
        if not 1 <= self.ghost_win_bits <= 16:
            raise ValueError(f"ghost_win_bits must be in 1..16, got {self.ghost_win_bits}")
        if self.fp_bits < 1:
            raise ValueError(f"ghost_bits={self.ghost_bits} leave no room for a fingerprint "
                             f"beside {self.cls_bits} bits of class and {self.ghost_win_bits} "
                             f"of window")

    @property
    def cls_bits(self) -> int:
        """Bits of a class in a ghost entry."""
        return (self.classes - 1).bit_length()

    @property
    def fp_bits(self) -> int:
        """Bits of a ghost entry's fingerprint: what the class and window leave."""
        return self.ghost_bits - self.cls_bits - self.ghost_win_bits


ONE = 1 << 16  # one event in the tables' fixed point
REBUILD_TICKS = 16  # the fewest clock ticks between two rebuilds of the densities
_OLD = -1  # the bucket key of a class's old list (ages past the horizon)


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer: spreads any 64-bit key over the ghost's sets."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Ghost:
    """Recently evicted keys with their class and last-use window, ``bits`` bits
    each: a fingerprint, ``cls_bits`` of class, ``win_bits`` of window.

    Set-associative: a full set overwrites its oldest entry, which is handed
    back to be counted as an end.
    """

    def __init__(self, entries: int, ways: int, bits: int = 32, win_bits: int = 12,
                 cls_bits: int = 2):
        self.ways = ways
        self.sets = max(1, -(-entries // ways)) if entries else 0
        self.table = [0] * (self.sets * ways)
        self.size = 0  # entries held (for status and metrics)
        self.bits, self.win_bits, self.cls_bits = bits, win_bits, cls_bits
        self.fp_bits = bits - cls_bits - win_bits
        self.win_mask = (1 << win_bits) - 1

    @property
    def nbytes(self) -> int:
        return len(self.table) * self.bits // 8

    def _locate(self, key: int) -> tuple[int, int]:
        h = splitmix64(key & MASK64)
        return ((h >> 32) % self.sets) * self.ways, (h & ((1 << self.fp_bits) - 1)) or 1

    def _unpack(self, e: int) -> int:
        return (e >> self.win_bits) & ((1 << self.cls_bits) - 1)

    def take(self, key: int) -> tuple[int, int] | None:
        """``(cls, win mod 2**win_bits)`` of ``key``'s entry, which is cleared; None
        if absent."""
        if not self.sets:
            return None
        base, fp = self._locate(key)
        shift = self.cls_bits + self.win_bits
        for i in range(base, base + self.ways):
            e = self.table[i]
            if e >> shift == fp:
                self.table[i] = 0
                self.size -= 1
                return self._unpack(e), e & self.win_mask
        return None

    def put(self, key: int, cls: int, win: int, cur_win: int) -> tuple[int, int] | None:
        """Remember ``key``; returns ``(cls, age in windows)`` of the entry it
        overwrote, or None when a way was empty."""
        if not self.sets:
            return None
        base, fp = self._locate(key)
        entry = fp << (self.cls_bits + self.win_bits) | cls << self.win_bits | (win & self.win_mask)
        oldest, oldest_age = base, -1
        for i in range(base, base + self.ways):
            e = self.table[i]
            if not e:
                self.table[i] = entry
                self.size += 1
                return None
            age = (cur_win - (e & self.win_mask)) & self.win_mask
            if age > oldest_age:
                oldest, oldest_age = i, age
        e = self.table[oldest]
        self.table[oldest] = entry
        return self._unpack(e), oldest_age


class AdaptivePolicy:
    """Learned hit density with a ghost (the algorithm is the module docstring)."""

    def __init__(self, capacity: int, params: AdaptiveParams | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        p = self.params = params or AdaptiveParams()
        self.window = max(p.min_window, capacity // p.windows_per_capacity)
        self.rebuild_every = -(-REBUILD_TICKS // self.window)  # windows between rebuilds
        self.ghost = Ghost(p.ghost_factor * capacity, p.ways, p.ghost_bits, p.ghost_win_bits,
                           p.cls_bits)
        self.tick = 0  # the caller's clock: the latest ``now``
        self.inserts = 0  # on_insert calls (for metrics)
        self.cur_win = 0
        self.cls: dict[int, int] = {}  # per block (node fields in C): class,
        self.stamp: dict[int, int] = {}  # and the tick of its last use
        self.hits = [[0] * p.bins for _ in range(p.classes)]
        self.ends = [[0] * p.bins for _ in range(p.classes)]
        self.density = [[0] * p.bins for _ in range(p.classes)]
        # (class, window or _OLD) -> leaves, oldest first (a doubly linked list in C)
        self.buckets: dict[tuple[int, int], OrderedDict[int, None]] = {}
        self.where: dict[int, tuple[int, int]] = {}  # leaf -> its bucket key
        self.ghost_hits = 0  # inserts the ghost remembered (for metrics)
        self._rank()

    # ----------------------------------------------------------- events
    def on_insert(self, key: int, depth: int, now: int) -> None:
        self._clock(now)
        self.inserts += 1
        back = self.ghost.take(key)
        if back is None:
            self.cls[key] = 0
        else:
            c, w = back
            self.ghost_hits += 1
            age = (self.cur_win - w) & self.ghost.win_mask
            last = self.params.bins - 1
            if age < last:  # reused within the horizon: a hit, and no end after all
                self.hits[c][age] += ONE
                self.ends[c][last] -= min(ONE, self.ends[c][last])
            self.cls[key] = min(c + 1, self.params.classes - 1)
        self.stamp[key] = self.tick

    def on_hit(self, key: int, now: int) -> None:
        self._clock(now)
        leaf = key in self.where
        if leaf:
            self.remove_leaf(key)
        c = self.cls[key]
        self._count(self.hits, c, self.cur_win - self.stamp[key] // self.window)
        self.cls[key] = min(c + 1, self.params.classes - 1)
        self.stamp[key] = self.tick
        if leaf:
            self.add_leaf(key)

    def on_evict(self, key: int) -> None:
        assert key not in self.where, f"{key:#x} evicted while listed as a leaf"
        win, c = self.stamp.pop(key) // self.window, self.cls.pop(key)
        self._count(self.ends, c, self.params.bins - 1)  # until the ghost sees it return
        self.ghost.put(key, c, win, self.cur_win)

    def _count(self, table: list[list[int]], c: int, age: int) -> None:
        table[c][min(age, self.params.bins - 1)] += ONE

    # -------------------------------------------------------- leaf set
    def add_leaf(self, key: int) -> None:
        assert key not in self.where, f"{key:#x} is a leaf already"
        c, stamp = self.cls[key], self.stamp[key]
        age = self.cur_win - stamp // self.window
        last = self.params.bins - 1
        where = (c, _OLD) if age >= last else (c, stamp // self.window)
        bucket = self.buckets.get(where)
        if bucket is None:
            bucket = self.buckets[where] = OrderedDict()
        if bucket and stamp <= self.stamp[next(reversed(bucket))]:
            bucket[key] = None  # older than the youngest: an exposed parent, next to go
            bucket.move_to_end(key, last=False)
        else:
            bucket[key] = None
        self.where[key] = where
        self.cursor = min(self.cursor, self.rank_of[c][min(age, last)])

    def remove_leaf(self, key: int) -> None:
        where = self.where.pop(key)
        bucket = self.buckets[where]
        del bucket[key]
        if not bucket:
            del self.buckets[where]

    def victim(self) -> int | None:
        last = self.params.bins - 1
        for r in range(self.cursor, len(self.ranks)):
            c, b = self.ranks[r]
            where = (c, _OLD) if b == last else (c, self.cur_win - b)
            bucket = self.buckets.get(where)
            if bucket:
                key, _ = bucket.popitem(last=False)  # the oldest
                if not bucket:
                    del self.buckets[where]
                del self.where[key]
                self.cursor = r
                return key
        self.cursor = len(self.ranks)
        return None

    def leaves(self) -> set[int]:
        return set(self.where)

    # ---------------------------------------------------------- tables
    def _clock(self, now: int) -> None:
        """The caller's clock reached ``now``: the windows it passed go by, each
        one ``_advance``. A gap of more than BINS windows (an idle tier) is cut
        to its last BINS: enough to move every bucket to the old lists."""
        self.tick = max(self.tick, now)
        target = self.tick // self.window
        if target - self.cur_win > self.params.bins:
            self.cur_win = target - self.params.bins
            # C keeps a ring of BINS - 1 slots: a bucket goes to the old lists
            # when the first advance reaches its slot. Key each bucket by that
            # advance's window.
            last = self.params.bins - 1
            lo = self.cur_win + 1 - last  # the first advance's window
            for c, w in [k for k in self.buckets if k[1] != _OLD and k[1] < lo]:
                a = w + (lo - w + last - 1) // last * last
                bucket = self.buckets[(c, a)] = self.buckets.pop((c, w))
                for key in bucket:
                    self.where[key] = (c, a)
        while self.cur_win < target:
            self._advance()

    def _advance(self) -> None:
        """A new window: the bucket of the window that just reached the last bin
        joins the old ones (younger than all they hold: at the end; after a cut
        gap, the bucket of the older window in its ring slot, keyed so by
        ``_clock``); then the rebuild."""
        self.cur_win += 1
        last = self.params.bins - 1
        aged = self.cur_win - last
        for c in range(self.params.classes):
            bucket = self.buckets.pop((c, aged), None)
            if bucket:
                old = self.buckets.setdefault((c, _OLD), OrderedDict())
                old.update(bucket)
                for key in bucket:
                    self.where[key] = (c, _OLD)
        self._rebuild()

    def _rebuild(self) -> None:
        """Every ``rebuild_every`` windows: the decay of each window since the last
        rebuild, then the densities and ranks. Between rebuilds the ranks stand,
        and the victim walk restarts (every bucket moved one bin on)."""
        if self.cur_win % self.rebuild_every:
            self.cursor = 0
            return
        last, shift = self.params.bins - 1, self.params.decay_shift
        for c in range(self.params.classes):
            hits, ends = self.hits[c], self.ends[c]
            for _ in range(self.rebuild_every):
                for b in range(last + 1):
                    hits[b] -= hits[b] >> shift
                    ends[b] -= ends[b] >> shift
            self._densities(hits, ends, self.density[c])
        self._rank()

    @staticmethod
    def _densities(hits: list[int], ends: list[int], dens: list[int]) -> None:
        """``dens[a] = max over A in (a, last] of (hits in [a, A)) << 32 // (space-time
        of holding every block of age a until reused or age A)``: the space-time is
        ``U[A] - U[a]``, ``U[A]`` summing, over the bins before A, the events (hits
        and ends) at or past each. The maximum is the slope from point a to the
        upper hull of the points past it (built from the last bin down, a stack:
        O(bins)); ``dens[last] = 0``."""
        last = len(hits) - 1
        alive = sum(hits) + sum(ends)  # events at or past bin b
        ph, u = [0] * (last + 1), [0] * (last + 1)  # Ph[A], U[A]
        for b in range(last):
            ph[b + 1] = ph[b] + hits[b]
            u[b + 1] = u[b] + alive
            alive -= hits[b] + ends[b]

        def slope(a: int, b: int) -> int:
            du = u[b] - u[a]
            return ((ph[b] - ph[a]) << 32) // du if du else 0

        hull = [last]
        for a in range(last - 1, -1, -1):
            while len(hull) > 1 and slope(a, hull[-1]) <= slope(a, hull[-2]):
                hull.pop()
            dens[a] = slope(a, hull[-1])
            hull.append(a)
        dens[last] = 0

    def _rank(self) -> None:
        p = self.params
        self.ranks = sorted(((c, b) for c in range(p.classes) for b in range(p.bins)),
                            key=lambda cb: (self.density[cb[0]][cb[1]], -cb[1], cb[0]))
        self.rank_of = [[0] * p.bins for _ in range(p.classes)]
        for r, (c, b) in enumerate(self.ranks):
            self.rank_of[c][b] = r
        self.cursor = 0


# ------------------------------------------------------- differential tests
class Recorder:
    """Wraps a policy and logs every call as ``(method, args, result)``: replay the
    log into another implementation (the C core's) with :func:`replay_calls`."""

    METHODS = ("on_insert", "on_hit", "add_leaf", "remove_leaf", "victim", "on_evict")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.log: list[tuple[str, tuple, int | None]] = []

    def __getattr__(self, name: str):
        target = getattr(self.policy, name)
        if name not in self.METHODS:
            return target

        def call(*args):
            result = target(*args)
            self.log.append((name, args, result))
            return result
        return call


def replay_calls(policy: Policy, log: list[tuple[str, tuple, int | None]]) -> int:
    """Make the logged calls on ``policy``; raises AssertionError naming the first
    call whose result differs. Returns the number of calls."""
    for i, (name, args, want) in enumerate(log):
        got = getattr(policy, name)(*args)
        assert got == want, f"call {i}: {name}{args} returned {got!r}, the log says {want!r}"
    return len(log)
