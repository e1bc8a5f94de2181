"""Trace replay: Mooncake-format parsing, hit rates per tier, the CLI and the shipped trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcached.tools.trace import (
    TRACE_BLOCK,
    TraceRequest,
    bench,
    load_trace,
    main,
    replay_trace,
    synthetic_trace,
    trace_tokens,
)

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "synthetic_trace.jsonl"
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}


def write(tmp_path, *lines: str) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_shipped_trace_is_what_the_generator_makes():
    rows = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    assert rows == synthetic_trace(200, seed=0)
    assert len(load_trace(SHIPPED)) == 200


def test_hit_rate_is_positive_and_grows_with_capacity():
    rates = []
    for gpu in (140, 400, 2000):
        res = replay_trace(SHIPPED, num_gpu_blocks=gpu)
        assert res["served"] == 200 and res["rejected"] == 0
        rates.append(res["hit_rate"])
    assert 0 < rates[0] < rates[1] < rates[2] <= res["ideal_hit_rate"]
    assert res["prefill_tokens_saved"] == sum(res["hit_tokens"].values())


def test_cpu_tier_adds_hits_on_top_of_a_small_gpu_tier():
    gpu_only = replay_trace(SHIPPED, max_requests=120, num_gpu_blocks=140)
    tiered = replay_trace(SHIPPED, max_requests=120, num_gpu_blocks=140, num_cpu_blocks=600)
    assert tiered["hit_rate_cpu"] > 0
    assert tiered["hit_rate"] > gpu_only["hit_rate"]
    assert tiered["manager_us_per_request"]["p50"] > 0


def test_equal_hash_ids_mean_equal_tokens():
    a = trace_tokens(TraceRequest(0, 700, 1, (5, 6)), index=0)
    b = trace_tokens(TraceRequest(0, 1024, 1, (5, 7)), index=1)
    assert len(a) == 700 and a[:TRACE_BLOCK] == b[:TRACE_BLOCK]
    assert a[TRACE_BLOCK] != b[TRACE_BLOCK]
    # Prompt longer than its ids: the tail is unique to the request.
    c = trace_tokens(TraceRequest(0, 600, 1, (5,)), index=2)
    d = trace_tokens(TraceRequest(0, 600, 1, (5,)), index=3)
    assert c[:TRACE_BLOCK] == d[:TRACE_BLOCK] and c[TRACE_BLOCK:] != d[TRACE_BLOCK:]


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not valid JSON"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing field"),
    (json.dumps({**GOOD, "input_length": -5}), "input_length must be >= 1"),
    (json.dumps({**GOOD, "output_length": -1}), "output_length must be >= 0"),
    (json.dumps({**GOOD, "hash_ids": "1,2"}), "hash_ids must be a list"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_bad_lines_name_their_line_number(tmp_path, bad, words):
    path = write(tmp_path, json.dumps(GOOD), "", bad)
    with pytest.raises(ValueError, match=f"line 3: .*{words}"):
        load_trace(path)


def test_cli_sweep_prints_a_json_line_per_capacity(tmp_path):
    res = CliRunner().invoke(bench, ["trace", "--trace", str(SHIPPED), "--max-requests", "30",
                                     "--gpu-blocks", "140", "--gpu-blocks", "1000",
                                     "--cpu-blocks", "100", "--block-size", "32",
                                     "--storage-dir", str(tmp_path / "store")])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert [r["num_gpu_blocks"] for r in lines] == [140, 1000]
    assert all(r["bench"] == "trace" and r["block_size"] == 32 for r in lines)
    assert list((tmp_path / "store").iterdir()) == []  # each replay's store is removed


def test_main_reports_bad_trace_without_a_traceback(tmp_path, capsys):
    path = write(tmp_path, json.dumps({**GOOD, "output_length": -1}))
    assert main(["--trace", str(path)]) == 1
    assert "line 1" in capsys.readouterr().err


def _plot_module():
    import importlib.util
    path = Path(__file__).parents[2] / "scripts" / "plot_benchmarks.py"
    spec = importlib.util.spec_from_file_location("plot_benchmarks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plot_script_reads_json_lines_and_never_needs_matplotlib(tmp_path):
    import subprocess
    import sys
    replay = replay_trace(SHIPPED, max_requests=20, num_gpu_blocks=200)
    src = write(tmp_path, "a table line", json.dumps(replay), "{broken",
                json.dumps({"bench": "cuda", "skipped": "no CUDA device"}))
    plot = _plot_module()
    got = plot.read_results([str(src)])
    assert list(got) == ["trace"] and got["trace"][0]["num_gpu_blocks"] == 200
    (key, rows), = plot.trace_series(got["trace"]).items()
    assert key[:3] == ("synthetic_trace.jsonl", 64, 0) and rows == got["trace"]
    out = tmp_path / "plots"
    run = subprocess.run([sys.executable, plot.__file__, str(src), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    # Either it drew the chart or it said why not (matplotlib is optional).
    assert (out / "trace_hit_rate.png").exists() or "matplotlib is not installed" in run.stderr
