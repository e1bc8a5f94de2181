#!/usr/bin/env python
"""kvcached behind vLLM's OpenAI server, measured with vLLM's own benchmark
client (``vllm bench serve``; on vLLM's CPU wheel the ``vllm`` command fails,
so the client's ``vllm.benchmarks.serve`` is called the same way, in this
process).

For each mode — vLLM without a connector (``plain``), kvcached (the README's
flag: a CPU tier and file storage) and, with ``--lmcache-python PY``,
LMCache in its multi-process mode (``bench_vllm.py``'s ``LMCacheServer``) —
the script starts ``python -m vllm.entrypoints.openai.api_server`` on
127.0.0.1 (a free port) with a random-weight Llama it makes (float32, block
size 32, a word-level tokenizer of the model's 1,024 ids: ``w0 w1 ...``, so
vLLM's datasets can decode and re-encode prompts exactly), and drives it
with the client:

- ``prefix_repetition`` (vLLM's dataset: a few long shared prefixes, many
  suffixes) at concurrency 1, 4 and 16; every prefix fits in vLLM's own KV
  cache, so kvcached cannot help: target within 5% of ``plain``;
- ``chat``: a multi-turn chat as vLLM's ``custom`` JSONL (``--disable-shuffle
  --skip-chat-template``): conversations of a shared system prompt, a
  document and user turns, each turn's prompt the previous one, an answer and
  a new user turn; turns of all conversations round-robin, so a
  conversation's next turn is sent only after many others (its previous one
  long answered); the working set about 4x vLLM's KV space. Targets:
  kvcached's TTFT p50 <= 0.5x and request throughput >= 1.5x ``plain``'s.
  (The answer in the next turn is a fixed text, not the model's: the client
  sends a prepared dataset. The previous prompt's blocks are what a cache
  can reuse either way.)

Per run: TTFT p50/p99, TPOT p50, request and token throughput (the client's
numbers) and the prefill tokens computed (the server's ``/metrics``,
``vllm:prompt_tokens_by_source{source="local_compute"}``, a difference over
the run; the cached ones by source beside it). Modes alternate in one
sitting (``--rounds`` times: plain, kvcached[, lmcache], plain, ...); each
server serves all workloads, each workload with prompts of its own seed.
The last line on stdout is JSON ``{"bench": "serve", ...}`` with the
ratios kvcached / plain (medians over rounds); ``scripts/plot_benchmarks.py``
draws it (``serve.png``).

    python scripts/bench_serve.py [--quick] [--rounds N] [--lmcache-python PY]
                                  [--modes plain,kvcached,kvcached_cpu,lmcache]
                                  [--workloads all|prefix|chat]

``--quick`` is a smoke run (a tiny model, few prompts). Progress goes to
stderr; each server's log to the work directory (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import emit, fork_start, load_script, log  # noqa: E402

BS = 32  # vLLM's CPU attention needs a multiple of 32
VOCAB = 1024
FULL = dict(layers=4, hidden=512, kv_mb=24, max_model_len=4096, max_num_seqs=16, cpu_blocks=2048,
            prefix=dict(prefix_len=512, suffix_len=128, num_prefixes=4, output_len=32,
                        prompts_per_concurrency={1: 48, 4: 32, 16: 64}),
            chat=dict(users=12, turns=4, system=256, doc=1024, turn=256, answer=32,
                      concurrency=4))
QUICK = dict(layers=2, hidden=128, kv_mb=2, max_model_len=1024, max_num_seqs=16, cpu_blocks=512,
             prefix=dict(prefix_len=128, suffix_len=32, num_prefixes=2, output_len=8,
                         prompts_per_concurrency={1: 4, 4: 8, 16: 16}),
             chat=dict(users=8, turns=3, system=64, doc=256, turn=64, answer=8,
                       concurrency=2))


# ------------------------------------------------------------------ model
def kv_bytes_per_token(layers: int, hidden: int) -> int:
    """float32 K and V of every layer (bench_vllm's shape: head 64, GQA 4:1)."""
    kv_heads = max(1, max(1, hidden // 64) // 4)
    return 2 * layers * kv_heads * 64 * 4


def make_model(path: str, layers: int, hidden: int) -> str:
    """``bench_vllm``'s random Llama, plus a tokenizer: word ``w<i>`` is id ``i``
    (whitespace split), so any id sequence decodes to text that encodes back
    to it (vLLM's prompt datasets need that)."""
    load_script("bench_vllm").make_model(path, layers, hidden)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0",
                                model_max_length=8192).save_pretrained(path)
    return path


def words(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"w{rng.randrange(1, 1000)}" for _ in range(n)]


# ----------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvcached_connector(store: Path | None, cpu_blocks: int, **extra) -> dict:
    """The README's flag (its run dir named by kvcached, its workers spawned);
    ``store`` None: the CPU tier alone."""
    storage = ({"storage_backend": "file", "storage_url": str(store)} if store
               else {"storage_backend": "none"})
    return {"kv_connector": "KvcachedConnector",
            "kv_connector_module_path": "kvcached.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"num_cpu_blocks": cpu_blocks, **storage, **extra}}


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's ppid fields)."""
    parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in parent.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGKILL when this script dies (a
    test's timeout SIGKILLs it; a server still starting ignores SIGTERM);
    kvcached's janitor then removes what its engine leaves."""
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` in a session of its own
    (a shell's Ctrl-C reaches its process group: ``stop("SIGINT")``)."""

    def __init__(self, model: str, log_path: Path, kv_mb: int, connector: dict | None = None,
                 max_num_seqs: int = 16, tokenizer: bool = True, env: dict | None = None,
                 max_model_len: int = 4096, extra_args: list[str] | None = None,
                 fork_server: str | None = None):
        self.model, self.port, self.log_path = model, free_port(), log_path
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(BS),
               "--enforce-eager", "--dtype", "float32", "--max-model-len", str(max_model_len),
               "--kv-cache-memory-bytes", str(kv_mb << 20), "--max-num-seqs",
               str(max_num_seqs), "--disable-uvicorn-access-log"]
        if not tokenizer:
            cmd.append("--skip-tokenizer-init")
        if connector:
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        cmd += extra_args or []
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                             "1"),
               **(env or {})}
        if fork_server:  # forked by the tests' fork server: vLLM imported there once
            self.log = None
            self.proc = fork_start(fork_server, cmd[3:], env, str(log_path), str(log_path),
                                   module=cmd[2])
        else:
            self.log = open(log_path, "wb")
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=env, preexec_fn=_die_with_parent)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> float:
        """Until /health answers; seconds it took."""
        t0 = time.monotonic()
        while self.get("/health") is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (rc {self.proc.returncode}); its log "
                                   f"{self.log_path}:\n{self.tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no /health within {timeout:.0f}s; log {self.log_path}")
            time.sleep(0.25)
        return time.monotonic() - t0

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def run_dir(self) -> Path | None:
        """kvcached's run dir, as vLLM's log names it (README: "Watching it")."""
        found = re.search(r"kvcached: run dir (\S+) ", self.log_path.read_text(errors="replace"))
        return Path(found.group(1)) if found else None

    def get(self, path: str, timeout: float = 10) -> str | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.read().decode()
        except OSError:
            return None

    def post(self, path: str, body: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def complete(self, prompt, max_tokens: int, salt: str | None = None,
                 timeout: float = 600) -> list[int]:
        """Greedy completion of ``prompt`` (token ids or text); its token ids."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if salt:
            body["cache_salt"] = salt
        return self.post("/v1/completions", body, timeout)["choices"][0]["token_ids"]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples ``name{labels}`` -> value (labels but ``source``
        and ``tier`` dropped, values summed)."""
        out: dict[str, float] = {}
        for line in (self.get("/metrics") or "").splitlines():
            if not line or line[0] == "#":
                continue
            name, _, value = line.rpartition(" ")
            base, _, labels = name.partition("{")
            keep = re.findall(r'((?:source|tier)="[^"]*")', labels)
            key = base + ("{" + ",".join(keep) + "}" if keep else "")
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                pass
        return out

    def stop(self, sig: str = "SIGINT", group: bool = True, timeout: float = 60) -> float:
        """``sig`` to the process group (a shell's Ctrl-C) or to the server only
        (Kubernetes, systemd); SIGKILL after ``timeout``. Seconds until it exited."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(self.proc.pid, getattr(signal, sig))
                else:
                    self.proc.send_signal(getattr(signal, sig))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log(f"server ignored {sig} for {timeout:.0f}s: SIGKILL to its group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        if self.log is not None:
            self.log.close()
        return time.monotonic() - t0


def computed(before: dict, after: dict) -> dict:
    """Prompt tokens of a run by source (the server's counters' differences)."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    by = {m.group(1): d(k) for k in after
          if (m := re.fullmatch(r'vllm:prompt_tokens_cached_by_source_total\{source="(\w+)"\}',
                                k))}
    return {"prompt_tokens": d("vllm:prompt_tokens_total"),
            "computed_tokens": d('vllm:prompt_tokens_by_source_total{source="local_compute"}'),
            "cached_by_source": {k: v for k, v in by.items() if v}}


# ----------------------------------------------------------------- client
CLIENT_KEYS = {"completed": "completed", "failed": "failed",
               "request_throughput": "request_throughput",
               "total_token_throughput": "token_throughput",
               "output_throughput": "output_throughput", "p50_ttft_ms": "ttft_p50_ms",
               "p99_ttft_ms": "ttft_p99_ms", "mean_ttft_ms": "ttft_mean_ms",
               "p50_tpot_ms": "tpot_p50_ms", "p99_tpot_ms": "tpot_p99_ms",
               "p50_e2el_ms": "e2el_p50_ms", "duration": "duration_s",
               "total_input_tokens": "input_tokens"}


def bench_client(srv: ApiServer, work: Path, args: list[str]) -> dict:
    """vLLM's benchmark client (``vllm bench serve ARGS``) against ``srv``, in
    this process; its result's numbers."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    out = work / f"client-{time.monotonic_ns()}.json"
    argv = ["--backend", "vllm", "--base-url", srv.url, "--model", srv.model,
            "--tokenizer", srv.model, "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--disable-tqdm", "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name,
            "--ready-check-timeout-sec", "60", *args]
    _custom_without_pandas()
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with contextlib.redirect_stdout(sys.stderr):  # stdout: our JSON line only
        main(parser.parse_args(argv))
    res = json.loads(out.read_text())
    out.unlink()
    return {mine: res[theirs] for theirs, mine in CLIENT_KEYS.items() if theirs in res}


def _custom_without_pandas() -> None:
    """vLLM's ``custom`` dataset reads its JSONL with pandas, which vLLM's CPU
    wheel does not install: where pandas is missing, the same rows are read
    with ``json`` (the loader is otherwise unchanged: every row a dict,
    shuffled unless ``--disable-shuffle``)."""
    try:
        import pandas  # noqa: F401
        return
    except ImportError:
        pass
    from vllm.benchmarks.datasets import datasets as ds

    def load_data(self) -> None:
        if not str(self.dataset_path).endswith(".jsonl"):
            raise NotImplementedError("Only JSONL format is supported for CustomDataset.")
        with open(self.dataset_path) as f:
            self.data = [json.loads(line) for line in f if line.strip()]
        if any("prompt" not in row for row in self.data):
            raise ValueError("JSONL file must contain a 'prompt' column.")
        random.seed(self.random_seed)
        if not getattr(self, "disable_shuffle", False):
            random.shuffle(self.data)
    ds.CustomDataset.load_data = load_data


def chat_dataset(path: Path, c: dict, seed: int) -> dict:
    """The multi-turn chat as vLLM's custom JSONL, turn-major (every
    conversation's turn t before any turn t+1); its size in tokens."""
    systems = [words(seed * 1000 + i, c["system"]) for i in range(2)]
    convs = [systems[u % 2] + words(seed * 1000 + 10 + u, c["doc"]) for u in range(c["users"])]
    rows, prompt_tokens = [], 0
    for t in range(c["turns"]):
        for u in range(c["users"]):
            rows.append({"prompt": " ".join(convs[u]), "output_tokens": c["answer"]})
            prompt_tokens += len(convs[u])
            convs[u] = convs[u] + words(seed * 1000 + 500 + 100 * u + t, c["answer"]) \
                + words(seed * 1000 + 50000 + 100 * u + t, c["turn"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = [len(v) - c["answer"] - c["turn"] for v in convs]  # each final prompt
    return {"requests": len(rows), "prompt_tokens": prompt_tokens,
            "working_set_tokens": sum(last)}


def run_workloads(srv: ApiServer, work: Path, p: dict, seed: int, workloads: str) -> dict:
    """The workloads (``prefix``, ``chat`` or ``all``) against one server; per
    workload the client's numbers and the server's prefill counters over it."""
    res = {}
    pr = p["prefix"]
    for conc, n in pr["prompts_per_concurrency"].items() if workloads != "chat" else ():
        before = srv.metrics()
        r = bench_client(srv, work, [
            "--dataset-name", "prefix_repetition", "--num-prompts", str(n),
            "--prefix-repetition-prefix-len", str(pr["prefix_len"]),
            "--prefix-repetition-suffix-len", str(pr["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(pr["num_prefixes"]),
            "--prefix-repetition-output-len", str(pr["output_len"]),
            "--max-concurrency", str(conc), "--seed", str(seed * 100 + conc)])
        res[f"prefix_c{conc}"] = {**r, **computed(before, srv.metrics())}
        log(f"  prefix_repetition c={conc}: {summary_line(res[f'prefix_c{conc}'])}")
    if workloads == "prefix":
        return res
    c = p["chat"]
    data = work / f"chat-{seed}.jsonl"
    size = chat_dataset(data, c, seed)
    before = srv.metrics()
    r = bench_client(srv, work, [
        "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts",
        str(size["requests"]), "--disable-shuffle", "--skip-chat-template",
        "--custom-output-len", str(c["answer"]), "--max-concurrency", str(c["concurrency"]),
        "--seed", str(seed)])
    res["chat"] = {**r, **computed(before, srv.metrics()), **size}
    log(f"  chat c={c['concurrency']}: {summary_line(res['chat'])}")
    return res


def summary_line(r: dict) -> str:
    return (f"{r.get('completed')} ok, TTFT p50 {r.get('ttft_p50_ms', 0):.0f} ms "
            f"p99 {r.get('ttft_p99_ms', 0):.0f} ms, TPOT p50 {r.get('tpot_p50_ms', 0):.1f} ms, "
            f"{r.get('request_throughput', 0):.2f} req/s, "
            f"computed {r['computed_tokens']:.0f}/{r['prompt_tokens']:.0f} tokens")


def run_mode(mode: str, model: str, work: Path, p: dict, seed: int, lmc=None,
             workloads: str = "all") -> dict:
    connector, env = None, None
    if mode == "kvcached":
        connector = kvcached_connector(work / f"store-{seed}", p["cpu_blocks"])
    elif mode == "kvcached_cpu":
        connector = kvcached_connector(None, p["cpu_blocks"])
    elif mode == "lmcache":
        connector, env = lmc.connector(), lmc.env()
    srv = ApiServer(model, work / f"{mode}-{seed}.log", p["kv_mb"], connector,
                    p["max_num_seqs"], env=env, max_model_len=p["max_model_len"])
    try:
        up = srv.wait_ready()
        log(f"{mode} (round seed {seed}): server up in {up:.0f}s on port {srv.port}")
        srv.complete("w1 w2 w3", 2)  # the first forward passes, outside the runs
        out = run_workloads(srv, work, p, seed, workloads)
    finally:
        srv.stop("SIGINT")
    out["load_avg_1m_after"] = os.getloadavg()[0]
    return out


# ----------------------------------------------------------------- report
def ratios(rounds: list[dict], mode: str) -> dict:
    """Per workload: medians over rounds of ``mode`` / plain (each round's pair)."""
    out = {}
    for wl in rounds[0]["plain"]:
        if not isinstance(rounds[0]["plain"][wl], dict):
            continue
        pairs = [(r[mode][wl], r["plain"][wl]) for r in rounds if mode in r]
        if not pairs:
            continue

        def med(key: str, pairs=pairs):
            vals = [a[key] / b[key] for a, b in pairs if b.get(key)]
            return statistics.median(vals) if vals else None
        out[wl] = {"ttft_p50": med("ttft_p50_ms"), "ttft_p99": med("ttft_p99_ms"),
                   "tpot_p50": med("tpot_p50_ms"),
                   "request_throughput": med("request_throughput"),
                   "token_throughput": med("token_throughput"),
                   "computed_tokens": med("computed_tokens")}
    return out


def targets(r: dict) -> dict:
    """The issue's targets, met or not (ratios to plain)."""
    out = {}
    chat = r.get("chat", {})
    if chat.get("ttft_p50") is not None:
        out["chat_ttft_p50_le_0.5"] = chat["ttft_p50"] <= 0.5
    if chat.get("request_throughput") is not None:
        out["chat_request_throughput_ge_1.5"] = chat["request_throughput"] >= 1.5
    for wl, v in r.items():
        if wl.startswith("prefix_") and v.get("request_throughput") is not None:
            out[f"{wl}_throughput_within_5pct"] = v["request_throughput"] >= 0.95
            out[f"{wl}_ttft_p50_within_5pct"] = v["ttft_p50"] <= 1.05
    return out


def medians(rounds: list[dict], mode: str) -> dict:
    """Per workload, the median over rounds of each number."""
    out = {}
    for wl, first in rounds[0].get(mode, {}).items():
        if not isinstance(first, dict):
            continue
        runs = [r[mode][wl] for r in rounds if mode in r]
        out[wl] = {k: statistics.median(x[k] for x in runs) for k, v in first.items()
                   if isinstance(v, (int, float))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, few prompts (smoke)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="how many times the modes alternate (plain, kvcached, ...)")
    ap.add_argument("--lmcache-python", metavar="PY",
                    help="LMCache's environment's interpreter: adds LMCache's multi-process "
                         "mode (scripts/setup_lmcache_env.sh makes that environment)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated, from plain, kvcached, kvcached_cpu (the CPU tier "
                         "alone, no storage), lmcache (default: plain, kvcached[, lmcache])")
    ap.add_argument("--workloads", choices=["all", "prefix", "chat"], default="all",
                    help="which workloads each server serves")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server logs)")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="kvcached-bench-serve-", dir="/tmp"))
    try:
        model = make_model(str(work / "model"), p["layers"], p["hidden"])
        kv_tokens = (p["kv_mb"] << 20) // kv_bytes_per_token(p["layers"], p["hidden"])
        modes = (args.modes.split(",") if args.modes else
                 ["plain", "kvcached"] + (["lmcache"] if args.lmcache_python else []))
        bad = set(modes) - {"plain", "kvcached", "kvcached_cpu", "lmcache"}
        if bad or modes[0] != "plain" or ("lmcache" in modes and not args.lmcache_python):
            ap.error(f"--modes {args.modes}: plain first, then kvcached, kvcached_cpu or "
                     "lmcache (with --lmcache-python)")
        lmc_cm = (load_script("bench_vllm").LMCacheServer(args.lmcache_python, work)
                  if args.lmcache_python else contextlib.nullcontext())
        rounds = []
        with lmc_cm as lmc:
            for k in range(args.rounds):
                rounds.append({m: run_mode(m, model, work, p, seed=k + 1, lmc=lmc,
                                           workloads=args.workloads) for m in modes})
    finally:
        if args.keep:
            log(f"work dir kept: {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    chat = rounds[0]["plain"].get("chat", {})
    result = {"bench": "serve", "quick": bool(args.quick), "rounds": args.rounds,
              "model": f"random Llama {p['layers']}x{p['hidden']} float32",
              "vllm_kv_tokens": kv_tokens, "kvcached_cpu_blocks": p["cpu_blocks"],
              "chat_working_set_tokens": chat.get("working_set_tokens"),
              "chat_working_set_vs_kv": chat.get("working_set_tokens", 0) / kv_tokens,
              "medians": {m: medians(rounds, m) for m in modes},
              "vs_plain": {m: ratios(rounds, m) for m in modes if m != "plain"},
              "load_avg_1m_after": [{m: r[m]["load_avg_1m_after"] for m in modes}
                                    for r in rounds]}
    result["targets"] = {m: targets(v) for m, v in result["vs_plain"].items()}
    emit(result)


if __name__ == "__main__":
    main()
