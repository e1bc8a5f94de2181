"""kvcached inside a real vLLM (its CPU build): the KV connector end to end.

Each test runs ``tests/vllm_app.py`` in its own process (a test process must
not hold vLLM) on a small random-weight Llama made at test time; vLLM runs
in that one process, except where a test needs more (a worker process per
rank: tensor parallelism; vLLM's OpenAI server).
One test starts vLLM's OpenAI server as a user would, with the README's
flag and workers started by ``kvcached launch``, and restarts it. Greedy outputs must match a run
without the connector token for token; vLLM's own ``num_cached_tokens``
shows what kvcached served.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_runs import (
    BLOCK,
    DEADLINE_S,
    SINGLE,
    fork_server,
    generated,
    run_app,
    run_script,
    served_share,
    vllm_env,
)

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")

PROMPTS = {"p": SINGLE, "s": [[11, 300]]}  # s: the tenants' (cache_salt) prompt
FULL_BLOCKS = sum((n - 1) // BLOCK for _, n in SINGLE)  # of the prompts: 69
SALTED_BLOCKS = (300 - 1) // BLOCK  # of the tenants' prompt
TIERS = ("CPU", "STORAGE")  # kvcached's media in vLLM's KV events


@pytest.fixture(scope="module")
def model(vllm_model) -> str:
    return vllm_model


@pytest.fixture(scope="module")
def baseline(vllm_plain) -> list[list[int]]:
    """Greedy outputs without a connector."""
    return vllm_plain["p"]["outputs"]


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-storage")


@pytest.fixture(scope="module")
def served(model, storage, tmp_path_factory) -> dict:
    """One vLLM with kvcached (CPU tier and file storage) through: a cold pass;
    a pass after vLLM's prefix cache is reset (the CPU tier serves); a pass with
    rank 0's transfer worker SIGKILLed just before; paused; asleep; and after
    each, resumed."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    steps = [["generate", "p"], ["reset"], ["generate", "p"], ["status"],
             ["metrics", "vllm:kvcached_", "vllm:prompt_tokens_cached_by_source"],
             ["loads"], ["reset"], ["kill_worker"], ["generate", "p"], ["wait_worker"],
             ["loads"], ["reset"], ["generate", "p"],
             ["ctl", "pause"], ["reset"], ["generate", "p"], ["ctl", "resume"],
             ["ctl", "sleep"], ["reset"], ["generate", "p"], ["ctl", "wakeup"],
             ["reset"], ["generate", "p"], ["status"],
             ["events", {"CPU": FULL_BLOCKS, "STORAGE": FULL_BLOCKS}],
             # tenants: one prompt under salt A, then salt B and no salt (each
             # after a reset: only kvcached's tiers could serve it), then A again
             ["generate", "s", "tenant-a"], ["reset"], ["generate", "s", "tenant-b"],
             ["reset"], ["generate", "s"], ["reset"], ["generate", "s", "tenant-a"],
             ["status"], ["events", {m: FULL_BLOCKS + 3 * SALTED_BLOCKS for m in TIERS}],
             # a frozen worker: its load inside the step runs past its deadline
             ["reset"], ["stop_worker"], ["generate", "p"], ["wait_worker"], ["loads"]]
    extra = {"num_cpu_blocks": 512, "run_dir": str(run_dir), "storage_backend": "file",
             "storage_url": str(storage), "step_load_timeout_s": 1.0}
    return run_app({"model": model, "extra": extra, "prompts": PROMPTS, "steps": steps,
                    "log_stats": True, "kv_events": str(run_dir.parent / "kv-events")})


def test_cpu_tier_serves_identical_outputs(served, baseline):
    cold, warm = generated(served)[:2]
    assert cold["outputs"] == baseline
    assert warm["outputs"] == baseline
    assert min(served_share(warm, PROMPTS["p"])) >= 0.9, warm["cached"]
    status = next(s["status"] for s in served["steps"] if s["step"] == ["status"])
    assert status["stats"]["hit_tokens"]["cpu"] == sum(warm["cached"])
    assert status["stats"]["tiers"]["cpu"]["used"] >= sum(warm["cached"]) // BLOCK


def test_cache_salt_keeps_tenants_apart(served):
    """Requests with another cache_salt, or none, get nothing from kvcached's CPU
    tier or storage (a hit would tell one tenant what another sent); the same
    salt hits. Outputs are the same whatever the salt (greedy, same tokens)."""
    runs = [s for s in generated(served) if s["step"][1] == "s"]
    a, b, none, a_again = runs
    assert a["cached"] == [0] and b["cached"] == [0] and none["cached"] == [0], \
        [r["cached"] for r in runs]
    assert served_share(a_again, PROMPTS["s"]) == [1.0], a_again["cached"]
    assert a["outputs"] == b["outputs"] == none["outputs"] == a_again["outputs"]
    status = [s["status"] for s in served["steps"] if s["step"] == ["status"]]
    before, after = status[-2]["stats"]["hit_tokens"], status[-1]["stats"]["hit_tokens"]
    # the one hit among the four is salt A's second run, from the CPU tier
    assert after["cpu"] - before["cpu"] == a_again["cached"][0], (before, after)
    assert after.get("storage", 0) == before.get("storage", 0)


def test_vllm_metrics_count_hits_by_source(served):
    """vLLM's own metrics see kvcached: its hit-source split (CPU tier = host)
    and kvcached's series (vllm:kvcached_*), after a cold and a warm pass."""
    warm = generated(served)[1]
    got = next(s["metrics"] for s in served["steps"] if s["step"][0] == "metrics")
    assert got["vllm:prompt_tokens_cached_by_source{source=host}"] == sum(warm["cached"]), got
    assert got["vllm:kvcached_hit_tokens{tier=cpu}"] == sum(warm["cached"]), got
    assert got.get("vllm:kvcached_hit_tokens{tier=storage}", 0) == 0, got
    assert got["vllm:kvcached_saved_blocks{}"] >= FULL_BLOCKS, got
    assert got["vllm:kvcached_load_seconds{}"] >= 1, got  # loads observed (count)


def test_vllm_kv_events_name_kvcached_tiers(served):
    """vLLM's KV events carry kvcached's CPU tier and storage (medium CPU,
    STORAGE), each block named by vLLM's own hash; tenants stay apart there
    too: the tenants' prompt under salts A, B and none is three sets of
    blocks in each tier, salt A's second run none more."""
    ev, after = [s["events"] for s in served["steps"] if s["step"][0] == "events"]
    assert ev["stored"]["CPU"] >= FULL_BLOCKS and ev["stored"]["STORAGE"] >= FULL_BLOCKS, ev
    assert ev["cpu_named_by_vllm"] and after["cpu_named_by_vllm"], (ev, after)
    for m in TIERS:
        assert after["stored"][m] - ev["stored"][m] == 3 * SALTED_BLOCKS, (ev, after)


def test_killed_worker_is_a_miss_then_comes_back(served, baseline):
    steps = served["steps"]
    killed = next(s["killed"] for s in steps if s["step"] == ["kill_worker"])
    back = next(s["pid"] for s in steps if s["step"] == ["wait_worker"])
    assert back != killed
    during, after = generated(served)[2:4]
    assert during["outputs"] == baseline  # lost loads were recomputed, not used
    assert after["outputs"] == baseline
    assert min(served_share(after, PROMPTS["p"])) >= 0.9, after["cached"]


def test_cpu_tier_hits_load_inside_their_step(served, baseline):
    """A CPU-tier hit is scheduled in the step vLLM asks about it (the connector
    answers (n, False): vLLM computes the rest of the prompt in that step's
    forward, which waits for each layer of the load); nothing is loaded a
    step later. A worker killed before such a load, or frozen during it
    (past ``step_load_timeout_s``), costs a recompute in the same pass: the
    outputs stay vLLM's own, and nothing hangs."""
    warm, killed, frozen = [s["loads"] for s in served["steps"] if s["step"] == ["loads"]]
    assert warm == {"step": 4}, warm  # the first warm pass: every prompt, none asynchronous
    assert killed.get("async", 0) == 0, killed
    assert frozen.get("async", 0) == 0, frozen
    stopped = generated(served)[-1]
    assert stopped["step"] == ["generate", "p"] and stopped["outputs"] == baseline
    assert frozen["step"] > killed["step"], (killed, frozen)


def test_ctl_pause_and_sleep_against_running_vllm(served, baseline):
    ctl = {s["step"][1]: s for s in served["steps"] if s["step"][0] == "ctl"}
    for op in ("pause", "resume", "sleep", "wakeup"):
        assert ctl[op]["rc"] == 0, ctl[op]["output"]
    paused, asleep, awake = generated(served)[4:7]
    assert paused["outputs"] == baseline and paused["cached"] == [0, 0, 0, 0]
    assert asleep["outputs"] == baseline and asleep["cached"] == [0, 0, 0, 0]
    assert awake["outputs"] == baseline
    assert min(served_share(awake, PROMPTS["p"])) >= 0.9, awake["cached"]


def test_load_failure_policy_fail_stops_vllm_with_the_fix(model, tmp_path):
    """kvcached never overwrites vLLM's setting: "fail" would fail a request on
    every miss that a load turns out to be, so vLLM stops and says what to set.
    (A bad kv_connector_extra_config stops it the same way, from the same
    constructor: tests/integrations/test_vllm_config.py checks those messages.)"""
    res = run_app({"model": model, "extra": {"num_cpu_blocks": 64,
                                             "run_dir": str(tmp_path / "run")},
                   "load_failure_policy": "fail", "prompts": PROMPTS,
                   "steps": [["generate", "p"]]}, check=False)
    assert res.returncode != 0
    assert ('kv_load_failure_policy = "recompute"' in res.stdout + res.stderr
            and "it is 'fail'" in res.stdout + res.stderr)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 binds one CPU per rank")
def test_tensor_parallel_two_ranks(tmp_path):
    """Two ranks, two transfer workers, every task barriered over both."""
    model = str(tmp_path / "llama-2kv")  # two KV heads: one per rank
    extra = {"num_cpu_blocks": 256, "run_dir": str(tmp_path / "run")}
    # the engine core in this process, one worker process per rank
    spec = {"model": model, "model_shape": [2, 256], "tp": 2, "extra": extra,
            "prompts": {"p": PROMPTS["p"][:2]},
            "steps": [["generate", "p"], ["reset"], ["generate", "p"], ["status"]]}
    # vLLM's CPU build binds each rank's threads to a NUMA node unless told the CPUs.
    res = run_app(spec, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    cold, warm = generated(res)
    assert warm["outputs"] == cold["outputs"]
    assert min(served_share(warm, spec["prompts"]["p"])) >= 0.9, warm["cached"]
    status = res["steps"][-1]["status"]
    assert sorted((w["rank"], w["state"]) for w in status["workers"]) == [(0, "ready"),
                                                                          (1, "ready")]
    # A task completes only once both ranks did it: loads (inside the step: each
    # rank waited for its own layers) and saves completed.
    transfers = status["stats"]["transfers"]
    assert transfers["swap_in_layers"]["done"] >= 1 and transfers["swap_out"]["done"] >= 1
    assert status["stats"]["hit_tokens"]["cpu"] == sum(warm["cached"])


def _cuda_vllm() -> bool:
    import torch
    from vllm.platforms import current_platform
    return torch.cuda.is_available() and current_platform.is_cuda()


@pytest.mark.skipif(not _cuda_vllm(), reason="needs a GPU and vLLM's CUDA build")
def test_cuda_ipc_path(model, tmp_path):
    """On a GPU the planes go to the transfer worker by CUDA IPC, copies ordered
    after each forward by the rank's KV event: the same contract as on CPU."""
    extra = {"num_cpu_blocks": 512, "run_dir": str(tmp_path / "run")}
    plain = run_app({"model": model, "extra": None, "prompts": PROMPTS,
                     "steps": [["generate", "p"]]})
    res = run_app({"model": model, "extra": extra, "prompts": PROMPTS,
                   "steps": [["generate", "p"], ["reset"], ["generate", "p"], ["status"]]})
    cold, warm = generated(res)
    assert cold["outputs"] == warm["outputs"] == generated(plain)[0]["outputs"]
    assert min(served_share(warm, PROMPTS["p"])) >= 0.9, warm["cached"]
    assert res["steps"][-1]["status"]["stats"]["hit_tokens"]["cpu"] == sum(warm["cached"])


class Served:
    """``python -m vllm.entrypoints.openai.api_server`` (the CPU wheel has no
    ``vllm`` command; forked by the session's fork server, which imported it,
    and run as ``python -m`` runs it: its engine core and worker are vLLM's
    own spawned processes) with the README's flag: its run dir named by kvcached
    and its transfer workers spawned (``run_dir`` None), or in ``run_dir``
    with the workers sidecars from ``kvcached launch`` (``spawn_workers =
    false``)."""

    def __init__(self, model: str, run_dir: Path | None, store: Path, log: Path):
        from conftest_storage import free_port
        self.model, self.port, self.run_dir = model, free_port(), run_dir
        extra = {"num_cpu_blocks": 256, "storage_backend": "file", "storage_url": str(store),
                 "worker_start_timeout_s": 300,
                 # a fresh server's first lookup on a loaded machine can pass
                 # the 0.1 s default, and the test asserts a storage hit
                 "storage_lookup_timeout_s": 10.0}
        if run_dir is not None:
            extra.update(run_dir=str(run_dir), spawn_workers=False)
        cfg = {"kv_connector": "KvcachedConnector",
               "kv_connector_module_path": "kvcached.integrations.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": extra}
        self.log = log
        # forked by the session's fork server, which imported vLLM (and this
        # module) once: as `python -m` would run it, in a session of its own
        self.proc = fork_server().start(
            "vllm.entrypoints.openai.api_server",
            ["--model", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--skip-tokenizer-init", "--block-size", str(BLOCK), "--enforce-eager",
             "--dtype", "float32", "--max-model-len", "2048",
             "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(cfg)],
            vllm_env(), str(log))
        self.launcher = None

    def wait_ready(self) -> None:
        """The operator's part (sidecars): once vLLM wrote its config, `kvcached
        launch`; then vLLM answers /health. Then what of kvcached runs: its
        shared-memory segments and processes, for ``assert_nothing_left``."""
        if self.run_dir is not None:
            self._until(lambda: (self.run_dir / "config.json").is_file(),
                        "vLLM's kvcached config")
            self.launcher = subprocess.Popen(
                [sys.executable, "-m", "kvcached", "launch", "--run-dir", str(self.run_dir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._until(lambda: self.get("/health") is not None, "vLLM's /health")
        self.temporary = self.run_dir is None
        if self.temporary:  # vLLM's log names it (README: "Watching it")
            import re
            found = re.search(r"kvcached: run dir (\S+) ", self.log.read_text())
            assert found, f"no run dir in vLLM's log {self.log}"
            self.run_dir = Path(found.group(1))
        self.segments = run_segments(self.run_dir)
        self.pids = kvcached_pids(self.run_dir)
        # the CPU tier; the janitor and the transfer worker (spawned) or the launcher's
        assert self.segments and len(self.pids) >= 2, (self.segments, self.pids)

    def _until(self, ready, what: str) -> None:
        import time
        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            assert self.proc.poll() is None, f"vLLM exited:\n{self.log}"
            assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S}s"
            time.sleep(0.2)

    def get(self, path: str) -> str | None:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read().decode()
        except OSError:
            return None

    def complete(self, prompt: list[int]) -> list[int]:
        import urllib.request
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as r:
            return json.loads(r.read())["choices"][0]["token_ids"]

    def stop(self, sig: str = "SIGINT", group: bool = True) -> None:
        """``sig`` to the server's process group (as a shell's Ctrl-C), or to the
        server only (``group`` False: as Kubernetes' SIGTERM)."""
        import signal

        from conftest_storage import stop_process
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, getattr(signal, sig))
            else:
                self.proc.send_signal(getattr(signal, sig))
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        stop_process(self.launcher, timeout=60)

    def assert_nothing_left(self) -> None:
        """Once the server is stopped: none of its kvcached processes runs, its
        segments are gone, and so is its run dir (kvcached's own) or what of it
        belonged to the dead engine (a configured one: its logs stay)."""
        def left() -> list:
            out = [p for p in self.pids + kvcached_pids(self.run_dir) if running(p)]
            out += run_segments(self.run_dir)
            if self.temporary:
                out += [self.run_dir] if self.run_dir.exists() else []
            else:
                out += [p for p in ("coord.sock", "ctl.sock", "engine.json")
                        if (self.run_dir / p).exists()]
            return out
        import time
        deadline = time.monotonic() + 30
        while left():
            assert time.monotonic() < deadline, f"left after the server stopped: {left()}"
            time.sleep(0.1)
        assert not set(self.segments) & set(os.listdir(SHM))


SHM = "/dev/shm"


def run_segments(run_dir: Path) -> list[str]:
    """kvcached's shared-memory segments of ``run_dir`` (``memory/shm.py``:
    ``kvcached-<pid>-<run id>-r<rank>-<kind>``)."""
    import hashlib
    rid = hashlib.blake2b(os.path.realpath(run_dir).encode(), digest_size=5).hexdigest()
    return sorted(n for n in os.listdir(SHM) if n.startswith("kvcached-") and f"-{rid}-" in n)


def kvcached_pids(run_dir: Path) -> list[int]:
    """Running processes whose command line names ``run_dir`` (workers, janitor, launcher)."""
    want = str(run_dir).encode()
    out = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and want in Path(f"/proc/{entry}/cmdline").read_bytes() \
                    and running(int(entry)):
                out.append(int(entry))
        except OSError:
            pass
    return out


def running(pid: int) -> bool:
    """``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample of ``/metrics`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_vllm_serve_restarted_serves_from_storage(model, baseline, tmp_path):
    """vLLM's OpenAI server with kvcached: a prompt through /v1/completions,
    the server restarted, the same prompt again: the same tokens, and
    /metrics shows it came from storage (vLLM's disk source,
    vllm:kvcached_hit_tokens{tier="storage"}). First as the README says
    (kvcached's run dir, workers it spawns), stopped with SIGINT to the
    process group (a shell's Ctrl-C); then with a run dir and sidecar workers
    from `kvcached launch`, stopped with SIGTERM to the server (Kubernetes).
    After each no kvcached process, shared-memory segment or run dir (its
    sockets, for a configured one) is left: vLLM SIGKILLs its engine core,
    the janitor cleans up."""
    import vllm_app
    prompt = vllm_app.prompts([SINGLE[0]])[0]
    full = (len(prompt) - 1) // BLOCK * BLOCK
    store, outputs = tmp_path / "store", []
    for k in range(2):
        srv = Served(model, None if k == 0 else tmp_path / "run1", store,
                     tmp_path / f"vllm{k}.log")
        try:
            srv.wait_ready()
            outputs.append(srv.complete(prompt))
            if k == 0:  # written through to storage before the server goes
                vllm_app.wait_stored(str(srv.run_dir), full // BLOCK, idle=lambda: None)
            else:
                text = srv.get("/metrics") or ""
        finally:
            srv.stop(*(("SIGINT", True) if k == 0 else ("SIGTERM", False)))
        srv.assert_nothing_left()
    assert "is gone: removed shm segment" in (tmp_path / "run1/logs/janitor.log").read_text()
    assert outputs == [baseline[0], baseline[0]]
    assert metric(text, "vllm:prompt_tokens_cached_by_source_total", source="disk") == full, \
        [line for line in text.splitlines() if "cached" in line]
    assert metric(text, "vllm:kvcached_hit_tokens_total", tier="storage") == full
    assert metric(text, "vllm:kvcached_hit_tokens_total", tier="cpu") == 0


def test_bench_vllm_quick():
    """The benchmark's smoke run (a tiny model): every mode serves the same
    greedy outputs, hits are served whole, chat computes no more than the
    workload allows."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_vllm.py"
    res = run_script(script, ["--quick"], timeout=1500)
    assert res.returncode == 0, res.stderr[-5000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "vllm" and out["identical_outputs"], out["identical"]
    assert out["cpu_hit_blocks_served"] >= 0.9 and out["storage_hit_blocks_served"] >= 0.9
    chat = out["chat"]
    assert out["chat_points_above_least"] <= 5.0, chat  # the target
    assert chat["kvcached"]["computed_tokens"] <= chat["plain"]["computed_tokens"]
    assert set(out["no_reuse_throughput_tok_s"]) == {"plain", "kvcached"}
    assert all(out["no_reuse_throughput_tok_s"].values())
    assert math.isfinite(out["no_reuse_throughput_lost"])  # a ratio: no timing asserted
    step = out["scheduler_step_us"]  # the scheduler's time in kvcached, from status
    assert step["steps"] > 0 and 0 < step["p50"] <= step["p99"] <= step["max"]
    assert out["cpu_hit_vs_own_hit_spread"]["pairs"] == 4  # 2 prompts x 2 rounds
    # each storage hit in the new process beside vLLM's own hit right after it
    assert out["storage_hit_vs_own_hit_spread"]["pairs"] == 2
    assert 0 < out["storage_own_hit_ttft_s"] and math.isfinite(out["storage_hit_vs_own_hit"])


BREAK_EVEN = Path(__file__).resolve().parents[2] / "scripts" / "bench_break_even.py"


def test_bench_break_even_quick():
    """The break-even benchmark's smoke run: every storage hit it times is
    served whole (a fill process that exits right after its last prefill
    leaves all of it in storage), and each recompute beside it computes."""
    res = run_script(BREAK_EVEN, ["--quick", "--backends", "file"], timeout=900)
    assert res.returncode == 0, res.stderr[-5000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rows = out["backends"]["file"]["per_blocks"]
    assert sorted(rows, key=int) == ["1", "4"]
    assert all(r["blocks_served"] == 1.0 for r in rows.values()), rows
    assert all(math.isfinite(r["storage_vs_recompute"]) for r in rows.values())
    assert out["backends"]["file"]["break_even_blocks"] in (None, 1, 4)


def test_bench_break_even_refuses_an_unknown_backend():
    res = subprocess.run([sys.executable, str(BREAK_EVEN), "--backends", "s3"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--backends takes file and/or redis" in res.stderr
