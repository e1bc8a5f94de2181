"""A load inside vLLM's step, as the scheduler half tells the worker halves of
it in the step's metadata (``KvcachedMetadata.step_load``): a module of its
own, so that both halves import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepLoad:
    """This step's loads inside the step, as one ``swap_in_layers`` task: what the
    workers wait for, layer by layer, in this step's forward (``task_id``; -1:
    none to wait for), and the blocks to report failed if it does not land
    (``blocks``); ``failed``: blocks already known not to arrive (nothing
    could be planned for them, or the task failed at submit); ``timeout_s``:
    how long a forward waits for a layer (``step_load_timeout_s``)."""

    task_id: int = -1
    blocks: list[int] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)
    timeout_s: float = 2.0
