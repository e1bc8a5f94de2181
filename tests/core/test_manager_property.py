"""Random allocate / commit / extend / free / eviction / failed transfers,
with ``check_invariants()`` after every step (hypothesis stateful testing),
under each eviction policy:

- ``lru``: the model of the manager's state machine (tests/reference/model.py)
  serves the same calls alongside; after every step both must be in the
  same state.
- ``adaptive``: the model evicts by LRU only, so the core's policy
  calls (both tiers, swap-outs, failed copies and all) are recorded and
  replayed into the reference policy (tests/reference/policy.py), one per
  tier, after every step: every victim the core took must be the one the
  reference picks.

150 examples x 100 steps per policy: at least 10,000 steps each. The examples
are the same in every run (tests/conftest.py), so the counts are too.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from conftest import tiny_config
from helpers import FlakyTransfer, snapshot
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reference.compare import diff, model_state, state
from reference.model import Model
from reference.policy import AdaptivePolicy, replay_calls

from kvcached import CacheManager, NoFreeBlocks, TransferFailed

BS = 4
# Few distinct block values so that prompts share prefixes and collide often.
prompts = st.lists(st.integers(1, 3), min_size=1, max_size=5).flatmap(
    lambda blocks: st.integers(0, BS - 1).map(
        lambda tail: [b for b in blocks for _ in range(BS)] + [7] * tail))


STEPS = {"lru": 0, "adaptive": 0}  # steps run, checked by test_enough_steps_ran
VICTIMS = {0: 0, 1: 0}  # adaptive: victims replayed per tier (0 gpu, 1 cpu)
GPU_BLOCKS, CPU_BLOCKS = 12, 6


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvc-prop-")
        cfg = tiny_config(run_dir=self.dir, num_gpu_blocks=GPU_BLOCKS,
                          num_cpu_blocks=CPU_BLOCKS, eviction_policy=self.policy)
        self.transfer = FlakyTransfer(cfg, self.dir)
        self.mgr = CacheManager(cfg, transfer=self.transfer).start()
        self.model = None
        if self.policy == "lru":
            self.model = Model(cfg)
        else:  # the reference policy of each tier, fed the core's calls
            self.mgr.core.set_policy_log(True)
            self.ref_policies = {0: AdaptivePolicy(GPU_BLOCKS), 1: AdaptivePolicy(CPU_BLOCKS)}
        self.running: dict[int, list[int]] = {}  # rid -> tokens it holds
        self.next_id = 0

    def teardown(self):
        self.mgr.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def both(self, fn):
        """fn(manager) on the manager and on the model (under LRU): the same
        result or the same exception type; returns the manager's result (or raises)."""
        if self.model is None:
            return fn(self.mgr)
        out = []
        for mgr in (self.mgr, self.model):
            try:
                out.append((None, fn(mgr)))
            except (NoFreeBlocks, TransferFailed) as e:
                out.append((e, None))
        (err, got), (ref_err, want) = out
        assert type(err) is type(ref_err) and got == want, (out, fn)
        if err is not None:
            raise err
        return got

    @rule(tokens=prompts, reserve=st.integers(0, 6))
    def allocate(self, tokens, reserve):
        rid, self.next_id = self.next_id, self.next_id + 1
        before = snapshot(self.mgr)

        def alloc(mgr):
            a = mgr.allocate(rid, tokens, reserve_tokens=reserve)
            failed = False
            try:
                a.wait()
            except TransferFailed:
                failed = True
            return list(a.block_ids), a.num_cached_tokens, tuple(a.hit), failed
        try:
            blocks, cached, hit, failed = self.both(alloc)
        except NoFreeBlocks:
            assert snapshot(self.mgr) == before  # including every LRU's order
            return
        assert len(blocks) == -(-(len(tokens) + reserve) // BS)
        assert cached <= len(tokens) - 1
        if failed:
            assert cached == hit[0]
        assert cached == hit[0] + hit[1]
        self.running[rid] = list(tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens = self.running[rid]
        n = data.draw(st.integers(0, len(tokens)))
        ids = self.both(lambda m: list(m.commit(rid, tokens, n)))
        assert len(set(ids)) == len(ids)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), max_size=6))
    def extend_and_commit(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        try:
            self.both(lambda m: m.extend(rid, len(extra)))
        except (NoFreeBlocks, TransferFailed):
            return
        self.running[rid] = self.running[rid] + extra
        self.both(lambda m: list(m.commit(rid, self.running[rid], len(self.running[rid]))))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.both(lambda m: m.free(rid))
        del self.running[rid]

    @rule(kinds=st.sets(st.sampled_from(["swap_out", "swap_in"])), lost=st.booleans())
    def set_failures(self, kinds, lost):
        for faults in [self.transfer] + ([self.model] if self.model is not None else []):
            faults.fail_kinds = kinds
            faults.lost = lost

    @rule(n=st.integers(1, 12))
    def force_eviction(self, n):
        """A big request that pushes most idle blocks out, then leaves."""
        rid, self.next_id = self.next_id, self.next_id + 1
        tokens = [100 + rid] * (n * BS)
        try:
            self.both(lambda m: list(m.allocate(rid, tokens).block_ids))
        except (NoFreeBlocks, TransferFailed):
            return
        self.both(lambda m: m.free(rid))

    @invariant()
    def invariants_hold(self):
        STEPS[self.policy] += 1
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_.tiers["gpu"].used + st_.tiers["gpu"].free == GPU_BLOCKS
        if self.model is not None:
            d = diff(state(self.mgr), model_state(self.model))
            assert d is None, d
        else:
            self.replay_policy_calls()

    def replay_policy_calls(self):
        """The core's policy calls since the last step, into the reference policies:
        every victim must be the reference's."""
        for tier, name, key, now in self.mgr.core.drain_policy_log():
            args = {"on_insert": (key, 0, now), "on_hit": (key, now), "victim": ()}.get(name, (key,))
            want = key if name == "victim" else None
            replay_calls(self.ref_policies[tier], [(name, args, want)])
            VICTIMS[tier] += name == "victim" and key is not None
        for tier, pol in self.ref_policies.items():
            snap = self.mgr.snapshot()
            listed = snap.gpu_lru if tier == 0 else snap.cpu_lru
            keys = {int.from_bytes(snap.nodes[i].hash[:8], "little") for i in listed}
            assert keys == pol.leaves(), f"tier {tier}: the core lists other leaves"


class AdaptiveManagerMachine(ManagerMachine):
    policy = "adaptive"


SETTINGS = settings(max_examples=150, stateful_step_count=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = SETTINGS
TestAdaptiveManagerMachine = AdaptiveManagerMachine.TestCase
TestAdaptiveManagerMachine.settings = SETTINGS


def test_enough_steps_ran():
    """Runs after the machines (file order): >= 10,000 steps were checked under
    each policy, and the adaptive policy chose >= 100 victims in each tier."""
    print(f"stateful steps checked: {STEPS}; adaptive victims replayed per tier: {VICTIMS}")
    assert min(STEPS.values()) >= 10_000
    assert min(VICTIMS.values()) >= 100
