"""RankExecutor: runs tasks on one rank's memory (its KV planes and host pool).

Used in the engine process by ``InProcessTransfer`` (one per rank) and in each
transfer worker process. It finds the rank's planes through the run
directory (``kvcached.export_kv_cache`` / ``allocate_kv_cache``) and the host
pool by name, so both transfer modes see exactly the same memory.

On CUDA every copy waits on the engine's KV event (kvcached.memory.kvevent):
swap-outs and stores after the forward that wrote the blocks, swap-ins and
loads after any kernel that still reads the blocks they overwrite. A task's
event stamp is checked first; a task that cannot be ordered fails untouched.
In the exporting process itself (in-process transfers) the event is the
engine's own object: CUDA does not open a process's own IPC handles.

A ``swap_in_layers`` task (a load inside the engine's step) is copied layer
by layer, each layer published in the rank's step progress channel
(``kvcached.memory.progress``) as it lands, so that the engine's forward
pass reads layer i while the layers after it are still being copied. On
CUDA each layer's copy is enqueued on a stream of the step's own (it never
waits behind other swap-ins), the channel's layer event i recorded after
it, and then the layer published: the engine's compute stream waits on
that event, not the engine's CPU. Every layer is copied (or enqueued)
under the channel's gate, so a task the engine gave up on copies nothing
more.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kvcached.config import CacheConfig
from kvcached.tasks import Task

logger = logging.getLogger(__name__)

LOAD_CHUNK = 16  # blocks read per storage batch; the load policy is applied between


class RankExecutor:
    """Copies blocks for one rank; ``run`` raises on any failure, touching nothing."""

    def __init__(self, cfg: CacheConfig, run_dir, rank: int, owner_pid: int | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = rank
        self.owner_pid = owner_pid or os.getpid()
        self.planes = None
        self.host = None
        self.engine = None
        self.store = None  # BlockStore when a storage backend is configured
        self._pinned = None  # CUDA registration of the host pool mapping
        self._event = None  # the engine's KV event every CUDA copy waits on (raw handle)
        self._event_opened = False  # opened from its IPC handle (ours to destroy)
        self._clock = None  # the event's generation clock (kvevent.EventClock)
        self._broken: Exception | None = None  # a fatal error: CUDA is unusable here
        self._cuda = cfg.device == "cuda"  # copies are ordered after the KV event (_ordered)
        self._progress = None  # the rank's step progress channel (swap_in_layers), if any
        self._layer_events: list[int] = []  # CUDA: the channel's layer events (raw handles)
        self._layer_events_opened = False  # opened from IPC handles (ours to destroy)
        self._layer_engines = None  # one copy engine per layer, made on first use

    def open(self, timeout_s: float) -> None:
        """Attach planes (waiting for the engine to export them) and the host pool."""
        from kvcached.memory.hostpool import HostPool
        from kvcached.memory.kvshare import attach_kv_cache, check_planes
        layout = self.cfg.layout
        self.planes = attach_kv_cache(self.run_dir, self.rank, timeout_s=timeout_s)
        check_planes(self.planes, layout, self.cfg.num_gpu_blocks)
        if self.cfg.num_cpu_blocks:
            self.host = HostPool.attach(self.run_dir, self.rank, self.cfg.num_cpu_blocks,
                                        layout.block_bytes, owner_pid=self.owner_pid)
            self.engine = self._make_engine()
            if self.cfg.storage_backend and self.store is None:
                from kvcached.storage.blockstore import BlockStore
                self.store = BlockStore.from_config(self.cfg, self.rank)
        self._open_progress()

    def _open_progress(self) -> None:
        """The step progress channel the engine made for this rank (vLLM's worker
        creates it before exporting its planes); none outside vLLM."""
        from kvcached.memory import progress
        self._close_progress()
        try:
            self._progress = progress.StepProgress.open(progress.progress_path(self.run_dir,
                                                                               self.rank))
        except (FileNotFoundError, ValueError):
            return
        self._progress.attach_writer()
        if self._cuda and self._progress.event_handles:
            self._open_layer_events(self._progress.event_handles)

    def _open_layer_events(self, handles: list[bytes]) -> None:
        """The engine's layer events (CUDA cannot open a process's own IPC handles:
        in the exporting process they are the engine's own events)."""
        from kvcached.memory import kvevent
        local = [kvevent.local_event(h.hex()) for h in handles]
        if all(e is not None for e in local):
            self._layer_events = local
            return
        from kvcached.copy.cuda import open_ipc_event
        self._layer_events_opened = True
        for h in handles:
            self._layer_events.append(open_ipc_event(h))

    def _close_progress(self) -> None:
        events = self._layer_events if self._layer_events_opened else []
        self._layer_events, self._layer_events_opened = [], False
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if events:
            from kvcached.copy import cuda as kvc
            for ev in events:
                kvc.load().event_destroy(ev)

    def _make_engine(self):
        offsets = self.cfg.layout.host_offsets
        if self.cfg.device == "cuda":
            from kvcached.copy.cuda import CudaCopyEngine
            from kvcached.memory.cuda_ipc import pin_host_memory
            cfg = self.cfg
            # The shm mapping is this process's: register it (in chunks) here.
            self._pinned = pin_host_memory(self.host.tensor)
            engine = CudaCopyEngine(self.planes, self.host.tensor, offsets,
                                    mode=(cfg.cuda_copy_d2h, cfg.cuda_copy_h2d),
                                    grid_blocks=cfg.cuda_grid_blocks,
                                    block_threads=cfg.cuda_block_threads)
            self.engine = engine  # close() frees it if the event cannot be opened
            self._open_engine_event()  # on the planes' device (the engine set it)
            return engine
        from kvcached.copy.cpu import CpuCopyEngine
        return CpuCopyEngine(self.planes, self.host.tensor, offsets,
                             threads=self.cfg.copy_threads)

    def _open_engine_event(self) -> None:
        """The engine's KV event and its clock, as the rank's descriptor names them."""
        from kvcached.memory import kvevent
        from kvcached.memory.kvshare import read_descriptor
        self._close_event()
        desc = read_descriptor(self.run_dir, self.rank)
        handle = desc.get("event_ipc_handle")
        if not handle:
            return
        if desc.get("event_pid", desc.get("pid")) == os.getpid():
            self._event = kvevent.local_event(handle)
            if self._event is None:
                raise RuntimeError(f"rank {self.rank}: this process exported a KV event but "
                                   "no longer holds it; keep the KVEvent alive while serving")
        else:
            from kvcached.copy.cuda import open_ipc_event
            self._event, self._event_opened = open_ipc_event(bytes.fromhex(handle)), True
        if desc.get("event_clock"):
            self._clock = kvevent.EventClock.open(Path(self.run_dir) / desc["event_clock"])

    def _close_event(self) -> None:
        if self._event_opened and self._event:
            from kvcached.copy import cuda as kvc
            try:
                kvc.load().event_destroy(self._event)
            except RuntimeError as e:  # a broken context: the process is going anyway
                logger.warning("rank %d: closing the engine's KV event: %s", self.rank, e)
        if self._clock is not None:
            self._clock.close()
        self._event, self._event_opened, self._clock = None, False, None

    def _ordered(self, task: Task) -> dict[str, Any]:
        """``wait_event`` for a copy of ``task`` (CUDA), after checking its stamp."""
        if self.cfg.device != "cuda":
            return {}
        from kvcached.memory import kvevent
        stamp = task.args.get(kvevent.STAMP_ARG)
        if stamp is not None:
            try:
                kvevent.check_stamp(task.kind, stamp, self.rank, self._clock,
                                    self._event is not None)
            except kvevent.OrderingError:
                # The engine may have exported a new event since we attached.
                self._open_engine_event()
                kvevent.check_stamp(task.kind, stamp, self.rank, self._clock,
                                    self._event is not None)
        return {"wait_event": self._event} if self._event is not None else {}

    def _swap_out(self, task: Task, device_ids, host_ids) -> int:
        if self._cuda:
            return self.engine.swap_out(device_ids, host_ids, **self._ordered(task))
        return self.engine.swap_out(device_ids, host_ids)

    def _swap_in(self, task: Task, host_ids, device_ids) -> int:
        if self._cuda:
            return self.engine.swap_in(host_ids, device_ids, **self._ordered(task))
        return self.engine.swap_in(host_ids, device_ids)

    def _swap_in_layers(self, task: Task) -> int:
        """A swap-in inside the engine's step: layer by layer, each published as it
        lands (on CUDA: as its copy and its layer event are enqueued), under the
        channel's gate; a failure is published too (the engine recomputes the
        blocks), and a task the engine gave up on stops before its next layer."""
        prog, tid = self._progress, task.task_id
        done = nbytes = 0
        try:
            if self._cuda and len(self._layer_events) != self.cfg.layout.num_layers:
                raise RuntimeError(f"rank {self.rank}: a load inside the step on CUDA needs "
                                   f"the engine's {self.cfg.layout.num_layers} layer events "
                                   f"in the step progress channel; it has "
                                   f"{len(self._layer_events)}")
            engines = self._per_layer()
            for layer, engine in enumerate(engines):
                with prog.layer_gate(tid) if prog is not None else nullcontext():
                    nbytes += self._copy_layer(task, layer, engine)
                    done += 1
                    if prog is not None:
                        prog.publish(tid, done)
            if self._cuda:  # the Done says every byte landed
                engines[0].synchronize()
            return nbytes
        except Exception:
            if prog is not None:
                prog.publish(tid, done, failed=True)
            raise

    def _copy_layer(self, task: Task, layer: int, engine) -> int:
        if not self._cuda:
            return engine.swap_in(task.src, task.dst)
        from kvcached.copy.cuda import H2D
        # one stream: layer 0's wait on the KV event orders every layer after it
        order = self._ordered(task) if layer == 0 else {}
        nbytes = engine.swap_in(task.src, task.dst, sync=False, **order)
        engine.record_event(self._layer_events[layer], H2D)
        return nbytes

    def _per_layer(self) -> list:
        """One copy engine per layer: its planes only (layer by layer, in the
        layout's order), over the same host pool. On CUDA they share layer 0's
        stream (the step's own: a load inside the step never queues behind the
        other swap-ins)."""
        if self._layer_engines is not None:
            return self._layer_engines
        n = self.cfg.layout.num_layers
        per = len(self.planes) // n
        assert per * n == len(self.planes), (len(self.planes), n)
        offsets = self.cfg.layout.host_offsets
        engines = []
        try:
            for i in range(n):
                planes, offs = self.planes[i * per:(i + 1) * per], offsets[i * per:(i + 1) * per]
                engines.append(self._layer_engine(planes, offs, engines[0] if engines else None))
        except BaseException:
            self._close_layer_engines(engines)
            raise
        self._layer_engines = engines
        return engines

    def _layer_engine(self, planes, offsets, first):
        if not self._cuda:
            from kvcached.copy.cpu import CpuCopyEngine
            return CpuCopyEngine(planes, self.host.tensor, offsets, threads=self.cfg.copy_threads)
        from kvcached.copy.cuda import H2D, CudaCopyEngine
        cfg = self.cfg
        return CudaCopyEngine(planes, self.host.tensor, offsets,
                              mode=(cfg.cuda_copy_d2h, cfg.cuda_copy_h2d),
                              grid_blocks=cfg.cuda_grid_blocks,
                              block_threads=cfg.cuda_block_threads,
                              stream=None if first is None else first.stream_of(H2D))

    @staticmethod
    def _close_layer_engines(engines) -> None:
        """Layer 0 owns the shared stream: it goes last."""
        for engine in reversed(engines or []):
            if hasattr(engine, "close"):
                engine.close()

    def run(self, task: Task) -> dict[str, Any]:
        """Execute one task on this rank; returns {"bytes": n, ...} (the Done's
        elapsed_s times it). ``task`` is a Task or, in a worker, the decoded
        protocol Task: only its kind, src, dst and args are read."""
        kind = task.kind  # one frame for a swap: it runs once per rank per swap
        try:
            if kind == "noop":
                return {"bytes": 0}
            if self.engine is None:
                raise RuntimeError(f"rank {self.rank}: no host pool (num_cpu_blocks=0, or asleep)")
            if kind == "swap_out":
                return {"bytes": self._swap_out(task, task.src, task.dst)}
            if kind == "swap_in":
                return {"bytes": self._swap_in(task, task.src, task.dst)}
            if kind == "swap_in_layers":
                return {"bytes": self._swap_in_layers(task)}
            if kind in ("store", "load", "lookup"):
                return self._storage_task(task)
            raise ValueError(f"rank {self.rank}: unsupported task kind {kind!r}")
        except Exception as e:
            if getattr(e, "fatal", False):
                self._broken = e  # close() then only logs what else fails
            raise

    # ---------------------------------------------------------------- storage
    def _storage_task(self, task: Task) -> dict[str, Any]:
        if self.store is None:
            raise RuntimeError(f"rank {self.rank}: no storage backend is attached")
        hashes = [bytes.fromhex(k) for k in task.args["keys"]]
        if task.kind == "lookup" and "lengths" in task.args:  # several runs, one call
            runs, at = [], 0
            for n in task.args["lengths"]:
                runs.append(hashes[at:at + n])
                at += n
            return {"prefixes": self.store.lookup_many(runs)}
        if task.kind == "lookup":
            return {"prefix": self.store.lookup(hashes)}
        if task.kind == "store":
            return self._store(task, hashes)
        return self._load(task, hashes)

    def _store(self, task: Task, hashes: list[bytes]) -> dict[str, Any]:
        """Write-through: optionally stage GPU blocks into the host blocks first."""
        device_ids = task.args.get("device_ids")
        nbytes = self._swap_out(task, device_ids, task.src) if device_ids else 0
        ok = self.store.store(hashes, self.host.tensor, task.src)
        return {"bytes": nbytes, "stored": [int(x) for x in ok]}

    def _load(self, task: Task, hashes: list[bytes]) -> dict[str, Any]:
        """Storage -> host blocks (chunk by chunk) -> GPU blocks; what arrived is
        used, the rest is recomputed. Between chunks, ``storage_load_policy``
        decides: ``best_effort`` stops at the first check (one chunk: it never
        waits for a second read), ``timeout`` once ``storage_load_timeout_s``
        passed, ``wait_complete`` never (every block the lookup found)."""
        policy = self.cfg.storage_load_policy
        deadline = task.args.get("deadline_s", self.cfg.storage_load_timeout_s)
        stop = time.monotonic() + deadline if policy == "timeout" else None
        done = 0
        while done < len(hashes):
            start, end = done, min(done + LOAD_CHUNK, len(hashes))
            done = start + self.store.load(hashes[start:end], self.host.tensor,
                                           task.dst[start:end])
            if (done < end or policy == "best_effort"
                    or (stop is not None and time.monotonic() > stop)):
                break
        device_ids = task.args.get("device_ids")
        nbytes = self._swap_in(task, task.dst[:done], device_ids[:done]) if device_ids and done \
            else 0
        return {"prefix": done, "bytes": nbytes}

    def attach_storage(self, cfg: CacheConfig) -> bool:
        """Open the storage backend ``cfg`` names (runtime attach); False if no change."""
        from kvcached.storage.blockstore import BlockStore
        same = (cfg.storage_backend, cfg.storage_url) == (self.cfg.storage_backend,
                                                          self.cfg.storage_url)
        if same and self.store is not None:
            return False
        self.detach_storage()
        self.cfg = cfg
        self.store = BlockStore.from_config(cfg, self.rank)
        return True

    def detach_storage(self) -> bool:
        """Close the backend and release what it holds (registered memory, sockets)."""
        if self.store is None:
            return False
        self.store.close()
        self.store = None
        return True

    def storage_health(self) -> dict[str, Any]:
        """This rank's storage as `kvcached status` shows it ({} without storage)."""
        store = self.store
        return store.health() if store is not None else {}

    def set_namespace(self, namespace: str) -> None:
        if self.store is not None:
            self.store.set_namespace(namespace)

    def close(self, final: bool = True) -> None:
        """Detach from the planes and host pool; ``final`` also closes storage.

        On CUDA the mappings are released, not just dropped: the copy engine
        finishes and frees its streams, the host pool is unregistered, the
        engine's event closed, and the planes' IPC mappings closed (sleep lets
        go of the engine's memory; wakeup maps it again through ``open``).
        Every step runs even when an earlier one fails; the first failure is
        raised at the end.
        """
        errors: list[Exception] = []

        def attempt(fn, *args) -> None:
            try:
                fn(*args)
            except Exception as e:  # keep releasing the rest
                logger.warning("rank %d: close: %s", self.rank, e)
                errors.append(e)

        if self.store is not None:
            attempt(self.store.release_host_pool)
            if final:
                attempt(self.store.close)
                self.store = None
        if self._layer_engines is not None:
            attempt(self._close_layer_engines, self._layer_engines)
            self._layer_engines = None
        if self.engine is not None and hasattr(self.engine, "close"):
            attempt(self.engine.close)
        self.engine = None
        attempt(self._close_progress)
        attempt(self._close_event)
        if self._pinned is not None:
            from kvcached.memory.cuda_ipc import unpin
            attempt(unpin, self._pinned)
            self._pinned = None
        if self.host is not None:
            self.host.close()
            self.host = None
        planes, self.planes = self.planes, None
        if planes is not None and self.cfg.device == "cuda":
            from kvcached.memory.cuda_ipc import close_cuda_planes
            attempt(close_cuda_planes, planes)
        # After a fatal error every CUDA call fails: what could be released was.
        if errors and self._broken is None and not any(getattr(e, "fatal", False)
                                                       for e in errors):
            raise errors[0]
