"""``KvcachedConnector``: kvcached as a vLLM KV connector.

Loaded by vLLM with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "KvcachedConnector",
      "kv_connector_module_path": "kvcached.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"num_cpu_blocks": 16384, "storage_backend": "file"}}'

vLLM makes one connector in its scheduler (the ``SchedulerHalf``: the cache
manager, its tiers and transfer workers) and one in every worker process
(the ``WorkerHalf``: hands the rank's KV tensors over). The copies run in
kvcached's transfer workers. A CPU-tier hit (short enough:
``step_load_max_blocks``) loads inside the step that computes the rest of
its prompt: the transfer worker copies it layer by layer while the forward
runs, and ``wait_for_layer_load`` waits for that layer only. Every other
load (storage, long hits) lands between steps, the request running in the
step after.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcached.integrations.vllm import config as vconfig
from kvcached.integrations.vllm.stepload import StepLoad


@dataclass
class KvcachedMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker each step: the requests whose
    loads finished, the engine blocks among them that did not get their KV,
    the finished requests whose saves are all done, the load inside this
    step (its task, to wait for layer by layer), and for a hybrid model the
    finished loads that failed (vLLM takes no block ids there)."""

    finished_loads: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    finished_saves: set[str] = field(default_factory=set)
    step_load: StepLoad = field(default_factory=StepLoad)
    failed_loads: set[str] = field(default_factory=set)


def _timed(method):
    """A scheduler hook: its time counts towards the step's (``kvcached status``
    shows p50/p99 per step, from one build_connector_meta to the next: what
    kvcached adds to vLLM's scheduler)."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.scheduler.hook_s += time.perf_counter() - t0
            self.scheduler.hook_cpu_s += time.thread_time() - c0
    return timed


class KvcachedConnector(KVConnectorBase_V1, SupportsHMA):
    """kvcached's CPU and storage tiers behind vLLM's GPU tier (see the module)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvcached.integrations.vllm.scheduler import SchedulerHalf
            vconfig.check_load_failure_policy(vllm_config.kv_transfer_config)
            self.scheduler = SchedulerHalf(vllm_config, kv_cache_config)
        else:
            from kvcached.integrations.vllm.worker import WorkerHalf
            self.worker = WorkerHalf(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # kvcached's planes are [blocks, heads, tokens, K|V], a block contiguous
        # in that order: vLLM's LBHNC. Where the attention backends take any
        # layout (FlashAttention) vLLM prefers LBNHC (tokens outside heads),
        # which the worker half refuses; and storage holds a page's bytes, so
        # every instance of a fleet must lay its pages out alike.
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # A load inside the step is waited for layer by layer (wait_for_layer_load),
        # which a full CUDA graph skips: vLLM then keeps to piecewise graphs.
        # (Were one replayed anyway, the worker half waits for the whole load first.)
        return vconfig.step_loads_enabled(extra_config)

    # ------------------------------------------------------------ scheduler
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.kv_cache_manager = kv_cache_manager

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.scheduler.block_pool = gpu_block_pool  # saves in flight hold their blocks
        self.scheduler.null_id = gpu_block_pool.null_block.block_id

    @_timed
    def has_pending_block_frees(self) -> bool:
        return self.scheduler.pending_block_frees()

    @_timed
    def on_new_request(self, request) -> None:
        self.scheduler.track(request)

    @_timed
    def get_num_new_matched_tokens(self, request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    @_timed
    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        return self.scheduler.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvcachedMetadata:
        t0, c0 = time.perf_counter(), time.thread_time()
        meta = KvcachedMetadata(*self.scheduler.build_meta(scheduler_output))
        # vLLM calls this once every step (update_connector_output not after a
        # step with no forward): a step's time is from here to here
        self.scheduler.end_step(self.scheduler.hook_s + time.perf_counter() - t0,
                                self.scheduler.hook_cpu_s + time.thread_time() - c0)
        return meta

    @_timed
    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_output(connector_output)

    @_timed
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    @_timed
    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: vLLM keeps its hybrid KV cache manager on (sliding-window
        # layers keep only their window); kvcached caches every group
        return self.scheduler.finished(request)

    def reset_cache(self) -> bool | None:
        return None  # vLLM's reset_prefix_cache leaves kvcached's tiers as they are

    # -------------------------------------------------------- observability
    def get_kv_connector_stats(self):
        # vLLM asks both halves; the numbers are the scheduler's
        return self.scheduler.take_stats() if self.scheduler is not None else None

    @_timed
    def take_events(self):
        return self.scheduler.take_events()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from kvcached.integrations.vllm.observe import KvcachedStats
        return KvcachedStats(data=data) if data is not None else KvcachedStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from kvcached.integrations.vllm.observe import KvcachedPromMetrics
        return KvcachedPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --------------------------------------------------------------- worker
    def get_mem_pool_context(self):
        return self.worker.mem_pool_context()

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvcachedMetadata)
        meta = connector_metadata
        self.worker.bind(meta.finished_loads, meta.load_errors, meta.finished_saves,
                         meta.step_load, meta.failed_loads)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_step_load(forward_context)  # its copy started when the scheduler sent it

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass  # saves are copied from the blocks once the forward is done

    def wait_for_save(self) -> None:
        self.worker.finish_step_load()  # every layer, also those no attention waited for
        self.worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        saves, loads, _ = self.worker.take_finished()
        return saves or None, loads or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        saves, loads, failed = self.worker.take_finished()
        return KVConnectorTransferResults(finished_sending=saves, finished_recving=loads,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
