"""Pick the Transfer implementation named by ``cfg.transfer_mode``."""

from __future__ import annotations

from kvcached.config import CacheConfig
from kvcached.transfer.base import Transfer


def make_transfer(cfg: CacheConfig, run_dir) -> Transfer:
    if cfg.transfer_mode == "inprocess":
        from kvcached.transfer.inprocess import InProcessTransfer
        return InProcessTransfer(cfg, run_dir)
    from kvcached.transfer.coordinator import WorkerTransfer
    return WorkerTransfer(cfg, run_dir)
