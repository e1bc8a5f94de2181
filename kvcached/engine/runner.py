"""The reference engine: the TinyTransformer over a paged KV cache that kvcached manages.

Per layer the KV cache is two planes, K and V, of
``[num_blocks, kv_heads_per_rank, block_size, head_dim]`` per TP rank, in
``KVLayout.planes`` order, each rank's planes in their own shared tensors
(what kvcached's transfer workers copy). The "ranks" run in this process:
the model computes every head and reads/writes head group ``r`` from/to
rank ``r``'s planes, so the data layout is exactly that of a TP deployment.

One request, as an engine's scheduler would drive it::

    a = mgr.allocate(rid, prompt, reserve_tokens=max_new_tokens)
    a.wait()                        # swap-ins done (TransferFailed: recompute)
    prefill prompt[a.num_cached_tokens:]   # cached K/V read via the block table
    ids = mgr.commit(rid, prompt, len(prompt))   # ids may change (dedup)
    decode; extend() for room, commit() as blocks fill
    mgr.free(rid)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kvcached.config import CacheConfig
from kvcached.engine.model import DenseKV, ModelConfig, TinyTransformer
from kvcached.errors import TransferFailed
from kvcached.memory.kvshare import allocate_kv_cache, attach_kv_cache, release_kv_cache
from kvcached.ops.wiring import CacheManager
from kvcached.types import HitInfo

logger = logging.getLogger(__name__)


class PagedKV:
    """One request's view of the paged cache: writes go to its blocks on every rank.

    The cached prefix is gathered once through the block table into a dense
    mirror that attention reads; new K/V go to both, so later requests find
    them in the blocks (and kvcached can move them between tiers).
    """

    def __init__(self, planes: list[list[torch.Tensor]], table: list[int], block_size: int,
                 cfg: ModelConfig, cached_tokens: int, capacity: int):
        self.planes = planes
        self.table = table
        self.bs = block_size
        self.heads = cfg.n_kv_heads // len(planes)  # KV heads per rank
        self.mirror = DenseKV(cfg, planes[0][0].device, capacity)
        for layer in range(cfg.n_layers):
            if cached_tokens:
                self.mirror.load(layer, *self._gather(layer, cached_tokens))

    def _gather(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``0..n-1`` of every rank: ``[n_kv_heads, n, head_dim]``."""
        nb = -(-n // self.bs)
        ids = torch.tensor(self.table[:nb], dtype=torch.long, device=self.planes[0][0].device)
        out = []
        for kind in (0, 1):
            parts = []
            for rank_planes in self.planes:
                blocks = rank_planes[2 * layer + kind].index_select(0, ids)  # [nb, h, bs, hd]
                parts.append(blocks.transpose(0, 1).reshape(self.heads, nb * self.bs, -1)[:, :n])
            out.append(torch.cat(parts, dim=0))
        return out[0], out[1]

    def append(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        block, off = self.table[pos // self.bs], pos % self.bs
        for r, rank_planes in enumerate(self.planes):
            heads = slice(r * self.heads, (r + 1) * self.heads)
            rank_planes[2 * layer][block, :, off] = k[heads]
            rank_planes[2 * layer + 1][block, :, off] = v[heads]
        self.mirror.append(layer, pos, k, v)

    def keys_values(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mirror.keys_values(layer, length)


@dataclass(slots=True)
class RequestResult:
    """What one request did: its output and how much of its prompt the cache served."""

    request_id: Hashable
    prompt_tokens: int
    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab], float32 on CPU
    num_cached_tokens: int
    hit: HitInfo
    computed_tokens: int  # prompt positions this request computed (prefill)
    transfer_error: str | None
    seconds: float


class Engine:
    """A CacheManager plus the model and its per-rank KV planes; one request at a time."""

    def __init__(self, mgr: CacheManager, model: TinyTransformer,
                 planes: list[list[torch.Tensor]], owns_planes: bool = False):
        _check_planes(mgr.cfg, model.cfg, planes)
        self.mgr = mgr
        self.model = model
        self.planes = planes
        self.block_size = mgr.cfg.block_size
        self._owns_planes = owns_planes

    @classmethod
    def create(cls, cfg: CacheConfig, model_cfg: ModelConfig | None = None,
               transfer=None) -> Engine:
        """Build the planes (or attach to kvcached's, with ``create_cache``), start
        the manager and build the model that matches ``cfg``'s layout.

        ``transfer``: an optional factory ``(cfg, run_dir) -> Transfer`` (tests
        inject failures with it; it needs ``cfg.run_dir`` set); kvcached picks
        one from ``cfg`` otherwise.
        """
        model_cfg = model_cfg or ModelConfig.for_cache(cfg)
        if transfer is not None and not cfg.run_dir:
            raise ValueError("Engine.create(transfer=...) needs cfg.run_dir: the transfer "
                             "is built before the manager creates a run directory")
        mgr = CacheManager(cfg, transfer=transfer(cfg, cfg.run_dir) if transfer else None)
        planes: list[list[torch.Tensor]] = []
        try:
            if not cfg.create_cache:  # the model runner owns its KV: export before start
                for r in range(cfg.tp_size):
                    planes.append(allocate_kv_cache(cfg.layout, cfg.num_gpu_blocks, r,
                                                    mgr.run_dir, device=_device(cfg)))
            mgr.start()
            if cfg.create_cache:
                planes = [attach_kv_cache(mgr.run_dir, r, timeout_s=cfg.worker_start_timeout_s)
                          for r in range(cfg.tp_size)]
            model = TinyTransformer(model_cfg, planes[0][0].device)
            return cls(mgr, model, planes, owns_planes=not cfg.create_cache)
        except BaseException:
            _release(mgr, planes if not cfg.create_cache else [])
            raise

    def close(self) -> None:
        """Stop the manager (and its workers) and drop the KV planes."""
        planes, self.planes = self.planes, []
        _release(self.mgr, planes if self._owns_planes else [])

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- serving
    def generate(self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int,
                 extra_key=None) -> RequestResult:
        """Serve one request greedily, reusing whatever prefix kvcached has cached."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        t0 = time.perf_counter()
        a = self.mgr.allocate(request_id, prompt, extra_key=extra_key,
                              reserve_tokens=max_new_tokens)
        try:
            error = _wait(a)
            tokens, logits = self._run(request_id, list(prompt), a, max_new_tokens)
        finally:
            self.mgr.free(request_id)
        return RequestResult(request_id, len(prompt), tokens, logits, a.num_cached_tokens,
                             a.hit, len(prompt) - a.num_cached_tokens, error,
                             time.perf_counter() - t0)

    @torch.inference_mode()
    def _run(self, rid: Hashable, tokens: list[int], a, max_new: int):
        """Prefill from the cached prefix on, then decode; returns (new tokens, logits)."""
        bs, n = self.block_size, len(tokens)
        kv = PagedKV(self.planes, list(a.block_ids), bs, self.model.cfg,
                     a.num_cached_tokens, capacity=n + max_new)
        logits = self.model.forward(tokens, a.num_cached_tokens, kv)
        kv.table = list(self.mgr.commit(rid, tokens, n))  # dedup may have swapped ids
        out, rows = [], []
        for i in range(max_new):
            tok = int(torch.argmax(logits))
            out.append(tok)
            rows.append(logits)
            if i + 1 == max_new:
                break
            pos = len(tokens)
            tokens.append(tok)
            kv.table.extend(self.mgr.extend(rid, 1))  # a no-op while the reserve lasts
            logits = self.model.forward(tokens, pos, kv)
            if (pos + 1) % bs == 0:  # a block just filled: make it reusable
                kv.table = list(self.mgr.commit(rid, tokens, pos + 1))
        return out, torch.stack(rows).cpu()


def _wait(a) -> str | None:
    """Wait for swap-ins; a failed one shrinks ``num_cached_tokens``: recompute the rest."""
    try:
        a.wait()
    except TransferFailed as e:
        logger.warning("request %r: transfer failed (%s); recomputing from token %d",
                       a.request_id, e, a.num_cached_tokens)
        return str(e)
    return None


def _device(cfg: CacheConfig) -> str:
    return "cuda" if cfg.device == "cuda" else "cpu"


def _release(mgr: CacheManager, planes: list[list[torch.Tensor]]) -> None:
    """Remove the engine's planes, then close the manager.

    Release comes first because it reads the descriptor in the run directory,
    which ``close`` deletes; workers that still map the segments keep them
    until they exit (unlinking shared memory never pulls it from under a mapping).
    """
    try:
        if planes:
            run_dir = mgr.run_dir
            planes.clear()
            for r in range(mgr.cfg.tp_size):
                release_kv_cache(run_dir, r)
    finally:
        mgr.close()


def _check_planes(cfg: CacheConfig, model_cfg: ModelConfig,
                  planes: list[list[torch.Tensor]]) -> None:
    """The model's KV must be exactly the planes kvcached moves: fail early, naming both."""
    if len(planes) != cfg.tp_size:
        raise ValueError(f"got planes for {len(planes)} ranks, tp_size is {cfg.tp_size}")
    if model_cfg.n_kv_heads != cfg.num_kv_heads * cfg.tp_size:
        raise ValueError(f"model has {model_cfg.n_kv_heads} KV heads; the cache holds "
                         f"{cfg.num_kv_heads} per rank x {cfg.tp_size} ranks")
    if (model_cfg.n_layers, model_cfg.head_dim, model_cfg.dtype) != (
            cfg.num_layers, cfg.head_dim, cfg.dtype):
        raise ValueError(f"model (layers={model_cfg.n_layers}, head_dim={model_cfg.head_dim}, "
                         f"{model_cfg.dtype}) does not match the cache layout "
                         f"(layers={cfg.num_layers}, head_dim={cfg.head_dim}, {cfg.dtype})")
    want = (cfg.num_gpu_blocks, cfg.num_kv_heads, cfg.block_size, cfg.head_dim)
    for r, rank_planes in enumerate(planes):
        if len(rank_planes) != 2 * cfg.num_layers:
            raise ValueError(f"rank {r}: {len(rank_planes)} planes, expected "
                             f"{2 * cfg.num_layers} (K and V per layer)")
        bad = [tuple(p.shape) for p in rank_planes if tuple(p.shape) != want]
        if bad:
            raise ValueError(f"rank {r}: plane shape {bad[0]}, expected {want}")
