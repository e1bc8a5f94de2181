"""Test helpers shared by several test modules."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

from kvcached.tasks import Task, TaskHandle, TaskResult
from kvcached.transfer.inprocess import InProcessTransfer


class FlakyTransfer(InProcessTransfer):
    """In-process copies, except that tasks of the kinds in ``fail_kinds`` fail
    without touching memory (as a worker that reports an error would)."""

    def __init__(self, cfg, run_dir):
        super().__init__(cfg, run_dir)
        self.fail_kinds: set[str] = set()
        self.lost = False
        self.is_healthy = True
        self.submitted: list[Task] = []

    @property
    def healthy(self) -> bool:
        return self.is_healthy

    def submit(self, task: Task) -> TaskHandle:
        self.submitted.append(task)
        if task.kind in self.fail_kinds:
            handle = self.new_handle(task)
            handle.complete(TaskResult(task.task_id, False, "injected failure", lost=self.lost))
            return handle
        return super().submit(task)


def snapshot(mgr) -> tuple:
    """Everything allocate may change, to prove a failed call changed nothing."""
    snap = mgr.snapshot()
    nodes = sorted((n.hash, n.state, n.gpu, n.cpu, n.ref, n.last_access)
                   for n in snap.nodes.values())
    reqs = sorted((str(r.rid), r.blocks, len(r.path)) for r in snap.requests)
    return (snap.gpu_free, snap.cpu_free, nodes, reqs, lru_order(snap, "gpu"),
            lru_order(snap, "cpu"))


def lru_order(snap, tier: str) -> list[bytes]:
    """The hashes of a tier's evictable leaves in the order eviction would take them."""
    return [snap.nodes[i].hash for i in (snap.gpu_lru if tier == "gpu" else snap.cpu_lru)]


def path_nodes(mgr, token_ids, extra_key=None) -> list:
    """The cached nodes (NodeView) along ``token_ids``'s path, root first."""
    from kvcached.core.hashing import block_hashes
    snap = mgr.snapshot()
    by_hash, out, parent = snap.by_hash(), [], 0
    for h in block_hashes(snap.namespace, token_ids, mgr.block_size, extra_key):
        node = by_hash.get(h)
        if node is None or node.parent != parent:
            break
        out.append(node)
        parent = node.id
    return out


def tier_of(mgr, token_ids, extra_key=None):
    """States of the cached nodes along ``token_ids``'s path, root first."""
    return [(n.state.name, n.gpu, n.cpu) for n in path_nodes(mgr, token_ids, extra_key)]


def cpu_used(mgr) -> int:
    return mgr.stats().tiers["cpu"].used


def wait_for(pred, timeout: float, what: str, step: float = 0.02):
    """Poll ``pred`` until it is truthy; fail naming ``what`` at the deadline
    (tests wait on conditions with deadlines, never on luck)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pid_alive(pid: int) -> bool:
    """True for a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def running_workload(mgr, seed: int, steps: int = 300):
    """Serve random prompts of shared prefixes, keeping 1-3 requests running;
    after each served request yields ``(step, rng, running request ids)``."""
    import random

    from conftest import toks

    from kvcached import NoFreeBlocks
    rng, held = random.Random(seed), []
    for i in range(steps):
        prompt = toks(*[rng.randrange(3) for _ in range(rng.randrange(1, 7))], tail=1)
        try:
            a = mgr.allocate(i, prompt)
        except NoFreeBlocks:  # running requests hold the GPU
            if held:
                mgr.free(held.pop(0))
            continue
        a.wait()
        mgr.commit(i, prompt, len(prompt))
        held.append(i)
        yield i, rng, held
        if len(held) > rng.randrange(1, 4):
            mgr.free(held.pop(0))


def own_pages_zeros(shape: tuple, dtype=None, offset: int = 64):
    """A zeroed tensor on pages of its own (an mmap), starting ``offset`` bytes
    into its first page as a large malloc allocation does: what
    ``share_in_place`` needs (a buffer in the malloc heap is refused)."""
    import math
    import mmap

    import torch
    dtype = dtype or torch.float32
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, offset + nbytes)
    # frombuffer keeps ``mm`` alive as long as the tensor
    return torch.frombuffer(mm, dtype=torch.uint8)[offset:offset + nbytes].view(dtype).view(shape)


def binary_task_frame(task_id: int, kind_code: int, src, dst, stamps=(), *,
                      version: int | None = None, mtype: int = 1, counts=None) -> bytes:
    """A binary task frame built by hand, unchecked (for hostile-frame tests):
    the layout of kvcached.transfer.protocol's docstring. ``counts`` overrides
    the header's (stamp pairs, src, dst) counts."""
    import struct

    from kvcached.transfer import protocol as P
    n_stamps, n_src, n_dst = counts or (len(stamps), len(src), len(dst))
    flat = [x for pair in stamps for x in pair]
    return (struct.pack("<BBBBIqII", 0xC1, P.PROTOCOL_VERSION if version is None else version,
                        mtype, kind_code, n_stamps, task_id, n_src, n_dst)
            + struct.pack(f"<{len(flat)}q", *flat)
            + struct.pack(f"<{len(src) + len(dst)}i", *src, *dst))


def binary_done_frame(task_id: int, rank: int = 0, blocks_done: int = 1, nbytes: int = 64,
                      elapsed_s: float = 0.001, finished: float = 1.0, *,
                      version: int | None = None, pad: int = 0) -> bytes:
    """A binary done frame built by hand, unchecked (for hostile-frame tests)."""
    import struct

    from kvcached.transfer import protocol as P
    return struct.pack("<BBBBIqqqdd", 0xC1, P.PROTOCOL_VERSION if version is None else version,
                       2, pad, rank, task_id, blocks_done, nbytes, elapsed_s, finished)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample; AssertionError listing the text if it is missing."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name:
            have = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
            if have == want:
                return float(m.group(3))
    raise AssertionError(f"no sample {name}{{{want}}} in:\n{text}")
