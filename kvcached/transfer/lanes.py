"""A transfer worker's lanes: the threads its tasks run on, each strictly in
order, and which kind of task goes to which (``kvcached.transfer.worker``
says why). Plain data, so that ``kvcached status`` can name the lanes
without importing the worker.
"""

LANE_OF = {"swap_out": "out", "swap_in": "in", "swap_in_layers": "step", "lookup": "load",
           "load": "load", "store": "store", "control": "ctl", "noop": "ctl"}
LANES = ("out", "in", "step", "load", "store", "ctl")
