"""The control plane survives any input: the control socket over real sockets,
the CLI's numbers, a dead engine, and a client light enough to start at once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner

import kvcached
from kvcached.ops.cli import main
from kvcached.ops.ctlserver import ControlServer
from kvcached.transfer import protocol as P
from kvcached.transfer.endpoints import control_endpoint

REPLY_S = 5.0


class Manager:
    """The control server's view of a manager: what its ops call."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.calls: list[str] = []

    def status(self):
        self.calls.append("status")
        return {"run_dir": str(self.run_dir), "paused": False, "asleep": False,
                "stats": {"requests": 3}, "workers": []}

    def pause(self):
        self.calls.append("pause")
        return {"changed": True, "paused": True}

    def sleep(self, release_host_pool=False, drain=False, drain_timeout_s=60.0):
        self.calls.append(f"sleep drain={drain} timeout={drain_timeout_s}")
        return {"changed": True, "asleep": True}


@pytest.fixture
def server(tmp_path):
    mgr = Manager(tmp_path)
    srv = ControlServer(mgr).start()
    yield mgr
    srv.close()


def exchange(run_dir: Path, frame: bytes) -> P.Message | None:
    """Send one raw frame to the control socket; the decoded reply (None: none)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control_endpoint(run_dir))
        sock.send_multipart([b"", frame])
        if not sock.poll(int(REPLY_S * 1000)):
            return None
        return P.decode(sock.recv_multipart()[-1])
    finally:
        sock.close()


def ctl_frame(op: str = "ping", args: dict | None = None, timeout_s=5.0) -> bytes:
    """A ctl request packed by hand: its numbers need not be valid."""
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "kind": "ctl", "op": op, "args": args or {},
                          "timeout_s": timeout_s})


def answers_ping(run_dir: Path) -> bool:
    reply = exchange(run_dir, ctl_frame("ping"))
    return isinstance(reply, P.CtlReply) and reply.ok and reply.result["pid"] == os.getpid()


# ------------------------------------------------------------ the socket
BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, 2**63 - 1, -(2**63)]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
def test_non_finite_or_extreme_timeouts_are_refused_and_the_server_lives_on(server, value):
    """One request with timeout_s=NaN killed the control thread: every later
    status/ctl timed out, and an engine asleep then could never be woken."""
    reply = exchange(server.run_dir, ctl_frame("status", timeout_s=value))
    assert isinstance(reply, P.ErrorReply), reply
    assert "ctl.timeout_s" in reply.detail
    assert answers_ping(server.run_dir)
    assert server.calls == []  # nothing ran on a refused request


@pytest.mark.parametrize("args", [
    {"drain": True, "drain_timeout_s": math.nan},
    {"drain": True, "drain_timeout_s": math.inf},
    {"drain": True, "drain_timeout_s": -5},
    {"drain": True, "drain_timeout_s": "soon"},
    {"release_host_pool": True, "x": [1.0, math.inf]},
], ids=str)
def test_non_finite_numbers_in_args_are_refused(server, args):
    reply = exchange(server.run_dir, ctl_frame("sleep", args))
    assert isinstance(reply, P.ErrorReply), reply
    assert answers_ping(server.run_dir) and server.calls == []


def test_a_drain_timeout_reaches_the_manager(server):
    reply = exchange(server.run_dir, ctl_frame("sleep", {"drain": True,
                                                         "drain_timeout_s": 7}))
    assert isinstance(reply, P.CtlReply) and reply.ok, reply
    assert server.calls == ["sleep drain=True timeout=7.0"]


def test_an_unexpected_error_in_one_request_is_answered_and_serving_goes_on(
        server, monkeypatch):
    real = ControlServer._dispatch

    def dispatch(self, sock, envelope, req):
        if req.op == "explode":
            raise RuntimeError("a bug in handling this request")
        return real(self, sock, envelope, req)

    monkeypatch.setattr(ControlServer, "_dispatch", dispatch)
    for _ in range(3):
        reply = exchange(server.run_dir, ctl_frame("explode"))
        assert isinstance(reply, P.ErrorReply) and reply.error == "internal error"
        assert "a bug in handling this request" in reply.detail
        assert answers_ping(server.run_dir)


# ------------------------------------------------------------- the CLI
def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("args", [
    ("status", "--timeout", "inf"), ("status", "--timeout", "nan"),
    ("status", "--timeout", "-inf"), ("status", "--timeout", "1e308"),
    ("status", "--watch", "--interval", "nan"),
    ("ctl", "pause", "--timeout", "nan"), ("ctl", "sleep", "--drain", "--timeout", "inf"),
])
def test_non_finite_cli_numbers_are_usage_errors(server, args):
    res = run(*args, "--run-dir", server.run_dir)
    assert res.exit_code == 2, res.output
    assert "Invalid value for" in res.output and "Traceback" not in res.output
    assert server.calls == []


def test_json_mode_prints_errors_as_json(tmp_path, server):
    res = run("ctl", "pause", "--json", "--run-dir", tmp_path / "gone")
    assert res.exit_code == 1
    got = json.loads(res.output)
    assert got["ok"] is False and got["op"] == "pause" and "does not exist" in got["error"]
    res = run("status", "--json", "--run-dir", server.run_dir)
    assert res.exit_code == 0 and json.loads(res.output)["stats"]["requests"] == 3


def test_ctl_sleep_drain_sends_its_timeout(server):
    res = run("ctl", "sleep", "--drain", "--timeout", "12", "--run-dir", server.run_dir)
    assert res.exit_code == 0, res.output
    assert server.calls == ["sleep drain=True timeout=12.0"]


# --------------------------------------------------------- a dead engine
ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from conftest import tiny_config
    from kvcached import CacheManager
    mgr = CacheManager(tiny_config(run_dir={run_dir!r}, num_cpu_blocks=4)).start()
    print(mgr.run_dir, flush=True)
    time.sleep(600)
""")


def start_engine(run_dir: str) -> tuple[subprocess.Popen, Path]:
    tests = str(Path(__file__).resolve().parents[1])
    eng = subprocess.Popen([sys.executable, "-c", ENGINE.format(tests=tests, run_dir=run_dir)],
                           stdout=subprocess.PIPE, text=True)
    line = eng.stdout.readline().strip()
    assert line, "the engine did not start"
    return eng, Path(line)


def test_a_dead_engine_is_reported_at_once_and_cleanup_removes_what_it_left(tmp_path):
    """ctl/status report a dead engine at once, not after a timeout that blames a
    busy engine."""
    from kvcached.memory import shm
    eng, run_dir = start_engine("")  # a temporary run dir, as most engines use
    try:
        assert run("status", "--run-dir", run_dir).exit_code == 0
        eng.kill()
        eng.wait()
    finally:
        eng.kill()
        eng.stdout.close()
    segments = sorted(p.name for p in shm.shm_dir().glob(f"kvcached-{eng.pid}-*"))
    assert segments and run_dir.is_dir() and (run_dir / "ctl.sock").exists()

    t0 = time.monotonic()
    res = run("status", "--run-dir", run_dir)
    assert time.monotonic() - t0 < 2.0  # not the 10 s timeout: the pid says it
    assert res.exit_code == 1
    assert f"engine pid {eng.pid} is not running (run dir {run_dir}" in res.output
    assert "kvcached cleanup" in res.output
    res = run("ctl", "wakeup", "--json", "--run-dir", run_dir)
    assert "is not running" in json.loads(res.output)["error"]

    dry = run("cleanup", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert all(f"would remove shm segment {shm.shm_dir() / s}" in dry.output for s in segments)
    assert f"would remove run dir {run_dir}" in dry.output
    assert run_dir.is_dir() and all((shm.shm_dir() / s).exists() for s in segments)

    live_engine, live_dir = start_engine("")  # a running engine is never touched
    try:
        live = sorted(shm.shm_dir().glob(f"kvcached-{live_engine.pid}-*"))
        res = run("cleanup")
        assert res.exit_code == 0, res.output
        assert not run_dir.exists()
        assert not any((shm.shm_dir() / s).exists() for s in segments)
        assert live and all(p.exists() for p in live) and live_dir.is_dir()
        assert run("status", "--run-dir", live_dir).exit_code == 0
    finally:
        live_engine.kill()
        live_engine.wait()
        live_engine.stdout.close()
        run("cleanup")


def test_cleanup_of_a_configured_run_dir_keeps_its_logs(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "engine.log").write_text("what happened\n")
    (run_dir / "engine.json").write_text(json.dumps({"pid": gone.pid}))
    (run_dir / "ctl.sock").write_text("")
    res = run("cleanup", "--run-dir", run_dir)
    assert res.exit_code == 0, res.output
    assert f"removed {run_dir / 'ctl.sock'} (engine pid {gone.pid} is gone)" in res.output
    assert not (run_dir / "ctl.sock").exists() and not (run_dir / "engine.json").exists()
    assert (run_dir / "logs" / "engine.log").read_text() == "what happened\n"
    (run_dir / "engine.json").write_text(json.dumps({"pid": os.getpid()}))
    res = run("cleanup", "--run-dir", run_dir)
    assert f"its engine pid {os.getpid()} is running" in res.output
    assert (run_dir / "engine.json").exists()
    assert run("cleanup", "--run-dir", tmp_path / "nope").exit_code == 1


# -------------------------------------------------------- a light client
CLIENT = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    from kvcached.ops.cli import main
    out = []
    for args in (["status", "--json"], ["ctl", "pause"], ["status"]):
        try:
            main(args + ["--run-dir", sys.argv[1]], standalone_mode=False)
        except SystemExit:
            pass
    print(json.dumps({{"seconds": time.perf_counter() - t0,
                      "heavy": [m for m in ("torch", "numpy") if m in sys.modules]}}))
""")


def test_the_control_client_imports_no_torch_and_answers_well_under_a_second(server):
    """`kvcached status` took ~3 s: it imported torch through the package."""
    proc = subprocess.run([sys.executable, "-c", CLIENT.format(), str(server.run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], f"the control client imported {got['heavy']}"
    assert got["seconds"] < 1.0, got  # three commands, interpreter start excluded
    assert server.calls == ["status", "pause", "status"]


def test_the_package_exports_load_on_first_use():
    assert sorted(kvcached.__all__) == sorted(kvcached._EXPORTS)
    for name in kvcached.__all__:
        assert getattr(kvcached, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvcached.nope  # noqa: B018
