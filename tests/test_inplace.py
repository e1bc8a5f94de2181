"""Moving a process's memory into shared memory in place (vLLM's CPU KV cache)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import own_pages_zeros

from kvcached.memory import shm
from kvcached.memory.inplace import share_in_place

CHILD = """
import sys, torch
from kvcached.memory import shm
seg = shm.open_shm_tensor(sys.argv[1], (int(sys.argv[2]),), torch.uint8)
view = seg[int(sys.argv[3]):int(sys.argv[3]) + 4096].view(torch.float32)
print(float(view.sum()))
view.fill_(7.0)
"""


@pytest.mark.parametrize("chunk", [64 << 20, 4096])  # one chunk; a chunk per page
def test_views_keep_their_data_and_another_process_shares_it(monkeypatch, chunk):
    from kvcached.memory import inplace
    monkeypatch.setattr(inplace, "_CHUNK", chunk)
    buf = own_pages_zeros((1024,))
    buf.copy_(torch.arange(1024, dtype=torch.float32))
    view = buf[10:20]  # a view taken before the move stays valid
    region = share_in_place(buf.data_ptr(), buf.nbytes, "test-inplace", buf)
    assert region.path.startswith("/proc/") and region.nbytes % 4096 == 0
    assert torch.equal(buf, torch.arange(1024, dtype=torch.float32))
    name, offset, _ = shm.find_segment(buf)
    assert name == region.path
    res = subprocess.run([sys.executable, "-c", CHILD, name, str(region.nbytes), str(offset)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) == float(sum(range(1024)))  # it read this process's bytes
    assert torch.all(buf == 7.0) and torch.all(view == 7.0)  # and its writes are seen here


def test_nothing_to_share_is_an_error():
    with pytest.raises(ValueError, match="nothing to share"):
        share_in_place(0, 0, "empty", None)


def test_a_buffer_in_the_malloc_heap_is_refused():
    """Its first and last pages hold other allocations: shared, another process
    (or a forked child) would write into this process's heap."""
    buf = torch.arange(1024, dtype=torch.float32)  # 4 KiB: malloc serves it from the heap
    with pytest.raises(ValueError, match="lies in the malloc heap"):
        share_in_place(buf.data_ptr(), buf.nbytes, "heap", buf)
    assert torch.equal(buf, torch.arange(1024, dtype=torch.float32))  # untouched
    assert shm.find_segment(buf) is None


OWN_PAGES_CHILD = """
import torch
from kvcached.memory import shm
from kvcached.memory.inplace import own_pages_for_large_allocations, share_in_place
assert own_pages_for_large_allocations(True)
buf = torch.full((1 << 19,), 3.0)  # 2 MiB: its own pages now
own_pages_for_large_allocations(False)
region = share_in_place(buf.data_ptr(), buf.nbytes, "own-pages", buf)
assert region.nbytes >= buf.nbytes and torch.all(buf == 3.0)
assert shm.find_segment(buf)[0] == region.path
print("moved")
"""


def test_own_pages_for_large_allocations_lets_a_torch_buffer_move():
    """What the vLLM connector does before vLLM allocates its KV cache, in a
    fresh process as vLLM's worker is (a long-lived heap may still serve a
    large allocation from a free chunk it holds: then it is refused)."""
    from kvcached.memory import inplace
    if getattr(inplace._libc, "mallopt", None) is None:
        pytest.skip("the allocator has no mallopt (not glibc)")
    res = subprocess.run([sys.executable, "-c", OWN_PAGES_CHILD], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "moved", res.stderr
