"""``kvcached demo``: the reference engine through every tier, verified against recompute."""

from __future__ import annotations

import io

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
    assert (tmp_path / "logs" / "engine.log").exists()


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
