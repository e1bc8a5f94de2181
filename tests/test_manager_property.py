"""Random allocate / commit / extend / free / eviction / failed transfers,
with ``check_invariants()`` after every step (hypothesis stateful testing),
the reference manager (tests/reference/) serving the same calls alongside:
after every step both must be in the same state.

150 examples x 100 steps: at least 10,000 steps in CI.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
from conftest import tiny_config
from helpers import FlakyTransfer, snapshot
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reference.compare import diff, reference_state, state
from reference.manager import CacheManager as ReferenceManager

from kvcached import NoFreeBlocks, TransferFailed
from kvcached.core.manager import CacheManager

BS = 4
# Few distinct block values so that prompts share prefixes and collide often.
prompts = st.lists(st.integers(1, 3), min_size=1, max_size=5).flatmap(
    lambda blocks: st.integers(0, BS - 1).map(
        lambda tail: [b for b in blocks for _ in range(BS)] + [7] * tail))


STEPS = [0]  # steps run by every example, checked by test_enough_steps_ran


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvc-prop-")
        cfg = tiny_config(run_dir=self.dir, num_gpu_blocks=12, num_cpu_blocks=6)
        self.transfer = FlakyTransfer(cfg, self.dir)
        self.mgr = CacheManager(cfg, transfer=self.transfer).start()
        ref_cfg = cfg.replace(run_dir=self.dir + "/reference")
        self.ref_transfer = FlakyTransfer(ref_cfg, ref_cfg.run_dir)
        self.ref = ReferenceManager(ref_cfg, transfer=self.ref_transfer).start()
        self.running: dict[int, list[int]] = {}  # rid -> tokens it holds
        self.next_id = 0

    def teardown(self):
        self.mgr.close()
        self.ref.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def both(self, fn):
        """fn(manager) on the manager and on the reference: the same result or
        the same exception type; returns the manager's result (or raises)."""
        out = []
        for mgr in (self.mgr, self.ref):
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
        for transfer in (self.transfer, self.ref_transfer):
            transfer.fail_kinds = kinds
            transfer.lost = lost

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
        STEPS[0] += 1
        self.mgr.check_invariants()
        st_ = self.mgr.stats()
        assert st_.tiers["gpu"].used + st_.tiers["gpu"].free == 12
        d = diff(state(self.mgr), reference_state(self.ref))
        assert d is None, d


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_enough_steps_ran():
    """Runs after the machine (file order): CI must have checked >= 10,000 steps."""
    print(f"stateful steps checked: {STEPS[0]}")
    assert STEPS[0] >= 10_000
