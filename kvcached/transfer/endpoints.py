"""Where the coordinator's sockets live: ipc:// files in the run directory
(mode 0700, so only this user can talk to them), or TCP on 127.0.0.1 when
configured."""

from __future__ import annotations

from pathlib import Path

from kvcached.config import CacheConfig

CONFIG_FILE = "config.json"
ENGINE_FILE = "engine.json"  # {"pid": engine pid}: names the host pools a worker attaches


def coordinator_endpoint(cfg: CacheConfig, run_dir) -> str:
    return f"ipc://{Path(run_dir) / 'coord.sock'}"


def control_endpoint(run_dir) -> str:
    return f"ipc://{Path(run_dir) / 'ctl.sock'}"


def socket_files(run_dir) -> list[Path]:
    return [Path(run_dir) / "coord.sock", Path(run_dir) / "ctl.sock"]
