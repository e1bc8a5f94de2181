"""``kvcached demo``: the reference engine serving a multi-turn chat through every tier.

It starts the reference engine (a small transformer, TP=2, one transfer
worker process per rank) on the embedded defaults, with a GPU tier too small
for the conversations in flight, a CPU tier too small for the rest, and file
storage in a temporary directory; so prefixes come back from all three
tiers. Every turn's prompt is the conversation so far (the model's own
earlier answers included) plus a new user message. At the end a sample of
requests is recomputed from scratch, without any cache, and compared token
by token and logit by logit; then a short report is printed.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from kvcached.config import CacheConfig
from kvcached.engine import Engine, ModelConfig
from kvcached.engine.runner import RequestResult

logger = logging.getLogger(__name__)

# Per-rank layout of a 2-layer model with 4 KV heads split over 2 ranks.
DEMO_LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, tp_size=2)
# Eight open chats need ~100 blocks: the GPU tier holds 40, the CPU tier 64 more.
DEMO_TIERS = dict(num_gpu_blocks=40, num_cpu_blocks=64)
DEMO_MODEL = dict(d_model=128, ffn_dim=256, vocab_size=512)
DEMO_MODEL_ID = "kvcached-demo"  # the reference model: storage keys are namespaced by it
MAX_NEW_TOKENS = 12
MAX_PROMPT = 480  # a chat longer than this ends (one request must fit the GPU tier)


# ---------------------------------------------------------------- workload
@dataclass(slots=True)
class _Chat:
    cid: int
    history: list[int]
    turns_left: int
    turn: int = 0


@dataclass
class ChatWorkload:
    """Open chats sharing a few system prompts; each step continues a random one."""

    seed: int = 0
    vocab: int = 512
    concurrent: int = 8
    system_prompts: int = 3
    max_turns: int = 6
    rng: random.Random = field(init=False)
    systems: list[list[int]] = field(init=False)
    chats: list[_Chat] = field(init=False)
    next_cid: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [self._words(40, 56) for _ in range(self.system_prompts)]
        self.chats = [self._new_chat() for _ in range(self.concurrent)]

    def _words(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(lo, hi))]

    def _new_chat(self) -> _Chat:
        self.next_cid += 1
        return _Chat(self.next_cid, list(self.rng.choice(self.systems)),
                     self.rng.randint(1, self.max_turns))

    def next_prompt(self) -> tuple[_Chat, list[int]]:
        """Pick a chat and return it with its next prompt (history + a user message)."""
        chat = self.rng.choice(self.chats)
        return chat, chat.history + self._words(8, 40)

    def record(self, chat: _Chat, prompt: list[int], answer: list[int]) -> None:
        """The model answered: the history grows, or the chat ends and a new one opens."""
        chat.history = prompt + answer
        chat.turn += 1
        chat.turns_left -= 1
        if chat.turns_left <= 0 or len(chat.history) + 40 > MAX_PROMPT:
            self.chats[self.chats.index(chat)] = self._new_chat()


# ---------------------------------------------------------------- progress
class Progress:
    """A one-line stderr progress bar, redrawn at most 10 times a second; when the
    stream is not a terminal, a plain line every 10% instead (logs stay readable)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.total, self.stream, self.enabled = total, stream or sys.stderr, enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = self._last = time.monotonic()
        self._decile = 0

    def update(self, done: int, note: str = "") -> None:
        """Show ``done`` of ``total`` requests and a short note."""
        if not self.enabled:
            return
        now = time.monotonic()
        line = f"{done}/{self.total} requests  {note}  {now - self.t0:5.1f}s"
        if not self.tty:
            decile = 10 * done // max(1, self.total)
            if decile > self._decile:
                self._decile = decile
                self.stream.write(f"  {line}\n")
            return
        if now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        fill = 30 * done // max(1, self.total)
        self.stream.write(f"\r  [{'#' * fill}{'.' * (30 - fill)}] {line} ")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -------------------------------------------------------------------- run
class DemoConfigError(ValueError):
    """The demo's configuration is invalid (a KVCACHED_* variable, most likely)."""


def demo_config(log_dir: Path | None, storage_dir: Path | None,
                **overrides) -> tuple[CacheConfig, str]:
    """The embedded defaults (and KVCACHED_* variables), resized for the demo;
    returns (config, storage note). Raises DemoConfigError naming what is wrong."""
    base = dict(DEMO_LAYOUT, **DEMO_TIERS, model_id=DEMO_MODEL_ID, **overrides)
    if log_dir is not None:
        base["log_dir"] = str(log_dir)
    if storage_dir is None:
        base.update(storage_backend=None)
        note = "off"
    else:
        base.update(storage_backend="file", storage_url=str(storage_dir))
        note = f"file store in {storage_dir} (temporary)"
    try:
        return CacheConfig.load(**base), note
    except ValueError as e:
        raise DemoConfigError(str(e)) from None


def overridden_env(**overrides) -> list[str]:
    """The KVCACHED_* variables set now that the demo overrides (they do not apply)."""
    from kvcached.config import env_name
    fields = {**DEMO_LAYOUT, **DEMO_TIERS, "model_id": DEMO_MODEL_ID, "log_dir": "",
              "storage_backend": "", "storage_url": "", **overrides}
    return [f"{env_name(k)}={os.environ[env_name(k)]}" for k in sorted(fields)
            if env_name(k) in os.environ]


def _report_overridden(**overrides) -> None:
    ignored = overridden_env(**overrides)
    if ignored:
        print(f"kvcached demo: ignoring {', '.join(ignored)}: the demo sets these itself "
              "(its workload is sized for its own tiers)", file=sys.stderr)


def serve_workload(eng: Engine, requests: int, seed: int,
                   progress: Progress) -> list[tuple[list[int], RequestResult]]:
    """Run ``requests`` chat turns through the engine; returns (prompt, result) pairs."""
    work = ChatWorkload(seed=seed, vocab=eng.model.cfg.vocab_size)
    out = []
    for i in range(requests):
        chat, prompt = work.next_prompt()
        res = eng.generate(f"chat{chat.cid}-turn{chat.turn}", prompt, MAX_NEW_TOKENS)
        work.record(chat, prompt, res.tokens)
        out.append((prompt, res))
        hit = sum(r.num_cached_tokens for _, r in out[-50:])
        total = sum(r.prompt_tokens for _, r in out[-50:])
        progress.update(i + 1, f"hit {hit / max(1, total):4.0%}")
    progress.close()
    return out


def _tier(r: RequestResult) -> str:
    """Where a request's prefix came from (the slowest tier it touched)."""
    return ("storage" if r.hit.storage_tokens else "cpu" if r.hit.cpu_tokens else
            "gpu" if r.hit.gpu_tokens else "miss")


TIER_ORDER = ("storage", "cpu", "gpu", "miss")


def pick_sample(served: list[tuple[list[int], RequestResult]], k: int) -> list[int]:
    """Indices of up to ``k`` requests, drawn in turn from storage, CPU, GPU hits and misses."""
    groups: dict[str, list[int]] = {t: [] for t in TIER_ORDER}
    for i, (_, r) in enumerate(served):
        groups[_tier(r)].append(i)
    picked: list[int] = []
    while len(picked) < k and any(groups.values()):
        for g in groups.values():
            if g and len(picked) < k:
                picked.append(g.pop(len(g) // 2))
    return sorted(picked)


def verify(eng: Engine, served, sample: list[int]) -> dict:
    """Recompute sampled requests without any cache; compare tokens and logits
    (bitwise for fp32 on CPU, where the engine is exact by construction)."""
    exact = eng.model.cfg.dtype == "float32" and eng.model.device.type == "cpu"
    same, cached_s, fresh_s = 0, 0.0, 0.0
    tiers = dict.fromkeys(TIER_ORDER, 0)
    for i in sample:
        prompt, res = served[i]
        t0 = time.perf_counter()
        ref = eng.model.generate(prompt, len(res.tokens))
        if res.num_cached_tokens:  # speed: only requests the cache could speed up
            fresh_s += time.perf_counter() - t0
            cached_s += res.seconds
        tiers[_tier(res)] += 1
        ok = ref.tokens == res.tokens and (
            torch.equal(ref.logits, res.logits) if exact
            else torch.allclose(ref.logits, res.logits, atol=5e-2, rtol=5e-2))
        same += ok
        if not ok:
            logger.error("request %r differs from its recompute", res.request_id)
    return {"checked": len(sample), "identical": same, "bitwise": exact, "by_tier": tiers,
            "cached_s": cached_s, "recompute_s": fresh_s}


# ------------------------------------------------------------------ report
def _transfer_lines(transfers: dict) -> list[str]:
    """One line per task kind; bandwidth is bytes moved over the summed task time
    (submit to completion on every rank, so it includes the round trips)."""
    lines = []
    for kind in ("swap_out", "swap_in", "store", "load"):
        t = transfers.get(kind)
        if not t or not t.get("done"):
            continue
        mib = t["bytes"] / 2**20
        rate = mib / t["seconds"] if t.get("seconds") else 0.0
        lines.append(f"    {kind:<9} {t['done']:5d} tasks {t['blocks']:6d} blocks "
                     f"{mib:8.1f} MiB  {rate:7.1f} MiB/s (median task {t['p50_ms']:.2f} ms)")
    return lines or ["    (none)"]


def build_report(eng: Engine, served, check: dict, wall_s: float, log_dir: Path,
                 storage_note: str) -> tuple[dict, str]:
    """The numbers as a dict, and the text printed at the end of the demo."""
    st = eng.mgr.stats()
    results = [r for _, r in served]
    prompt = sum(r.prompt_tokens for r in results)
    tiers = {"gpu": sum(r.hit.gpu_tokens for r in results),
             "cpu": sum(r.hit.cpu_tokens for r in results),
             "storage": sum(r.hit.storage_tokens for r in results)}
    saved = sum(tiers.values())
    m = eng.model.cfg
    report = {"requests": len(results), "prompt_tokens": prompt, "hit_tokens": tiers,
              "prefill_tokens_saved": saved, "generated_tokens": sum(len(r.tokens) for r in results),
              "transfer_failures": sum(1 for r in results if r.transfer_error),
              "transfers": st.transfers, "evictions": st.evictions, "verify": check,
              "wall_s": wall_s, "log_dir": str(log_dir), "storage": storage_note}
    pct = (lambda n: f"{n / prompt:6.1%}") if prompt else (lambda n: "   n/a")
    cfg = eng.mgr.cfg
    text = [
        "",
        f"kvcached demo: {m.n_layers}-layer transformer (d_model {m.d_model}, {m.n_heads} heads, "
        f"{m.n_kv_heads} KV heads), TP={cfg.tp_size}, {cfg.transfer_mode} transfer",
        f"  tiers          GPU {cfg.num_gpu_blocks} blocks, CPU {cfg.num_cpu_blocks} blocks "
        f"(x {cfg.block_size} tokens), storage: {storage_note}",
        f"  requests       {len(results)} chat turns, {prompt} prompt tokens, "
        f"{report['generated_tokens']} generated",
        f"  served from    GPU {tiers['gpu']:7d} tokens {pct(tiers['gpu'])}",
        f"                 CPU {tiers['cpu']:7d} tokens {pct(tiers['cpu'])}",
        f"             storage {tiers['storage']:7d} tokens {pct(tiers['storage'])}",
        f"  prefill saved  {saved} of {prompt} prompt tokens {pct(saved).strip()} "
        f"(computed {prompt - saved})",
        "  transfers", *_transfer_lines(st.transfers),
        f"  evictions      {_evictions(st.evictions)}",
        _verify_line(check),
        f"  wall time      {wall_s:.1f} s (set-up, serving and verification)",
        f"  logs           {log_dir}/",
    ]
    return report, "\n".join(text)


EVICTION_WORDS = {"gpu_to_cpu": "GPU -> CPU (copied)",
                  "gpu_to_cpu_backup": "GPU -> CPU (a CPU copy was there)",
                  "gpu_dropped": "GPU dropped", "cpu_dropped": "CPU dropped"}


def _evictions(evictions: dict) -> str:
    """Evicted blocks by kind, in words."""
    parts = [f"{n} {EVICTION_WORDS.get(kind, kind)}" for kind, n in sorted(evictions.items())]
    return (", ".join(parts) + " blocks") if parts else "none"


def _verify_line(check: dict) -> str:
    how = "bitwise logits" if check["bitwise"] else "logits within bf16 tolerance"
    speed = ""
    if check["cached_s"] > 0:
        speed = (f"; the hits took {check['cached_s']:.2f} s served vs "
                 f"{check['recompute_s']:.2f} s recomputed")
    mix = ", ".join(f"{n} {t}" for t, n in check["by_tier"].items() if n)
    return (f"  verified       {check['identical']}/{check['checked']} sampled requests "
            f"({mix}) identical to a full recompute ({how}, same tokens){speed}")


# --------------------------------------------------------------- entry
def run_demo(requests: int = 600, seed: int = 0, verify_sample: int = 8,
             log_dir: str | Path = "kvcached-logs", progress: bool = True,
             storage: bool = True, out: TextIO | None = None, **overrides) -> dict:
    """Run the demo and print its report to ``out`` (stdout); returns the report dict.

    ``overrides`` are CacheConfig fields (e.g. ``transfer_mode="inprocess"``);
    ``storage=False`` leaves the storage tier off.
    Raises RuntimeError when a sampled request differs from its recompute.
    """
    from kvcached.ops.logs import setup_process_logging
    out = out or sys.stdout
    t0 = time.perf_counter()
    log_dir = Path(log_dir).resolve()
    storage_dir = Path(tempfile.mkdtemp(prefix="kvcached-demo-store-"))
    try:  # checked before anything starts: a bad setting is one line, not a traceback
        cfg, note = demo_config(log_dir, storage_dir if storage else None, **overrides)
    except DemoConfigError:
        shutil.rmtree(storage_dir, ignore_errors=True)
        raise
    _report_overridden(**overrides)
    log_file = setup_process_logging(log_dir, "engine")
    threads = torch.get_num_threads()
    # One position at a time: tiny ops, for which intra-op threads only cost.
    torch.set_num_threads(1)
    try:
        print(f"kvcached demo: starting {cfg.tp_size} transfer worker(s) "
              f"({cfg.transfer_mode}), {requests} requests ...", file=sys.stderr)
        with Engine.create(cfg, ModelConfig.for_cache(cfg, **DEMO_MODEL)) as eng:
            served = serve_workload(eng, requests, seed,
                                    Progress(requests, enabled=progress))
            check = verify(eng, served, pick_sample(served, verify_sample))
            report, text = build_report(eng, served, check, time.perf_counter() - t0,
                                        log_dir, note)
        print(text, file=out, flush=True)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(storage_dir, ignore_errors=True)
        _remove_log_handler(log_file)
    if check["identical"] != check["checked"]:
        raise RuntimeError(f"{check['checked'] - check['identical']} sampled request(s) "
                           f"differ from a full recompute; see {log_dir}")
    return report


def _remove_log_handler(log_file: Path) -> None:
    """Undo setup_process_logging's file handler, so repeated runs do not stack them."""
    root = logging.getLogger("kvcached")
    for h in list(root.handlers):
        if getattr(h, "baseFilename", None) == str(log_file.resolve()):
            root.removeHandler(h)
            h.close()


# ------------------------------------------------------------------- serve
SERVE_HELP = """\
kvcached demo --serve: engine pid {pid} serves a chat workload until Ctrl-C
  run dir   {run_dir}
  metrics   {metrics}
  logs      {log_dir}/  (engine.log, worker-rank0.log, worker-rank1.log)
  try       export KVCACHED_RUN_DIR={run_dir}
            kvcached status
            kvcached ctl pause; kvcached ctl resume
            kvcached ctl sleep --drain; kvcached ctl wakeup
"""


def serve_demo(run_dir: str | None = None, rate: float = 20.0, seed: int = 0,
               max_requests: int | None = None, stop: threading.Event | None = None,
               out: TextIO | None = None, **overrides) -> dict:
    """``kvcached demo --serve``: the demo's engine as a long-lived service to point
    ``kvcached status`` and ``kvcached ctl`` at. Serves ``rate`` chat turns a
    second until ``stop`` is set (Ctrl-C / SIGTERM in the CLI) or
    ``max_requests`` were served; while the cache is asleep it waits for wakeup.
    Prints the run dir, the metrics URL and the log files first; returns
    counts. Raises DemoConfigError for a bad setting."""
    out = out or sys.stdout
    stop = stop or threading.Event()
    storage_dir = Path(tempfile.mkdtemp(prefix="kvcached-demo-store-"))
    try:
        cfg, _ = demo_config(None, storage_dir, run_dir=run_dir or "", control_socket=True,
                             **overrides)
        _report_overridden(run_dir="", control_socket=True, **overrides)
        torch.set_num_threads(1)
        with Engine.create(cfg, ModelConfig.for_cache(cfg, **DEMO_MODEL)) as eng:
            metrics = _start_metrics(eng.mgr)
            try:
                print(SERVE_HELP.format(pid=os.getpid(), run_dir=eng.mgr.run_dir,
                                        metrics=metrics.url if metrics else _NO_METRICS,
                                        log_dir=eng.mgr.log_dir), file=out, flush=True)
                counts = _serve_until(eng, rate, seed, max_requests, stop)
            finally:
                if metrics is not None:
                    metrics.close()
        print(f"kvcached demo --serve: stopped after {counts['served']} requests "
              f"({counts['asleep_waits']} waits while asleep)", file=out, flush=True)
        return counts
    finally:
        shutil.rmtree(storage_dir, ignore_errors=True)


_NO_METRICS = "off (pip install 'kvcached[metrics]' for a /metrics endpoint)"


def _start_metrics(mgr):
    """A /metrics endpoint on a free loopback port (None without prometheus-client)."""
    if mgr.metrics is not None:  # metrics_port was configured: that one serves
        return None
    from kvcached.ops.metrics import MetricsServer
    try:
        return MetricsServer(mgr, "127.0.0.1", 0).start()
    except RuntimeError as e:
        logger.warning("demo: no metrics endpoint: %s", e)
        return None


def _serve_until(eng: Engine, rate: float, seed: int, max_requests: int | None,
                 stop: threading.Event) -> dict:
    from kvcached.errors import CacheAsleep
    work = ChatWorkload(seed=seed, vocab=eng.model.cfg.vocab_size)
    served = asleep = 0
    while not stop.is_set() and (max_requests is None or served < max_requests):
        chat, prompt = work.next_prompt()
        try:
            res = eng.generate(f"chat{chat.cid}-turn{chat.turn}-{served}", prompt,
                               MAX_NEW_TOKENS)
        except CacheAsleep:  # `kvcached ctl sleep`: wait for `kvcached ctl wakeup`
            asleep += 1
            stop.wait(0.2)
            continue
        work.record(chat, prompt, res.tokens)
        served += 1
        stop.wait(1.0 / rate)
    return {"served": served, "asleep_waits": asleep}
