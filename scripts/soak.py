#!/usr/bin/env python
"""A soak of vLLM's OpenAI server with kvcached: a steady load for a while,
checked for leaks and wrong answers, then stopped as a shell or a service
manager stops it, and checked for leftovers.

The server is ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1
with the README's flag (kvcached's own run dir, its transfer worker spawned),
a CPU tier small enough to churn and file storage capped
(``storage_max_bytes``) below what the load writes; vLLM's KV space a
fraction of the prompts' working set. A small random-weight Llama (made
here unless ``--model`` names one); prompts are token ids (``w`` shared
heads, many suffixes), each drawn at random from a fixed pool, so prompts
come back after their blocks left vLLM's cache, the CPU tier or storage.

``--concurrency`` clients send greedy completions (8 tokens, ``ignore_eos``)
until the deadline. Checks (``checks`` in the JSON line, all must be true):

- ``all_completed``: every request answered, with its 8 tokens;
- ``identical``: every ``--verify-every``-th request is sent again with a
  ``cache_salt`` of its own (vLLM folds the salt into its block hashes: no
  tier can serve it, the prompt is computed without cache) and both answers
  must match token for token; every answer of a prompt matches the first
  cold answer of it (also across the runs of ``--signals both``);
- ``rss_flat``: per process (API server, engine core, each transfer worker,
  the janitor; found by process tree and by the run dir on their command
  lines) the RSS at the end (median of the last tenth of the samples) at most
  5% above its RSS at a third of the run (median of the tenth after it);
  (``--rss-exempt NAME``: reported, not judged. vLLM's own CPU worker,
  ``VLLM::Worker``, grows with each new batch shape for a while, the same
  without kvcached: 673 -> 1,333 MB in 45 s here with prompts of many
  lengths, 673 -> 832 MB with one length; the short run of ``make test``
  exempts it);
- ``fds_flat``, ``threads_flat``: open fds and threads at the end (the least
  over the last quarter of the samples) no more than at a third of the run
  (the most over the quarter after it);
- ``storage_within_cap``: the storage directory's bytes, sampled, never above
  the cap plus four objects (writes in flight); a walk of the directory that
  finds more is repeated twice and the least of the three counts (a walk
  adds up files seen at different moments while objects are written and
  evicted);
- ``nothing_left``: after the signal (``--signals``: SIGINT to the server's
  process group as a shell's Ctrl-C, SIGTERM to the server alone as
  Kubernetes or systemd; ``both``: a second run, on the same storage, stopped
  with SIGTERM) no process of the run, no ``/dev/shm/kvcached-*`` segment of
  it and no run dir is left, polled until ``--leftover-deadline-s``;
  ``SIGKILL`` (or ``all``: a third run) kills every process of the run, the
  janitor too, then runs ``kvcached cleanup``;
- ``kill_left_something`` (SIGKILL): the killed processes left their CPU
  tier's segment or their run dir (else the run proves nothing), and
  ``nothing_left`` then holds after ``kvcached cleanup`` (``cleanup_named``:
  what it removed; a kvcached starting meanwhile on the machine sweeps them
  too, and logs it).

Progress on stderr (every ``--progress-s``); the last line on stdout is JSON
``{"bench": "soak", "ok": ..., "checks": {...}, ...}`` with the RSS, fd and
thread samples per process (``--curve N`` of them); exit code 1 if a check
failed.

    python scripts/soak.py --minutes 20 [--signals SIGINT|SIGTERM|SIGKILL|both|all]
    python scripts/soak.py --seconds 20    # the short run of ``make test``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import emit, load_script, log  # noqa: E402

serve = load_script("bench_serve")
SHM = "/dev/shm"
MAX_TOKENS = 8
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ prompts
def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def prompt_pool(heads: int, head_len: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` prompts: one of ``heads`` shared heads, then a suffix of its own."""
    rng = random.Random(1)
    shared = [tokens(10 + h, head_len) for h in range(heads)]
    return [shared[i % heads] + tokens(1000 + i, rng.randrange(lo, hi)) for i in range(n)]


# ---------------------------------------------------------------- processes
def proc_info(pid: int) -> dict | None:
    """RSS (and its anonymous and shared-memory parts), fds, threads of ``pid``;
    None if it is gone or a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            return None
        kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
        return {"rss": kb("VmRSS"), "rss_anon": kb("RssAnon"), "rss_shmem": kb("RssShmem"),
                "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(fields["Threads"])}
    except (OSError, KeyError, ValueError):
        return None


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def naming(pid: int) -> str:
    """What a process of the run is, from its name and command line."""
    cmd = cmdline(pid)
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = "?"
    if b"kvcached.ops.janitor" in cmd:
        return "janitor"
    if b"\0worker\0" in cmd and b"kvcached" in cmd:
        rank = cmd.split(b"--rank\0")[1].split(b"\0")[0].decode() if b"--rank\0" in cmd else "0"
        return f"transfer_worker_r{rank}"
    if "EngineCor" in comm:
        return "engine_core"
    if b"vllm.entrypoints.openai.api_server" in cmd:
        return "api_server"
    return comm


def run_pids(server_pid: int, run_dir: Path | None) -> dict[int, str]:
    """The run's processes: the server's tree, and every process whose command
    line names the run dir (the transfer workers, the janitor outside the tree)."""
    pids = {server_pid, *serve.children(server_pid)}
    if run_dir is not None:
        want = str(run_dir).encode()
        pids |= {int(e) for e in os.listdir("/proc") if e.isdigit() and want in cmdline(int(e))}
    # the server: also when the tests' fork server forked it (its command line
    # is then that server's)
    return {p: "api_server" if p == server_pid else naming(p) for p in pids if running(p)}


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` carry each name (digits dropped: pool members alike)."""
    out: dict[str, int] = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            name = name.rstrip("0123456789_-") or name
            out[name] = out.get(name, 0) + 1
    except OSError:
        pass
    return out


def run_segments(run_dir: Path) -> list[str]:
    """kvcached's shared-memory segments of ``run_dir``
    (``kvcached-<pid>-<run id>-r<rank>-<kind>``, memory/shm.py)."""
    rid = hashlib.blake2b(os.path.realpath(run_dir).encode(), digest_size=5).hexdigest()
    return sorted(n for n in os.listdir(SHM) if n.startswith("kvcached-") and f"-{rid}-" in n)


def dir_bytes(path: Path) -> tuple[int, int, int]:
    """(all files' bytes, objects' bytes, largest object) under ``path``."""
    total = objects = largest = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                n = os.stat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
            total += n
            if not f.startswith("."):
                objects += n
                largest = max(largest, n)
    return total, objects, largest


# --------------------------------------------------------------------- load
class Load:
    """Clients in threads, each sending prompts of the pool until the deadline."""

    def __init__(self, srv, pool: list[list[int]], refs: dict, verify_every: int, seed: int):
        self.srv, self.pool, self.refs, self.verify_every = srv, pool, refs, verify_every
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.sent = self.done = self.verified = 0
        self.errors: list[str] = []
        self.mismatch_cold: list[int] = []  # prompt indexes whose cached answer != cold
        self.inconsistent: list[int] = []  # a later answer != the first cold answer
        self.latency: list[float] = []
        self.cached_requests = 0

    def one(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            with self.lock:
                i = self.rng.randrange(len(self.pool))
                self.sent += 1
                verify = self.sent % self.verify_every == 0
            try:
                t0 = time.monotonic()
                res = self.srv.post("/v1/completions", self.body(i), timeout=300)
                dt = time.monotonic() - t0
                got = res["choices"][0]["token_ids"]
                cached = ((res.get("usage") or {}).get("prompt_tokens_details") or {}) \
                    .get("cached_tokens") or 0
                if len(got) != MAX_TOKENS:
                    raise ValueError(f"{len(got)} tokens, not {MAX_TOKENS}")
                cold = self.srv.complete(self.pool[i], MAX_TOKENS, salt=uuid.uuid4().hex,
                                         timeout=300) if verify else None
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                with self.lock:
                    self.errors.append(f"prompt {i}: {type(e).__name__}: {e}"[:300])
                continue
            with self.lock:
                self.done += 1
                self.latency.append(dt)
                self.cached_requests += cached > 0
                if cold is not None:
                    self.verified += 1
                    if cold != got:
                        self.mismatch_cold.append(i)
                    self.refs.setdefault(i, cold)
                if i in self.refs and self.refs[i] != got:
                    self.inconsistent.append(i)

    def body(self, i: int) -> dict:
        return {"model": self.srv.model, "prompt": self.pool[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}


# ---------------------------------------------------------------------- run
def window(samples: list, frac: float, where: str) -> list:
    n = max(1, int(len(samples) * frac))
    return samples[:n] if where == "head" else samples[-n:]


def leak_checks(series: dict[str, list[dict]], t_end: float) -> dict:
    """Per process, over the samples from a third of the run on: RSS growth
    (median of the last tenth over the median of the first tenth), fds and
    threads (the least of the last quarter minus the most of the first: a
    leak raises even the least; a thread or fd that comes and goes does not)."""
    out = {}
    for name, samples in series.items():
        late = [s for s in samples if s["t"] >= t_end / 3]
        if len(late) < 2 or samples[-1]["t"] < 0.9 * t_end:  # gone or new late: no trend
            out[name] = {"samples": len(late), "judged": False}
            continue
        head, tail = window(late, 0.1, "head"), window(late, 0.1, "tail")
        head4, tail4 = window(late, 0.25, "head"), window(late, 0.25, "tail")
        med = lambda w, k: statistics.median(s[k] for s in w)  # noqa: E731
        out[name] = {"samples": len(late), "judged": True,
                     "rss_mb_at_third": med(head, "rss") / 2**20,
                     "rss_mb_at_end": med(tail, "rss") / 2**20,
                     "rss_growth": med(tail, "rss") / med(head, "rss") - 1,
                     "rss_anon_growth": med(tail, "rss_anon") / max(1, med(head, "rss_anon")) - 1,
                     "fds_growth": min(s["fds"] for s in tail4) - max(s["fds"] for s in head4),
                     "threads_growth": min(s["threads"] for s in tail4)
                     - max(s["threads"] for s in head4),
                     "fds_end": max(s["fds"] for s in tail),
                     "threads_end": max(s["threads"] for s in tail)}
    return out


def soak_run(k: int, sig: str, args, model: str, store: Path, cap: int, pool, refs,
             work: Path) -> dict:
    """One server under load for ``args.seconds`` (or ``args.second_seconds``),
    stopped with ``sig``; what it saw."""
    seconds = args.seconds if k == 0 else args.second_seconds
    extra = {"storage_max_bytes": cap, "worker_start_timeout_s": 300,
             "storage_lookup_timeout_s": 10.0}
    connector = None if args.plain else serve.kvcached_connector(store, args.cpu_blocks,
                                                                   **extra)
    srv = serve.ApiServer(model, work / f"server{k}.log", args.kv_mb, connector,
                          max_num_seqs=max(8, args.concurrency * 2), tokenizer=False,
                          max_model_len=2048,
                          # each answer's usage counts its cached prompt tokens
                          extra_args=["--enable-prompt-tokens-details"],
                          fork_server=args.fork_server)
    out: dict = {"signal": sig, "seconds": seconds}
    try:
        out["startup_s"] = srv.wait_ready()
        run_dir = srv.run_dir()
        log(f"run {k}: server up in {out['startup_s']:.0f}s (port {srv.port}, "
            f"kvcached run dir {run_dir})")
        if run_dir is None and not args.plain:
            raise RuntimeError(f"no kvcached run dir in the server's log {srv.log_path}")
        load = Load(srv, pool, refs, args.verify_every, seed=k)
        t0 = time.monotonic()
        deadline = t0 + seconds
        threads = [threading.Thread(target=load.one, args=(deadline,), daemon=True)
                   for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        series: dict[str, list[dict]] = {}
        names: dict[int, str] = {}
        third_threads: dict[str, dict] = {}
        segments: set[str] = set()
        storage = {"max_bytes": 0, "max_objects_bytes": 0, "largest_object": 0, "samples": [],
                   "walks_over_cap": 0}
        last_progress = t0
        while True:
            now = time.monotonic() - t0
            for pid, name in run_pids(srv.proc.pid, run_dir).items():
                info = proc_info(pid)
                if info is None:
                    continue
                key = f"{name}:{pid}"
                names[pid] = key
                series.setdefault(key, []).append({"t": round(now, 1), **info})
            if now >= seconds / 3 and not third_threads:  # thread names, to tell what grew
                third_threads.update({names[p]: thread_names(p) for p in names})
            if run_dir is not None:
                segments.update(run_segments(run_dir))
            total, objects, largest = dir_bytes(store)
            if total > cap:  # a walk sums files seen at different moments: look again
                storage["walks_over_cap"] += 1
                total = min(total, min(dir_bytes(store)[0] for _ in range(2)))
            storage["max_bytes"] = max(storage["max_bytes"], total)
            storage["max_objects_bytes"] = max(storage["max_objects_bytes"], objects)
            storage["largest_object"] = max(storage["largest_object"], largest)
            storage["samples"].append([round(now, 1), total])
            if srv.proc.poll() is not None:
                load.errors.append(f"the server exited (rc {srv.proc.returncode})")
                log(f"run {k}: the server exited (rc {srv.proc.returncode}); its log's "
                    f"end:\n{srv.tail(3000)}")
                break
            if time.monotonic() - last_progress >= args.progress_s:
                last_progress = time.monotonic()
                rss = ", ".join(f"{n.rsplit(':', 1)[0]} {s[-1]['rss'] / 2**20:.0f}"
                                for n, s in series.items() if s[-1]["t"] >= now - 1)
                log(f"run {k}: {now:.0f}/{seconds:.0f}s, {load.done} done, "
                    f"{len(load.errors)} errors, {load.verified} verified "
                    f"({len(load.mismatch_cold)} differ), RSS MB: {rss}; storage "
                    f"{total / 2**20:.1f}/{cap / 2**20:.1f} MB")
            if now >= seconds and not any(t.is_alive() for t in threads):
                break
            time.sleep(args.sample_s)
        for t in threads:
            t.join(300)
        elapsed = time.monotonic() - t0
        metrics = srv.metrics()
        pids_at_stop = run_pids(srv.proc.pid, run_dir)
        end_threads = {names[p]: thread_names(p) for p in names if running(p)}
        if run_dir is not None:
            segments.update(run_segments(run_dir))
    except Exception:
        srv.stop("SIGKILL")
        raise
    # ---- stop, then look for leftovers
    everything = set(names) | set(pids_at_stop)
    if sig == "SIGKILL":
        out.update(kill_everything(srv, everything, run_dir, segments,
                                   args.leftover_deadline_s))
    else:
        out["stop_s"] = srv.stop(sig, group=sig == "SIGINT", timeout=args.leftover_deadline_s)
    out["server_rc"] = srv.proc.returncode
    deadline = time.monotonic() + args.leftover_deadline_s
    t_stop = time.monotonic()
    while True:
        left_pids = sorted(naming(p) + f":{p}" for p in everything if running(p))
        left_pids += sorted(naming(p) + f":{p}" for p in run_pids(srv.proc.pid, run_dir)
                            if p != srv.proc.pid and p not in everything)
        left_shm = sorted(set(run_segments(run_dir) if run_dir else [])
                          | {s for s in segments if os.path.exists(os.path.join(SHM, s))})
        left_dir = [str(run_dir)] if run_dir and run_dir.exists() else []
        if not (left_pids or left_shm or left_dir) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out["cleanup_s"] = time.monotonic() - t_stop
    out["left"] = {"processes": left_pids, "shm": left_shm, "run_dir": left_dir}
    out["segments_seen"] = sorted(segments)
    out["processes_seen"] = sorted(series)
    leaks = leak_checks(series, elapsed)
    for name, v in leaks.items():  # which threads came after a third of the run
        if v.get("threads_growth", 0) > 0 and name in third_threads and name in end_threads:
            v["new_threads"] = {n: c - third_threads[name].get(n, 0)
                                for n, c in end_threads[name].items()
                                if c > third_threads[name].get(n, 0)}
    judged = [v for n, v in leaks.items() if v["judged"]
              and n.rsplit(":", 1)[0] not in (args.rss_exempt or [])]
    slack = storage["largest_object"] * 4
    out.update({
        "elapsed_s": elapsed, "requests": load.sent, "completed": load.done,
        "errors": load.errors[:10], "error_count": len(load.errors),
        "requests_per_s": load.done / elapsed,
        "latency_p50_s": statistics.median(load.latency) if load.latency else None,
        "requests_with_cached_tokens": load.cached_requests, "verified": load.verified,
        "mismatch_vs_cold": len(load.mismatch_cold), "inconsistent": len(load.inconsistent),
        "storage": {"cap_bytes": cap, "max_bytes": storage["max_bytes"],
                    "max_objects_bytes": storage["max_objects_bytes"],
                    "largest_object": storage["largest_object"],
                    "walks_over_cap": storage["walks_over_cap"],
                    "curve": thin(storage["samples"], args.curve)},
        "kvcached_hit_tokens": {k2: v for k2, v in metrics.items()
                                if k2.startswith("vllm:kvcached_hit_tokens")},
        "prompt_tokens_cached_by_source": {
            k2.split('"')[1]: v for k2, v in metrics.items()
            if k2.startswith("vllm:prompt_tokens_cached_by_source_total") and v},
        "processes": leaks,
        "curves": {n: [[s["t"], round(s["rss"] / 2**20, 1), s["fds"], s["threads"]]
                       for s in thin(v, args.curve)] for n, v in series.items()},
    })
    out["checks"] = {
        "all_completed": load.done == load.sent and not load.errors and load.done > 0,
        "identical": load.verified > 0 and not load.mismatch_cold and not load.inconsistent,
        "rss_flat": bool(judged) and all(v["rss_growth"] <= 0.05 for v in judged),
        "fds_flat": bool(judged) and all(v["fds_growth"] <= 0 for v in judged),
        "threads_flat": bool(judged) and all(v["threads_growth"] <= 0 for v in judged),
        "storage_within_cap": storage["max_bytes"] <= cap + slack,
        "nothing_left": not (left_pids or left_shm or left_dir),
    }
    if sig == "SIGKILL":  # the kill left something, and nothing is left after cleanup
        out["checks"]["kill_left_something"] = out["kill_left_something"]
    bad = [c for c, ok in out["checks"].items() if not ok]
    log(f"run {k} ({sig}): {load.done}/{load.sent} requests in {elapsed:.0f}s, "
        f"{load.verified} verified; stopped in {out['stop_s']:.1f}s, clean in "
        f"{out['cleanup_s']:.1f}s; " + (f"FAILED: {bad}" if bad else "all checks ok"))
    return out


def kill_everything(srv, pids: set[int], run_dir: Path | None, segments: set[str],
                    deadline_s: float) -> dict:
    """SIGKILL to every process of the run at once, the janitor first (as an
    OOM killer or a node's power would leave it): nothing of kvcached runs to
    clean, so what they held stays until ``kvcached cleanup`` (or the next
    start) removes it, saying what it removed."""
    t0 = time.monotonic()
    for pid in sorted(pids, key=lambda p: naming(p) != "janitor"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    srv.stop("SIGKILL")
    deadline = time.monotonic() + deadline_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(set(run_segments(run_dir) if run_dir else [])
                  | {s for s in segments if os.path.exists(os.path.join(SHM, s))})
    left_dir = run_dir is not None and run_dir.exists()
    res = subprocess.run([sys.executable, "-m", "kvcached", "cleanup"], capture_output=True,
                         text=True, timeout=120)
    # Any kvcached that starts on this machine sweeps a dead engine's leftovers
    # too: what cleanup did not name, another start removed (and logged) first.
    named = [s for s in left if f"removed shm segment {os.path.join(SHM, s)}" in res.stdout]
    named += [str(run_dir)] if left_dir and f"removed run dir {run_dir}" in res.stdout else []
    log(f"after SIGKILL: {len(left)} segments and {'the' if left_dir else 'no'} run dir left; "
        f"kvcached cleanup said:\n{res.stdout.strip() or res.stderr.strip()}")
    return {"stop_s": time.monotonic() - t0, "left_after_kill": {"shm": left,
                                                                 "run_dir": left_dir},
            "cleanup_output": res.stdout[-2000:], "cleanup_named": named,
            "kill_left_something": res.returncode == 0 and bool(left or left_dir)}


def thin(samples: list, n: int) -> list:
    """At most ``n`` samples, evenly spaced, the last included."""
    if len(samples) <= n:
        return samples
    step = (len(samples) - 1) / (n - 1)
    return [samples[round(i * step)] for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, help="how long the load runs (default 5)")
    g.add_argument("--seconds", type=float, help="the same in seconds")
    ap.add_argument("--signals", default="SIGINT",
                    choices=["SIGINT", "SIGTERM", "SIGKILL", "both", "all"],
                    help="how the server is stopped; both: a second run stopped with SIGTERM; "
                         "all: a third, every process SIGKILLed, then `kvcached cleanup`")
    ap.add_argument("--second-seconds", type=float,
                    help="how long the second run (--signals both) lasts (default: as the first)")
    ap.add_argument("--model", help="a model dir (made here if it has no config.json)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--verify-every", type=int, default=10,
                    help="every n-th request is also computed without cache and compared")
    ap.add_argument("--kv-mb", type=int, default=4, help="vLLM's KV space (MiB)")
    ap.add_argument("--cpu-blocks", type=int, default=96, help="kvcached's CPU tier (blocks)")
    ap.add_argument("--storage-mb", type=float, default=8, help="storage_max_bytes (MiB)")
    ap.add_argument("--pool", type=int, default=48, help="distinct prompts")
    ap.add_argument("--suffix", type=int, nargs=2, default=[64, 448], metavar=("LO", "HI"),
                    help="a prompt's own tokens after its 256-token head: LO..HI-1")
    ap.add_argument("--sample-s", type=float, help="seconds between samples")
    ap.add_argument("--progress-s", type=float, default=30.0)
    ap.add_argument("--curve", type=int, default=21, help="samples per curve in the JSON")
    ap.add_argument("--leftover-deadline-s", type=float, default=60.0)
    ap.add_argument("--rss-exempt", action="append", metavar="NAME",
                    help="a process (by name: VLLM::Worker, api_server, engine_core, ...) "
                         "reported but not judged by rss_flat/fds_flat/threads_flat")
    ap.add_argument("--plain", action="store_true",
                    help="vLLM without kvcached, the same load (what vLLM's own processes do)")
    ap.add_argument("--keep", metavar="DIR", help="copy the servers' logs into DIR")
    ap.add_argument("--fork-server", metavar="SOCKET",
                    help="tests: the server forked by this fork server "
                         "(tests/vllm_forkserver.py: vLLM imported once) instead of started")
    args = ap.parse_args()
    args.seconds = args.seconds or 60 * (args.minutes or 5)
    args.second_seconds = args.second_seconds or args.seconds
    args.sample_s = args.sample_s or max(0.5, min(5.0, args.seconds / 200))
    signals = {"both": ["SIGINT", "SIGTERM"], "all": ["SIGINT", "SIGTERM", "SIGKILL"]}.get(
        args.signals, [args.signals])
    pool = prompt_pool(heads=8, head_len=256, n=args.pool, lo=args.suffix[0],
                       hi=max(args.suffix[1], args.suffix[0] + 1))
    pool_blocks = len({(tuple(p[:32 * (b + 1)])) for p in pool
                       for b in range(len(p) // 32)})
    cap = int(args.storage_mb * 2**20)
    refs: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvcached-soak-", dir="/tmp") as tmp:
        work = Path(tmp)
        model = args.model or str(work / "model")
        if not os.path.exists(os.path.join(model, "config.json")):
            load_script("bench_vllm").make_model(model, 2, 128)
        store = work / "store"
        runs = []
        for k, sig in enumerate(signals):
            try:
                runs.append(soak_run(k, sig, args, model, store, cap, pool, refs, work))
            except Exception as e:  # noqa: BLE001
                log(f"run {k}: {type(e).__name__}: {e}")
                runs.append({"signal": sig, "error": f"{type(e).__name__}: {e}"[:2000],
                             "checks": {"ran": False}})
                break
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            for f in work.glob("server*.log"):
                shutil.copy(f, args.keep)
    checks = {c: all(r["checks"].get(c, False) for r in runs)
              for r0 in runs for c in r0["checks"]}
    out = {"bench": "soak", "ok": all(checks.values()) and len(runs) == len(signals),
           "checks": checks, "seconds": args.seconds, "concurrency": args.concurrency,
           "signals": signals, "pool_prompts": len(pool), "pool_blocks": pool_blocks,
           "vllm_kv_blocks": (args.kv_mb << 20) // serve.kv_bytes_per_token(2, 128) // 32,
           "cpu_blocks": args.cpu_blocks, "storage_cap_bytes": cap, "runs": runs}
    emit(out)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
