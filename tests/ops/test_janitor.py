"""What an engine that dies without closing leaves, and who removes it.

vLLM's server stops its engine core with SIGKILL (its shutdown timeout is 0
by default), so kvcached's manager never closes there: the engine's
janitor (``kvcached.ops.janitor``, outside the engine's process tree)
removes its shared memory, its temporary run dir and any transfer worker
left; if the janitor dies too, the next start or ``kvcached cleanup``
does, and says so. (The real server, stopped with SIGINT and SIGTERM:
``tests/integrations/test_vllm.py``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached.memory import rundir
from kvcached.ops import janitor


def running(pid: int) -> bool:
    """``pid`` runs (a zombie nobody reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def until(cond, what: str, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {deadline_s}s"
        time.sleep(0.02)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(d))  # the janitor's, and clean()'s
    return d


def engine_with_leftovers(tmp_path: Path, shm_dir: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A stand-in engine (a sleeping process), its segment and its temporary run dir."""
    eng = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    run_dir = tmp_path / f"kvcached-vllm-{eng.pid}"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "coord.sock").touch()
    rundir.mark_temporary(run_dir, eng.pid)
    seg = shm_dir / f"kvcached-{eng.pid}-0123456789-r0-host"
    seg.write_bytes(b"\0" * 4096)
    return eng, run_dir, seg


def fake_worker(engine_pid: int) -> subprocess.Popen:
    """A process whose command line is a spawned worker's of ``engine_pid``
    (and that ignores the engine's death)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                             "kvcached", "worker", "--rank", "0", "--engine-pid",
                             str(engine_pid)])


def test_janitor_removes_what_a_killed_engine_left(tmp_path, shm_dir):
    eng, run_dir, seg = engine_with_leftovers(tmp_path, shm_dir)
    other = shm_dir / f"kvcached-{os.getpid()}-0123456789-r0-host"  # a live engine's
    other.touch()
    try:
        pid = janitor.watch(eng.pid, run_dir, tmp_path / "logs")
        assert pid and running(pid)
        assert os.getsid(pid) != os.getsid(0)  # a Ctrl-C at our terminal misses it
        time.sleep(0.3)  # while the engine lives, nothing goes
        assert seg.exists() and run_dir.is_dir() and running(pid)
    finally:
        eng.kill()
        eng.wait()
    until(lambda: not running(pid), "the janitor's exit")
    assert not seg.exists() and not run_dir.exists()
    assert other.exists()
    log = (tmp_path / "logs" / "janitor.log").read_text()
    assert f"engine pid {eng.pid} is gone: removed shm segment {seg}; " \
           f"removed run dir {run_dir}" in log


def test_janitor_kills_a_worker_left_and_keeps_a_configured_run_dirs_logs(tmp_path, shm_dir):
    eng = subprocess.Popen(["true"])
    eng.wait()  # reaped: a dead engine
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "engine.log").write_text("what happened\n")
    (run_dir / "engine.json").write_text(f'{{"pid": {eng.pid}}}')
    (run_dir / "ctl.sock").touch()
    worker = fake_worker(eng.pid)
    try:
        until(lambda: worker.pid in janitor.workers_of(eng.pid), "the worker's start")
        lines = janitor.clean(eng.pid, run_dir, worker_grace_s=0.1)
        assert worker.wait(timeout=10) == -9
    finally:
        worker.kill()
        worker.wait()
    assert f"killed transfer worker pid {worker.pid}" in lines
    assert not (run_dir / "ctl.sock").exists() and not (run_dir / "engine.json").exists()
    assert (run_dir / "logs" / "engine.log").read_text() == "what happened\n"


def test_a_vllm_run_dir_of_a_killed_engine_is_swept_and_said(tmp_path, shm_dir, monkeypatch):
    """Everything SIGKILLed, the janitor too: `kvcached cleanup` (as the next
    start) removes the segment and the temporary run dir, and says so."""
    import tempfile

    from click.testing import CliRunner

    from kvcached.memory import shm
    from kvcached.ops.cli import main
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(shm, "SHM_DIR", shm_dir)
    eng, run_dir, seg = engine_with_leftovers(tmp_path, shm_dir)
    live = tmp_path / "kvcached-vllm-live"
    live.mkdir()
    rundir.mark_temporary(live)  # this process: alive, never touched
    eng.kill()
    eng.wait()
    res = CliRunner().invoke(main, ["cleanup"])
    assert res.exit_code == 0, res.output
    assert f"removed shm segment {seg}" in res.output
    assert f"removed run dir {run_dir}" in res.output
    assert not seg.exists() and not run_dir.exists() and live.is_dir()


def test_a_zombie_engine_is_not_alive():
    """vLLM's API server reaps its killed engine core late: until then the
    engine is a zombie, and what it left is a dead engine's."""
    eng = subprocess.Popen(["true"])
    try:
        until(lambda: not running(eng.pid), "the zombie")
        assert Path(f"/proc/{eng.pid}").exists()  # not reaped yet
        assert not rundir.pid_alive(eng.pid)
    finally:
        eng.wait()
    assert rundir.pid_alive(os.getpid())


def test_the_first_mark_of_a_temporary_run_dir_stays_until_the_engine_claims_it(tmp_path):
    """vLLM's worker processes mark kvcached's run dir first (a vLLM that dies
    while loading leaves it to the sweep); its scheduler claims it after."""
    rundir.mark_temporary(tmp_path, 11, replace=False)
    rundir.mark_temporary(tmp_path, 12, replace=False)  # another rank: the first stays
    assert (tmp_path / rundir.PID_FILE).read_text() == "11"
    rundir.mark_temporary(tmp_path)
    assert rundir.engine_pid(tmp_path) == os.getpid()
