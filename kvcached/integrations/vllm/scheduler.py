"""The scheduler half of the connector: kvcached's manager inside vLLM's
engine-core process.

vLLM keeps its GPU tier (its block pool, its prefix cache, its block ids);
kvcached's ``CacheManager`` (with ``external_gpu_tier``) holds the CPU tier
and storage for this model and drives the transfer workers. Each step:

- ``get_num_new_matched_tokens``: how many tokens past vLLM's own hit the
  CPU tier, then storage, hold (block-aligned; at least one prompt token is
  left to compute). Changes nothing.
- ``update_state_after_alloc``: vLLM gave the request its blocks; the cached
  prefix is pinned and its copy into those blocks planned (asynchronous:
  the request waits in WAITING_FOR_REMOTE_KVS, vLLM keeps scheduling).
- ``build_connector_meta``: (1) the saves of blocks an earlier forward
  computed are copied into the CPU tier, in one task, and waited for: this
  step's forward may reuse a block vLLM freed meanwhile; (2) this step's loads
  are submitted (one task per direction); (3) this step's saves are planned;
  (4) loads that finished are handed to the workers, with the blocks that
  did not arrive, in the metadata; the workers report them back to vLLM
  (``finished_recving`` / ``get_block_ids_with_load_errors``), so a failed
  or lost load is recomputed, never used.

A save planned at step N is copied at step N + lag, lag being the number of
batches vLLM keeps in flight (1, or 2 with async scheduling): by then
forward N has finished, and a block freed since can only be rewritten by a
forward not yet started. A request preempted in between is not saved (its
blocks may already hold another request's KV).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from kvcached.core.manager import CacheManager, EngineLoad
from kvcached.integrations.vllm import config as vconfig
from kvcached.memory import kvshare
from kvcached.transfer.base import Task, TaskHandle, TaskResult

# Through vLLM's logger: its log is where a vLLM operator looks (the run dir).
logger = logging.getLogger("vllm.kvcached")


@dataclass
class Tracked:
    """A vLLM request as kvcached knows it."""

    request: object  # vllm.v1.request.Request
    creq: object  # the core's request: keys of vLLM's block hashes, the path it holds
    n_keys: int = 0  # vLLM block hashes made keys so far
    saved: int = 0  # blocks up to which saves were planned
    hit: tuple[int, int, int] = (0, 0, 0)  # (vLLM's own blocks, CPU tier, storage) at lookup
    loads: list[Load] = field(default_factory=list)  # in flight
    counted: bool = False  # in the hit statistics
    failed: bool = False  # a load failed: the rest of the request computes its KV
    finished: bool = False
    preempted_at: int = -1  # step of the last preemption


@dataclass
class Part:
    """One task of a load, inside a step's batch: ``length`` of the batch's blocks
    from ``offset`` on."""

    batch: TaskHandle | None = None
    offset: int = 0
    length: int = 0


@dataclass
class Load:
    plan: EngineLoad
    parts: list[Part]

    def done(self) -> bool:
        return all(p.batch is not None and p.batch.done() for p in self.parts)

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
    device_ids: list[int]


class SchedulerHalf:
    """kvcached in vLLM's scheduler (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config):
        self.run_dir = vconfig.run_dir_of(vllm_config)
        group = vconfig.attention_spec(kv_cache_config)
        # The workers exported their planes before the scheduler starts: their
        # shape says whether K and V share a plane (vLLM's CPU backend) or not.
        desc = kvshare.read_descriptor(self.run_dir, 0)
        fused = len(desc["planes"]) == len(group.layer_names)
        cfg = vconfig.cache_config(vllm_config, kv_cache_config, fused)
        why = vconfig.check_hashes_reproducible(vllm_config, cfg)
        if why:
            logger.warning("kvcached: %s", why)
        self.block_size = cfg.block_size
        self.lag = max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))
        self.mgr = CacheManager(cfg).start()
        self.reqs: dict[str, Tracked] = {}
        self.saves: collections.deque[SavePlan] = collections.deque()
        self.step = 0
        self.planned_loads: list[tuple[Tracked, Load]] = []
        self.kv_cache_manager = None
        logger.info("kvcached: run dir %s (kvcached status --run-dir %s); CPU tier %d blocks, "
                    "storage %s", self.run_dir, self.run_dir, cfg.num_cpu_blocks,
                    cfg.storage_backend or "off")

    # ------------------------------------------------------------ requests
    def track(self, request) -> Tracked:
        t = self.reqs.get(request.request_id)
        if t is None:
            t = self.reqs[request.request_id] = Tracked(request,
                                                        self.mgr.engine_request([]))
        hashes = request.block_hashes
        if len(hashes) > t.n_keys:
            self.mgr.add_engine_hashes(t.creq, list(hashes[t.n_keys:]))
            t.n_keys = len(hashes)
        return t

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past vLLM's own hit that kvcached can load (asynchronously)."""
        t = self.track(request)
        bs = self.block_size
        limit = min((request.num_tokens - 1) // bs, t.n_keys)  # one token left to compute
        local = num_computed_tokens // bs
        if limit <= local or t.failed:  # after a failed load: no second try, no livelock
            return 0, False
        n_cpu, n_storage = self.mgr.engine_lookup(t.creq, limit)
        t.hit = (local, n_cpu, n_storage)
        ext = max(0, n_cpu + n_storage - local) * bs
        return ext, ext > 0

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: pin the prefix, plan the load."""
        t = self.track(request)
        bs = self.block_size
        cpu = storage = 0
        if num_external_tokens > 0:
            local = t.hit[0]
            stop = local + num_external_tokens // bs
            self._renew(t)
            plan = self.mgr.engine_load(t.creq, local, stop, list(blocks.get_block_ids()[0]))
            self.planned_loads.append((t, Load(plan, [Part() for _ in plan.tasks])))
            cpu = max(0, min(plan.n_cpu, stop) - local) * bs
            storage = max(0, min(plan.n_cpu + len(plan.nodes), stop) - max(plan.n_cpu, local)) * bs
        if not t.counted:
            t.counted = True
            self.mgr.count_engine_request(request.num_tokens, cpu, storage)

    def finished(self, request) -> tuple[bool, None]:
        """vLLM is done with the request. Its blocks are freed at once (a save
        still due copies before any forward can reuse them); its pinned path is
        released once its loads and saves are done."""
        t = self.reqs.get(request.request_id)
        if t is not None:
            t.finished = True
            self._release_if_done(t)
        return False, None

    def _release_if_done(self, t: Tracked) -> None:
        if t.finished and not t.loads and not any(p.rid == t.request.request_id
                                                  for p in self.saves):
            self.mgr.engine_release(t.creq)
            del self.reqs[t.request.request_id]

    # ---------------------------------------------------------------- steps
    def build_meta(self, scheduler_output) -> tuple[set[str], set[int]]:
        """One step (see the module docstring); returns the requests whose loads
        finished and the engine blocks that did not get their KV."""
        self.step += 1
        for rid in scheduler_output.preempted_req_ids or ():
            self._preempted(rid)
        self._run_saves()
        self._submit_loads()
        self._plan_saves(scheduler_output)
        return self._finished_loads()

    def _preempted(self, rid: str) -> None:
        """vLLM freed the request's blocks and will compute it again: its path is
        let go (its blocks stay cached) and its unsaved blocks are not saved."""
        t = self.reqs.get(rid)
        if t is None:
            return
        t.preempted_at = self.step
        t.saved = 0
        if not t.loads:  # a load in flight keeps the path until it lands
            self._renew(t)

    def _renew(self, t: Tracked) -> None:
        """Let go of the path the request's loads and saves pinned (its blocks stay
        cached): vLLM computes the request again, or loads it anew."""
        if t.creq.n_path:
            self.mgr.engine_release(t.creq)
            t.creq = self.mgr.engine_request(list(t.request.block_hashes[:t.n_keys]))

    def _run_saves(self) -> None:
        due, batch = [], []
        while self.saves and self.saves[0].step + self.lag <= self.step:
            due.append(self.saves.popleft())
        for plan in due:
            t = self.reqs.get(plan.rid)
            if t is None or t.preempted_at > plan.step:  # its blocks may hold other KV now
                continue
            self.track(t.request)
            batch.append((t.creq, min(plan.blocks, t.n_keys), plan.device_ids))
        if batch:
            self.mgr.engine_save(batch)
        for plan in due:
            t = self.reqs.get(plan.rid)
            if t is not None:
                self._release_if_done(t)

    def _submit_loads(self) -> None:
        """This step's loads, one task per kind: a swap-in from the CPU tier, a load
        from storage into the engine's blocks, a load into host blocks only."""
        batches: dict[tuple[str, bool], list[tuple[Task, Part]]] = collections.defaultdict(list)
        for t, load in self.planned_loads:
            for task, part in zip(load.plan.tasks, load.parts, strict=True):
                batches[task.kind, "device_ids" in task.args].append((task, part))
            t.loads.append(load)
        self.planned_loads.clear()
        for (kind, _), parts in batches.items():
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

    def _plan_saves(self, scheduler_output) -> None:
        """The full blocks this step's forward computes, to copy ``lag`` steps on."""
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
                ids = list(self.kv_cache_manager.get_block_ids(rid)[0])
                self.saves.append(SavePlan(self.step, rid, blocks, ids))
                t.saved = blocks

    def _finished_loads(self) -> tuple[set[str], set[int]]:
        done: set[str] = set()
        bad: set[int] = set()
        for rid, t in list(self.reqs.items()):
            if not t.loads:
                continue
            for load in [x for x in t.loads if x.done()]:
                lost = self.mgr.engine_finish_load(load.plan, load.results())
                t.failed |= bool(lost)
                bad.update(lost)
                t.loads.remove(load)
            if not t.loads:
                done.add(rid)
                self._release_if_done(t)
        return done, bad

    def close(self) -> None:
        self.mgr.close()
