"""CPU tensors allocated in shared memory (vLLM's CPU KV cache, through the
connector's get_mem_pool_context)."""

from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys

import torch

from kvcached.memory import shm
from kvcached.memory.shared_alloc import SharedAllocations, shared_empty

CHILD = """
import sys, torch
from kvcached.memory import shm
seg = shm.open_shm_tensor(sys.argv[1], (int(sys.argv[2]),), torch.uint8)
view = seg[int(sys.argv[3]):int(sys.argv[3]) + 4096].view(torch.float32)
print(float(view.sum()))
view.fill_(7.0)
"""


def test_another_process_shares_the_tensor():
    buf, region = shared_empty((1024,), torch.float32, "test-shared")
    assert torch.count_nonzero(buf) == 0 and region.nbytes % 4096 == 0
    buf.copy_(torch.arange(1024, dtype=torch.float32))
    name, offset, _ = shm.find_segment(buf)
    assert name == region.path and region.path.startswith("/proc/")
    res = subprocess.run([sys.executable, "-c", CHILD, name, str(region.nbytes), str(offset)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) == float(sum(range(1024)))  # it read this process's bytes
    assert torch.all(buf == 7.0)  # and its writes are seen here


def test_the_memory_is_allocated_and_mapped_at_once():
    """vLLM's KV cache: its pages exist and are mapped before the first copy
    (a page fault per 4 KiB made a worker's first copies slow)."""
    buf, region = shared_empty((8 << 20,), torch.uint8, "test-populated")
    assert os.fstat(region.fd).st_blocks * 512 >= region.nbytes
    pages = region.nbytes // mmap.PAGESIZE
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf.view(-1, mmap.PAGESIZE)[:, 0] = 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < pages // 8


def test_inside_the_mode_cpu_factories_allocate_shared():
    """vLLM allocates with torch.zeros(n, dtype=int8, device=...)."""
    mode = SharedAllocations("test-mode")
    with mode:
        a = torch.zeros(10000, dtype=torch.int8, device=torch.device("cpu"))
        b = torch.empty((3, 5), dtype=torch.float16)
        c = torch.zeros(size=(2, 2))
        d = torch.ones(4)  # not an allocation the engine's KV cache uses
    assert [tuple(t.shape) for t in (a, b, c)] == [(10000,), (3, 5), (2, 2)]
    assert (a.dtype, b.dtype, c.dtype) == (torch.int8, torch.float16, torch.float32)
    assert torch.count_nonzero(a) == 0 and torch.count_nonzero(c) == 0
    assert len(mode.regions) == 3
    assert all(shm.find_segment(t) is not None for t in (a, b, c))
    assert shm.find_segment(d) is None and torch.equal(d, torch.ones(4))
    outside = torch.zeros(100)
    assert shm.find_segment(outside) is None  # the mode ends with its block
