#!/usr/bin/env python
"""kvcached in a fleet: N = 2 vLLM instances (its CPU build) behind round-robin
routing, serving multi-turn chats whose turns land on either instance.

Both instances are alive at once, each its own OS process running vLLM in
that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), forked from a server
that imported vLLM once and driven by this script over a pipe each (a
command, a reply). Each runs on a core of its own with one thread, as if
each had a machine of its own (its transfer worker shares that core). The
model is a random-weight Llama made here (float32: in bfloat16 a random
model's near-tie logits flip a greedy token when the batch shape changes);
nothing is downloaded.

The workload is ``scripts/bench_vllm.py``'s chat: conversations (one of two
shared system prompts, a document, user turns, the model's own answers
appended), every turn extending the previous one, turns of different
conversations interleaved (rounds: every conversation sends its next turn,
in a shuffled order), vLLM's KV space a fraction of the working set. Turn
``t`` of conversation ``u`` goes to instance ``(u + t) % N``: consecutive
turns of a conversation land on different instances. Prompts are served
one at a time (TTFT: from submission to the first token; ``bench_vllm``
sends two at a time to its one instance). Between rounds
every instance finishes its saves (a user reads the answer before typing
the next turn; ``--no-settle`` sends the next round at once).

Modes: ``none`` (no connector), ``cpu`` (kvcached, CPU tier only: each
instance keeps what it computed), ``file`` and ``redis`` (kvcached, both
instances on one storage: a directory, a Redis server started here on
127.0.0.1; skipped when redis-server is not installed), and the reference
``single`` (one instance with a CPU tier that holds everything, serving
every turn). Per mode: prefill tokens computed (prompt tokens minus vLLM's
``num_cached_tokens``), the least the workload allows (each turn's tokens
past the previous turn's full blocks), TTFT mean/p50/p99. Target: with
shared storage, prefill computed within 10% of ``single``'s. Every mode must
give the same greedy outputs (exit status 1 otherwise).

    python scripts/bench_fleet.py [--quick] [--no-settle] [--modes none,cpu,...]

Progress on stderr; the last line on stdout is JSON ``{"bench": "fleet", ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import ROOT, load_script, log, percentile, rounded, short_tmp_dir  # noqa: E402

bv = load_script("bench_vllm")  # the model, the tokens, the timed Server
BS = bv.BS
N = 2  # instances behind the router
CPU_BLOCKS = 2048  # per instance: holds every conversation (one block: 32 tokens)
# 4 layers x 512 (head size 64, GQA 4:1): five modes of 40 turns take about
# five minutes here, and a first turn's prefill (1,280 tokens, ~1 s on one
# core) still dominates a hit. The workload is bench_vllm's chat.
FULL = dict(layers=4, hidden=512, users=8, turns=5, system=256, first_len=1024, turn_len=256,
            answer=32, kv_mb=20, max_model_len=4096)  # KV space ~5,100 tokens: a quarter
                                                      # of the working set
QUICK = dict(layers=2, hidden=128, users=4, turns=3, system=64, first_len=320, turn_len=64,
             answer=8, kv_mb=2, max_model_len=1024)  # KV space 2,048 tokens
MODES = ("none", "cpu", "file", "redis", "single")


# ------------------------------------------------------------------ workload
def route(user: int, turn: int, n: int) -> int:
    """The instance serving ``turn`` of conversation ``user``: round-robin over
    turns, so that consecutive turns of a conversation land on different
    instances and every round splits evenly when ``n`` divides the users."""
    return (user + turn) % n


def round_order(users: int, turns: int, seed: int = 7) -> list[list[int]]:
    """Per round (turn), the order in which the conversations send it."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        out.append(order)
    return out


def reusable_tokens(prompt_len: int, prev_kv: int, turn: int, system_seen: bool,
                    system: int) -> int:
    """The prompt tokens a cache holding everything serves: the full blocks the
    previous turn computed (prompt and answer; one prompt token is always
    computed), or on a first turn a system prompt served before."""
    if turn == 0:
        return system // BS * BS if system_seen else 0
    return min(prev_kv // BS, (prompt_len - 1) // BS) * BS


# --------------------------------------------------------------------- child
class Instance(bv.Server):
    """One vLLM engine in this process (``bench_vllm.Server``'s timed serve),
    its KV space and max_model_len sized for the fleet's prompts."""

    def __init__(self, spec: dict):
        from vllm import LLM
        kw = {"kv_transfer_config": spec["connector"]} if spec["connector"] else {}
        self.llm = LLM(model=spec["model"], skip_tokenizer_init=True, block_size=BS,
                       enforce_eager=True, dtype="float32", max_model_len=spec["max_model_len"],
                       kv_cache_memory_bytes=spec["kv_mb"] << 20, disable_log_stats=True,
                       max_num_seqs=4, **kw)
        self.n = 0
        core = self.llm.llm_engine.engine_core.engine_core  # vLLM's engine core, in process
        self.sched = core.scheduler
        conn = getattr(self.sched, "connector", None)
        self.kv = getattr(getattr(conn, "scheduler", None), "mgr", None)  # kvcached's manager
        self.half = getattr(conn, "scheduler", None)

    def idle(self) -> None:
        """Step while finished requests wait for their saves: an engine core in
        this process steps only when asked, and a save that lands is written
        through to storage from its step."""
        if self.sched.has_requests():
            self.llm.llm_engine.step()

    def busy(self) -> bool:
        """Whether a save or a storage write of this instance is still in flight."""
        if self.sched.has_requests():
            return True
        if self.half is None:
            return False
        with self.kv._lock:
            self.kv.planner.reap()
            return bool(self.half.saves or self.half.saving or self.kv.planner.pending)

    def settle(self, deadline_s: float = 120.0) -> float:
        t0 = time.monotonic()
        while self.busy():
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"saves still in flight after {deadline_s}s")
            self.idle()
            time.sleep(0.005)
        return time.monotonic() - t0

    def kv_stats(self) -> dict:
        if self.kv is None:
            return {}
        st = self.kv.stats()
        return {"hit_tokens": st.hit_tokens, "storage": st.storage}


def child(conn, spec: dict, core: int | None) -> None:
    """An instance: serve the parent's commands (one reply each) until told to exit."""
    os.dup2(2, 1)  # vLLM prints at times: stdout stays the parent's JSON line
    if core is not None:
        # One core (and one thread) per instance, as if each had a machine of
        # its own; the transfer worker it starts shares that core. Two vLLM
        # processes with thread pools across both cores stall each other, and
        # stall on any other job: a step of the tiny model went from 3 ms to
        # 120 ms here.
        os.sched_setaffinity(0, {core})
    t0 = time.perf_counter()
    srv = Instance(spec)
    conn.send({"ready": True, "startup_s": time.perf_counter() - t0})
    while True:
        while not conn.poll(0.01):
            srv.idle()
        cmd = conn.recv()
        if cmd["op"] == "serve":
            out = srv.serve([cmd["prompt"]], cmd["max_tokens"])[0]
        elif cmd["op"] == "settle":
            out = {"settle_s": srv.settle()}
        elif cmd["op"] == "stats":
            out = srv.kv_stats()
        elif cmd["op"] == "exit":
            srv.settle()
            # A forked child skips atexit: vLLM's engine and the connector
            # (kvcached's manager, its transfer worker) are shut down here.
            srv.llm.llm_engine.engine_core.shutdown()
            conn.close()
            return
        else:
            raise ValueError(f"unknown command {cmd!r}")
        conn.send(out)


# -------------------------------------------------------------------- parent
_forkserver = None


def forkserver():
    """Instances are forked from a server that imported vLLM once: importing
    it takes ~15 s of CPU here, the rest of an instance's start-up a few."""
    global _forkserver
    if _forkserver is None:
        # Read when vLLM (its logger) and torch (its OpenMP runtime) load,
        # in the fork server.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the instance
        if len(os.sched_getaffinity(0)) >= N:
            os.environ["OMP_NUM_THREADS"] = "1"
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(["vllm", "vllm.entrypoints.llm",
                                            "kvcached.integrations.vllm.connector"])
    return _forkserver


class Child:
    """A vLLM instance in a child process (see ``child``), over a pipe."""

    def __init__(self, name: str, spec: dict, core: int | None):
        self.name = name
        ctx = forkserver()
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child, args=(theirs, spec, core), name=name)
        self.proc.start()
        theirs.close()  # a dead child is then EOF here

    def read(self) -> dict:
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise SystemExit(f"instance {self.name} died (exit code {self.proc.exitcode}); "
                             "its log is above") from None

    def call(self, **cmd) -> dict:
        self.conn.send(cmd)
        return self.read()


def close_all(insts: list[Child]) -> None:
    """Every instance finishes its saves and exits (side by side)."""
    for inst in insts:
        try:
            inst.conn.send({"op": "exit"})
        except OSError:
            pass
    for inst in insts:
        inst.proc.join(120)
        if inst.proc.exitcode is None:
            inst.proc.kill()
            inst.proc.join()
        inst.conn.close()


def chat(insts: list[Child], p: dict, settle: bool) -> dict:
    """``bench_vllm``'s chat over the fleet: rounds of every conversation's next
    turn (shuffled), each routed by ``route``, served one at a time."""
    systems = [bv.tokens(900 + i, p["system"]) for i in range(2)]
    convs = [systems[u % 2] + bv.tokens(1000 + u, p["first_len"]) for u in range(p["users"])]
    prev_kv = [0] * p["users"]  # tokens whose KV the previous turn computed
    seen = set()  # system prompts served already (by any instance)
    reqs = []
    settle_s = 0.0
    t0 = time.perf_counter()
    for turn, order in enumerate(round_order(p["users"], p["turns"])):
        for u in order:
            i = route(u, turn, len(insts))
            r = insts[i].call(op="serve", prompt=convs[u], max_tokens=p["answer"])
            n = len(convs[u])
            reqs.append({"user": u, "turn": turn, "instance": i, "prompt": n,
                         "reusable": reusable_tokens(n, prev_kv[u], turn, u % 2 in seen,
                                                     p["system"]), **r})
            seen.add(u % 2)
            prev_kv[u] = n + len(r["output"]) - 1
            convs[u] = convs[u] + r["output"] + bv.tokens(2000 + 100 * u + turn, p["turn_len"])
        if settle:  # the users read the answers: every save lands first
            settle_s += max(inst.call(op="settle")["settle_s"] for inst in insts)
        done = reqs[-len(order):]
        log(f"  turn {turn}: {sum(r['prompt'] - r['cached'] for r in done)} of "
            f"{sum(r['prompt'] for r in done)} prompt tokens computed")
    wall = time.perf_counter() - t0 - settle_s
    ttft = [r["ttft"] for r in reqs]
    prompt = sum(r["prompt"] for r in reqs)
    return {"requests": len(reqs), "prompt_tokens": prompt,
            "computed_tokens": sum(r["prompt"] - r["cached"] for r in reqs),
            "least_computed_tokens": sum(r["prompt"] - r["reusable"] for r in reqs),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99), "serve_wall_s": wall,
            "requests_per_instance": [sum(r["instance"] == i for r in reqs)
                                      for i in range(len(insts))],
            "outputs": [[r["user"], r["turn"], r["output"]] for r in reqs]}


def connector(run_dir: Path, backend: str = "", url: str = "") -> dict:
    """kvcached's connector with a CPU tier of ``CPU_BLOCKS`` and, given a
    backend, that storage."""
    extra = {"num_cpu_blocks": CPU_BLOCKS, "run_dir": str(run_dir)}
    if backend:
        extra.update(storage_backend=backend, storage_url=url)
    return {"kv_connector": "KvcachedConnector",
            "kv_connector_module_path": "kvcached.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_mode(name: str, model: str, p: dict, connectors: list[dict | None],
             settle: bool) -> dict:
    t = time.monotonic()
    spec = {"model": model, "kv_mb": p["kv_mb"], "max_model_len": p["max_model_len"]}
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= len(connectors)
    insts = [Child(f"{name}[{i}]", {**spec, "connector": c}, cores[i] if pin else None)
             for i, c in enumerate(connectors)]
    try:
        startup = [inst.read()["startup_s"] for inst in insts]  # they start side by side
        log(f"{name}: {len(insts)} instance(s) up in {time.monotonic() - t:.0f}s")
        out = chat(insts, p, settle)
        out["kvcached"] = [inst.call(op="stats") for inst in insts]
        out["startup_s"] = startup
    finally:
        close_all(insts)
    log(f"{name}: done in {time.monotonic() - t:.0f}s: {out['computed_tokens']} of "
        f"{out['prompt_tokens']} prompt tokens computed, TTFT mean {out['ttft_mean_s']:.3f}s")
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)  # other work on the machine
    return out


def redis_server(work: Path):
    """A Redis server on 127.0.0.1 (the storage tests' helper), or the reason
    there is none."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import redis  # noqa: F401
        from conftest_storage import NO_REDIS_REASON, REDIS_SERVER, RedisServer
    except ImportError as e:
        return None, f"cannot start Redis here ({e})"
    if REDIS_SERVER is None:
        return None, NO_REDIS_REASON
    (work / "redis").mkdir()
    try:
        return RedisServer(work / "redis").start(), None
    except (RuntimeError, TimeoutError) as e:
        return None, str(e)


def summary(modes: dict, skipped: dict) -> dict:
    outputs = [r["outputs"] for r in modes.values()]
    out = {"modes": {m: {k: v for k, v in r.items() if k != "outputs"}
                     for m, r in modes.items()},
           "skipped": skipped,
           "identical_outputs": all(o == outputs[0] for o in outputs)}
    targets = {"identical_outputs": out["identical_outputs"]}
    single, none = modes.get("single"), modes.get("none")
    for m, r in modes.items():
        if single and m != "single":
            ratio = r["computed_tokens"] / single["computed_tokens"]
            out.setdefault("computed_vs_single", {})[m] = ratio
            if m in ("file", "redis"):
                targets[f"computed_vs_single_{m}_le_1.10"] = ratio <= 1.10
        if none and m != "none":
            out.setdefault("ttft_mean_vs_none", {})[m] = r["ttft_mean_s"] / none["ttft_mean_s"]
    out["targets"] = targets
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, few turns (smoke)")
    ap.add_argument("--no-settle", action="store_true",
                    help="send the next round while the last one's saves are in flight")
    ap.add_argument("--modes", default=",".join(MODES), help="a comma-separated subset")
    args = ap.parse_args()
    p = QUICK if args.quick else FULL
    wanted = [m for m in args.modes.split(",") if m]
    bad = set(wanted) - set(MODES)
    if bad:
        ap.error(f"unknown modes {sorted(bad)}; choose from {MODES}")
    modes, skipped = {}, {}
    with short_tmp_dir("kvcached-fleet-") as work:
        model = bv.make_model(str(work / "model"), p["layers"], p["hidden"])
        settle = not args.no_settle
        for m in wanted:
            log(f"mode {m}")
            srv = None
            if m == "none":
                conns = [None] * N
            elif m == "single":
                conns = [connector(work / "run-single")]
            elif m == "cpu":
                conns = [connector(work / f"run-cpu{i}") for i in range(N)]
            elif m == "file":
                conns = [connector(work / f"run-file{i}", "file", str(work / "store"))
                         for i in range(N)]
            else:  # redis
                srv, why = redis_server(work)
                if srv is None:
                    log(f"redis: skipped: {why}")
                    skipped[m] = why
                    continue
                conns = [connector(work / f"run-redis{i}", "redis", srv.url) for i in range(N)]
            try:
                modes[m] = run_mode(m, model, p, conns, settle)
            finally:
                if srv is not None:
                    srv.stop()
    out = {"bench": "fleet", "quick": bool(args.quick), "instances": N, "settle": settle,
           "model": f"random Llama {p['layers']}x{p['hidden']}",
           "workload": {k: p[k] for k in ("users", "turns", "system", "first_len", "turn_len",
                                          "answer", "kv_mb")},
           **summary(modes, skipped)}
    print(json.dumps(rounded(out, 4)), flush=True)
    if not out["identical_outputs"]:
        log("FAILED: the modes gave different greedy outputs")
        sys.exit(1)


if __name__ == "__main__":
    main()
