"""PeerTracker: the coordinator's last words reach a worker before the socket closes.

Real processes over real ipc sockets. A worker's DEALER uses IMMEDIATE, with
which ZeroMQ discards what it received but has not read yet when the
connection goes; replying and then closing at once lost the reply in about a
fifth of the tries on a busy machine (tests/transfer/test_coordinator.py's refused worker
then never exited).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

from kvcached.transfer.peers import PeerTracker

# A worker-like peer: says hello until answered, exits 3 when it reads the
# answer, 1 if none came; stays connected for a while when told to "linger".
PEER = r"""
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.IDENTITY, b"rank-0")
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.IMMEDIATE, 1)
s.connect(sys.argv[1])
deadline, last = time.monotonic() + 10, 0.0
while time.monotonic() < deadline:
    if time.monotonic() - last > 0.5:
        try:
            s.send(b"hello", zmq.NOBLOCK)
        except zmq.Again:
            pass
        last = time.monotonic()
    if s.poll(20):
        if s.recv() == b"linger":
            time.sleep(30)
        sys.exit(3)
sys.exit(1)
"""


@pytest.fixture
def endpoint():
    d = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))  # ipc paths must stay short
    yield f"ipc://{d}/s"
    shutil.rmtree(d, ignore_errors=True)


def bound(endpoint: str) -> tuple[zmq.Socket, PeerTracker]:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    return router, PeerTracker(router)


def start_peer(endpoint: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, endpoint])


def hello(router: zmq.Socket, peers: PeerTracker) -> bytes:
    assert router.poll(20_000), "no hello from the peer"
    ident, msg = router.recv_multipart()
    assert msg == b"hello"
    deadline = time.monotonic() + 10  # the accept event precedes the hello; allow for it
    while len(peers.open) != 1 and time.monotonic() < deadline:
        peers.update(100)
    assert len(peers.open) == 1
    return ident


def test_last_words_arrive_when_the_socket_waits_for_its_peers(endpoint):
    for attempt in range(10):
        router, peers = bound(endpoint)
        proc = start_peer(endpoint)
        try:
            router.send_multipart([hello(router, peers), b"refused"])
            assert peers.wait_all_gone(10.0), "the peer did not leave"
            assert peers.open == set()
        finally:
            peers.close()
            router.close()
        assert proc.wait(timeout=20) == 3, f"the answer was lost (attempt {attempt})"


def test_wait_all_gone_keeps_its_deadline(endpoint):
    router, peers = bound(endpoint)
    assert peers.wait_all_gone(0.0)  # nobody connected
    proc = start_peer(endpoint)
    try:
        router.send_multipart([hello(router, peers), b"linger"])
        t0 = time.monotonic()
        assert not peers.wait_all_gone(0.3)
        assert 0.3 <= time.monotonic() - t0 < 5.0
        assert len(peers.open) == 1
        proc.kill()
        proc.wait()
        assert peers.wait_all_gone(10.0)  # the kill closes the connection
    finally:
        proc.kill()
        proc.wait()
        peers.close()
        router.close()
