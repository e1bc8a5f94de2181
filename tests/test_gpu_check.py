"""scripts/gpu_check.sh and its JUnit checker, on a machine without a GPU.

The script itself is for a GPU machine; here it must say "no GPU" and fail
(exit 3), with a plan that fits its budget and GPU tests that still import.
The checker must fail a run in which a test was skipped, failed or missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import _junit_check  # noqa: E402


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: run it")
def test_dry_run_says_no_gpu_and_fails(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out), "HOME": str(tmp_path),
                              "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-2000:]
    assert "no GPU: dry run" in res.stdout
    summary = (out / "summary.txt").read_text()
    assert "env rc=3" in summary and "checks rc=0" in summary, summary
    assert "plan total: 480s (budget 480s)" in res.stdout
    assert "plan: hybrid <= 25s" in res.stdout  # a hybrid model's pages have their step
    assert "no GPU: dry run" in (out / "gpu_check.log").read_text()


def junit(tmp_path, cases: str) -> str:
    path = tmp_path / "r.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}'
                    "</testsuite></testsuites>")
    return str(path)


PASS = '<testcase classname="t" name="ok{}"/>'
SKIP = '<testcase classname="t" name="s"><skipped message="{}">x</skipped></testcase>'


def test_junit_all_passed(tmp_path):
    ok, summary = _junit_check.check(junit(tmp_path, PASS.format(1) + PASS.format(2)), 2)
    assert ok and "2 tests, 2 passed" in summary


@pytest.mark.parametrize("cases,min_tests,allow,text", [
    (SKIP.format("no CUDA device"), 1, None, "SKIPPED t::s: no CUDA device"),
    (SKIP.format("no CUDA device"), 1, "a GPU is present", "SKIPPED"),
    ('<testcase classname="t" name="f"><failure message="boom"/></testcase>', 1, None,
     "FAILURE t::f: boom"),
    ('<testcase classname="t" name="e"><error message="fixture"/></testcase>', 1, None,
     "ERROR t::e"),
    ("", 1, None, "fewer than 1 tests"),
    (PASS.format(1), 5, None, "fewer than 5 tests"),
])
def test_junit_fails_what_did_not_run_and_pass(tmp_path, capsys, cases, min_tests, allow, text):
    ok, summary = _junit_check.check(junit(tmp_path, cases), min_tests, allow)
    assert not ok
    assert text in capsys.readouterr().out + summary


def test_junit_allowed_skip_and_missing_file(tmp_path):
    ok, _ = _junit_check.check(junit(tmp_path, PASS.format(1) + SKIP.format(
        "a GPU is present: this checks behaviour without one")), 1, "a GPU is present")
    assert ok
    ok, summary = _junit_check.check(str(tmp_path / "missing.xml"))
    assert not ok and "no readable JUnit XML" in summary
    assert _junit_check.main([str(tmp_path / "missing.xml")]) == 1


FAKE_SMI = """#!/bin/bash
case "$*" in *-L*) echo "GPU 0: Fake GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
             *) echo "fake nvidia-smi $*" ;; esac
"""
FAKE_PY = """#!/bin/bash
# The real interpreter, except that it claims a CUDA torch: the script goes past
# its dry run, and every GPU test then skips (this machine has no GPU).
for a in "$@"; do
    case "$a" in *torch.cuda.is_available*) echo "torch (fake) available True"; exit 0 ;; esac
done
exec {python} "$@"
"""


def fake_gpu_env(tmp_path, nvcc: str, **extra) -> dict:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(FAKE_SMI)
    (fake / "python").write_text(FAKE_PY.format(python=sys.executable))
    for f in fake.iterdir():
        f.chmod(0o755)
    from kvcached.native_build import cache_dir
    return {"PATH": f"{fake}:{Path(nvcc).parent}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
            "HOME": str(tmp_path), "PYTHON": str(fake / "python"),
            "KVCACHED_CACHE_DIR": str(cache_dir()), **extra}  # reuse this session's build


def step_rcs(out: Path) -> dict[str, int]:
    lines = (out / "summary.txt").read_text().splitlines()
    return {line.split(" rc=")[0]: int(line.split(" rc=")[1].split()[0])
            for line in lines if " rc=" in line}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: run it")
def test_steps_get_no_more_than_the_budget_left(tmp_path):
    from kvcached.copy import cuda as kvc
    nvcc = kvc.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the script stops before its steps")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                         env=fake_gpu_env(tmp_path, nvcc, BUDGET_S="1"), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1
    rcs = step_rcs(tmp_path / "out")
    assert rcs.pop("env") == 0 and len(rcs) == 7, rcs
    if rcs["sanitizer"] == 1:  # not found: a failure whatever the budget
        assert "compute-sanitizer not found" in (tmp_path / "out" / "summary.txt").read_text()
        del rcs["sanitizer"]
    assert set(rcs.values()) == {124}, rcs
    assert "no time left in the budget" in res.stdout


def junit_cases(path: Path, prefix: str) -> dict[str, int]:
    """How the test cases of a JUnit file whose names start with ``prefix`` ended."""
    import xml.etree.ElementTree as ET
    out: dict[str, int] = {}
    for case in ET.parse(path).iter("testcase"):
        if case.get("name", "").startswith(prefix):
            ended = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")),
                         "passed")
            out[ended] = out.get(ended, 0) + 1
    return out


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: run it")
def test_a_run_whose_gpu_tests_skip_fails(tmp_path):
    """Past the dry run (a fake nvidia-smi, a Python that claims a CUDA torch): the
    build and the build tests pass (the hybrid pages' round trip among them,
    emulated), but skipped GPU tests (the hybrid step's too), a missing
    sanitizer and a benchmark that did not measure each fail their step, and
    the script."""
    from kvcached.copy import cuda as kvc
    nvcc = kvc.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the script's build step needs it")
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                         env=fake_gpu_env(tmp_path, nvcc), capture_output=True, text=True,
                         timeout=480)
    log = res.stdout + res.stderr
    assert res.returncode == 1, log[-4000:]
    rc = step_rcs(out)
    assert rc == {"env": 0, "build": 0, "build_tests": 0, "hybrid": 1, "gpu_tests": 1,
                  "gpu_grid": 1, "sanitizer": 1, "bench": 2}, rc
    assert "SKIPPED" in log  # the checker named the skipped GPU tests
    assert junit_cases(out / "build_tests.xml", "test_hybrid_pages_round_trip_emulated") == \
        {"passed": 3}
    assert junit_cases(out / "hybrid.xml", "test_hybrid_pages") == {"skipped": 4}
    assert '"built": true' in (out / "build.json").read_text()
    assert (out / "gpu_tests.xml").exists() and (out / "bench.jsonl").exists()


NO_ZMQ = """
import sys
sys.modules["zmq"] = None      # the GPU machine has no pyzmq ...
sys.modules["msgpack"] = None  # ... and maybe no msgpack
import kvcached.copy.cuda, kvcached.memory.cuda_ipc, kvcached.memory.kvevent  # noqa
import kvcached.memory.stepwait, kvcached.transfer.executor  # noqa (a load inside the step)
from kvcached import CacheConfig, CacheManager
from kvcached.transfer.inprocess import InProcessTransfer  # noqa
cfg = CacheConfig.load(transfer_mode="inprocess", control_socket=False, storage_backend=None,
                       create_cache=True, num_gpu_blocks=4, num_cpu_blocks=8,
                       run_dir=sys.argv[1])
with CacheManager(cfg) as mgr:
    for i in range(6):  # enough requests to evict to the CPU tier and back
        toks = [i] * 33
        a = mgr.allocate(f"r{i}", toks)
        a.wait(10)
        mgr.commit(f"r{i}", toks, len(toks))
        mgr.free(f"r{i}")
    a = mgr.allocate("again", [0] * 33)
    a.wait(10)
    assert a.hit.cpu_tokens > 0, a.hit
print("ok")
"""


def test_gpu_machine_imports_work_without_pyzmq(tmp_path):
    """What tests/copy/test_cuda_gpu.py needs (the copy engine, CUDA IPC, the KV event,
    the executor and the engine's waits of a load inside the step, an in-process
    manager) imports and runs with zmq and msgpack unavailable."""
    res = subprocess.run([sys.executable, "-c", NO_ZMQ, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                              "HOME": str(tmp_path)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
