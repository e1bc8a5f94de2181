"""Errors callers handle. Messages say what happened and what to do."""


class KVCachedError(RuntimeError):
    """Base class of kvcached's runtime errors."""


class NoFreeBlocks(KVCachedError):
    """Not enough GPU blocks even after eviction; the manager's state is unchanged."""

    def __init__(self, needed: int, available: int, message: str = ""):
        self.needed = needed
        self.available = available
        super().__init__(message or (
            f"need {needed} GPU blocks but only {available} can be freed "
            "(the rest are used by running requests); retry after requests finish"))


class TransferFailed(KVCachedError):
    """A transfer task failed on at least one rank; its blocks were rolled back."""


class WorkerLost(TransferFailed):
    """A transfer worker died or missed its heartbeat deadline."""


class CacheAsleep(KVCachedError):
    """The cache is asleep (``sleep()``); call ``wakeup()`` before allocating."""
