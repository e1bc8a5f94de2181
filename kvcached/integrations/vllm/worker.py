"""The worker half of the connector: one per vLLM worker process (TP rank).

It hands the rank's KV tensors to the rank's kvcached transfer worker, which
the scheduler half spawns: on vLLM's CPU build the KV cache is allocated in
shared memory in the first place (vLLM's ``get_mem_pool_context``: the
connector chooses the memory, ``kvcached.memory.shared_alloc``); on CUDA it
is exported by CUDA IPC with the rank's KV event, recorded after every
forward so that copies are ordered after the model's use of the blocks.
Either way a descriptor in the run dir tells the transfer worker where the
planes are.

The copies themselves never run here: the scheduler half submits them and
learns when every rank finished. It passes the finished loads (and the
blocks that did not arrive) in each step's metadata, and this half reports
them to vLLM, every rank alike, as vLLM's aggregation expects.

A load inside the step (a CPU-tier hit vLLM schedules at once) is the one
thing this half waits for: the transfer worker copies it layer by layer and
publishes each layer in the rank's step progress channel
(``kvcached.memory.progress``), and ``wait_layer`` waits, before a layer's
attention, for that layer only (``kvcached.memory.stepwait``: on CUDA the
compute stream waits on the layer's event, the CPU only until it was
recorded). A load that fails, stalls past its deadline or loses its worker
is reported through ``take_load_errors`` in the same forward pass (vLLM
discards that pass's output for the request and recomputes the blocks), and
no copy of it lands afterwards; nothing waits without a deadline. Where a
full CUDA graph may run, the per-layer hooks may not: the whole load is
waited for before the forward starts.
"""

from __future__ import annotations

import logging

import torch

from kvcached.integrations.vllm import config as vconfig
from kvcached.memory import kvshare, progress
from kvcached.memory.rundir import create_run_dir, mark_temporary
from kvcached.memory.stepwait import StepWait, layerwise

# Through vLLM's logger: its log is where a vLLM operator looks (the run dir).
logger = logging.getLogger("vllm.kvcached")


def planes_of(kv_caches: dict[str, torch.Tensor], layer_names: list[str],
              num_blocks: int) -> list[torch.Tensor]:
    """The KV planes in kvcached's order (layer by layer, K then V): a layer's
    tensor is one plane when its first dimension is the block (K and V share
    it, as vLLM's CPU attention lays them out; MLA's latent), two when it is
    [2, blocks, ...] (K and V apart, as FlashAttention does). ``layer_names``
    are vLLM's physical layers (``config.physical_layers``): in a hybrid
    model one layer of each group shares a page region, copied once."""
    planes = []
    for name in layer_names:
        t = kv_caches[name]
        if t.shape[0] == num_blocks:
            planes.append(t)
        elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            planes += [t[0], t[1]]
        else:
            raise ValueError(f"kvcached: layer {name}'s KV cache has shape {tuple(t.shape)}; "
                             f"expected [{num_blocks}, ...] or [2, {num_blocks}, ...]")
    return planes


class WorkerHalf:
    """Registers this rank's KV cache and reports the loads that finished."""

    def __init__(self, vllm_config, kv_cache_config):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        self.rank = get_tensor_model_parallel_rank()
        self.run_dir, _ = create_run_dir(str(vconfig.run_dir_of(vllm_config)))
        if not (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("run_dir"):
            # kvcached named it: temporary from the start, so that a vLLM that
            # dies before its scheduler starts (which marks it its own) leaves
            # nothing for good (the next start or `kvcached cleanup` sweeps it)
            mark_temporary(self.run_dir, replace=False)
        vconfig.cached_groups(kv_cache_config, str(vllm_config.model_config.model))
        self.layers = vconfig.physical_layers(kv_cache_config)
        self.num_blocks = kv_cache_config.num_blocks
        self.event = None  # the rank's KV event on CUDA
        self.finished: set[str] = set()
        self.failed: set[str] = set()  # a hybrid's failed loads (vLLM takes no block ids there)
        self.load_errors: set[int] = set()
        self.saved: set[str] = set()
        self.on_cpu = vllm_config.device_config.device_type == "cpu"
        self.allocations = None  # SharedAllocations: vLLM's KV cache, on CPU
        self.layer_index = {name: i for i, name in enumerate(self.layers)}
        self.waits: StepWait | None = None  # made with the planes
        # vLLM may replay full CUDA graphs (which skip the per-layer hooks) unless
        # the connector's requires_piecewise_for_cudagraph turned them off
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        self.full_graphs = bool(mode is not None and mode.has_full_cudagraphs())

    def mem_pool_context(self):
        """Where vLLM allocates its KV cache: on CPU, shared memory the transfer
        worker can map (None: vLLM's default, CUDA IPC exports it as it is)."""
        if not self.on_cpu:
            return None
        from kvcached.memory.shared_alloc import SharedAllocations
        self.allocations = SharedAllocations(f"kvcached-kv-rank{self.rank}")
        return self.allocations

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        planes = planes_of(kv_caches, self.layers, self.num_blocks)
        if planes[0].device.type == "cuda":
            from kvcached.memory.kvevent import KVEvent
            self.event = KVEvent(self.run_dir, self.rank)
        elif self.allocations is None or not self.allocations.regions:
            raise RuntimeError(
                "kvcached: vLLM allocated its CPU KV cache outside the connector's memory "
                "(get_mem_pool_context was not used), so the transfer worker cannot reach "
                "it; this vLLM version is not supported on CPU (kvcached needs vLLM 0.32+)")
        # before the planes: a transfer worker opens it when it attaches to them
        events = self._layer_events() if self.event is not None else None
        chan = progress.StepProgress.create(
            progress.progress_path(self.run_dir, self.rank),
            [bytes(e.ipc_handle()) for e in events or ()])
        self.waits = StepWait(chan, len(self.layers), self.rank, events, log=logger)
        kvshare.export_kv_cache(planes, self.rank, self.run_dir, event=self.event)

    def _layer_events(self) -> list:
        """One interprocess event per layer: the transfer worker records layer i's
        after its copy, the compute stream waits on it."""
        from kvcached.memory.kvevent import remember_local_event
        events = [torch.cuda.Event(interprocess=True) for _ in self.layers]
        for e in events:  # an in-process executor uses them as they are
            remember_local_event(bytes(e.ipc_handle()).hex(), e)
        return events

    def after_forward(self) -> None:
        """A forward finished on this rank (vLLM's wait_for_save): on CUDA the KV
        event is recorded, so kvcached's copies wait for it."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream())

    def bind(self, finished: set[str], load_errors: set[int], saved: set[str],
             step=None, failed: set[str] = frozenset()) -> None:
        self.finished = set(finished)
        self.failed = set(failed)
        self.load_errors = set(load_errors)
        self.saved = set(saved)
        if self.waits is not None:
            self.waits.expect(-1, [], 0.0)  # none, unless this step names one
        if step is not None:
            self.load_errors |= step.failed
            if step.task_id >= 0 and self.waits is not None:
                self.waits.expect(step.task_id, step.blocks, step.timeout_s)

    # ------------------------------------------------------ loads in the step
    def start_step_load(self, forward_context=None) -> None:
        """The forward is about to start (its deadline starts now). Where a full CUDA
        graph may run it, the whole load is waited for here."""
        if self.waits is not None:
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            self.waits.start(layerwise(not self.on_cpu, self.full_graphs, mode))

    def wait_layer(self, layer_name: str) -> None:
        """Before ``layer_name``'s attention: wait until its planes landed (a
        layer kvcached does not know: all of them)."""
        if self.waits is not None:
            self.waits.layer(self.layer_index.get(layer_name, len(self.layers) - 1))

    def finish_step_load(self) -> None:
        """After the forward: every layer landed, or the load's blocks are errors."""
        if self.waits is not None:
            self.waits.finish()

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished requests whose saves are done, requests whose loads are,
        those of them whose loads failed: a hybrid model's)."""
        out = self.saved, self.finished, self.failed
        self.saved, self.finished, self.failed = set(), set(), set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        if self.waits is not None:
            out |= self.waits.take_errors()
        return out
