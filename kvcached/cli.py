"""The ``kvcached`` command line: a thin shell over the library API."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from kvcached.config import CacheConfig


@click.group()
def main() -> None:
    """kvcached: a hierarchical KV cache for LLM inference engines."""


@main.command()
@click.option("--rank", type=int, required=True, help="tensor-parallel rank served")
@click.option("--run-dir", type=click.Path(file_okay=False), required=True,
              envvar="KVCACHED_RUN_DIR", help="the engine's run directory")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config (default: <run-dir>/config.json written by the engine)")
@click.option("--engine-pid", type=int, default=None, help="exit when this pid is gone")
@click.option("--restarts", type=int, default=0, help="how many times this rank restarted")
def worker(rank: int, run_dir: str, config_path: str | None, engine_pid: int | None,
           restarts: int) -> None:
    """Run one transfer worker (what the engine and `kvcached launch` spawn)."""
    from kvcached.transfer.endpoints import CONFIG_FILE
    from kvcached.transfer.worker import run_worker
    cfg = _worker_config(run_dir, config_path, CONFIG_FILE)
    if not 0 <= rank < cfg.tp_size:
        raise click.ClickException(f"--rank must be in 0..{cfg.tp_size - 1} (tp_size), got {rank}")
    sys.exit(run_worker(cfg, run_dir, rank, engine_pid, restarts))


def _worker_config(run_dir: str, config_path: str | None, config_file: str) -> CacheConfig:
    try:
        if config_path:
            return CacheConfig.load(config_path, run_dir=run_dir)
        path = Path(run_dir) / config_file
        if not path.is_file():
            raise click.ClickException(
                f"no {config_file} in {run_dir}: is the engine running? (or pass --config)")
        return CacheConfig.from_dict(json.loads(path.read_text()))
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--requests", type=int, default=600, help="requests to replay")
@click.option("--seed", type=int, default=0)
def demo(requests: int, seed: int) -> None:
    """Run the manager on a synthetic multi-turn chat workload and report."""
    from kvcached.demo import run_demo
    run_demo(requests=requests, seed=seed)


if __name__ == "__main__":
    main(prog_name=os.path.basename(sys.argv[0]))
