"""The scheduler half's wait in a step with nothing scheduled
(``SchedulerHalf._wait_idle``): it sleeps, the GIL released, until the oldest
lookup or load in flight lands, and never longer than ``IDLE_WAIT_S``; with
nothing in flight it returns at once. (vLLM's own runs of it: the storage
hits of tests/integrations/test_vllm_conformance.py and ``bench_vllm``.) And
what it does at close: the saves vLLM's last steps planned land first
(``SchedulerHalf._drain_saves``; vLLM's own run of it: the producer that
exits at once, in the conformance module). And which blocks vLLM may wait
for rather than preempt (``SchedulerHalf.pending_block_frees``)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")
from kvcached.integrations.vllm import scheduler as S  # noqa: E402
from kvcached.tasks import Task, TaskHandle, TaskResult  # noqa: E402


def half_with(lookup_handle=None, load_handle=None) -> S.SchedulerHalf:
    """A scheduler half holding one tracked request with that work in flight."""
    half = S.SchedulerHalf.__new__(S.SchedulerHalf)  # no vLLM config: only its state
    t = S.Tracked(request=None, creqs=[None])
    if lookup_handle is not None:
        t.lookup = S.Lookup(("run",), [(None, 0, 4)], handle=lookup_handle)
    if load_handle is not None:
        t.loads.append(S.Load(plan=None, parts=[S.Part(batch=load_handle)]))
    half.reqs = {"r": t}
    half.loading = {"r": t} if t.loads else {}
    return half


def handle() -> TaskHandle:
    return TaskHandle(Task("noop", [], []), collections.deque())


def complete_after(h: TaskHandle, seconds: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(seconds),
                                          h.complete(TaskResult(task_id=0, ok=True))))
    th.start()
    return th


@pytest.mark.parametrize("kind", ["lookup", "load"])
def test_an_idle_step_waits_for_the_work_in_flight(monkeypatch, kind):
    monkeypatch.setattr(S, "IDLE_WAIT_S", 30.0)  # longer than the test may take
    h = handle()
    half = half_with(**{f"{kind}_handle": h})
    th = complete_after(h, 0.05)
    t0 = time.monotonic()
    half._wait_idle()
    assert h.done(), "the idle step returned before the work it waits for landed"
    assert time.monotonic() - t0 < 10.0  # woken by the completion, not the bound
    th.join()


def test_the_wait_is_bounded_and_nothing_in_flight_returns_at_once(monkeypatch):
    monkeypatch.setattr(S, "IDLE_WAIT_S", 0.05)
    h = handle()  # never completes
    t0 = time.monotonic()
    half_with(lookup_handle=h)._wait_idle()
    waited = time.monotonic() - t0
    assert 0.04 <= waited < 10.0 and not h.done()
    done = handle()
    done.complete(TaskResult(task_id=0, ok=True))
    monkeypatch.setattr(S, "IDLE_WAIT_S", 30.0)
    t0 = time.monotonic()
    half_with(lookup_handle=done)._wait_idle()  # landed already: nothing to wait for
    half_with()._wait_idle()  # nothing in flight
    assert time.monotonic() - t0 < 10.0


def test_a_load_with_nothing_to_copy_reports_its_blocks_lost():
    """A block that left the CPU tier (and storage) between the lookup and
    vLLM's allocation is planned as missing, with no task: the load finishes
    at once and vLLM recomputes the block (the soak's churn found this)."""
    from kvcached.core.manager import EngineLoad

    half = counting_half(blockwise=[1])
    t = half.reqs["r"]
    t.split = (0, 16)
    t.loads.append(S.Load(EngineLoad(None, 0, 1, [7], 0, missing=[7]), [], window=True))
    half.loading = {"r": t}
    assert half._poll_loads(with_failed=True) == ({"r"}, {7}, {"r"})
    assert t.failed and not t.loads and not half.loading
    # a hybrid's failed load is recomputed whole: no hit
    assert hits(half) == (0, 0) and half.mgr.counted == [(64, 0, 0, 0)]


class CountingManager:
    """Lands loads (the blocks ``plan.missing`` plus ``lose`` did not arrive) and
    records the requests counted in the hit statistics."""

    def __init__(self, lose=()):
        self.lose, self.counted = set(lose), []

    def engine_finish_load(self, plan, results):
        return sorted(set(plan.missing) | (self.lose & set(plan.device_ids)))

    def engine_release(self, creq):
        pass

    def count_engine_request(self, prompt, own, cpu, storage):
        self.counted.append((prompt, own, cpu, storage))


def counting_half(blockwise=(), lose=()) -> S.SchedulerHalf:
    half = half_with()
    half.mgr, half.stats = CountingManager(lose), S.observe.KvcachedStats()
    half.chains, half.blockwise = [0], list(blockwise)
    half.block_size, half.block_bytes = 16, 100
    half.reqs["r"].request = type("Request", (), {"request_id": "r", "num_tokens": 64})()
    return half


def hits(half) -> tuple[int, int]:
    c = half.stats.data["counters"]
    return c["hit_tokens_cpu"], c["hit_tokens_storage"]


@pytest.mark.parametrize("lose, want", [((), (16, 32)), ((7,), (16, 0)), ((6,), (0, 0))])
def test_a_hit_counts_the_tokens_that_arrived(lose, want):
    """A hit is counted when its load lands, less what did not arrive (a storage
    object refused on read: a bad MAC) and every block after it (vLLM
    recomputes from the first missing one): kvcached's hit tokens agree with
    what it served, in its stats and in vLLM's metrics."""
    from kvcached.core.manager import EngineLoad
    half = counting_half(lose=lose)
    t = half.reqs["r"]
    t.split, t.own = (16, 32), 16  # block 1 from the CPU tier, 2 and 3 from storage
    t.loads.append(S.Load(EngineLoad(None, 1, 4, [5, 6, 7, 8], 2), []))
    half.loading = {"r": t}
    half._poll_loads(with_failed=True)
    assert hits(half) == want
    assert half.stats.data["counters"]["loaded_bytes_storage"] == want[1] // 16 * 100
    assert half.mgr.counted == [(64, 16, *want)]


class SavingManager:
    """The manager calls a close drains saves through, recorded."""

    def __init__(self):
        self.saved, self.landed, self.closed = [], 0, False

    def engine_save(self, batch):
        from kvcached.core.manager import EngineSave
        self.saved.append([blocks for _, blocks, _ in batch])
        src = [i for _, blocks, ids in batch for i in ids[:blocks]]
        h = TaskHandle(Task("swap_out", src, src), collections.deque())
        h.complete(TaskResult(task_id=0, ok=True))
        return EngineSave(handle=h)

    def engine_finish_save(self, save):
        self.landed += 1

    def engine_cpu_prefix(self, creq, blocks):
        return blocks, 0

    def engine_release(self, creq):
        pass

    def close(self):
        self.closed = True


def half_saving(lag: int) -> tuple[S.SchedulerHalf, SavingManager]:
    """A finished request with one save planned at each of steps 1 and 2 (the last)."""
    half = S.SchedulerHalf.__new__(S.SchedulerHalf)
    half.mgr, half.lag, half.step = SavingManager(), lag, 2
    half.events_on, half.block_pool, half.stats = False, None, S.observe.KvcachedStats()
    half.move_wait_s, half.saving, half.sent, half.block_bytes = 5.0, [], set(), 64
    half.temporary = False  # a run dir of the test's own

    class Request:
        request_id, block_hashes = "r", [b"a", b"b", b"c", b"d"]
    t = S.Tracked(request=Request(), creqs=[None], n_keys=4, saved=4, saves=2, finished=True,
                  delayed=True)
    half.reqs = {"r": t}
    half.groups, half.tags = [S.vconfig.Group(0, "full", ("l",))], [b""]
    half.chains, half.windows = [0], []
    half.saves = collections.deque([S.SavePlan(1, "r", 2, ([10, 11, 12, 13],)),
                                    S.SavePlan(2, "r", 4, ([10, 11, 12, 13],))])
    return half, half.mgr


def test_close_lands_the_last_steps_saves():
    """No forward runs at close: with one batch in flight the last step's
    forward has finished, so its saves go too, and each lands (its write to
    storage starts there) before the manager closes."""
    half, mgr = half_saving(lag=1)
    half.close()
    assert mgr.saved == [[2, 4]] and mgr.landed == 1 and mgr.closed
    assert half.sent == {"r"}  # the request's saves are done


def test_close_with_two_batches_in_flight_keeps_the_last_steps_saves():
    """With async scheduling the last step's forward may not have run: its
    blocks may hold nothing yet, so only the saves due by the usual rule go."""
    half, mgr = half_saving(lag=2)
    half.step = 3
    half.close()
    assert mgr.saved == [[2]] and mgr.closed


def half_with_pool(blocks: int):
    """A scheduler half bound to vLLM's own block pool, with no save in flight."""
    from vllm.v1.core.block_pool import BlockPool
    half = S.SchedulerHalf.__new__(S.SchedulerHalf)
    half.block_pool = BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=16)
    half.saving = []
    return half


def test_blocks_only_saves_hold_are_pending_frees():
    """vLLM waits for blocks rather than preempt when the connector says some
    are about to be freed: true only while a save in flight holds a block that
    nothing else does (two saves of one block hold it twice)."""
    half = half_with_pool(8)
    assert not half.pending_block_frees()  # nothing in flight
    a, b = half.block_pool.get_new_blocks(2)  # a request's blocks (ref 1 each)
    for src in ([a.block_id], [a.block_id, b.block_id]):
        half._pin(src)
        half.saving.append(S.Saving(None, [], src))
    assert not half.pending_block_frees()  # the request still holds both blocks
    half.block_pool.free_blocks([a, b])  # preempted: vLLM lets go of them
    assert half.pending_block_frees()  # the saves alone hold them now
    for s in half.saving:
        half._unpin(s.src)
    half.saving = []
    assert not half.pending_block_frees() and a.ref_cnt == b.ref_cnt == 0


def test_mamba_states_are_saved_where_vllm_hands_them_over():
    """vLLM names each Mamba state it keeps: (group, engine block, tokens). One
    at a block boundary is saved as its group's block tokens / block_size - 1,
    its engine block pinned from the plan (vLLM frees a state's block as the
    request moves on) until the save runs or the request is preempted; one
    inside a block, vLLM's null block, another group's and an untracked
    request's are not saved."""
    from types import SimpleNamespace
    half = half_with_pool(8)
    half.block_size, half.null_id, half.saves_on, half.step = 16, 0, True, 3
    half.groups = [S.vconfig.Group(0, "full", ("a",)), S.vconfig.Group(1, "mamba", ("m",))]
    half.chains, half.windows, half.states = [], [], [1]
    half.saves, half.stats = collections.deque(), S.observe.KvcachedStats()

    class Request:
        request_id, block_hashes = "r", [b"a", b"b", b"c"]
    half.reqs = {"r": S.Tracked(request=Request(), creqs=[], n_keys=3)}
    t = half.reqs["r"]
    a, b = half.block_pool.get_new_blocks(2)
    handed = {"r": [(1, a.block_id, 32), (1, b.block_id, 40), (1, 0, 16), (0, b.block_id, 48),
                    (1, b.block_id, 64)],  # past the request's hashed blocks
              "untracked": [(1, b.block_id, 16)]}
    out = SimpleNamespace(
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=handed),
        num_scheduled_tokens={}, scheduled_spec_decode_tokens=None, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    half._plan_saves(out)
    (plan,) = half.saves
    assert plan.states == [(1, 1, a.block_id)] and plan.blocks == 0 and t.saves == 1
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)  # pinned: vLLM's reference and the plan's
    half._preempted("r")
    assert not half.saves and t.saves == 0 and (a.ref_cnt, b.ref_cnt) == (1, 1)


def test_a_hit_ends_where_every_mamba_group_has_its_state():
    """A Mamba group restores a hit of s blocks from its state after block
    s - 1 alone; a window group from the window before s."""
    half = S.SchedulerHalf.__new__(S.SchedulerHalf)
    half.block_size = 16
    half.groups = [S.vconfig.Group(0, "mamba", ("m",)),
                   S.vconfig.Group(1, "sliding", ("s",), window=32)]
    assert list(half._needs(0, 5, 2)) == [4]
    assert list(half._needs(0, 2, 2)) == []  # vLLM's own hit holds it
    assert list(half._needs(1, 5, 2)) == [3, 4]


def test_a_request_asked_again_while_its_lookup_is_out_is_answered_at_once():
    """vLLM asks every step for each waiting request: one whose storage lookup
    is still out gets None again without the manager being asked anything;
    once the lookup lands (or the request changed) it is looked at anew."""
    class Consulted(Exception):
        pass

    class Manager:
        def engine_cpu_prefix(self, creq, limit):
            raise Consulted
    h = handle()
    half = half_with(lookup_handle=h)
    half.mgr, half.block_size, half.loads_on = Manager(), 16, True
    t = half.reqs["r"]

    class Request:
        request_id, block_hashes, num_tokens = "r", [b"a", b"b", b"c", b"d"], 70
    t.request, t.n_keys, t.asked = Request(), 4, (0, 70, t.lookup)
    assert half.matched_tokens(Request(), 0) == (None, False)
    with pytest.raises(Consulted):
        half.matched_tokens(Request(), 16)  # vLLM's own hit grew: a new question
    t.asked = (0, 70, t.lookup)
    h.complete(TaskResult(task_id=0, ok=True, result={"prefixes": [2]}))
    with pytest.raises(Consulted):
        half.matched_tokens(Request(), 0)
