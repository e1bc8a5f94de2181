"""A hybrid model's KV cache as vLLM 0.32 lays it out, kvcached's planes over
it, and the oracle of a copy round trip (for both copy engines' CUDA tests:
``test_cuda_build.py`` emulated, ``test_cuda_gpu.py`` on a GPU; no vLLM
needed, and ``tests/integrations/test_vllm_config.py`` checks the layout
against vLLM's own allocator).

vLLM allocates one buffer for every KV cache group
(``vllm/v1/worker/utils.py: allocate_kv_cache``). Layer i of every group
lies on the same bytes, region i: a block id belongs to one group at a time.
In the layer-outermost layouts (the default) a region is one page per block.
An attention layer views its page as ``[heads, tokens, K|V]`` (LBHNC); a
Mamba layer keeps its states at the start of the page, padded to the
attention page, whose block size vLLM aligned so that a state fits (544
tokens here, as for the Qwen3-Next the vLLM tests serve). kvcached copies a
block as one plane per region (``integrations/vllm/config.physical_layers``,
``worker.planes_of``): the whole page, whichever group owns the block.

The model here: a sliding-window, a full-attention and a Mamba group of two
layers each, so two regions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcached.layout import KVLayout

BLOCK = 544  # tokens: vLLM's block size aligned for the Mamba state
HEADS, HEAD_SIZE = 1, 64
DTYPE = torch.bfloat16
PAGE = HEADS * BLOCK * 2 * HEAD_SIZE * 2  # bytes: K and V of every token
# the gated delta-net state: a conv state, then the recurrent (SSM) one
CONV, SSM = ((3, 384), torch.bfloat16), ((2, 128, 128), torch.float32)
CONV_BYTES = 3 * 384 * 2
STATE = CONV_BYTES + 2 * 128 * 128 * 4  # bytes, padded to PAGE
REGIONS = 2
GROUPS = {"sliding": ["s0", "s1"], "full": ["f0", "f1"], "mamba": ["m0", "m1"]}
assert STATE <= PAGE
# The blocks a test moves (the group owning each), where they go in the host
# pool and where they come back: runs of ids consecutive on both sides (the
# direct path merges them) and single blocks.
OWNERS = {3: "sliding", 7: "full", 8: "mamba", 9: "mamba", 20: "full"}
HOST_IDS = [5, 0, 1, 2, 7]
BACK = [21, 10, 11, 12, 4]
NUM_BLOCKS, NUM_HOST = 24, 8


@dataclass
class HybridPages:
    """The one buffer (``buf``, int8, ``REGIONS`` regions of ``num_blocks`` pages)."""

    buf: torch.Tensor
    num_blocks: int

    @classmethod
    def random(cls, num_blocks: int, device: str, seed: int = 0) -> HybridPages:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(-128, 128, (REGIONS * num_blocks * PAGE,), dtype=torch.int8,
                            generator=g)
        return cls(raw.to(device), num_blocks)

    def region(self, r: int) -> torch.Tensor:
        """Region ``r``'s pages, ``[num_blocks, PAGE]`` bytes."""
        start = r * self.num_blocks * PAGE
        return self.buf[start:start + self.num_blocks * PAGE].view(self.num_blocks, PAGE)

    def attention(self, r: int) -> torch.Tensor:
        """What region ``r``'s sliding-window and full-attention layers read:
        ``[blocks, heads, tokens, K|V]`` (vLLM's ``[B, H, N, C]``)."""
        return self.region(r).view(DTYPE).view(self.num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE)

    def states(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What region ``r``'s Mamba layer reads: its conv and SSM states per block."""
        page = self.region(r)
        conv = page[:, :CONV_BYTES].view(CONV[1]).view(self.num_blocks, *CONV[0])
        ssm = page[:, CONV_BYTES:STATE].view(SSM[1]).view(self.num_blocks, *SSM[0])
        return conv, ssm

    @property
    def planes(self) -> list[torch.Tensor]:
        """kvcached's planes: one per region, the attention layer's view of it."""
        return [self.attention(r) for r in range(REGIONS)]

    @staticmethod
    def layout() -> KVLayout:
        """kvcached's layout of these planes (one fused K|V plane per region)."""
        return KVLayout(REGIONS, HEADS, HEAD_SIZE, BLOCK, "bfloat16", fused_kv=True)


def check_round_trip(pages: HybridPages, host: torch.Tensor, owners: dict[int, str],
                     host_ids: list[int], back: list[int], copy) -> None:
    """``copy(src, host_ids, back)`` swaps the blocks of ``owners`` (block id ->
    the group owning it) out to ``host_ids``, then those in again at ``back``.
    Checks the host pool (``host``: ``[blocks, layout.block_bytes]`` uint8) and
    the buffer against a plain indexed copy of the bytes on the CPU, and that
    each block reads back through its own group's view (a Mamba state is
    restored through the attention plane)."""
    layout = pages.layout()
    assert layout.plane_bytes == (PAGE,) * REGIONS and layout.block_bytes == REGIONS * PAGE
    src, n = list(owners), pages.num_blocks
    before = pages.buf.cpu().view(torch.uint8).clone()
    regions = [before[r * n * PAGE:(r + 1) * n * PAGE].view(n, PAGE) for r in range(REGIONS)]
    expect = host.clone()
    want = before.clone()
    for s, h, b in zip(src, host_ids, back, strict=True):
        for r, off in enumerate(layout.host_offsets):
            expect[h, off:off + PAGE] = regions[r][s]
            want[(r * n + b) * PAGE:(r * n + b + 1) * PAGE] = regions[r][s]

    copy(src, host_ids, back)
    assert torch.equal(host, expect), "swap_out differs from the indexed copy"
    after = pages.buf.cpu().view(torch.uint8)
    assert torch.equal(after, want), "swap_in differs from the indexed copy"

    old = HybridPages(before.view(torch.int8), n)
    new = HybridPages(after.view(torch.int8), n)
    for (s, group), b in zip(owners.items(), back, strict=True):
        for r in range(REGIONS):
            if group == "mamba":
                for o, m in zip(old.states(r), new.states(r), strict=True):
                    assert _same(o[s], m[b]), f"Mamba state of block {s}, region {r}"
            else:
                assert _same(old.attention(r)[s], new.attention(r)[b]), \
                    f"{group} block {s}, region {r}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (random bytes read as floats hold NaNs, never equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
