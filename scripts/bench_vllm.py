#!/usr/bin/env python
"""kvcached inside vLLM (its CPU build): what a hit costs, what chat gains, what
no reuse loses. Each mode runs in its own vLLM process (a random-weight Llama,
6 layers, 1024 wide, GQA 4:1, float32, made here; nothing is downloaded; at 512 wide,
as first planned, a 2,000-token prefill takes 0.4 s here, too little to
dominate as it does on real models):

1. Per hit. The same 2,000-token prompts served again one at a time (TTFT;
   vLLM's prefix cache is reset before each kvcached hit): from vLLM's own
   prefix cache (the floor: nothing to load), from kvcached's CPU tier, from
   file storage in a fresh vLLM process (empty CPU tier), and through vLLM's
   ``ExampleConnector`` (its disk connector, the other connector that runs on
   CPU). kvcached's CPU hit and vLLM's own hit alternate on each prompt in
   the same process; ``cpu_hit_vs_own_hit`` is the median of their ratios
   (target <= 1.15). In the fresh process each prompt's storage hit is
   followed by vLLM's own hit of it; ``storage_hit_vs_own_hit`` is the median
   of those ratios (target <= 1.5). ``--storage-only`` runs just this (a
   process that fills storage, then the fresh one); ``--storage-secret``
   with it runs that three times: unsigned, signed (a fleet secret) and
   encrypted (``storage_encrypt``), and reports each mode's ratio over the
   unsigned one (``signed_vs_unsigned``, target <= 1.1; each ratio is taken
   in its own process, so a process's speed cancels out), JSON
   ``{"bench": "vllm_storage_mac"}``.
2. Multi-turn chat. Conversations (a shared system prompt, a document, user
   turns, the model's own answers) whose every turn extends the previous one, turns of
   different conversations interleaved, and vLLM's KV space a third of the
   working set: no connector, ``ExampleConnector`` (it keys whole prompts, so
   an extended prompt misses), kvcached. Reports prefill tokens computed (and
   the least the workload allows: each turn's part not in the previous turn's
   blocks), TTFT mean/p50/p99 and throughput. Targets: kvcached's mean TTFT at
   most half of the others'; its computed share within 5 points of the least.
3. No reuse. Rounds of unique prompts, in two processes of each mode taken
   in turn: the median round's throughput without and with kvcached
   (target: at most 5% lost). Both run with the same process settings: the
   connector changes nothing in the process but where the KV cache lives
   (shared memory, through vLLM's ``get_mem_pool_context``).
   ``--no-reuse-only`` runs just these.
4. Scheduler time. 64 requests running at once, ~200 steps (enough that p99
   is not the worst step): the time vLLM's scheduler spends in kvcached per
   step, p50/p99 (target p99 <= 1 ms), as ``kvcached status`` reports it:
   wall time, and that thread's CPU time (the rest is waiting for a core or
   for the GIL). ``--busy-only`` runs just this.
Every mode must give the same greedy outputs, and every mode's vLLM binds its
threads alike: vLLM's CPU build keeps cores out of its worker's OpenMP threads
for its other processes, one without a connector and one more with any
connector (``ompmultiprocessing.py``: "reserve at one more core for
nixl_connector"), and where that leaves no core to the worker it reserves none
(on 2 cores: the worker computes on both with a connector, on one without).
Each mode runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (unless set): the worker
computes on all cores but one in every mode, the connector's own processes
(kvcached's transfer workers, LMCache's server) share the other with vLLM's.

    python scripts/bench_vllm.py [--quick] [--lmcache-python PY] [--hit-chat-only]
                                 [--busy-only] [--storage-only [--storage-secret]]
                                 [--family gemma3|qwen3_next] [--fork-server SOCKET]

``--family gemma3`` runs phase 1 on a random Gemma 3 of the same shape (its
layers sliding-window of 512 tokens but every sixth, vLLM's hybrid KV cache
manager on), ``--family qwen3_next`` on a random Qwen3-Next (gated delta-net
layers but every third, full attention; bfloat16, vLLM's CPU kernel for them
has no other; vLLM aligns the block so that a page holds a state):
``cpu_hit_vs_own_hit`` (target <= 1.15) and ``storage_hit_vs_own_hit``
(target <= 1.5), JSON ``{"bench": "vllm_family"}``.

``--quick`` is a smoke run of the script (a tiny model; no ExampleConnector;
the scheduler phase in the kvcached process; vLLM's engine in one process).

``--lmcache-python PY`` adds LMCache, the peer, as a mode of phases 1 and 2:
``PY`` is the interpreter of LMCache's own environment
(``scripts/setup_lmcache_env.sh`` makes it: LMCache pulls CUDA-only wheels
and an older numpy). LMCache 0.5.6 runs on vLLM's CPU build in its
multi-process mode only: the script starts its server (``PY -m
lmcache.v1.multiprocess.http_server --chunk-size 32 --l1-size-gb 2
--eviction-policy LRU --supported-transfer-mode auto --shm-name NAME``), runs
vLLM with vLLM's ``LMCacheMPConnector`` against it (vLLM's processes see that
environment's ``lmcache`` package through a PYTHONPATH entry holding only a
link to it) and stops the server at the end. Its CPU hit and vLLM's own hit
alternate on each prompt in its process, as kvcached's do. LMCache's usage
reporting is turned off (``LMCACHE_TRACK_USAGE=false``).

``--hit-chat-only`` runs only phases 1 and 2 (no restart, no-reuse or
scheduler processes): the full run with LMCache takes ~35 minutes here,
these ~20.

Progress on stderr; the last line on stdout is JSON ``{"bench": "vllm", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from _bench_util import log, percentile, result_file, run_child  # noqa: E402

BS = 32  # vLLM's CPU attention needs a multiple of 32
FULL = dict(layers=6, hidden=1024, hit_prompts=4, hit_len=2000, hit_rounds=3,
            users=8, turns=5, system=256, first_len=1024, turn_len=256, answer=32, kv_mb=56,
            noreuse=8, noreuse_len=1000, noreuse_out=32, noreuse_rounds=3,
            busy=64, busy_len=256, busy_out=128, busy_kv_mb=256)
QUICK = dict(layers=2, hidden=128, hit_prompts=2, hit_len=600, hit_rounds=2,
             users=3, turns=3, system=64, first_len=192, turn_len=64, answer=8, kv_mb=6,
             noreuse=4, noreuse_len=300, noreuse_out=8, noreuse_rounds=1,
             busy=16, busy_len=96, busy_out=8, busy_kv_mb=8, one_process=True)


# ------------------------------------------------------------------ child
def make_model(path: str, layers: int, hidden: int, family: str = "llama") -> str:
    """A random-weight model: ``llama``, ``gemma3`` (the same shape, its layers
    sliding-window of 512 tokens but every sixth, full: Gemma 3's 5:1) or
    ``qwen3_next`` (the same shape, its layers gated delta-net but every third,
    full; small linear heads keep a state near a block of KV)."""
    if not os.path.exists(os.path.join(path, "config.json")):
        import torch
        import transformers as tf
        heads = max(1, hidden // 64)  # head size 64, GQA 4:1, MLP 4x: a real model's shape
        shape = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=max(1, heads // 4), max_position_embeddings=8192)
        torch.manual_seed(0)
        if family == "gemma3":
            kinds = ["full_attention" if i % 6 == 5 else "sliding_attention"
                     for i in range(layers)]
            model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
                **shape, head_dim=64, sliding_window=512, layer_types=kinds,
                tie_word_embeddings=False))  # tied, a random Gemma 3 repeats one token
        elif family == "qwen3_next":
            model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
                **shape, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=hidden,
                shared_expert_intermediate_size=hidden, full_attention_interval=min(3, layers),
                tie_word_embeddings=False))
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape))
        model.to(torch.bfloat16).save_pretrained(path)
    return path


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


class Server:
    """A vLLM engine driven step by step, so each request's first token is timed.
    float32: with bfloat16, vLLM's CPU build gives different greedy outputs
    from one process to the next for the same batch (seen here), which would
    hide whether a cache changed them."""

    def __init__(self, spec: dict):
        from vllm import LLM
        kw = {}
        if spec["connector"]:
            kw["kv_transfer_config"] = spec["connector"]
        dtype = "float32"
        if spec["params"].get("family") == "qwen3_next":  # gated delta-net: bfloat16 only
            dtype, kw["mamba_cache_mode"] = "bfloat16", "align"
        self.llm = LLM(model=spec["model"], skip_tokenizer_init=True, block_size=BS,
                       enforce_eager=True, dtype=dtype,
                       max_model_len=spec["params"].get("max_model_len", 4096),
                       kv_cache_memory_bytes=spec["kv_mb"] << 20, disable_log_stats=True,
                       max_num_seqs=spec.get("max_num_seqs", 8), **kw)
        self.n = 0

    def serve(self, prompts: list[list[int]], max_tokens: int) -> list[dict]:
        """Submit ``prompts`` together; per request: TTFT, output, cached tokens."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        eng = self.llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        ids = []
        for p in prompts:
            self.n += 1
            ids.append(str(self.n))
            eng.add_request(ids[-1], TokensPrompt(prompt_token_ids=p), sp)
        res = {rid: {"ttft": None, "output": [], "cached": 0} for rid in ids}
        while eng.has_unfinished_requests():
            for out in eng.step():
                r = res[out.request_id]
                new = out.outputs[0].token_ids if out.outputs else []
                if new and r["ttft"] is None:
                    r["ttft"] = time.perf_counter() - t0
                r["output"] += list(new)
                r["cached"] = max(r["cached"], out.num_cached_tokens or 0)
        return [res[rid] for rid in ids]

    def reset(self) -> None:
        """vLLM refuses while a finished request still holds blocks (with
        kvcached: until its saves are done), so ask until it takes."""
        deadline = time.monotonic() + 60
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's prefix cache never became free to reset")
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                self.llm.llm_engine.step()  # an engine core in this process steps when asked
            time.sleep(0.05)


def per_hit(srv: Server, p: dict, connector: bool) -> dict:
    """Cold TTFT per prompt, then rounds of [connector hit, vLLM's own hit]."""
    prompts = [tokens(100 + i, p["hit_len"]) for i in range(p["hit_prompts"])]
    out = {"cold": [], "own": [], "conn": [], "outputs": [], "conn_cached": []}
    for q in prompts:
        r = srv.serve([q], 4)[0]
        out["cold"].append(r["ttft"])
        out["outputs"].append(r["output"])
    for _ in range(p["hit_rounds"]):
        for q, want in zip(prompts, out["outputs"], strict=True):
            if connector:
                srv.reset()
                r = srv.serve([q], 4)[0]
                out["conn"].append(r["ttft"])
                out["conn_cached"].append(r["cached"])
                assert r["output"] == want, "a connector hit changed the output"
            r = srv.serve([q], 4)[0]
            out["own"].append(r["ttft"])
            assert r["output"] == want, "vLLM's own hit changed the output"
    return out


def fill(srv: Server, p: dict) -> dict:
    """The per-hit prompts computed once (kvcached writes them to storage)."""
    prompts = [tokens(100 + i, p["hit_len"]) for i in range(p["hit_prompts"])]
    return {"outputs": [srv.serve([q], 4)[0]["output"] for q in prompts]}


def restart_hit(srv: Server, p: dict) -> dict:
    """In a process that never saw the per-hit prompts: each served from
    storage, then at once again (vLLM's own hit), a pair in the same process.
    An unrelated prompt of the same length goes first, computed and hit, so
    neither side of the first pair pays the process's first forward passes."""
    warm = tokens(99, p["hit_len"])
    srv.serve([warm], 4)
    srv.serve([warm], 4)
    prompts = [tokens(100 + i, p["hit_len"]) for i in range(p["hit_prompts"])]
    out = {"storage": [], "own": [], "cached": [], "outputs": []}
    for q in prompts:
        r = srv.serve([q], 4)[0]
        own = srv.serve([q], 4)[0]
        assert own["output"] == r["output"], "vLLM's own hit changed the output"
        out["storage"].append(r["ttft"])
        out["own"].append(own["ttft"])
        out["cached"].append(r["cached"])
        out["outputs"].append(r["output"])
    return out


def chat(srv: Server, p: dict) -> dict:
    """Rounds: every conversation sends its next turn (in a shuffled order, a few
    at a time); its next prompt is this prompt, the model's answer and a new
    user turn."""
    rng = random.Random(7)
    systems = [tokens(900 + i, p["system"]) for i in range(2)]
    convs = [systems[u % 2] + tokens(1000 + u, p["first_len"]) for u in range(p["users"])]
    prev_kv = [0] * p["users"]  # tokens whose KV the previous turn computed
    seen = set()  # system prompts served already
    reqs = []
    t0 = time.perf_counter()
    for turn in range(p["turns"]):
        order = list(range(p["users"]))
        rng.shuffle(order)
        for i in range(0, len(order), 2):
            group = order[i:i + 2]
            for u, r in zip(group, srv.serve([convs[u] for u in group], p["answer"]),
                            strict=True):
                n = len(convs[u])
                reusable = min(prev_kv[u] // BS, (n - 1) // BS) * BS
                if turn == 0 and u % 2 in seen:  # an earlier conversation's system prompt
                    reusable = p["system"] // BS * BS
                seen.add(u % 2)
                reqs.append({"user": u, "turn": turn, "prompt": n, "reusable": reusable,
                             **r})
                prev_kv[u] = n + len(r["output"]) - 1
                convs[u] = convs[u] + r["output"] + tokens(2000 + 100 * u + turn,
                                                             p["turn_len"])
    wall = time.perf_counter() - t0
    prompt = sum(r["prompt"] for r in reqs)
    ttft = [r["ttft"] for r in reqs]
    return {"requests": len(reqs), "prompt_tokens": prompt,
            "computed_tokens": sum(r["prompt"] - r["cached"] for r in reqs),
            "least_computed_tokens": sum(r["prompt"] - r["reusable"] for r in reqs),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99), "wall_s": wall,
            "throughput_tok_s": (prompt + sum(len(r["output"]) for r in reqs)) / wall,
            "outputs": [[r["user"], r["turn"], r["output"]] for r in reqs]}


def no_reuse(srv: Server, p: dict) -> dict:
    """Rounds of unique prompts served together; the median round's throughput."""
    rates, outputs = [], []
    for rnd in range(p["noreuse_rounds"]):
        prompts = [tokens(5000 + 100 * rnd + i, p["noreuse_len"]) for i in range(p["noreuse"])]
        t0 = time.perf_counter()
        res = srv.serve(prompts, p["noreuse_out"])
        wall = time.perf_counter() - t0
        rates.append((sum(map(len, prompts)) + sum(len(r["output"]) for r in res)) / wall)
        outputs += [r["output"] for r in res]
    return {"throughput_tok_s": statistics.median(rates), "rounds": rates, "outputs": outputs}


def busy(srv: Server, p: dict, run_dir: str) -> dict:
    """Many requests running at once (vLLM's scheduler at work each step): the
    time it spent in kvcached per step, from ``kvcached status``."""
    prompts = [tokens(7000 + i, p["busy_len"]) for i in range(p["busy"])]
    t0 = time.perf_counter()
    res = srv.serve(prompts, p["busy_out"])
    wall = time.perf_counter() - t0
    st = subprocess.run([sys.executable, "-m", "kvcached", "status", "--run-dir", run_dir,
                         "--json"], capture_output=True, text=True, timeout=120)
    step = json.loads(st.stdout).get("scheduler_step_us", {})
    return {"requests": len(prompts), "wall_s": wall, "scheduler_step_us": step,
            "outputs": [r["output"] for r in res]}


def busy_hit(srv: Server, hit: list[int], decoders: int, seed: int) -> dict:
    """``decoders`` requests decoding, then ``hit`` (in the CPU tier) arrives:
    its TTFT, and the time the decoders' steps took from its arrival to its
    first token over what their steps took before (what it cost them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    eng = srv.llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(decoders)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=tokens(seed * 100 + i, 64)), sp)
    before = []
    for _ in range(8):  # prefilled, then decode steps alone
        t = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    eng.add_request(f"h{seed}", TokensPrompt(prompt_token_ids=hit),
                    SamplingParams(temperature=0, max_tokens=1))
    steps, ttft = 0, None
    while ttft is None:
        steps += 1
        for out in eng.step():
            if out.request_id == f"h{seed}" and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
    window = time.perf_counter() - t0
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    base = statistics.median(before[4:])
    return {"ttft": ttft, "steps": steps, "decoder_extra": max(0.0, window - steps * base),
            "decode_step": base}


def crossing(srv: Server, p: dict) -> dict:
    """Per hit length: a CPU-tier hit arriving at a batch of decoding requests,
    loaded inside the step (``step_load_max_blocks`` above it) and a step
    later (0), taken in turn. Cost = the hit's TTFT + every decoder's extra
    wait; the crossing point is the shortest hit whose in-step cost exceeds
    its asynchronous one (None: none measured did)."""
    half = srv.llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    rows, seed = {}, 0
    for n in p["cross_lens"]:
        hit = tokens(8000 + n, n)
        srv.serve([hit], 1)  # computed once: its blocks are saved to the CPU tier
        got = {"step": [], "async": []}
        for _ in range(p["cross_rounds"]):
            for mode, step_max in (("step", 1 << 20), ("async", 0)):
                srv.reset()
                half.step_max = step_max
                seed += 1
                got[mode].append(busy_hit(srv, hit, p["cross_decoders"], seed))
        row = {}
        for mode, runs in got.items():
            row[mode] = {k: statistics.median(r[k] for r in runs)
                         for k in ("ttft", "decoder_extra", "decode_step", "steps")}
            row[mode]["cost"] = statistics.median(
                r["ttft"] + p["cross_decoders"] * r["decoder_extra"] for r in runs)
        rows[str(n)] = row
    over = [int(n) for n, r in rows.items() if r["step"]["cost"] > r["async"]["cost"]]
    return {"decoders": p["cross_decoders"], "rows": rows,
            "crossing_tokens": min(over) if over else None}


def child(spec: dict) -> dict:
    p = spec["params"]
    srv = Server(spec)
    # vLLM's, which it may have aligned (a Mamba hybrid's page holds a state)
    out = {"block_size": srv.llm.llm_engine.vllm_config.cache_config.block_size}
    for phase in spec["phases"]:
        log(f"{spec['name']}: {phase}")
        if phase == "no_reuse":
            out[phase] = no_reuse(srv, p)
        elif phase == "per_hit":
            out[phase] = per_hit(srv, p, connector=spec["connector"] is not None)
        elif phase == "restart_hit":
            out[phase] = restart_hit(srv, p)
        elif phase == "fill":
            out[phase] = fill(srv, p)
        elif phase == "busy":
            out[phase] = busy(srv, p, spec["connector"]["kv_connector_extra_config"]["run_dir"])
        elif phase == "crossing":
            out[phase] = crossing(srv, p)
        elif phase == "chat":
            srv.reset()
            out[phase] = chat(srv, p)
    return out


# ----------------------------------------------------------------- parent
FORK_SERVER: str | None = None  # --fork-server (the tests' smoke run): see _bench_util.run_child


def run_mode(name: str, model: str, p: dict, connector: dict | None,
             phases: list[str], max_num_seqs: int = 8, env: dict | None = None) -> dict:
    t = time.monotonic()
    # vLLM's own progress stays quiet; its warnings and ours reach stderr.
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           # the same cores for the worker's threads in every mode (docstring)
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
           **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if p.get("one_process") else {}),
           **(env or {})}  # vLLM in one process starts in seconds, not tens
    with result_file() as result:
        spec = {"name": name, "model": model, "params": p, "connector": connector,
                "phases": phases, "kv_mb": p["kv_mb"], "result": str(result),
                "max_num_seqs": max_num_seqs}
        rc = run_child(__file__, ["--child", json.dumps(spec)], env, 3600, FORK_SERVER)
        if rc or not result.exists():
            raise SystemExit(f"mode {name} failed (rc {rc}); its log is above")
        out = json.loads(result.read_text())
    log(f"{name}: done in {time.monotonic() - t:.0f}s")
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the machine
    return out


STEP_MAX: int | None = None  # --step-max: step_load_max_blocks of every kvcached mode


def kvcached_connector(run_dir: Path, store: Path, cpu_blocks: int, **extra) -> dict:
    extra = {"num_cpu_blocks": cpu_blocks, "run_dir": str(run_dir),
             "storage_backend": "file", "storage_url": str(store), **extra}
    if STEP_MAX is not None:
        extra["step_load_max_blocks"] = STEP_MAX
    return {"kv_connector": "KvcachedConnector",
            "kv_connector_module_path": "kvcached.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def storage_modes(model: str, p: dict, work: Path, cpu_blocks: int, secret: bool,
                  quick: bool) -> dict:
    """Phase 1's storage hit alone: a process fills file storage, a new one
    serves from it. With ``secret``: three times, unsigned, signed (a fleet
    secret) and encrypted (``storage_encrypt``), each on a store of its own,
    in that order; each mode's hits over vLLM's own hits in its process, and
    those ratios over the unsigned one."""
    modes = {"unsigned": {}}
    if secret:
        path = work / "fleet.secret"
        path.write_text(os.urandom(32).hex() + "\n")
        modes.update(signed={"storage_secret_file": str(path)},
                     encrypted={"storage_secret_file": str(path), "storage_encrypt": True})
    full = p["hit_len"] - 1 - (p["hit_len"] - 1) % BS
    out, outputs = {}, {}
    for name, extra in modes.items():
        store = work / f"store-{name}"
        run_mode(f"fill ({name})", model, p,
                 kvcached_connector(work / f"run1-{name}", store, cpu_blocks, **extra), ["fill"])
        rs = run_mode(f"restart ({name})", model, p,
                      kvcached_connector(work / f"run2-{name}", store, cpu_blocks, **extra),
                      ["restart_hit"])
        out[name] = storage_summary(rs, full)
        outputs[name] = rs["restart_hit"]["outputs"]
    if not secret:
        return {"bench": "vllm_storage", "quick": quick, **out["unsigned"]}
    base = out["unsigned"]
    return {"bench": "vllm_storage_mac", "quick": quick, "modes": out,
            **{f"{m}_vs_unsigned": out[m]["storage_hit_vs_own_hit"]
               / base["storage_hit_vs_own_hit"] for m in ("signed", "encrypted")},
            **{f"{m}_vs_unsigned_ttft": out[m]["storage_hit_ttft_s"] / base["storage_hit_ttft_s"]
               for m in ("signed", "encrypted")},
            "identical_outputs": all(o == outputs["unsigned"] for o in outputs.values())}


def example_connector(path: Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


class LMCacheServer:
    """LMCache's multi-process server, run by the interpreter of LMCache's own
    environment, and what vLLM's processes need to reach it."""

    def __init__(self, python: str, work: Path, l1_gb: int = 2):
        self.python, self.work, self.l1_gb = python, work, l1_gb
        self.port, self.http_port = free_port(), free_port()
        self.shm = f"kvcached-bench-lmcache-{os.getpid()}"
        self.log = work / "lmcache-server.log"
        self.proc: subprocess.Popen | None = None
        # vLLM's connector imports the lmcache package: a folder holding only a
        # link to that environment's package goes on vLLM's PYTHONPATH, so none
        # of that environment's other packages (its numpy, its CUDA wheels) do.
        where = subprocess.run(
            [python, "-c", "import importlib.util as u; "
             "print(u.find_spec('lmcache').submodule_search_locations[0])"],
            capture_output=True, text=True, timeout=60)
        if where.returncode:
            raise SystemExit(f"{python} has no lmcache package (scripts/setup_lmcache_env.sh "
                             f"makes one): {where.stderr.strip()[-500:]}")
        self.path = work / "lmcache-path"
        self.path.mkdir(exist_ok=True)
        (self.path / "lmcache").symlink_to(where.stdout.strip())

    def env(self) -> dict:
        """For vLLM's processes: the lmcache package reachable, no usage reports,
        and vLLM in its own layout even with --quick: in one process the
        connector (importing lmcache, which imports numba) is loaded before
        vLLM's CPU worker scans every module for Triton kernels to override,
        and the scan fails on an llvmlite object (AttributeError:
        '_lib_fn_wrapper' object has no attribute 'get')."""
        pp = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": f"{self.path}{os.pathsep + pp if pp else ''}",
                "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

    def connector(self) -> dict:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def __enter__(self) -> LMCacheServer:
        cmd = [self.python, "-m", "lmcache.v1.multiprocess.http_server",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
               "--chunk-size", str(BS), "--l1-size-gb", str(self.l1_gb),
               "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
               "--shm-name", self.shm]
        log(f"lmcache: starting its server ({' '.join(cmd[1:])}), log in {self.log}")
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
        env.pop("PYTHONPATH", None)  # its own environment, nothing of this checkout's
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        url = f"http://127.0.0.1:{self.http_port}/"
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"LMCache's server exited (rc {self.proc.returncode}):\n"
                                 + self.log.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"LMCache's server did not answer on {url} in 180 s; "
                                 f"its log: {self.log}")
            time.sleep(0.5)
        log(f"lmcache: server up on port {self.port}")
        return self

    def __exit__(self, *exc) -> None:
        """SIGTERM (it closes its cache and removes its shared memory), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            log("lmcache: server ignored SIGTERM for 30 s; killed")
            self.proc.kill()
            self.proc.wait(10)
        log(f"lmcache: server stopped (rc {self.proc.returncode})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rounds(modes: dict, mode: str) -> list[float]:
    """No-reuse throughput of every round of ``mode``'s processes."""
    return [r for m in (mode, mode + "2") if m in modes for r in modes[m]["no_reuse"]["rounds"]]


def no_reuse_summary(modes: dict) -> dict:
    med = statistics.median
    kv = med(rounds(modes, "kvcached"))
    return {"no_reuse_throughput_tok_s": {m: rounds(modes, m)
                                          for m in ("plain", "kvcached")},
            "no_reuse_throughput_lost": 1 - kv / med(rounds(modes, "plain")),
            "no_reuse_identical": all(modes[m]["no_reuse"]["outputs"]
                                      == modes["plain"]["no_reuse"]["outputs"] for m in modes
                                      if "no_reuse" in modes[m])}


def hit_pairs(mode: dict) -> list[float]:
    """A connector's hit over vLLM's own hit of the same prompt, taken in turn."""
    hit = mode["per_hit"]
    return [c / o for c, o in zip(hit["conn"], hit["own"][:len(hit["conn"])], strict=True)]


def storage_summary(restart: dict, full: int) -> dict:
    """Storage hits in a new process over vLLM's own hit of the same prompt
    right after, in that process."""
    r = restart["restart_hit"]
    pairs = [s / o for s, o in zip(r["storage"], r["own"], strict=True)]
    return {"storage_hit_vs_own_hit": statistics.median(pairs),
            "storage_hit_vs_own_hit_spread": {"pairs": len(pairs),
                                              "min": min(pairs), "max": max(pairs)},
            "storage_hit_ttft_s": statistics.median(r["storage"]),
            "storage_own_hit_ttft_s": statistics.median(r["own"]),
            "storage_hit_blocks_served": min(r["cached"]) / full,
            "storage_hit_cached_tokens": r["cached"]}


def family_hits(family: str, model: str, p: dict, work: Path, cpu_blocks: int,
                quick: bool) -> dict:
    """Phase 1 for another model family: a CPU-tier hit and a storage hit, each
    over vLLM's own hit of the same prompt in the same process."""
    store = work / "store"
    kv = run_mode("kvcached", model, p, kvcached_connector(work / "run1", store, cpu_blocks),
                  ["per_hit"])
    rs = run_mode("restart", model, p, kvcached_connector(work / "run2", store, cpu_blocks),
                  ["restart_hit"])
    assert rs["restart_hit"]["outputs"] == kv["per_hit"]["outputs"], "outputs differ"
    bs = kv["block_size"]
    full = p["hit_len"] - 1 - (p["hit_len"] - 1) % bs
    pairs = hit_pairs(kv)
    return {"bench": "vllm_family", "family": family, "quick": quick, "block_size": bs,
            "cpu_hit_vs_own_hit": statistics.median(pairs),
            "cpu_hit_vs_own_hit_spread": {"pairs": len(pairs), "min": min(pairs),
                                          "max": max(pairs)},
            "cpu_hit_blocks_served": min(kv["per_hit"]["conn_cached"]) / full,
            **storage_summary(rs, full)}


def summary(modes: dict, p: dict) -> dict:
    plain, kv = modes["plain"], modes["kvcached"]
    rs = modes.get("restart")  # not in --hit-chat-only
    ex = modes.get("example")  # not in --quick
    lm = modes.get("lmcache")  # with --lmcache-python
    busy = modes.get("busy", kv).get("busy")
    hit = kv["per_hit"]
    pairs = hit_pairs(kv)
    med = statistics.median
    full = p["hit_len"] - 1 - (p["hit_len"] - 1) % BS
    chats = {m: modes[m]["chat"] for m in ("plain", "example", "lmcache", "kvcached")
             if m in modes}
    ref = plain["per_hit"]["outputs"]
    same = {"per_hit_kvcached": hit["outputs"] == ref,
            "chat_kvcached": chats["kvcached"]["outputs"] == chats["plain"]["outputs"]}
    for m in ("example", "lmcache"):
        if m in modes:
            same.update({f"per_hit_{m}": modes[m]["per_hit"]["outputs"] == ref,
                         f"chat_{m}": chats[m]["outputs"] == chats["plain"]["outputs"]})
    least = chats["kvcached"]["least_computed_tokens"] / chats["kvcached"]["prompt_tokens"]
    got = chats["kvcached"]["computed_tokens"] / chats["kvcached"]["prompt_tokens"]
    ttft = {"full_prefill": med(plain["per_hit"]["cold"]), "vllm_own_hit": med(hit["own"]),
            "kvcached_cpu": med(hit["conn"])}
    out = {
        "per_hit_ttft_s": ttft,
        "cpu_hit_vs_own_hit": med(pairs),
        "cpu_hit_vs_own_hit_spread": {"pairs": len(pairs), "p10": percentile(pairs, 0.1),
                                      "p90": percentile(pairs, 0.9)},
        "cpu_hit_blocks_served": min(hit["conn_cached"]) / full,
        "chat": {m: {k: v for k, v in c.items() if k != "outputs"} for m, c in chats.items()},
        "chat_ttft_vs_no_connector": chats["kvcached"]["ttft_mean_s"]
        / chats["plain"]["ttft_mean_s"],
        "chat_computed_share": got, "chat_least_computed_share": least,
        "chat_points_above_least": 100 * (got - least),
    }
    if rs:
        same["restart"] = rs["restart_hit"]["outputs"] == ref
        ttft["kvcached_storage_after_restart"] = med(rs["restart_hit"]["storage"])
        out.update(storage_summary(rs, full))
    if busy:
        out["scheduler_step_us"] = busy["scheduler_step_us"]
        out["busy_running_requests"] = busy["requests"]
    if "no_reuse" in plain:
        same["no_reuse"] = no_reuse_summary(modes)["no_reuse_identical"]
        out.update({k: v for k, v in no_reuse_summary(modes).items()
                    if k != "no_reuse_identical"})
    if ex:
        ttft["example_connector"] = med(ex["per_hit"]["conn"])
        out["example_vs_own_hit"] = med(ex["per_hit"]["conn"]) / med(ex["per_hit"]["own"])
        out["chat_ttft_vs_example"] = (chats["kvcached"]["ttft_mean_s"]
                                       / chats["example"]["ttft_mean_s"])
    if lm:
        lpairs = hit_pairs(lm)
        ttft["lmcache_cpu"] = med(lm["per_hit"]["conn"])
        ttft["lmcache_vllm_own_hit"] = med(lm["per_hit"]["own"])
        out["lmcache_hit_vs_own_hit"] = med(lpairs)
        out["lmcache_hit_vs_own_hit_spread"] = {"pairs": len(lpairs),
                                                "p10": percentile(lpairs, 0.1),
                                                "p90": percentile(lpairs, 0.9)}
        out["lmcache_hit_blocks_served"] = min(lm["per_hit"]["conn_cached"]) / full
        out["chat_ttft_vs_lmcache"] = (chats["kvcached"]["ttft_mean_s"]
                                       / chats["lmcache"]["ttft_mean_s"])
    out.update(identical_outputs=all(same.values()), identical=same)
    return out


def no_reuse_modes(model: str, p: dict, work: Path, cpu_blocks: int, twice: bool) -> dict:
    """The no-reuse rounds alone: each mode's processes taken in turn."""
    modes = {}
    for suffix in ("", "2") if twice else ("",):
        modes["plain" + suffix] = run_mode("plain" + suffix, model, p, None, ["no_reuse"])
        modes["kvcached" + suffix] = run_mode("kvcached" + suffix, model, p, kvcached_connector(
            work / f"run{suffix}", work / f"store{suffix}", cpu_blocks), ["no_reuse"])
    return {**no_reuse_summary(modes),
            "load_avg_1m_after": {m: r["load_avg_1m_after"] for m, r in modes.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, few prompts (smoke)")
    ap.add_argument("--no-reuse-only", action="store_true",
                    help="only the no-reuse rounds (plain, kvcached)")
    ap.add_argument("--busy-only", action="store_true",
                    help="only the scheduler-time phase (64 requests running at once)")
    ap.add_argument("--lmcache-python", metavar="PY",
                    help="LMCache's environment's interpreter: adds LMCache as a mode "
                         "(scripts/setup_lmcache_env.sh makes that environment)")
    ap.add_argument("--storage-only", action="store_true",
                    help="only the storage hits in a new process (after one that fills it)")
    ap.add_argument("--storage-secret", action="store_true",
                    help="with --storage-only: unsigned, signed (a fleet secret) and "
                         "encrypted (storage_encrypt) storage hits, each over vLLM's own hit")
    ap.add_argument("--hit-chat-only", action="store_true",
                    help="only the per-hit and multi-turn chat phases")
    ap.add_argument("--hit-only", action="store_true",
                    help="only kvcached's CPU-tier hits, each beside vLLM's own hit of the "
                         "same prompt in the same process (cpu_hit_vs_own_hit)")
    ap.add_argument("--small", action="store_true",
                    help="a smaller model (6 layers, 512 wide), where a step weighs most")
    ap.add_argument("--hit-len", type=int, default=None,
                    help="tokens of the per-hit prompts (default 2,000)")
    ap.add_argument("--hit-rounds", type=int, default=None,
                    help="rounds of per-hit pairs (default 3: 12 pairs); more narrow the median")
    ap.add_argument("--crossing", action="store_true",
                    help="only where a CPU-tier hit stops paying to load inside the step: "
                         "hits of 1,000 to 8,000 tokens arriving at 8 decoding requests, in-step "
                         "and a step later (one vLLM process: the setting is switched live)")
    ap.add_argument("--step-max", type=int, default=None,
                    help="kvcached's step_load_max_blocks (0: every hit loads a step later)")
    ap.add_argument("--family", choices=["llama", "gemma3", "qwen3_next"], default="llama",
                    help="the model family: with gemma3 (sliding-window layers) or qwen3_next "
                         "(gated delta-net layers), both under vLLM's hybrid KV cache manager, "
                         "only the per-hit and storage-hit phases run")
    ap.add_argument("--fork-server", metavar="SOCKET",
                    help="tests: each mode's process forked by this fork server "
                         "(tests/vllm_forkserver.py: vLLM imported once) instead of started")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        Path(spec["result"]).write_text(json.dumps(child(spec)))
        return
    if args.storage_secret and not args.storage_only:
        ap.error("--storage-secret goes with --storage-only")
    global FORK_SERVER
    FORK_SERVER = args.fork_server
    p = {**(QUICK if args.quick else FULL), "family": args.family}
    if args.small:
        p["hidden"] = 512
    if args.hit_len:
        p["hit_len"] = args.hit_len
    if args.hit_rounds:
        p["hit_rounds"] = args.hit_rounds
    global STEP_MAX
    STEP_MAX = args.step_max
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-vllm-") as tmp:
        work = Path(tmp)
        model = make_model(str(work / "model"), p["layers"], p["hidden"], args.family)
        cpu_blocks = 4096 if not args.quick else 512
        store = work / "store"
        if args.busy_only:
            res = run_mode("busy", model, {**p, "kv_mb": p["busy_kv_mb"]},
                           kvcached_connector(work / "run4", work / "store4", cpu_blocks),
                           ["busy"], max_num_seqs=p["busy"])
            print(json.dumps({"bench": "vllm_busy", "scheduler_step_us":
                              res["busy"]["scheduler_step_us"],
                              "running_requests": res["busy"]["requests"]}), flush=True)
            return
        if args.crossing:
            res = run_mode("crossing", model, {**p, "one_process": True, "cross_lens": [
                1000, 2000, 4000, 8000] if not args.quick else [200, 500], "max_model_len": 8192,
                "cross_rounds": 3 if not args.quick else 1, "cross_decoders": 8,
                "kv_mb": p["busy_kv_mb"]}, kvcached_connector(work / "run5", work / "store5",
                                                              cpu_blocks),
                ["crossing"], max_num_seqs=16)
            print(json.dumps({"bench": "vllm_crossing",
                              "model": f"random Llama {p['layers']}x{p['hidden']}",
                              **res["crossing"], "load_avg_1m_after": res["load_avg_1m_after"]}),
                  flush=True)
            return
        if args.hit_only:
            kv = run_mode("kvcached", model, p, kvcached_connector(work / "run1", store,
                                                                   cpu_blocks), ["per_hit"])
            pairs = hit_pairs(kv)
            full = p["hit_len"] - 1 - (p["hit_len"] - 1) % BS
            print(json.dumps({
                "bench": "vllm_hit", "model": f"random Llama {p['layers']}x{p['hidden']}",
                "hit_len": p["hit_len"], "step_load_max_blocks": STEP_MAX,
                "cpu_hit_vs_own_hit": statistics.median(pairs),
                "cpu_hit_vs_own_hit_spread": {"pairs": len(pairs), "min": min(pairs),
                                              "max": max(pairs)},
                "per_hit_ttft_s": {"vllm_own_hit": statistics.median(kv["per_hit"]["own"]),
                                   "kvcached_cpu": statistics.median(kv["per_hit"]["conn"])},
                "cpu_hit_blocks_served": min(kv["per_hit"]["conn_cached"]) / full,
                "load_avg_1m_after": kv["load_avg_1m_after"]}), flush=True)
            return
        if args.family != "llama":
            print(json.dumps(family_hits(args.family, model, p, work, cpu_blocks,
                                         bool(args.quick))), flush=True)
            return
        if args.storage_only:
            print(json.dumps(storage_modes(model, p, work, cpu_blocks, args.storage_secret,
                                           bool(args.quick))),
                  flush=True)
            return
        if args.no_reuse_only:
            print(json.dumps({"bench": "vllm_no_reuse", **no_reuse_modes(
                model, p, work, cpu_blocks, twice=not args.quick)}), flush=True)
            return
        hit_chat = ["per_hit", "chat"]
        kv_phases = hit_chat if args.hit_chat_only else ["no_reuse"] + hit_chat
        modes = {
            "plain": run_mode("plain", model, p, None, kv_phases),
            # --quick (a smoke run): the busy phase in this process, no example
            "kvcached": run_mode("kvcached", model, p,
                                 kvcached_connector(work / "run1", store, cpu_blocks),
                                 kv_phases + ["busy"] * (args.quick and not args.hit_chat_only)),
        }
        if args.lmcache_python:
            with LMCacheServer(args.lmcache_python, work) as lmc:
                modes["lmcache"] = run_mode("lmcache", model, p, lmc.connector(), hit_chat,
                                            env=lmc.env())
        if not args.hit_chat_only:
            modes["restart"] = run_mode("restart", model, p,
                                        kvcached_connector(work / "run2", store, cpu_blocks),
                                        ["restart_hit"])
        if not args.quick:
            modes["example"] = run_mode("example", model, p, example_connector(work / "example"),
                                        hit_chat)
        if not args.quick and not args.hit_chat_only:
            modes["busy"] = run_mode("busy", model, {**p, "kv_mb": p["busy_kv_mb"]},
                                     kvcached_connector(work / "run4", work / "store4",
                                                        cpu_blocks),
                                     ["busy"], max_num_seqs=p["busy"])
            # A second process of each, in turn: one vLLM process runs up to
            # ~1.5x faster than another of the same configuration here.
            modes["plain2"] = run_mode("plain2", model, p, None, ["no_reuse"])
            modes["kvcached2"] = run_mode("kvcached2", model, p, kvcached_connector(
                work / "run3", work / "store3", cpu_blocks), ["no_reuse"])
    out = {"bench": "vllm", "quick": bool(args.quick), "hit_chat_only": args.hit_chat_only,
           "model": f"random Llama {p['layers']}x{p['hidden']}", **summary(modes, p),
           "load_avg_1m_after": {m: r["load_avg_1m_after"] for m, r in modes.items()}}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
