"""A vLLM run for the connector tests: runs the steps of a JSON spec in one
vLLM process and writes what each step saw, as JSON, to RESULT.

    python tests/vllm_app.py '{"model": DIR, "extra": {...} | null, "steps": [...]}' RESULT

vLLM's engine core runs in this one process (with ``"tp": 2``, one worker
process per rank); the tests fork it from ``tests/vllm_forkserver.py``.

Steps: ``["generate", name]`` (greedy outputs and ``num_cached_tokens`` of the
prompt set ``name``; ``["generate", name, salt]``: every prompt with that
``cache_salt``), ``["reset"]`` (vLLM's prefix cache), ``["kill_worker"]``
(SIGKILL rank 0's transfer worker; ``restarts`` reports it came back), ``["stop_worker"]``
(SIGSTOP it: frozen, it is declared lost and replaced),
``["ctl", op]`` (``kvcached ctl op``), ``["status"]``, ``["corrupt", dir, n]`` (every
n-th stored object damaged), ``["signal", pid, name]`` (e.g. freeze a storage
server), ``["preemptions"]`` (vLLM's counter; needs ``log_stats``), ``["metrics", prefix, ...]``
(vLLM's metrics of those names; needs ``log_stats``), ``["events", {medium: n}]`` (vLLM's KV
events once n blocks were stored in each medium; needs ``kv_events``, a socket path),
``["abort_after", name, n]``
(the set's requests aborted after n engine steps), ``["loads"]`` (requests loaded
inside their step and asynchronously, so far), ``["touch", path]`` /
``["wait_file", path]`` (two instances in step), ``["wait_stored", n]`` (n blocks
written to storage), ``["wait_rejected", reason, n]`` (n stored objects refused
by the workers, e.g. ``bad_mac``; its status). Prompt sets are token ids made from the spec's ``prompts``:
``{name: [[seed, length], ...]}``. vLLM spawns processes: hence the main guard.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


def make_model(path: str, layers: int = 2, hidden: int = 128, family: str = "llama") -> str:
    """A small model with random weights (nothing downloaded); reused if present.
    ``family``: ``llama`` (full attention), ``gemma3`` (sliding-window layers
    of 64 tokens and a full-attention one, vLLM's hybrid KV cache manager),
    ``deepseek_v2`` (MLA: one 576-wide latent per token and layer),
    ``qwen3_next`` (gated delta-net layers and a full-attention one every
    fourth layer: Mamba-like states; vLLM's CPU kernel for them is bfloat16)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers as tf
    torch.manual_seed(0)
    common = {"vocab_size": 1024, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "max_position_embeddings": 8192}
    if family == "llama":
        cfg = tf.LlamaConfig(**common, num_attention_heads=max(1, hidden // 64),
                             num_key_value_heads=max(1, hidden // 128))
        model = tf.LlamaForCausalLM(cfg)
    elif family == "gemma3":
        # untied output embeddings and a wider init: a random Gemma 3 otherwise
        # repeats one token, and the tests compare outputs token by token
        cfg = tf.Gemma3TextConfig(**common, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=64, sliding_window=64, initializer_range=0.2,
                                  tie_word_embeddings=False,
                                  layer_types=["sliding_attention"] * (layers - 1)
                                  + ["full_attention"])
        model = tf.Gemma3ForCausalLM(cfg)
    elif family == "deepseek_v2":
        cfg = tf.DeepseekV2Config(**common, moe_intermediate_size=hidden // 2,
                                  num_attention_heads=2, num_key_value_heads=2,
                                  kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                  qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=1, topk_group=1, n_group=1,
                                  initializer_range=0.2)
        model = tf.DeepseekV2ForCausalLM(cfg)
    elif family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**common, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=64, linear_num_value_heads=2, linear_num_key_heads=1,
                                 linear_key_head_dim=128, linear_value_head_dim=128,
                                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=hidden // 2,
                                 shared_expert_intermediate_size=hidden // 2,
                                 full_attention_interval=4, initializer_range=0.2,
                                 tie_word_embeddings=False)
        model = tf.Qwen3NextForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model family {family!r}")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


def prompts(spec: list[list[int]]) -> list[list[int]]:
    """``[seed, length]``: random tokens; ``[seed, length, head_seed, head_len]``:
    a head shared by every prompt with that head seed, then the prompt's own."""
    out = []
    for seed, length, *head in spec:
        shared = tokens(head[0], head[1]) if head else []
        out.append(shared + tokens(seed, length - len(shared)))
    return out


def corrupt(store: str, every: int) -> int:
    """Flip the last byte of every ``every``-th stored object (sorted by path);
    returns how many."""
    files = sorted(p for p in Path(store).rglob("*") if p.is_file())
    for path in files[::every]:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    return len(files[::every])


def metric(llm, name: str) -> float:
    """A counter of vLLM's own metrics (``LLM.get_metrics``), summed over labels."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def metrics(llm, prefixes: list[str]) -> dict:
    """vLLM's metrics whose names start with one of ``prefixes``:
    ``{name{label=value,...}: value}`` (histograms: their count)."""
    out = {}
    for m in llm.get_metrics():
        if any(m.name.startswith(p) for p in prefixes):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                              if k not in ("engine", "model_name"))
            out[f"{m.name}{{{labels}}}"] = getattr(m, "value", getattr(m, "count", None))
    return out


class KVEvents:
    """vLLM's KV events, read back from its publisher's replay socket (every
    batch since start-up: a subscriber could miss those sent before it joined)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint  # the replay endpoint
        self.events: list = []

    def replay(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(self.endpoint)
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            events = []
            while True:
                assert sock.poll(30_000), "vLLM's KV event replay did not answer"
                _, _, seq, payload = sock.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    break
                events += dec.decode(payload).events
            self.events = events
        finally:
            sock.close(linger=0)

    def hashes(self, kind: str, medium: str) -> set:
        return {h for e in self.events if type(e).__name__ == kind and e.medium == medium
                for h in e.block_hashes}  # AllBlocksCleared (a reset) has neither

    def summary(self, want: dict[str, int], idle, deadline_s: float = 60.0) -> dict:
        """Once at least ``want[medium]`` blocks were stored in each medium:
        blocks stored and removed per medium, and whether every block kvcached
        stored in its CPU tier is one vLLM stored first (named by vLLM's hash)."""
        end = time.monotonic() + deadline_s
        while True:
            self.replay()
            got = {m: len(self.hashes("BlockStored", m)) for m in want}
            if all(got[m] >= n for m, n in want.items()):
                break
            assert time.monotonic() < end, f"KV events: {got} blocks stored, wanted {want}"
            idle()
        media = {e.medium for e in self.events if hasattr(e, "medium")}
        return {"stored": {m: len(self.hashes("BlockStored", m)) for m in media},
                "removed": {m: len(self.hashes("BlockRemoved", m)) for m in media},
                "cpu_named_by_vllm": self.hashes("BlockStored", "CPU")
                <= self.hashes("BlockStored", "GPU")}


def status(run_dir: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "kvcached", "status", "--run-dir", run_dir,
                          "--json"], capture_output=True, text=True, timeout=60)
    return json.loads(res.stdout)


def worker(run_dir: str, rank: int = 0) -> dict:
    return next(w for w in status(run_dir)["workers"] if w["rank"] == rank)


def wait_worker_back(run_dir: str, old_pid: int, deadline_s: float = 60.0) -> int:
    """The pid of rank 0's worker once a new one runs (or raises)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        w = worker(run_dir)
        if w["state"] == "ready" and w["pid"] != old_pid:
            return int(w["pid"])
        time.sleep(0.2)
    raise TimeoutError(f"rank 0's transfer worker (pid {old_pid}, killed) did not come back "
                       f"within {deadline_s}s")


def idle(llm, spec: dict) -> None:
    """Let vLLM run while the app waits: its engine core, in this process,
    steps only when asked (finished requests wait there for their saves)."""
    llm.llm_engine.step()
    time.sleep(0.01)


def wait_stored(run_dir: str, blocks: int, idle, deadline_s: float = 120.0) -> int:
    """Wait until this instance wrote at least ``blocks`` blocks to storage;
    returns how many it wrote."""
    end = time.monotonic() + deadline_s
    while True:
        stored = status(run_dir)["stats"]["storage"].get("stored", 0)
        if stored >= blocks:
            return stored
        assert time.monotonic() < end, f"{stored} of {blocks} blocks stored"
        idle()


def storage_health(st: dict) -> list[dict]:
    """Each rank's storage health, as its worker's last heartbeat told it."""
    return [w["storage"] for w in st.get("workers", []) if w.get("storage")]


def wait_rejected(run_dir: str, reason: str, n: int, idle, deadline_s: float = 60.0) -> dict:
    """Wait until the workers refused at least ``n`` stored objects for
    ``reason`` (their heartbeats say so); returns that status."""
    end = time.monotonic() + deadline_s
    while True:
        st = status(run_dir)
        got = sum(h.get("rejected", {}).get(reason, 0) for h in storage_health(st))
        if got >= n:
            return st
        assert time.monotonic() < end, f"{got} of {n} objects rejected ({reason})"
        idle()


def abort_after(llm, prompt_set: list[list[int]], sp, steps: int) -> dict:
    """Submit the prompts, run ``steps`` engine steps (their loads start), abort
    every request, then step until vLLM has none left."""
    from vllm.inputs import TokensPrompt
    eng = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(prompt_set))]
    for rid, p in zip(ids, prompt_set, strict=True):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
    for _ in range(steps):
        eng.step()
    eng.abort_request(ids)
    deadline = time.monotonic() + 120
    n = 0
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "aborted requests never left vLLM"
        eng.step()
        n += 1
    return {"aborted": len(ids), "steps_after": n}


def main(spec: dict) -> dict:
    # vLLM's engine core in this process: the same connector calls, without
    # another Python process to spawn (vLLM's CPU build spawns, importing vLLM
    # again: ~10 s here)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = {}
    if spec.get("extra") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": spec.get("connector", "KvcachedConnector"),
            "kv_connector_module_path": spec.get("module", "kvcached.integrations.vllm"),
            "kv_role": spec.get("role", "kv_both"), "kv_connector_extra_config": spec["extra"],
            "kv_load_failure_policy": spec.get("load_failure_policy", "recompute")}
    # vLLM's scheduling: a small token budget chunks every prompt; few blocks
    # make it queue and preempt
    sched = {k: spec[k] for k in ("max_num_batched_tokens", "num_gpu_blocks_override")
             if k in spec}
    if "max_num_batched_tokens" in spec:
        sched["enable_chunked_prefill"] = True
    if "mamba_cache_mode" in spec:  # a Mamba hybrid's states kept at chunk ends
        kw["mamba_cache_mode"] = spec["mamba_cache_mode"]
    events = None
    if spec.get("kv_events"):  # vLLM publishes its KV events (and kvcached's) here
        replay = f"ipc://{spec['kv_events']}-replay"
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"ipc://{spec['kv_events']}",
                                  "replay_endpoint": replay}
        events = KVEvents(replay)
    t0 = time.monotonic()
    # float32: a random-weight model's logits come near ties, and in bfloat16
    # a different batch shape (a request deferred a step for its lookup) flips
    # a greedy token now and then; the tests compare tokens across runs
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, block_size=32, enforce_eager=True,
              max_model_len=spec.get("max_model_len", 4096), dtype=spec.get("dtype", "float32"),
              kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20),
              tensor_parallel_size=spec.get("tp", 1),
              disable_log_stats=not spec.get("log_stats", False),
              max_num_seqs=spec.get("max_num_seqs", 16), **sched, **kw)
    out: dict = {"startup_s": time.monotonic() - t0, "steps": []}
    sets = {name: prompts(p) for name, p in spec["prompts"].items()}
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 8))
    run_dir = (spec.get("extra") or {}).get("run_dir")
    for step in spec["steps"]:
        if step[0] == "generate":
            t = time.monotonic()
            salt = {"cache_salt": step[2]} if len(step) > 2 and step[2] else {}
            res = llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in sets[step[1]]],
                               sp, use_tqdm=False)
            out["steps"].append({"step": step, "seconds": time.monotonic() - t,
                                 "outputs": [list(r.outputs[0].token_ids) for r in res],
                                 "cached": [r.num_cached_tokens for r in res]})
        elif step[0] == "reset":
            # vLLM refuses while a finished request still holds blocks: with
            # kvcached, until its saves are done (finished_sending)
            deadline = time.monotonic() + 60
            while not llm.reset_prefix_cache():
                assert time.monotonic() < deadline, "vLLM's prefix cache never became free"
                idle(llm, spec)
            out["steps"].append({"step": step})
        elif step[0] in ("kill_worker", "stop_worker"):
            pid = int(worker(run_dir)["pid"])
            os.kill(pid, signal.SIGKILL if step[0] == "kill_worker" else signal.SIGSTOP)
            out["steps"].append({"step": step, "killed": pid})
        elif step[0] == "wait_worker":
            killed = next(s["killed"] for s in reversed(out["steps"]) if "killed" in s)
            out["steps"].append({"step": step, "pid": wait_worker_back(run_dir, killed)})
        elif step[0] == "ctl":  # kvcached ctl OP against this vLLM
            res = subprocess.run([sys.executable, "-m", "kvcached", "ctl", step[1], "--run-dir",
                                  run_dir], capture_output=True, text=True, timeout=120)
            out["steps"].append({"step": step, "rc": res.returncode,
                                 "output": res.stdout + res.stderr})
        elif step[0] == "corrupt":  # ["corrupt", store dir, every n-th object]
            out["steps"].append({"step": step, "corrupted": corrupt(step[1], step[2])})
        elif step[0] == "signal":  # ["signal", pid, "SIGSTOP" | "SIGCONT" | "SIGKILL"]
            os.kill(int(step[1]), getattr(signal, step[2]))
            out["steps"].append({"step": step})
        elif step[0] == "abort_after":  # ["abort_after", name, steps]: abort mid-flight
            out["steps"].append({"step": step, **abort_after(llm, sets[step[1]], sp, step[2])})
        elif step[0] == "touch":  # ["touch", path]: tell another instance
            Path(step[1]).touch()
            out["steps"].append({"step": step})
        elif step[0] == "wait_file":  # ["wait_file", path]: wait for another instance
            deadline = time.monotonic() + 600
            while not Path(step[1]).exists():
                assert time.monotonic() < deadline, f"{step[1]} never appeared"
                idle(llm, spec)
            out["steps"].append({"step": step})
        elif step[0] == "wait_stored":  # ["wait_stored", n]: n blocks written to storage
            out["steps"].append({"step": step, "stored": wait_stored(
                run_dir, step[1], lambda: idle(llm, spec))})
        elif step[0] == "wait_rejected":  # ["wait_rejected", reason, n]: by the workers
            out["steps"].append({"step": step, "status": wait_rejected(
                run_dir, step[1], step[2], lambda: idle(llm, spec))})
        elif step[0] == "metrics":  # ["metrics", prefix, ...]: needs log_stats
            out["steps"].append({"step": step, "metrics": metrics(llm, step[1:])})
        elif step[0] == "events":  # ["events", {medium: blocks}]: needs kv_events
            out["steps"].append({"step": step, "events": events.summary(
                step[1], lambda: idle(llm, spec))})
        elif step[0] == "preemptions":
            out["steps"].append({"step": step,
                                 "preemptions": metric(llm, "vllm:num_preemptions")})
        elif step[0] == "status":
            out["steps"].append({"step": step, "status": status(run_dir)})
        elif step[0] == "loads":  # one process: requests loaded inside their step, or not
            half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
            out["steps"].append({"step": step, "loads": dict(half.loads)})
        elif step[0] == "kv_events_kept":  # one process: the scheduler half's event state
            half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
            out["steps"].append({"step": step, "kept": {
                "names": len(half.names), "take_events": len(half.take_events()),
                "events_on": half.events_on, "manager": len(half.mgr.take_kv_events())}})
        else:
            raise ValueError(f"unknown step {step!r}")
    return out


def run(spec_json: str, result_path: str) -> None:
    spec = json.loads(spec_json)
    make_model(spec["model"], *spec.get("model_shape", ()))
    result = main(spec)
    # A file, not stdout: vLLM's processes write to stdout at any moment.
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
