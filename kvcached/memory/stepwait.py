"""The engine's wait for a load inside its step: layer by layer, and giving up for good.

The engine's worker for a rank (vLLM's worker half) waits, before layer i's
attention reads the KV cache, for layer i of the step's ``swap_in_layers``
task, as the rank's step progress channel (``kvcached.memory.progress``)
reports it. On the CPU the channel says the layer landed, and the wait is
the CPU's. On CUDA it says the layer's copy was enqueued and its layer event
recorded after it: the compute stream then waits on that event
(``cudaStreamWaitEvent``, the CPU goes on), so layer i's attention overlaps
the copy of the layers after it.

Per layer only where the per-layer hook runs: a full CUDA graph replays the
forward without it, so where one may run the whole load is waited for
before the forward starts (:func:`layerwise`).

A wait that fails (the copy failed, its worker was lost, the deadline
passed) gives up: the load's blocks become load errors, which the engine
computes again. Giving up must be final, or a late copy would overwrite the
recomputed KV: the channel's gate is closed first (no layer starts after
it); a layer in flight gets one more timeout to finish; a writer stuck
inside one past that is killed (SIGKILL, its coordinator starts a new one),
the one way to be sure it writes nothing more. On CUDA the compute stream
also waits on the last layer enqueued, so nothing computed later is
overwritten by a copy still running on the GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from kvcached.memory.progress import StepProgress, Wait

logger = logging.getLogger(__name__)

KILL_WAIT_S = 5.0  # a killed writer releases the gate (the kernel closes its files) by then


def layerwise(on_cuda: bool, full_graphs: bool, runtime_mode=None) -> bool:
    """Whether a forward's attention layers wait for their own layer of the load
    (else the whole load is waited for before the forward). Always on the CPU;
    on CUDA only where no full CUDA graph may replay the forward, which runs
    without the per-layer hook and would read layers not yet copied.
    ``full_graphs``: the engine may replay full graphs (vLLM: its cudagraph
    mode has them); ``runtime_mode``: this forward's mode where the engine
    says it (vLLM's forward context; ``FULL`` is a full graph)."""
    if not on_cuda:
        return True
    return not full_graphs and getattr(runtime_mode, "name", runtime_mode) != "FULL"


class StepWait:
    """One rank's waits for the loads inside its steps (see the module).

    ``events``: on CUDA, the layer events (``torch.cuda.Event``, one per layer,
    their IPC handles in the channel); None on the CPU. ``log``: where the
    give-ups are told (vLLM's worker half: vLLM's log)."""

    def __init__(self, progress: StepProgress, num_layers: int, rank: int = 0, events=None,
                 log: logging.Logger = logger):
        self.progress = progress
        self.num_layers = num_layers
        self.rank = rank
        self.events = events
        self.log = log
        self.errors: set[int] = set()  # blocks of loads given up, for the engine to take
        self.layerwise = True
        self._task = -1  # the task this forward waits for (-1: none)
        self._blocks: list[int] = []
        self._timeout_s = 0.0
        self._deadline = 0.0
        self._seen = 0  # of its layers, those the channel reported
        self._ordered = 0  # CUDA: those the compute stream waits for

    @property
    def active(self) -> bool:
        return self._task >= 0

    def expect(self, task_id: int, blocks: list[int], timeout_s: float) -> None:
        """This step's forward waits for task ``task_id``; ``blocks`` fail if it
        does not land, ``timeout_s`` after the forward's start."""
        self._task, self._blocks, self._timeout_s = task_id, list(blocks), timeout_s
        self._deadline, self._seen, self._ordered = 0.0, 0, 0

    def start(self, layerwise: bool = True) -> None:
        """The forward is about to start: its deadline starts now; without per-layer
        waits, the whole load is waited for here."""
        if self._task < 0:
            return
        self._deadline = time.monotonic() + self._timeout_s
        self.layerwise = layerwise
        if not layerwise:
            self.wait(self.num_layers)

    def layer(self, index: int) -> None:
        """Before layer ``index``'s attention."""
        if self.layerwise:
            self.wait(index + 1)

    def finish(self) -> None:
        """After the forward: every layer (those no attention waited for too)."""
        self.wait(self.num_layers)
        self._task = -1

    def wait(self, layers: int) -> None:
        """Wait until layers ``0..layers-1`` can be read, or give up."""
        if self._task < 0:
            return
        if not self._deadline:
            self._deadline = time.monotonic() + self._timeout_s
        if layers > self._seen:
            res = self.progress.wait(self._task, layers, self._deadline)
            if not res.ok:
                self._give_up(res)
                return
            self._seen = res.layers
        if self.events is not None and layers > self._ordered:
            self._order_after(layers)

    def _order_after(self, layers: int) -> None:
        """The compute stream waits for the copies of layers ``0..layers-1`` (one
        copy stream: layer ``layers-1``'s event comes after the others)."""
        import torch
        torch.cuda.current_stream().wait_event(self.events[layers - 1])
        self._ordered = layers

    def _give_up(self, res: Wait) -> None:
        task, blocks = self._task, self._blocks
        self._task = -1
        if not self.progress.cancel(task, time.monotonic() + self._timeout_s):
            self._stop_writer(task)
        # The gate is closed: nothing more gets enqueued. A dead writer's copies
        # died with its CUDA context, and its events may never fire: no wait then.
        if self.events is not None and self.progress.writer_alive():
            last_task, enqueued, _ = self.progress.state()
            if last_task == task and enqueued > self._ordered:
                self._order_after(enqueued)
        self.errors.update(blocks)
        self.log.warning("kvcached: rank %d: a load inside the step (task %d, %d blocks) %s "
                         "after %d of %d layers; its blocks are computed again", self.rank,
                         task, len(blocks), res.outcome, res.layers, self.num_layers)

    def _stop_writer(self, task: int) -> None:
        """The writer held the gate, inside a layer, for a whole timeout more: kill
        it, and take the gate once the kernel released it with its files."""
        pid = self.progress.writer_pid()
        self.log.error("kvcached: rank %d: transfer worker pid %d is stuck copying a layer of "
                       "task %d; killing it so that it cannot overwrite the blocks computed "
                       "again (it is restarted)", self.rank, pid, task)
        if pid and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self.progress.cancel(task, time.monotonic() + KILL_WAIT_S):
            raise RuntimeError(
                f"kvcached: rank {self.rank}: the step gate of task {task} is still held "
                f"{KILL_WAIT_S}s after killing transfer worker pid {pid}; its copy could "
                "still overwrite KV computed again, so this forward cannot go on. Stop the "
                "process holding it (see `lsof` on the run dir's step-rank*.progress)")

    def take_errors(self) -> set[int]:
        out, self.errors = self.errors, set()
        return out
