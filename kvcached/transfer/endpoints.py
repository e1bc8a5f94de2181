"""Where the coordinator's and the control socket live: ipc:// files in the
run directory.

Only ipc://: the run directory is mode 0700, so the file system is the access
control (only this user can send tasks that write KV memory, or pause the
engine). TCP is not offered: a TCP port on 127.0.0.1 is open to every local
user, and the protocol has no authentication. (KV events, which only
publish, may use TCP: ``kv_events_endpoint``.)"""

from __future__ import annotations

from pathlib import Path

from kvcached.config import CacheConfig

# {"pid": engine pid}: names the host pools a worker attaches
from kvcached.memory.rundir import ENGINE_FILE as ENGINE_FILE

CONFIG_FILE = "config.json"


def coordinator_endpoint(cfg: CacheConfig, run_dir) -> str:
    return f"ipc://{Path(run_dir) / 'coord.sock'}"


def control_endpoint(run_dir) -> str:
    return f"ipc://{Path(run_dir) / 'ctl.sock'}"


def socket_files(run_dir) -> list[Path]:
    return [Path(run_dir) / "coord.sock", Path(run_dir) / "ctl.sock"]
