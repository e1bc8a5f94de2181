"""The ``kvcached`` command line: a thin shell over the library API."""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import click

from kvcached.config import CacheConfig


class Finite(click.FloatRange):
    """A finite number in range (``inf`` and ``nan`` are usage errors; FloatRange
    alone lets ``nan`` through, as every comparison with it is false)."""

    name = "number"
    what = "number"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite {self.what}", param, ctx)
        return number


class Seconds(Finite):
    """A finite number of seconds in range."""

    name = "seconds"
    what = "number of seconds"


class _LazyGroup(click.Group):
    """A group whose heavy subcommands are imported only when invoked: `kvcached
    status` and `kvcached ctl` must not pay for numpy or torch (`bench` imports
    both). ``--help`` lists them from their one-line help below."""

    LAZY = {"bench": ("kvcached.tools.trace", "bench",
                      "Benchmarks; each prints a JSON line at the end.")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.LAZY:
            return super().get_command(ctx, name)
        module, attr, short = self.LAZY[name]
        if ctx.meta.get("kvcached.listing"):  # --help: no import for a line
            return click.Command(name, help=short)
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError:  # an install without the tools: the command is absent
            return None

    def format_commands(self, ctx: click.Context, formatter) -> None:
        ctx.meta["kvcached.listing"] = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            ctx.meta["kvcached.listing"] = False


@click.group(cls=_LazyGroup)
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
    from kvcached.ops.logs import setup_process_logging
    from kvcached.transfer.endpoints import CONFIG_FILE
    from kvcached.transfer.worker import run_worker
    cfg = _worker_config(run_dir, config_path, CONFIG_FILE)
    if not 0 <= rank < cfg.tp_size:
        raise click.ClickException(f"--rank must be in 0..{cfg.tp_size - 1} (tp_size), got {rank}")
    setup_process_logging(cfg.log_dir or os.path.join(run_dir, "logs"), f"worker-rank{rank}")
    sys.exit(run_worker(cfg, run_dir, rank, engine_pid, restarts))


def _worker_config(run_dir: str, config_path: str | None, config_file: str) -> CacheConfig:
    """The worker's config. Host memory is not checked here: the engine creates
    (and checked) the host pools, which, once they exist, take the very memory
    a check would look for, so a restarted worker would be refused."""
    try:
        if config_path:
            return CacheConfig.load(config_path, run_dir=run_dir, check_host_memory=False)
        path = Path(run_dir) / config_file
        if not path.is_file():
            raise click.ClickException(
                f"no {config_file} in {run_dir}: is the engine running? (or pass --config)")
        from kvcached.transfer.runconfig import read_run_config
        return CacheConfig.from_dict(read_run_config(run_dir), check_host_memory=False)
    except ValueError as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.option("--requests", type=click.IntRange(min=1), default=None,
              help="requests to serve (default: 600; with --serve: until Ctrl-C)")
@click.option("--seed", type=int, default=0, help="seeds the workload")
@click.option("--serve", is_flag=True,
              help="run as a long-lived engine to point `kvcached status` and `kvcached ctl` "
              "at: prints its run dir and metrics URL, serves until Ctrl-C")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="with --serve: the engine's run directory (default: a new temporary one)")
@click.option("--rate", type=Finite(min=0.1, max=1000.0), default=20.0,
              show_default=True, help="with --serve: requests per second")
def demo(requests: int | None, seed: int, serve: bool, run_dir: str | None,
         rate: float) -> None:
    """Run the reference engine with kvcached on a synthetic multi-turn chat workload.

    Without --serve: serve the requests, verify a sample against a full
    recompute and print a report. KVCACHED_* variables apply, except those
    for the settings the demo sizes itself (it says which it ignores)."""
    from kvcached.tools.demo import DemoConfigError, run_demo, serve_demo
    try:
        if serve:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            serve_demo(run_dir=run_dir, rate=rate, seed=seed, max_requests=requests, stop=stop)
        else:
            if run_dir:
                raise click.UsageError("--run-dir goes with --serve")
            run_demo(requests=requests or 600, seed=seed)
    except DemoConfigError as e:
        raise click.ClickException(f"invalid configuration: {e}") from None


# ------------------------------------------------------------------ launch
@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              default=None, help="TOML config shared with the engine (spawn_workers = false); "
              "default: the config the running engine wrote into --run-dir (vLLM)")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              envvar="KVCACHED_RUN_DIR", help="the engine's run directory (default: run_dir "
              "in the config)")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="give up after this many consecutive crashes of a rank (default: never)")
def launch(config_path: str | None, run_dir: str | None, max_restarts: int | None) -> None:
    """Run one transfer worker per rank as a supervised group, in the foreground.

    For engines configured with spawn_workers = false (workers as their own
    service: a sidecar, a systemd unit). Crashed workers are restarted with a
    bounded backoff; Ctrl-C or SIGTERM stops the group.
    """
    from kvcached.ops.launcher import launch as run_launcher
    try:
        code = run_launcher(config_path, run_dir, max_restarts=max_restarts)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    sys.exit(code)


# ------------------------------------------------------- ctl and status
# This path imports neither torch nor numpy (checked by a test): only click,
# zmq, msgpack and the light modules of kvcached.
RUN_DIR_HELP = "the engine's run directory (also KVCACHED_RUN_DIR)"
SLEEP_AFTER_DRAIN_S = 60.0  # with --drain, the sleep itself gets this long after the drain


class JsonFailure(click.ClickException):
    """A failure printed as one JSON object on stdout (the commands' --json mode)."""

    def __init__(self, op: str, error: Exception):
        super().__init__(str(error))
        self.payload = {"ok": False, "op": op, "error": str(error),
                        "timeout": isinstance(error, TimeoutError)}

    def show(self, file=None) -> None:
        click.echo(json.dumps(self.payload, sort_keys=True))


def _run_dir_option(f):
    return click.option("--run-dir", type=click.Path(file_okay=False), default=None,
                        envvar="KVCACHED_RUN_DIR", help=RUN_DIR_HELP)(f)


def _need_run_dir(run_dir: str | None) -> str:
    if not run_dir:
        raise click.ClickException(
            "no run directory: pass --run-dir or set KVCACHED_RUN_DIR to the engine's "
            "run_dir (CacheManager.run_dir, or run_dir in its config)")
    return run_dir


def _request(run_dir: str | None, op: str, args: dict | None, timeout: float,
             as_json: bool = False) -> dict:
    """One control request; every failure becomes a ClickException saying what to do
    (as JSON with ``as_json``)."""
    from kvcached.ops.ctlserver import ControlError, ControlUnavailable, request
    try:
        return request(_need_run_dir(run_dir), op, args, timeout_s=timeout)
    except (ControlUnavailable, ControlError, TimeoutError, ValueError,
            click.ClickException) as e:
        if as_json:
            raise JsonFailure(op, e) from e
        if isinstance(e, click.ClickException):
            raise
        raise click.ClickException(str(e)) from e


@main.group()
def ctl() -> None:
    """Control a running engine's cache: pause, resume, sleep, wakeup, update-weights,
    restart-workers."""


def _ctl_command(name: str, op: str, doc: str, extra=(), prepare=None):
    """Build `kvcached ctl <name>`: the same options and output for every op.
    ``prepare(args, timeout) -> (args, request timeout)`` adapts an op's arguments."""
    def command(run_dir, timeout, as_json, **kwargs):
        args = {k: v for k, v in kwargs.items() if v is not None}
        if prepare is not None:
            args, timeout = prepare(args, timeout)
        result = _request(run_dir, op, args, timeout, as_json)
        if as_json:
            click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
        else:
            click.echo(_describe(name, result))
    command.__doc__ = doc
    command.__name__ = name.replace("-", "_")
    for opt in extra:
        command = opt(command)
    command = click.option("--json", "as_json", is_flag=True,
                           help="print the raw result (errors too) as JSON")(command)
    command = click.option("--timeout", type=Seconds(min=0.1, max=3600.0), default=60.0,
                           show_default=True, help="seconds to wait for every rank")(command)
    command = _run_dir_option(command)
    return ctl.command(name)(command)


def _describe(name: str, result: dict) -> str:
    changed = result.get("changed")
    ranks = result.get("ranks")
    if changed is None and isinstance(ranks, dict) and ranks:
        changed = any(isinstance(r, dict) and r.get("changed") for r in ranks.values())
    state = ("changed" if changed else "no change: already in that state") \
        if changed is not None else "done"
    version = f", weights {result['version']}" if result.get("version") else ""
    restarted = (f", restarted ranks {result['restarted']}" if result.get("restarted")
                 else "")
    return f"{name}: ok ({state}{version}{restarted})"


def _sleep_args(args: dict, timeout: float) -> tuple[dict, float]:
    """--drain: the drain may take --timeout, the sleep itself then its own budget."""
    if not args.pop("drain", False):
        return args, timeout
    return {**args, "drain": True, "drain_timeout_s": timeout}, timeout + SLEEP_AFTER_DRAIN_S


_ctl_command("pause", "pause", """Hold transfers: in-flight ones finish, queued ones wait.

    While paused, GPU hits are served as usual; a prefix held in the CPU tier or
    in storage is served as a miss (the engine recomputes it), so no request
    waits for resume. Storage writes stop too.""")
_ctl_command("resume", "resume", "Run the held transfers, in order.")
_ctl_command("sleep", "sleep", """Pause and detach from the KV planes (optionally free the
    host pool).

    Fails while requests are running, unless --drain: then new allocations get
    CacheAsleep at once, running requests finish (for up to --timeout
    seconds), and then it sleeps. A drain that times out changes nothing.""",
             extra=[click.option("--release-host-pool", is_flag=True, default=None,
                                 help="also release the host pool (the CPU tier is emptied)"),
                    click.option("--drain", is_flag=True, default=False,
                                 help="refuse new requests and wait for running ones first")],
             prepare=_sleep_args)
_ctl_command("wakeup", "wakeup", "Re-attach the KV planes (and host pool) and resume.")
_ctl_command("update-weights", "update_weights", "Switch to a new weight version: KV "
             "cached under other weights is never reused.", extra=[click.option(
                 "--version", required=True, help="the new weight version")])
_ctl_command("restart-workers", "restart_workers", """Restart transfer workers that gave up
    (a rank past max_worker_restarts consecutive crashes) and, once every rank
    is ready, turn the CPU tier and storage back on.""")


@main.command()
@_run_dir_option
@click.option("--json", "as_json", is_flag=True,
              help="print the raw status (errors too) as JSON")
@click.option("--watch", is_flag=True, help="refresh until Ctrl-C")
@click.option("--interval", type=Seconds(min=0.1, max=3600.0), default=2.0,
              show_default=True, help="seconds between refreshes with --watch")
@click.option("--timeout", type=Seconds(min=0.1, max=3600.0), default=10.0, show_default=True,
              help="seconds to wait for the engine")
@click.option("--count", type=click.IntRange(min=0), default=0, hidden=True,
              help="with --watch: stop after this many refreshes (tests)")
def status(run_dir: str | None, as_json: bool, watch: bool, interval: float, timeout: float,
           count: int) -> None:
    """Show workers, tiers, hit rates, transfers, storage health and log locations.

    Storage health: per rank, the space the store uses and its cap, and the
    objects rejected on read (checksum mismatch, bad header, short read,
    wrong block: each is a miss, never data)."""
    from kvcached.ops.statusview import render_status
    shown = 0
    try:
        while True:
            st = _request(run_dir, "status", None, timeout, as_json)
            if watch and not as_json:
                click.clear()
            click.echo(json.dumps(st, indent=2, sort_keys=True, default=str) if as_json
                       else render_status(st))
            shown += 1
            if not watch or (count and shown >= count):
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


# ---------------------------------------------------------------- cleanup
@main.command()
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
@click.option("--run-dir", "run_dirs", multiple=True, type=click.Path(file_okay=False),
              help="also clean this configured run directory if its engine is gone "
              "(its sockets and pid file; logs stay); repeatable")
def cleanup(dry_run: bool, run_dirs: tuple[str, ...]) -> None:
    """Remove what dead engines left: shared-memory segments (KV planes, host pools)
    and temporary run directories.

    Only leftovers whose engine pid is gone are touched; a running engine's
    memory and sockets are never removed."""
    from kvcached.ops.cleanup import cleanup_leftovers
    try:
        lines = cleanup_leftovers(dry_run=dry_run, run_dirs=run_dirs)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    for line in lines:
        click.echo(line)


# ------------------------------------------------------------- build-cuda
@main.command("build-cuda")
@click.option("--archs", default=None, help="SM versions, e.g. '80;90' (default: this "
              "machine's GPUs)")
def build_cuda(archs: str | None) -> None:
    """Build (or reuse) the CUDA copy kernel ahead of time; prints a JSON summary."""
    from kvcached.copy import cuda
    argv = ["--build"] + (["--archs", archs] if archs else [])
    sys.exit(cuda.main(argv))


if __name__ == "__main__":
    main(prog_name=os.path.basename(sys.argv[0]))
