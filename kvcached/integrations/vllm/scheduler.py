"""The scheduler half of the connector: kvcached's manager inside vLLM's
engine-core process.

vLLM keeps its GPU tier (its block pool, its prefix cache, its block ids);
kvcached's ``CacheManager`` (with ``external_gpu_tier``) holds the CPU tier
and storage for this model and drives the transfer workers. No hook waits
on I/O or on a worker while vLLM has work: vLLM's scheduler never stalls on
kvcached. (A step with nothing scheduled, which vLLM follows at once with the
next, waits up to ``IDLE_WAIT_S`` for the oldest lookup or load in flight;
see ``_wait_idle``.)

A model's KV cache groups (a hybrid's sliding-window, Mamba and
full-attention layers; see ``group_tags``) are cached apart: a request holds
one core request per chained group (full attention, MLA), a sliding-window
group's blocks and a Mamba group's states are cached one by one, and a hit
is the longest prefix the chains restore whose windows and states are all
there (``_blockwise``).

- ``get_num_new_matched_tokens``: how many tokens past vLLM's own hit the
  CPU tier, then storage, hold (block-aligned; at least one prompt token is
  left to compute). The CPU tier answers at once; storage is asked by a
  lookup task (one per step for every request asked: one storage round
  trip), and until it answers the request gets ``None`` (vLLM asks again
  next step and schedules the others meanwhile). A lookup not
  answered within ``storage_lookup_timeout_s`` is a miss. A request whose
  prefix is on its way into the CPU tier for another request (or out of it,
  saved) also gets ``None`` until that lands, so that it takes the whole hit
  instead of the part before.
- ``update_state_after_alloc``: vLLM gave the request its blocks; the cached
  prefix is pinned and its copy into those blocks planned (asynchronous:
  the request waits in WAITING_FOR_REMOTE_KVS, vLLM keeps scheduling).
- ``build_connector_meta``: (1) the saves of blocks an earlier forward
  computed are submitted, one task for the step; (2) this step's loads are
  submitted (one task per kind; a request's storage reads, of all its
  groups, one task of their own); (3) this step's saves are planned; (4) loads
  that finished since the last report are handed to the workers in the
  metadata, failed ones with the blocks that did not arrive, and so are
  finished requests whose saves are done; the workers report them to vLLM
  (``finished_recving`` / ``finished_sending`` and
  ``get_block_ids_with_load_errors`` in the same pass), so a failed or lost
  load is recomputed, never used.
- ``update_connector_output`` (after a step whose workers reported): loads
  that completed whole are added to ``finished_recving`` directly, saves
  that completed to ``finished_sending``: the request is scheduled, or its
  blocks freed, at the next step, without a round trip through the workers.
  vLLM skips this call after a step with no forward and nothing reported,
  so whatever it would have carried goes through the next metadata instead.

A save planned at step N is copied from step N + lag on, lag being the
number of batches vLLM keeps in flight (1, or 2 with async scheduling): by
then forward N has finished. The blocks it reads are full, so no later
forward of the request writes them. While a save is copied its source blocks
hold a reference in vLLM's block pool, so nothing reuses them: a preempted
request's blocks stay intact until their saves land (vLLM waits for them
through ``has_pending_block_frees`` rather than preempt another request),
and no step waits. A finished request keeps its blocks while a save or a
load of it is in flight (``request_finished`` returns True; it comes back in
``finished_sending``, or in ``finished_recving`` for a load).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from kvcached.core.manager import EngineLoad, EngineSave
from kvcached.integrations.vllm import config as vconfig
from kvcached.integrations.vllm import observe
from kvcached.integrations.vllm.stepload import StepLoad
from kvcached.memory import kvshare, rundir
from kvcached.ops import janitor
from kvcached.ops.wiring import CacheManager
from kvcached.tasks import Task, TaskHandle, TaskResult

# Through vLLM's logger: its log is where a vLLM operator looks (the run dir).
logger = logging.getLogger("vllm.kvcached")


@dataclass
class Lookup:
    """A storage lookup of a request: ``runs`` of (core request, start, limit),
    known by ``ident`` (vLLM may ask several times: one lookup per ident); in
    flight until ``prefixes`` is known: per run, the leading blocks from
    ``start`` storage holds (none on trouble or past the deadline)."""

    ident: tuple
    runs: list[tuple[object, int, int]]
    handle: TaskHandle | None = None  # None until the step's lookups go out together
    index: int = 0  # this lookup's first run in its task
    deadline: float = float("inf")
    prefixes: list[int] | None = None

    def answered(self, now: float) -> bool:
        """Whether the answer is known, or can be read (landed, or past its deadline)."""
        return self.prefixes is not None or (
            self.handle is not None and (self.handle.done() or now >= self.deadline))


# How long build_connector_meta waits for a load inside the step to be sent.
STEP_FLUSH_S = 0.002

# How long a step with nothing scheduled waits for kvcached's work in flight:
# a lookup or a small load lands within it; a new request waits at most this
# long to be seen.
IDLE_WAIT_S = 0.001


@dataclass
class Tracked:
    """A vLLM request as kvcached knows it."""

    request: object  # vllm.v1.request.Request
    creqs: list  # per chained group (SchedulerHalf.chains), the core's request
    n_keys: int = 0  # vLLM block hashes made keys so far
    saved: int = 0  # blocks up to which saves were planned
    named: int = 0  # blocks whose vLLM hashes are in SchedulerHalf.names
    hit: tuple[int, int, int] = (0, 0, 0)  # (vLLM's own blocks, CPU tier, storage) at lookup
    split: tuple[int, int] = (0, 0)  # tokens the last load takes from (CPU tier, storage)
    lookup: Lookup | None = None  # the chained groups'
    wlookup: Lookup | None = None  # the window groups' blocks
    waiting_since: float | None = None  # asked again while its prefix moves
    asked: tuple | None = None  # (vLLM's hit, tokens, lookup): an ask answered None for it
    loads: list[Load] = field(default_factory=list)  # in flight
    saves: int = 0  # save plans not yet done (planned, or in flight)
    counted: bool = False  # in the hit statistics
    own: int = 0  # tokens of vLLM's own prefix-cache hit, at the last allocation
    failed: bool = False  # a load failed: the rest of the request computes its KV
    in_step: bool = False  # its hit, as last answered, loads inside the step
    preempted: bool = False  # since its last allocation
    finished: bool = False
    delayed: bool = False  # request_finished returned True: vLLM waits for our report


@dataclass
class Part:
    """One task of a load, inside a step's batch: ``length`` of the batch's blocks
    from ``offset`` on."""

    batch: TaskHandle | None = None
    offset: int = 0
    length: int = 0
    submitted: float = 0.0  # time.monotonic()


@dataclass
class Load:
    plan: EngineLoad
    parts: list[Part]
    window: bool = False  # one block of a window group: its request goes once it lands
    step: bool = False  # inside the step vLLM schedules the request in (see StepLoad)

    def done(self) -> bool:
        return all(p.batch is not None and p.batch.done() for p in self.parts)

    def clean(self) -> bool:
        """Every block arrived (nothing for vLLM to recompute)."""
        if self.plan.missing:
            return False
        for task, p, r in zip(self.plan.tasks, self.parts, self.results(), strict=True):
            if not r.ok or (task.kind == "load" and r.result["prefix"] < p.length):
                return False
        return True

    def results(self) -> list[TaskResult]:
        """Each task's own result, cut out of its batch's: a storage batch's usable
        prefix counts blocks of every load before this one."""
        out = []
        for p in self.parts:
            r = p.batch.result
            prefix = int(r.result.get("prefix", 0)) if r.ok else 0
            got = max(0, min(p.length, prefix - p.offset))
            out.append(TaskResult(r.task_id, r.ok, r.error, r.lost, result={"prefix": got}))
        return out


@dataclass
class SavePlan:
    step: int
    rid: str
    blocks: int
    device_ids: tuple[list[int], ...]  # per KV cache group
    attempt: int = 1
    start: int = 0  # blocks an earlier plan of the request covers
    held: list[int] = field(default_factory=list)  # blockwise groups' blocks pinned until it runs
    states: list[tuple[int, int, int]] = field(default_factory=list)  # Mamba (group, block, id)


@dataclass
class Saving:
    """A save task in flight: the plans it copies and the blocks it holds."""

    save: EngineSave | None
    plans: list[SavePlan]
    src: list[int]
    windows: list = field(default_factory=list)  # window groups' block requests, let go on landing


# A save stops at a block another request is saving or loading (nothing may
# hang under an unfinished copy): it is tried again once that lands, a few times.
SAVE_ATTEMPTS = 4


def group_tags(groups: list[vconfig.Group]) -> list[bytes]:
    """What each KV cache group adds to vLLM's block hashes: a block is kvcached's
    by (vLLM's hash, group), so the groups of a hybrid model never share a key.
    A model of one group adds nothing (its keys are as they always were)."""
    if len(groups) == 1:
        return [b""]
    return [hashlib.blake2b(f"{g.kind}:{','.join(g.layer_names)}".encode(),
                            digest_size=8).digest() for g in groups]


def tagged(hashes: list[bytes], tag: bytes) -> list[bytes]:
    return [h + tag for h in hashes] if tag else hashes


class SchedulerHalf:
    """kvcached in vLLM's scheduler (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config):
        self.run_dir = vconfig.run_dir_of(vllm_config)
        self.groups = vconfig.cached_groups(kv_cache_config, str(vllm_config.model_config.model))
        self.tags = group_tags(self.groups)
        # Full-attention and MLA groups are chains (a hit needs every block
        # before it); a sliding-window group's blocks are cached one by one (a
        # hit needs only the window before it), and so are a Mamba group's
        # states (a hit at block s needs the state after it, which vLLM keeps
        # where a chunk ended and hands over: ``_plan_states``).
        self.chains = [g.index for g in self.groups if g.kind in ("full", "mla")]
        self.windows = [g.index for g in self.groups if g.kind == "sliding"]
        self.states = [g.index for g in self.groups if g.kind == "mamba"]
        self.blockwise = self.windows + self.states
        # The workers exported their planes before the scheduler starts: their
        # shape says whether K and V share a plane (vLLM's CPU backend) or not.
        desc = kvshare.read_descriptor(self.run_dir, 0)
        fused = len(desc["planes"]) == len(vconfig.physical_layers(kv_cache_config))
        cfg = vconfig.cache_config(vllm_config, kv_cache_config, fused)
        why = vconfig.check_hashes_reproducible(vllm_config, cfg)
        if why:
            logger.warning("kvcached: %s", why)
        self.block_size = cfg.block_size
        self.lag = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))
        # kv_producer saves and never loads, kv_consumer loads and never saves
        # (disaggregated prefill); kv_both does both.
        role = vllm_config.kv_transfer_config
        self.loads_on, self.saves_on = role.is_kv_consumer, role.is_kv_producer
        why = vconfig.loads_unsupported(vllm_config, cfg)
        if why and self.loads_on:
            logger.warning("kvcached: %s", why)
            self.loads_on = False
        self.lookup_timeout_s = cfg.storage_lookup_timeout_s
        # A CPU-tier hit of at most this many blocks loads inside the step vLLM
        # schedules its request in. Not with several KV cache groups: vLLM 0.32
        # takes no block-level load errors from them, so a failed load inside
        # the step could not be recomputed (they stay asynchronous, and report
        # failures as finished loads).
        self.step_max = cfg.step_load_max_blocks if (
            len(self.groups) == 1 and cfg.transfer_mode == "workers") else 0
        self.step_timeout_s = cfg.step_load_timeout_s
        self.loads = collections.Counter()  # requests loaded: "step" (inside it), "async"
        # A prefix moving for another request lands within a task's time.
        self.move_wait_s = cfg.task_timeout_s
        # A run dir kvcached named (no run_dir configured) is temporary: it
        # goes at close, or, if this process dies first, with the janitor, the
        # next start or `kvcached cleanup`. vLLM's server stops this process
        # with SIGKILL (its shutdown timeout is 0 by default), before it would
        # close the connector: the janitor, outside vLLM's process tree,
        # removes the CPU tier's shared memory and the run dir then.
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.temporary = not extra.get("run_dir")
        if self.temporary:
            rundir.mark_temporary(self.run_dir)
        self.janitor = janitor.watch(os.getpid(), self.run_dir, cfg.log_dir or self.run_dir / "logs")
        self.mgr = CacheManager(cfg).start()
        # vLLM asks for KV events every step, published or not: kvcached keeps
        # them (and the names they carry) only when vLLM publishes them.
        events = vllm_config.kv_events_config
        self.events_on = bool(events and events.enable_kv_cache_events)
        if self.events_on:
            self.mgr.keep_kv_events()
        self.block_bytes = cfg.layout.block_bytes * cfg.tp_size
        self.storage_source = observe.storage_source(cfg.storage_backend)
        self.stats = observe.KvcachedStats()  # this interval's, for vLLM's stats
        # kvcached key -> vLLM block hash, for KV events; bounded (a CPU tier's
        # worth, twice, and room for storage's recent writes)
        self.names: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.names_cap = 2 * cfg.num_cpu_blocks + (1 << 16)
        self.reqs: dict[str, Tracked] = {}
        self.loading: dict[str, Tracked] = {}  # with loads in flight: what a step polls
        self.saves: collections.deque[SavePlan] = collections.deque()  # planned
        self.saving: list[Saving] = []  # in flight
        self.sent: set[str] = set()  # finished requests whose saves are done
        self.step = 0
        self.planned_loads: list[tuple[Tracked, Load]] = []
        self.step_loading: list[tuple[Tracked, Load, list[int]]] = []  # in flight, pinned
        self.lookups: list[Lookup] = []  # asked this step, not submitted yet
        self.kv_cache_manager = None
        self.block_pool = None
        self.null_id = 0  # vLLM's null block (its pool's first): a window's skipped blocks
        self.hook_s = 0.0  # time vLLM's scheduler spent in kvcached this step
        self.hook_cpu_s = 0.0  # and that thread's CPU time in it
        logger.info("kvcached: run dir %s (kvcached status --run-dir %s); CPU tier %d blocks, "
                    "storage %s", self.run_dir, self.run_dir, cfg.num_cpu_blocks,
                    cfg.storage_backend or "off")

    # ------------------------------------------------------------ requests
    def track(self, request) -> Tracked:
        t = self.reqs.get(request.request_id)
        hashes = request.block_hashes
        if t is None:
            t = self.reqs[request.request_id] = Tracked(
                request, self._requests(hashes), n_keys=len(hashes))
        elif len(hashes) > t.n_keys:
            new = list(hashes[t.n_keys:])
            for g, creq in zip(self.chains, t.creqs, strict=True):
                self.mgr.add_engine_hashes(creq, tagged(new, self.tags[g]))
            t.n_keys = len(hashes)
        return t

    def _requests(self, hashes) -> list:
        """The core's requests of vLLM's block hashes, one per chained group."""
        return [self.mgr.engine_request(tagged(list(hashes), self.tags[g])) for g in self.chains]

    def _block(self, t: Tracked, g: int, p: int, probe: bool = False):
        """The core's request of block ``p`` of window group ``g`` alone (a probe:
        only to look with, nothing to release)."""
        make = self.mgr.engine_probe if probe else self.mgr.engine_request
        return make([t.request.block_hashes[p] + self.tags[g]])

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit that kvcached can load (asynchronously), or
        None while that is not known yet (see the module docstring)."""
        t = self.track(request)
        now = time.monotonic()
        # vLLM asks every step for each request it could schedule: one whose
        # lookup is still out gets its answer again at once (a burst of new
        # requests waits a step or two for theirs, asked each step)
        if t.asked is not None and t.asked[:2] == (num_computed_tokens, request.num_tokens) \
                and not t.asked[2].answered(now):
            return None, False
        t.asked = None
        bs = self.block_size
        limit = min((request.num_tokens - 1) // bs, t.n_keys)  # one token left to compute
        local = num_computed_tokens // bs
        t.hit = (local, 0, 0)
        if limit <= local or t.failed or not self.loads_on:
            return 0, False  # after a failed load: no second try, no livelock
        if t.saves or t.loads:  # preempted while its saves or its in-step load copy
            return None, False  # (their blocks are about to be cached, or pinned)
        n_cpu, moving = [], False
        for creq in t.creqs:
            n, m = self.mgr.engine_cpu_prefix(creq, limit)
            n_cpu.append(n)
            moving |= m
        if moving:
            t.waiting_since = t.waiting_since or now
            if now - t.waiting_since < self.move_wait_s:
                return None, False
        total = self._restorable(t, n_cpu, limit, now)
        if total is not None and self.blockwise and total > local:
            total = self._blockwise(t, local, total, now)
        if total is None:
            lk = t.lookup if t.lookup is not None and t.lookup.prefixes is None else t.wlookup
            t.asked = (num_computed_tokens, request.num_tokens, lk)
            return None, False
        t.waiting_since = None
        cpu = min(n_cpu, default=total)
        t.hit = (local, cpu, max(0, total - cpu))
        ext = max(0, total - local) * bs
        # the CPU tier holds it all and it is short enough: load inside the step
        t.in_step = 0 < total - local <= self.step_max and total <= cpu
        return ext, ext > 0 and not t.in_step

    def _window_start(self, g: int, stop: int) -> int:
        """The first block window group ``g`` needs to go on after block ``stop``
        (vLLM's skipped blocks: the tokens a window no longer sees)."""
        return max(0, stop * self.block_size - self.groups[g].window + 1) // self.block_size

    def _needs(self, g: int, s: int, local: int) -> range:
        """The blocks of blockwise group ``g`` a hit of ``s`` blocks restores past
        vLLM's own ``local``: a window's, or a Mamba group's state after block
        ``s - 1`` (the one vLLM resumes from)."""
        if self.groups[g].kind == "mamba":
            return range(s - 1, s) if s > local else range(0)
        return range(max(local, self._window_start(g, s)), s)

    def _blockwise(self, t: Tracked, local: int, stop: int, now: float) -> int | None:
        """The longest hit up to ``stop`` blocks whose windows and states every
        blockwise group restores, from the CPU tier or storage: one lookup of
        what the CPU tier lacks of ``stop``'s windows and of every state past
        vLLM's own hit (a shorter hit may end at a state where a longer one has
        none); None until that lookup answers."""
        have: dict[tuple[int, int], bool] = {}

        def present(gp: tuple[int, int]) -> bool:
            if gp not in have:
                have[gp] = self.mgr.engine_cpu_prefix(self._block(t, *gp, probe=True),
                                                      1)[0] == 1
            return have[gp]

        need = [(g, p) for g in self.windows for p in self._needs(g, stop, local)]
        need += [(g, p) for g in self.states for p in range(local, stop)]
        missing = [gp for gp in need if not present(gp)]
        if missing and self.mgr.storage_lookup_wanted(local, stop):  # worth it for the hit
            ident = ("blockwise", stop, tuple(missing))
            prefixes = self._looked_up(t, "wlookup", ident, lambda: [
                (self._block(t, g, p, probe=True), 0, 1) for g, p in missing], now)
            if prefixes is None:
                return None
            have.update((gp, True) for gp, n in zip(missing, prefixes, strict=True) if n)
        for s in range(stop, local, -1):  # the CPU tier may hold a shorter hit's
            if all(present((g, p)) for g in self.blockwise for p in self._needs(g, s, local)):
                return s
        return local

    def _restorable(self, t: Tracked, n_cpu: list[int], limit: int, now: float) -> int | None:
        """How many leading blocks every chained group can restore, from the CPU
        tier (``n_cpu``, per group) and storage; None until storage's lookup
        answers."""
        wanted = self.mgr.storage_lookup_wanted
        runs, cap = [], limit  # (group, its CPU prefix) storage may extend; the others' cap
        for i, n in enumerate(n_cpu):
            if n < limit and wanted(n, limit):
                runs.append((i, n))
            elif n < cap:
                cap = n
        if not runs:
            return cap
        prefixes = self._looked_up(t, "lookup", (tuple(runs), limit), lambda: [
            (t.creqs[i], n, limit) for i, n in runs], now)
        if prefixes is None:
            return None
        return min([cap] + [n + found for (_, n), found in zip(runs, prefixes, strict=True)])

    def _looked_up(self, t: Tracked, attr: str, ident: tuple, runs, now: float
                   ) -> list[int] | None:
        """The answer of the request's lookup ``attr`` (per run, the blocks
        storage holds), asking it first if it is not the one asked (``runs()``
        makes its runs); None until storage answers. A lookup not answered by
        its deadline, or failed, found nothing."""
        lk = getattr(t, attr)
        if lk is None or lk.ident != ident:
            lk = Lookup(ident, runs())
            setattr(t, attr, lk)
            self.lookups.append(lk)  # submitted with the step's others
            return None
        if lk.prefixes is None:
            if lk.handle is None:
                return None
            if lk.handle.done():
                r = lk.handle.result
                lk.prefixes = [int(n) for n in r.result["prefixes"][
                    lk.index:lk.index + len(lk.runs)]] if r.ok else [0] * len(lk.runs)
                if not r.ok:
                    self.mgr.count_storage("lookup_failed")
            elif now >= lk.deadline:
                lk.prefixes = [0] * len(lk.runs)  # storage is slow: computing beats waiting
                self.mgr.count_storage("lookup_timed_out")
            else:
                return None
        return lk.prefixes

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: pin the prefix, plan the load."""
        t = self.track(request)
        bs = self.block_size
        cpu = 0
        t.own = t.hit[0] * bs  # vLLM's own prefix-cache hit
        t.preempted = False
        if num_external_tokens > 0:
            local = t.hit[0]
            stop = local + num_external_tokens // bs
            self._renew(t)
            ids = blocks.get_block_ids()
            cpu = num_external_tokens
            for g, creq in zip(self.chains, t.creqs, strict=True):
                plan = self._load(t, creq, local, list(ids[g]), stop, step=t.in_step)
                cpu = min(cpu, max(0, min(plan.n_cpu, stop) - local) * bs)
            for g in self.blockwise:
                # the window's blocks, or the state vLLM resumes from, only:
                # vLLM's null block stands for the ones before, and nothing
                # is copied there
                for p in range(self._first_copied(ids[g], local, stop), stop):
                    plan = self._load(t, self._block(t, g, p), 0, [ids[g][p]], 1, window=True)
                    if not self.chains and plan.n_cpu < 1:
                        cpu = 0  # blockwise groups alone: storage's if any block is
            self._name(t, stop)  # blocks storage brings into the CPU tier
            self.loads["step" if t.in_step else "async"] += 1
            if t.in_step:
                self.stats.count("step_loads")
            else:
                self.loading[request.request_id] = t
            t.lookup = t.wlookup = None
        t.split = (cpu, num_external_tokens - cpu)
        if not num_external_tokens:
            self._count_hit(t, 0)
        # else counted when its loads land: a block that fails to load (a
        # storage object refused on read) is no hit

    def _count_hit(self, t: Tracked, lost_tokens: int) -> None:
        """Count the hit the request's last allocation planned, less the tokens
        whose load failed (and every token after them: vLLM recomputes from
        the first missing block on)."""
        bs = self.block_size
        served = max(0, sum(t.split) - lost_tokens)
        cpu = min(t.split[0], served)
        for tier, tokens in zip(observe.TIERS, (cpu, served - cpu), strict=True):
            if tokens:  # most requests hit nothing: nothing to add
                self.stats.count(f"hit_tokens_{tier}", tokens)
                self.stats.count(f"loaded_bytes_{tier}", tokens // bs * self.block_bytes)
        if not t.counted:
            t.counted = True
            self.mgr.count_engine_request(t.request.num_tokens, t.own, cpu, served - cpu)

    def _lost_tokens(self, t: Tracked, load: Load, lost: list[int]) -> int:
        """Tokens of the request's hit that do not arrive, given the engine blocks
        ``lost`` of one of its loads: a hybrid's whole hit (vLLM computes it all
        again), else the load's blocks from the first lost one on."""
        if not lost:
            return 0
        if self.blockwise or len(self.chains) > 1:
            return sum(t.split)
        plan, gone = load.plan, set(lost)
        first = next((i for i in range(plan.start, plan.stop) if plan.device_ids[i] in gone),
                     plan.stop)
        return (plan.stop - first) * self.block_size

    def _load(self, t: Tracked, creq, start: int, ids: list[int], stop: int,
              window: bool = False, step: bool = False) -> EngineLoad:
        """Plan copying blocks ``start..stop-1`` of ``creq`` into ``ids``: in
        flight from here, submitted with this step's metadata."""
        plan = self.mgr.engine_load(creq, start, stop, ids)
        load = Load(plan, [Part() for _ in plan.tasks], window=window, step=step)
        t.loads.append(load)
        self.planned_loads.append((t, load))
        return plan

    def _first_copied(self, ids: list[int], local: int, stop: int) -> int:
        """The first of blocks ``local..stop-1`` a load copies into: past the
        last of vLLM's null blocks (a sliding window's, all before it)."""
        null = self.null_id
        for i in range(stop - 1, local - 1, -1):
            if ids[i] == null:
                return i + 1
        return local

    def hit_sources(self, request, num_external_tokens: int) -> dict:
        """The tokens of the request's external hit by vLLM's source names."""
        t = self.reqs.get(request.request_id)
        if t is None or not num_external_tokens:
            return {}
        cpu = min(t.split[0], num_external_tokens)
        return observe.hit_sources(cpu, num_external_tokens - cpu, self.storage_source)

    def take_stats(self) -> observe.KvcachedStats | None:
        """This interval's stats (None if nothing happened); a new interval starts."""
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, observe.KvcachedStats()
        return out

    def take_events(self) -> list:
        """vLLM's KV events for the CPU tier and storage since the last call, by
        vLLM's block hashes (a block kvcached no longer knows by name goes
        unreported)."""
        if not self.events_on:
            return []
        named = []
        for stored, tier, key in self.mgr.take_kv_events():
            h = self.names.get(key)
            if h is not None:
                named.append((stored, tier, h))
        return observe.kv_events(named)

    def _name(self, t: Tracked, blocks: int) -> None:
        """Remember vLLM's hashes of the blocks a save or a load brings into the
        CPU tier, by kvcached's keys (what the KV events carry); the oldest
        names go past a bound."""
        if not self.events_on:
            return
        new = list(t.request.block_hashes[t.named:blocks])  # the first group's names
        for key, h in zip(self.mgr.engine_keys(tagged(new, self.tags[0])), new, strict=True):
            self.names[key] = h
        t.named = max(t.named, blocks)
        while len(self.names) > self.names_cap:
            self.names.popitem(last=False)

    def finished(self, request) -> tuple[bool, None]:
        """vLLM is done with the request. Its blocks stay while a save or a load
        of it is in flight (True: vLLM frees them once it comes back in
        ``finished_sending`` or ``finished_recving``); its pinned path is
        released once nothing of it is in flight."""
        t = self.reqs.get(request.request_id)
        if t is None:
            return False, None
        t.finished = True
        # an in-step load holds its blocks itself (pinned until it lands)
        t.delayed = bool(t.saves or any(not load.step for load in t.loads))
        self._release_if_done(t)
        return t.delayed, None

    def _release_if_done(self, t: Tracked) -> None:
        if t.finished and not t.loads and not t.saves:
            for creq in t.creqs:
                self.mgr.engine_release(creq)
            self.reqs.pop(t.request.request_id, None)

    # ---------------------------------------------------------------- steps
    def build_meta(self, scheduler_output) -> tuple[set[str], set[int], set[str], StepLoad,
                                                    set[str]]:
        """One step (see the module docstring); returns the requests whose loads
        finished, the engine blocks that did not get their KV, the finished
        requests whose saves are all done (the workers report them), this
        step's load inside the step (the workers wait for it), and, for a
        model of several KV cache groups, the requests whose loads failed (in
        place of their blocks)."""
        self.step += 1
        for rid in scheduler_output.preempted_req_ids or ():
            self._preempted(rid)
        self._poll_step_loads()
        self._run_saves()
        self._submit_lookups()
        step_load = self._submit_loads()
        self._plan_saves(scheduler_output)
        self._poll_saves()
        done, bad, failed = self._poll_loads(with_failed=True)
        sent, self.sent = self.sent, set()
        if not scheduler_output.total_num_scheduled_tokens:
            self._wait_idle()
        if len(self.groups) == 1:
            return done, bad, sent, step_load, set()
        # A block id is a group's only: vLLM maps failed blocks back to their
        # requests for a model of one group, and stops on them for a hybrid.
        # There the request is failed whole (vLLM computes it all again).
        return done, set(), sent, step_load, failed

    def _wait_idle(self) -> None:
        """Nothing runs in this step and vLLM steps again at once. A loop that
        spins holds the GIL, and the coordinator's IO thread in this process
        gets it for each message only when the interpreter switches threads
        (every 5 ms): a storage hit, a lookup and a load, waited tens of ms.
        Such a step instead waits, the GIL released, up to ``IDLE_WAIT_S``
        for the oldest lookup or load in flight; the next step sees it land."""
        for t in self.reqs.values():
            for lk in (t.lookup, t.wlookup):
                if lk is not None and lk.prefixes is None and lk.handle is not None \
                        and not lk.handle.done():
                    lk.handle.wait(IDLE_WAIT_S)
                    return
        for t in self.loading.values():
            for load in t.loads:
                for part in load.parts:
                    if part.batch is not None and not part.batch.done():
                        part.batch.wait(IDLE_WAIT_S)
                        return

    def update_output(self, output) -> None:
        """After a step: completed loads and saves go straight to vLLM."""
        self._poll_step_loads()
        done, _, _ = self._poll_loads(with_failed=False)
        self._poll_saves()
        if done:
            output.finished_recving = (output.finished_recving or set()) | done
        if self.sent:
            output.finished_sending = (output.finished_sending or set()) | self.sent
            self.sent = set()

    def end_step(self, seconds: float, cpu_seconds: float) -> None:
        self.mgr.record_engine_step(seconds, cpu_seconds)
        self.hook_s = self.hook_cpu_s = 0.0

    def _preempted(self, rid: str) -> None:
        """vLLM freed the request's blocks and will compute it again: its planned
        saves are dropped (their blocks may be reused), those in flight copy on
        from blocks they hold; its path is let go once they land."""
        t = self.reqs.get(rid)
        if t is None:
            return
        t.saved = 0
        t.preempted = True
        kept = collections.deque()
        for plan in self.saves:
            if plan.rid == rid:
                t.saves -= 1
                self._unpin(plan.held)
                self.stats.count("saves_dropped")
            else:
                kept.append(plan)
        self.saves = kept
        self._renew(t)

    def _renew(self, t: Tracked) -> None:
        """Let go of the path the request's loads and saves pinned (its blocks stay
        cached): vLLM computes the request again, or loads it anew."""
        if any(c.n_path for c in t.creqs) and not t.saves and not t.loads:
            for creq in t.creqs:
                self.mgr.engine_release(creq)
            t.creqs = self._requests(t.request.block_hashes[:t.n_keys])

    # ------------------------------------------------------------ block pins
    # A save in flight holds a reference to each block it reads (one per save
    # that reads it): nothing reuses them until it lands.
    def _pin(self, block_ids: list[int]) -> None:
        if self.block_pool is not None:
            self.block_pool.touch([self.block_pool.blocks[i] for i in block_ids])

    def _unpin(self, block_ids: list[int]) -> None:
        if self.block_pool is not None:
            self.block_pool.free_blocks([self.block_pool.blocks[i] for i in block_ids])

    def pending_block_frees(self) -> bool:
        """Whether saves in flight hold blocks nothing else does: they are free
        once the saves land, so vLLM may wait for them rather than preempt.
        (vLLM asks only when it is out of blocks: the count is made then.)"""
        pool = self.block_pool
        if pool is None or not self.saving:
            return False
        held = collections.Counter(i for s in self.saving for i in s.src)
        return any(pool.blocks[i].ref_cnt == n for i, n in held.items())

    # ------------------------------------------------------------------ saves
    def _run_saves(self) -> None:
        """Submit the saves that are due, as one task."""
        due, batch, windows = [], [], []
        while self.saves and self.saves[0].step + self.lag <= self.step:
            due.append(self.saves.popleft())
        for plan in due:
            t = self.reqs[plan.rid]
            self.track(t.request)
            blocks = min(plan.blocks, t.n_keys)
            for g, creq in zip(self.chains, t.creqs, strict=True):
                if plan.blocks:  # none: a plan of Mamba states alone
                    batch.append((creq, blocks, plan.device_ids[g]))
            for g, p, block_id in plan.states:
                windows.append(self._block(t, g, p))
                batch.append((windows[-1], 1, [block_id]))
            for g in self.windows:
                # each block of its own (a block vLLM dropped from the window
                # before this plan, its null block, was saved by an earlier one)
                for p in range(plan.start, blocks):
                    if plan.device_ids[g][p] != self.null_id:
                        windows.append(self._block(t, g, p))
                        batch.append((windows[-1], 1, [plan.device_ids[g][p]]))
            self._name(t, blocks)
        if due:
            save = self.mgr.engine_save(batch)
            src = list(save.handle.task.src) if save is not None else []
            self._pin(src)
            for plan in due:
                self._unpin(plan.held)
            self.saving.append(Saving(save, due, src, windows))

    def _poll_saves(self) -> None:
        still = []
        for s in self.saving:
            if s.save is not None and not s.save.done():
                still.append(s)
                continue
            if s.save is not None:
                self.mgr.engine_finish_save(s.save)
                if s.save.done() and s.save.handle.result.ok:
                    self.stats.count("saved_blocks", len(s.src))
                    self.stats.count("saved_bytes", len(s.src) * self.block_bytes)
            for creq in s.windows:  # their blocks stay cached, unpinned
                self.mgr.engine_release(creq)
            self._unpin(s.src)
            for plan in s.plans:
                t = self.reqs[plan.rid]
                self._retry_if_short(t, plan)
                t.saves -= 1
                self._save_done(t)
        self.saving = still

    def _retry_if_short(self, t: Tracked, plan: SavePlan) -> None:
        """Plan the save again if it stopped short (at a block another request was
        moving), unless the request was preempted since (its blocks went back)."""
        if plan.attempt >= SAVE_ATTEMPTS or t.saved < plan.blocks:
            return
        blocks = min(plan.blocks, t.n_keys)
        if any(self.mgr.engine_cpu_prefix(c, blocks)[0] < blocks for c in t.creqs):
            self.saves.append(SavePlan(self.step, plan.rid, plan.blocks, plan.device_ids,
                                       plan.attempt + 1, start=plan.start))
            t.saves += 1

    def _save_done(self, t: Tracked) -> None:
        if t.finished and t.delayed and not t.saves and not t.loads:
            self.sent.add(t.request.request_id)
        if not t.finished and not t.saves and t.saved == 0:
            self._renew(t)  # preempted: its path goes now that its saves landed
        self._release_if_done(t)

    def _plan_saves(self, scheduler_output) -> None:
        """The full blocks this step's forward computes, and the Mamba states it
        leaves, to copy ``lag`` steps on."""
        if not self.saves_on:
            return
        states = self._plan_states(scheduler_output)
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            t = self.reqs.get(rid)
            if t is None:
                continue
            done = computed.get(rid, 0) + n - len(spec.get(rid, ()))  # drafts may be rejected
            blocks = done // self.block_size
            if blocks > t.saved:
                ids = tuple(list(g) for g in self.kv_cache_manager.get_block_ids(rid))
                # vLLM drops a sliding window's blocks from the request as it
                # moves on, before this save runs: they stay pinned until then
                held = [i for g, group in zip(ids, self.groups, strict=True)
                        if group.kind == "sliding" for i in g[t.saved:blocks] if i != self.null_id]
                self._add_plan(t, SavePlan(self.step, rid, blocks, ids, held=held, start=t.saved,
                                           states=states.pop(rid, [])))
                t.saved = blocks
        for rid, found in states.items():  # a request not computing this step
            self._add_plan(self.reqs[rid], SavePlan(self.step, rid, 0, (), states=found))

    def _add_plan(self, t: Tracked, plan: SavePlan) -> None:
        plan.held += [block_id for _, _, block_id in plan.states]
        self._pin(plan.held)
        self.saves.append(plan)
        t.saves += 1

    def _plan_states(self, scheduler_output) -> dict[str, list[tuple[int, int, int]]]:
        """The Mamba states vLLM hands over this step, by request: (group, block,
        engine block id) of each state at a block boundary (the state after
        that block's last token; one inside a block is never a hit's). vLLM
        names the exact block each lives in: a Mamba group's block table is no
        guide, as vLLM moves and frees its states while the request runs."""
        handed = getattr(scheduler_output, "kv_connector_block_state", None)
        out: dict[str, list[tuple[int, int, int]]] = {}
        if handed is None or not self.states:
            return out
        bs = self.block_size
        for rid, entries in (handed.boundary_state_offloads or {}).items():
            t = self.reqs.get(rid)
            if t is None:
                continue
            for g, block_id, tokens in entries:
                if g in self.states and tokens % bs == 0 \
                        and 0 < tokens // bs <= len(t.request.block_hashes) \
                        and block_id != self.null_id:
                    out.setdefault(rid, []).append((g, tokens // bs - 1, block_id))
        return out

    # ---------------------------------------------------------------- lookups
    def _submit_lookups(self) -> None:
        """This step's storage lookups, one task: one round trip to storage for
        all the requests vLLM asked about."""
        if not self.lookups:
            return
        batch, self.lookups = self.lookups, []
        runs = []
        for lk in batch:
            lk.index = len(runs)
            runs += lk.runs
        handle = self.mgr.engine_storage_lookups(runs)
        deadline = time.monotonic() + self.lookup_timeout_s
        for lk in batch:
            if handle is None:
                lk.prefixes = [0] * len(lk.runs)  # storage went unusable since
            lk.handle, lk.deadline = handle, deadline

    # ------------------------------------------------------------------ loads
    def _submit_loads(self) -> StepLoad:
        """This step's loads, one task per kind: a swap-in from the CPU tier, a load
        from storage into the engine's blocks, a load into host blocks only; and
        the swap-ins inside the step, one ``swap_in_layers`` task whose blocks
        stay pinned until it lands (whatever becomes of their requests)."""
        batches: dict[tuple[str, bool, int], list[tuple[Task, Part]]] = \
            collections.defaultdict(list)
        step = StepLoad(timeout_s=self.step_timeout_s)
        pinned: list[int] = []  # the step's loads share it (one task)
        for t, load in self.planned_loads:
            if load.step:
                step.failed.update(load.plan.missing)
                self.step_loading.append((t, load, pinned))  # filled below
            for task, part in zip(load.plan.tasks, load.parts, strict=True):
                # Swap-ins batch (all or nothing); a storage read reports the
                # prefix it got, which must be this request's alone (its
                # groups' in one read: a block short in one group counts the
                # later groups' as not arrived, and they are recomputed).
                kind = "swap_in_layers" if load.step else task.kind
                key = (kind, "device_ids" in task.args, id(t) if task.kind == "load" else -1)
                batches[key].append((task, part))
        self.planned_loads.clear()
        for (kind, _, _), parts in batches.items():
            merged = Task(kind, [], [], {})
            for task, part in parts:
                part.offset, part.length = len(merged.dst), len(task.dst)
                merged.src += task.src
                merged.dst += task.dst
                for key, value in task.args.items():
                    merged.args.setdefault(key, []).extend(value)
            handle = self.mgr.submit(merged)
            for _, part in parts:
                part.batch = handle
                part.submitted = time.monotonic()
            if kind == "swap_in_layers":
                if handle.done() and not handle.result.ok:  # refused at once (ranks down)
                    step.failed.update(merged.dst)
                else:
                    step.task_id = handle.task.task_id
                    step.blocks = list(merged.dst)
                    pinned += merged.dst
                    self._pin(pinned)
        if step.task_id >= 0:
            # vLLM's forward starts next, in this process on one rank, and holds
            # the GIL: let the coordinator send the task first (microseconds)
            self.mgr.flush_submitted(STEP_FLUSH_S)
        return step

    def _poll_step_loads(self) -> None:
        """Land the loads inside a step whose task completed. The forward that
        needed them waited for every layer (or reported their blocks failed,
        in the same pass), so vLLM hears nothing more: their blocks are
        unpinned, and their requests let go once nothing else is in flight."""
        if not self.step_loading:
            return
        still = []
        for t, load, pinned in self.step_loading:
            if not load.done():
                still.append((t, load, pinned))
                continue
            lost = self.mgr.engine_finish_load(load.plan, load.results())
            t.failed |= bool(lost)
            self.stats.count("load_failed_blocks", len(lost))
            self._count_hit(t, self._lost_tokens(t, load, lost))
            if load.parts:
                self.stats.load_took(time.monotonic() - load.parts[0].submitted)
            t.loads.remove(load)
            if pinned:  # one list for the step's loads (one task: done together)
                self._unpin(pinned)
                pinned.clear()
            if t.preempted:
                self._renew(t)  # its path goes once nothing of it is in flight
            if t.finished and t.delayed and not t.saves and not t.loads:
                self.sent.add(t.request.request_id)
            self._release_if_done(t)
        self.step_loading = still

    def _poll_loads(self, with_failed: bool) -> tuple[set[str], set[int], set[str]]:
        """Requests whose loads all completed, the blocks that did not arrive, and
        the requests those belong to. Without ``with_failed`` a request with a
        failed load is left for the next call with it: its blocks must reach
        vLLM in the pass that finishes it, and only the workers' report carries
        them."""
        done: set[str] = set()
        bad: set[int] = set()
        failed: set[str] = set()
        for rid, t in list(self.loading.items()):
            if not all(load.done() for load in t.loads):
                continue
            if not with_failed and not all(load.clean() for load in t.loads):
                continue
            now = time.monotonic()
            gone = 0  # tokens of the hit that did not arrive
            for load in t.loads:
                lost = self.mgr.engine_finish_load(load.plan, load.results())
                if load.window:
                    self.mgr.engine_release(load.plan.creq)
                t.failed |= bool(lost)
                bad.update(lost)
                if lost:
                    failed.add(rid)
                gone = max(gone, self._lost_tokens(t, load, lost))
                self.stats.count("load_failed_blocks", len(lost))
                if load.parts:  # none when nothing could be planned (all missing)
                    self.stats.load_took(now - min(p.submitted for p in load.parts))
            self._count_hit(t, gone)
            t.loads.clear()
            del self.loading[rid]
            done.add(rid)  # a finished request's blocks are freed by this too
            self._release_if_done(t)
        return done, bad, failed

    def close(self) -> None:
        """Land the saves vLLM's last steps planned, then close the manager (it
        waits for their writes to storage): without this, the blocks of a
        process's last requests (a producer's last prompt) never reached the
        CPU tier's write-through, for nothing steps again to land them."""
        try:
            self._drain_saves(time.monotonic() + self.move_wait_s)
        finally:
            try:
                self.mgr.close()
            finally:
                if self.temporary:
                    shutil.rmtree(self.run_dir, ignore_errors=True)

    def _drain_saves(self, deadline: float) -> None:
        """vLLM closes the connector after its model executor, between steps, so
        no forward runs now. With one batch in flight (lag 1) the last step's
        forward has finished, and every planned save copies computed blocks;
        with two (async scheduling) the last step's may not have run, and only
        the saves due by the usual rule go."""
        self.step += 1 if self.lag == 1 else 0
        self._run_saves()
        for s in self.saving:
            if s.save is not None and not s.save.handle.wait(max(0.0, deadline - time.monotonic())):
                logger.warning("kvcached: closing with a save still in flight")
                return
        self._poll_saves()
