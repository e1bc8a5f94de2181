"""``kvcached demo``: the reference engine through every tier, verified against recompute."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcached.tools.demo import ChatWorkload, Progress, pick_sample, run_demo


def test_demo_serves_from_every_tier_and_matches_recompute(tmp_path):
    out = io.StringIO()
    rep = run_demo(requests=60, seed=1, verify_sample=4, log_dir=tmp_path / "logs",
                   progress=False, out=out, transfer_mode="inprocess")
    hits = rep["hit_tokens"]
    assert hits["gpu"] > 0 and hits["cpu"] > 0, hits  # the GPU tier overflowed
    assert rep["prefill_tokens_saved"] == sum(hits.values()) < rep["prompt_tokens"]
    assert rep["verify"]["checked"] == 4 and rep["verify"]["identical"] == 4
    assert rep["verify"]["bitwise"]
    text = out.getvalue()
    for words in ("served from", "prefill saved", "swap_in", "verified", "logs"):
        assert words in text
    evictions = next(line for line in text.splitlines() if "evictions" in line)
    assert "{" not in evictions and "blocks" in evictions  # in words, not a raw dict
    assert (tmp_path / "logs" / "engine.log").exists()


def test_demo_refuses_a_request_count_below_one():
    from kvcached.ops.cli import main
    for bad in ("-5", "0"):
        res = CliRunner().invoke(main, ["demo", "--requests", bad])
        assert res.exit_code == 2 and "Invalid value for '--requests'" in res.output


@pytest.mark.parametrize("env,words", [
    ({"KVCACHED_TRANSFER_MODE": "threads"}, "transfer_mode must be one of"),
    ({"KVCACHED_NUM_GPU_BLOCKS": "lots"}, "environment variable KVCACHED_NUM_GPU_BLOCKS="),
    ({"KVCACHED_NUM_GPU_BLOCK": "64"}, "did you mean KVCACHED_NUM_GPU_BLOCKS?"),
])
def test_demo_with_a_bad_variable_prints_one_line(tmp_path, monkeypatch, env, words):
    """It printed two tracebacks (the second from a retry without storage)."""
    from kvcached.ops.cli import main
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["demo", "--requests", "2"], env=env)
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: invalid configuration: ")
    assert words in lines[0] and "Traceback" not in res.output


def test_demo_reports_the_variables_it_overrides(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCACHED_NUM_GPU_BLOCKS", "100")  # the demo sizes its tiers itself
    monkeypatch.setenv("KVCACHED_TASK_TIMEOUT_S", "20")  # this one applies
    run_demo(requests=4, seed=1, verify_sample=1, log_dir=tmp_path / "logs", progress=False,
             out=io.StringIO(), transfer_mode="inprocess")
    err = capsys.readouterr().err
    assert "ignoring KVCACHED_NUM_GPU_BLOCKS=100: the demo sets these itself" in err
    assert "TASK_TIMEOUT" not in err


def test_cli_demo_runs_workers_and_logs_in_the_working_directory(tmp_path, monkeypatch):
    from kvcached.ops.cli import main
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["demo", "--requests", "24", "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and "TP=2, workers transfer" in res.output
    logs = tmp_path / "kvcached-logs"
    assert {"engine.log", "worker-rank0.log", "worker-rank1.log"} <= {
        p.name for p in logs.iterdir()}


def test_workload_turns_extend_their_chat_history():
    work = ChatWorkload(seed=3, concurrent=2)
    chat, p1 = work.next_prompt()
    work.record(chat, p1, [7, 7, 7])
    if chat in work.chats:  # the chat goes on: its next prompt starts with all of turn 1
        p2 = None
        while p2 is None:
            c, p = work.next_prompt()
            p2 = p if c is chat else None
        assert p2[:len(p1) + 3] == p1 + [7, 7, 7]
    again = ChatWorkload(seed=3, concurrent=2)
    assert again.next_prompt()[1] == p1  # a seed fixes the workload


def test_sample_takes_every_tier_in_turn():
    from types import SimpleNamespace as NS
    served = [(None, NS(hit=NS(storage_tokens=s, cpu_tokens=c, gpu_tokens=g)))
              for s, c, g in [(0, 0, 0), (0, 0, 16), (0, 16, 0), (16, 0, 0), (0, 0, 32)]]
    # One storage, one CPU, one miss, and the middle one of the two GPU hits.
    assert pick_sample(served, 4) == [0, 2, 3, 4]
    assert pick_sample(served, 10) == [0, 1, 2, 3, 4]


def test_progress_without_a_terminal_prints_plain_lines():
    buf = io.StringIO()
    p = Progress(20, stream=buf)
    for i in range(1, 21):
        p.update(i)
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in buf.getvalue() and lines[-1].strip().startswith("20/20")


# ------------------------------------------------------------ demo --serve
def _serve_status(run_dir) -> dict:
    from kvcached.ops.cli import main
    res = CliRunner().invoke(main, ["status", "--json", "--run-dir", str(run_dir)])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_demo_serve_is_an_engine_to_point_status_and_ctl_at(tmp_path):
    """The README's operator recipe, end to end: `kvcached demo --serve` prints
    its run dir and metrics URL, `kvcached status` / `ctl` work against it, its
    logs are where it says, and Ctrl-C stops it cleanly."""
    from helpers import wait_for

    from kvcached.ops.cli import main
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvcached", "demo", "--serve", "--rate",
                                 "50"], stdout=subprocess.PIPE, stderr=err, text=True,
                                cwd=tmp_path)
    try:
        banner = {}
        for line in proc.stdout:
            words = line.split()
            if words[:2] == ["run", "dir"]:
                banner["run_dir"] = Path(words[2])
            elif words[:1] == ["metrics"]:
                banner["metrics"] = words[1]
            elif words[:1] == ["try"]:
                break
        run_dir = banner["run_dir"]
        assert run_dir.is_dir() and banner["metrics"].startswith("http://127.0.0.1:")
        served = wait_for(lambda: _serve_status(run_dir)["stats"]["requests"] > 3, 60,
                          "the demo to serve")
        assert served
        for log in ("engine.log", "worker-rank0.log", "worker-rank1.log"):
            assert (run_dir / "logs" / log).stat().st_size > 0

        def ctl(*args):
            res = CliRunner().invoke(main, ["ctl", *args, "--run-dir", str(run_dir)])
            assert res.exit_code == 0, res.output
            return res.output

        assert "pause: ok (changed)" in ctl("pause")
        assert _serve_status(run_dir)["paused"]
        ctl("resume")
        assert "sleep: ok (changed)" in ctl("sleep", "--drain", "--timeout", "30")
        st = _serve_status(run_dir)
        assert st["asleep"] and st["stats"]["running"] == 0
        ctl("wakeup")
        before = st["stats"]["requests"]
        wait_for(lambda: _serve_status(run_dir)["stats"]["requests"] > before + 3, 60,
                 "serving to go on after wakeup")
        with urllib.request.urlopen(banner["metrics"], timeout=10) as r:
            assert "kvcached_requests_total" in r.read().decode()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert "stopped after" in proc.stdout.read()
        assert not run_dir.exists()  # a temporary run dir goes with its engine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
