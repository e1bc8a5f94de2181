"""Moving a process's memory into shared memory in place (vLLM's CPU KV cache)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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
    buf = torch.arange(1024, dtype=torch.float32)
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
