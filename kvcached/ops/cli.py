"""The ``kvcached`` command line: a thin shell over the library API."""

from __future__ import annotations

import json
import os
import sys
import time
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
    from kvcached.tools.demo import run_demo
    run_demo(requests=requests, seed=seed)


# ------------------------------------------------------------------ launch
@main.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              required=True, help="TOML config shared with the engine (spawn_workers = false)")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              envvar="KVCACHED_RUN_DIR", help="the engine's run directory (default: run_dir "
              "in the config)")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="give up after this many consecutive crashes of a rank (default: never)")
def launch(config_path: str, run_dir: str | None, max_restarts: int | None) -> None:
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
RUN_DIR_HELP = "the engine's run directory (also KVCACHED_RUN_DIR)"


def _run_dir_option(f):
    return click.option("--run-dir", type=click.Path(file_okay=False), default=None,
                        envvar="KVCACHED_RUN_DIR", help=RUN_DIR_HELP)(f)


def _need_run_dir(run_dir: str | None) -> str:
    if not run_dir:
        raise click.ClickException(
            "no run directory: pass --run-dir or set KVCACHED_RUN_DIR to the engine's "
            "run_dir (CacheManager.run_dir, or run_dir in its config)")
    return run_dir


def _request(run_dir: str | None, op: str, args: dict | None, timeout: float) -> dict:
    """One control request; every failure becomes a ClickException saying what to do."""
    from kvcached.ops.ctlserver import ControlError, ControlUnavailable, request
    try:
        return request(_need_run_dir(run_dir), op, args, timeout_s=timeout)
    except (ControlUnavailable, ControlError, TimeoutError) as e:
        raise click.ClickException(str(e)) from e


@main.group()
def ctl() -> None:
    """Control a running engine's cache: pause, resume, sleep, wakeup, update-weights."""


def _ctl_command(name: str, op: str, doc: str, extra=()):
    """Build `kvcached ctl <name>`: the same options and output for every op."""
    def command(run_dir, timeout, as_json, **kwargs):
        args = {k: v for k, v in kwargs.items() if v is not None}
        result = _request(run_dir, op, args, timeout)
        if as_json:
            click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
        else:
            click.echo(_describe(name, result))
    command.__doc__ = doc
    command.__name__ = name.replace("-", "_")
    for opt in extra:
        command = opt(command)
    command = click.option("--json", "as_json", is_flag=True, help="print the raw result")(
        command)
    command = click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0,
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
    return f"{name}: ok ({state}{version})"


_ctl_command("pause", "pause", "Hold transfers: in-flight ones finish, queued ones wait.")
_ctl_command("resume", "resume", "Run the held transfers, in order.")
_ctl_command("sleep", "sleep", "Pause and detach from the KV planes (optionally free the "
             "host pool).", extra=[click.option(
                 "--release-host-pool", is_flag=True, default=None,
                 help="also release the host pool (the CPU tier is emptied)")])
_ctl_command("wakeup", "wakeup", "Re-attach the KV planes (and host pool) and resume.")
_ctl_command("update-weights", "update_weights", "Switch to a new weight version: KV "
             "cached under other weights is never reused.", extra=[click.option(
                 "--version", required=True, help="the new weight version")])


@main.command()
@_run_dir_option
@click.option("--json", "as_json", is_flag=True, help="print the raw status as JSON")
@click.option("--watch", is_flag=True, help="refresh until Ctrl-C")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds between refreshes with --watch")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="seconds to wait for the engine")
@click.option("--count", type=click.IntRange(min=0), default=0, hidden=True,
              help="with --watch: stop after this many refreshes (tests)")
def status(run_dir: str | None, as_json: bool, watch: bool, interval: float, timeout: float,
           count: int) -> None:
    """Show workers, tiers, hit rates, transfers, storage health and log locations."""
    shown = 0
    try:
        while True:
            st = _request(run_dir, "status", None, timeout)
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


def render_status(st: dict) -> str:
    """The text `kvcached status` prints for a manager.status() dict."""
    stats = st.get("stats") or {}
    state = "ASLEEP" if st.get("asleep") else "PAUSED" if st.get("paused") else "serving"
    lines = [f"kvcached: {state}   run_dir {st.get('run_dir', '?')}   "
             f"({st.get('transfer_mode', '?')}, tp={st.get('tp_size', '?')}, "
             f"weights {st.get('weight_version', '?')}, "
             f"cpu tier {'on' if st.get('cpu_tier', True) else 'OFF'})",
             f"logs: {st.get('log_dir', '?')}", ""]
    coord = st.get("transfer") or {}
    if coord:
        lines += [f"coordinator: {coord.get('held', 0)} tasks held, "
                  f"{coord.get('inflight', 0)} in flight, "
                  f"{'healthy' if coord.get('healthy', True) else 'UNHEALTHY (CPU tier off)'}"]
    lines += _workers_table(st.get("workers") or stats.get("workers") or [])
    lines += _tiers_table(stats.get("tiers") or {})
    lines += _hits_lines(stats)
    lines += _transfers_table(stats.get("transfers") or {})
    storage = st.get("storage") or stats.get("storage") or {}
    lines.append("storage: " + (_pairs(storage) if storage else "no activity (or off)"))
    if stats.get("evictions"):
        lines.append("evictions: " + _pairs(stats["evictions"]))
    return "\n".join(lines)


def _pairs(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def _table(header: list[str], rows: list[list], indent: str = "  ") -> list[str]:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _workers_table(workers: list[dict]) -> list[str]:
    if not workers:
        return ["workers: none (in-process transfer)", ""]
    rows = []
    for w in workers:
        queues = w.get("queues") or {}
        rows.append([w.get("rank", "?"), w.get("pid", "?"), w.get("state", "?"),
                     f"{w.get('last_seen_s', 0):.1f}s ago",
                     "/".join(str(queues.get(k, 0)) for k in ("out", "in", "ctl")),
                     w.get("restarts", 0), w.get("done", "-"), w.get("fast", "-"),
                     w.get("failed", "-"), w.get("lost_reason", "")])
    # fast: of the tasks done, those the native fast path served (transfer.fastpath)
    return ["workers:"] + _table(["rank", "pid", "state", "heartbeat", "queues out/in/ctl",
                                  "restarts", "done", "fast", "failed", "lost reason"],
                                 rows) + [""]


def _tiers_table(tiers: dict) -> list[str]:
    rows = [[name, t.get("total", "?"), t.get("used", "?"), t.get("free", "?"),
             t.get("cached", "?")] for name, t in tiers.items() if isinstance(t, dict)]
    return ["tiers (blocks):"] + _table(["tier", "total", "used", "free", "cached"], rows) + [""]


def _hits_lines(stats: dict) -> list[str]:
    prompt = stats.get("prompt_tokens", 0) or 0
    hits = stats.get("hit_tokens") or {}
    rates = "  ".join(f"{t} {100 * n / prompt:.1f}%" if prompt else f"{t} -"
                      for t, n in hits.items())
    total = f"{100 * sum(hits.values()) / prompt:.1f}%" if prompt else "-"
    return [f"hit rate: {total} of {prompt} prompt tokens in {stats.get('requests', 0)} "
            f"requests ({stats.get('running', 0)} running)   by tier: {rates or '-'}", ""]


def _transfers_table(transfers: dict) -> list[str]:
    if not transfers:
        return ["transfers: none yet", ""]
    rows = [[kind, t.get("submitted", 0), t.get("done", 0), t.get("failed", 0),
             t.get("blocks", 0), _bytes(t.get("bytes", 0)), f"{t.get('p50_ms', 0):.2f}",
             f"{t.get('p99_ms', 0):.2f}"] for kind, t in sorted(transfers.items())]
    return ["transfers:"] + _table(["kind", "submitted", "done", "failed", "blocks", "moved",
                                    "p50 ms", "p99 ms"], rows) + [""]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ------------------------------------------------------------- build-cuda
@main.command("build-cuda")
@click.option("--archs", default=None, help="SM versions, e.g. '80;90' (default: this "
              "machine's GPUs)")
def build_cuda(archs: str | None) -> None:
    """Build (or reuse) the CUDA copy kernel ahead of time; prints a JSON summary."""
    from kvcached.copy import cuda
    argv = ["--build"] + (["--archs", archs] if archs else [])
    sys.exit(cuda.main(argv))


try:  # `kvcached bench` lives with the trace replayer, which may not be installed
    from kvcached.tools.trace import bench
except ImportError:
    bench = None
else:
    main.add_command(bench)


if __name__ == "__main__":
    main(prog_name=os.path.basename(sys.argv[0]))
