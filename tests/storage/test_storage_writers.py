"""Several processes writing one file store (a fleet of engines on one node):
one size cap for all of them, cleanup that reaches every writer's objects,
and a writer killed with SIGKILL mid-save leaves nothing a reader takes as data.

Writers are real processes (forked: the store is all they need), started
together on an event; every wait has a deadline.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest_storage import make_hashes, make_pool, make_store, wait_until  # noqa: E402

from kvcached.layout import KVLayout  # noqa: E402
from kvcached.storage import HEADER_SIZE  # noqa: E402
from kvcached.storage.file import TMP_PREFIX, FileBackend  # noqa: E402
from kvcached.storage.ledger import SharedLedger  # noqa: E402

CTX = multiprocessing.get_context("fork")
OBJ = 4096  # bytes per raw object
SMALL = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32")
DEADLINE = 20.0


def payload(name: str, i: int) -> bytes:
    """The deterministic bytes of object ``i`` of writer ``name``."""
    seed = hashlib.blake2b(f"{name}/{i}".encode()).digest()
    return (seed * (OBJ // len(seed) + 1))[:OBJ]


def key(name: str, i: int) -> str:
    return f"ns/{name}-{i:04d}"


def on_disk(root: Path) -> dict[str, int]:
    """Object files (not temp files, the marker or ledgers) and their sizes."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and p.parent != root and not p.name.startswith(".")}


def ledger_total(root: Path, name: str = ".usage") -> int:
    led = SharedLedger(root / name)
    try:
        return led.read()
    finally:
        led.close()


def join(proc, what: str) -> int:
    proc.join(DEADLINE)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"{what} did not finish within {DEADLINE}s")
    return proc.exitcode


# ----------------------------------------------------------------- writers
def _write_many(root: str, cap: int, name: str, n: int, go, results) -> None:
    be = FileBackend(root, max_bytes=cap)
    if not go.wait(DEADLINE):
        os._exit(3)
    ok = sum(be.put_from([key(name, i)], [payload(name, i)])[0] for i in range(n))
    be.close()
    results.put((name, ok))


def test_two_writers_share_one_cap(tmp_path):
    """Two processes write 60 objects each at once into a store capped at 20:
    the store ends at most at the cap (each writer alone would keep 20 of its
    own: 40), the ledger matches the files, every object reads back whole."""
    root, cap = tmp_path / "store", 20 * OBJ
    FileBackend(root, max_bytes=cap).close()
    go, results = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_write_many, args=(str(root), cap, w, 60, go, results))
             for w in ("a", "b")]
    for p in procs:
        p.start()
    go.set()
    assert [join(p, "writer") for p in procs] == [0, 0]
    assert sorted(results.get(timeout=DEADLINE) for _ in procs) == [("a", 60), ("b", 60)]

    files = on_disk(root)
    assert sum(files.values()) <= cap and len(files) >= 19  # full, not over
    assert ledger_total(root) == sum(files.values())
    reader = FileBackend(root, max_bytes=cap)
    assert reader.stats()["bytes_used"] == sum(files.values())  # a recount agrees
    keys = [f"ns/{w}-{i:04d}" for w in "ab" for i in range(60)]
    present = reader.exists(keys)
    # Oldest first, whoever wrote it: what survives of each writer is its
    # newest objects (which writer finished last depends on scheduling).
    for w in (present[:60], present[60:]):
        assert w == sorted(w), "an object survived one its writer wrote later"
    assert present[59] or present[119]
    bufs = [bytearray(OBJ) for _ in keys]
    got = reader.get_into(keys, bufs)
    for k, ok, n, buf in zip(keys, present, got, bufs, strict=True):
        name, i = k[3], int(k[5:])
        assert (n == OBJ and bytes(buf) == payload(name, i)) if ok else n == -1


def test_cleanup_reaches_the_other_writers_objects(tmp_path):
    """Writer a fills most of the cap and stops; writer b's cleanup evicts a's
    (older) objects before its own: the survivors are exactly the newest."""
    root, cap = tmp_path / "store", 20 * OBJ
    a, b = FileBackend(root, max_bytes=cap), FileBackend(root, max_bytes=cap)
    for i in range(15):
        assert a.put_from([key("a", i)], [payload("a", i)]) == [True]
    for i in range(30):
        assert b.put_from([key("b", i)], [payload("b", i)]) == [True]
    survivors = [k for k in (key(w, i) for w in "ab" for i in range(30)) if b.exists([k])[0]]
    assert survivors == [key("b", i) for i in range(10, 30)]
    assert ledger_total(root) == sum(on_disk(root).values()) == cap
    # a's index still names its evicted objects: they are misses, and its own
    # cleanup never counts them twice.
    assert a.exists([key("a", 0)]) == [False]
    assert a.put_from([key("a", 99)], [payload("a", 99)]) == [True]
    assert ledger_total(root) == sum(on_disk(root).values()) == cap
    a.close()
    b.close()


def test_deleting_and_clearing_keep_the_ledger(tmp_path):
    root = tmp_path / "store"
    a, b = FileBackend(root), FileBackend(root)
    a.put_from([key("a", i) for i in range(4)], [payload("a", i) for i in range(4)])
    b.delete([key("a", 0), key("a", 0), key("missing", 1)])  # twice: counted once
    assert ledger_total(root) == 3 * OBJ
    b.clear()
    assert ledger_total(root) == 0 and a.stats()["bytes_used"] == 0


def test_a_recount_at_open_repairs_the_ledger(tmp_path):
    root = tmp_path / "store"
    a = FileBackend(root)
    a.put_from([key("a", i) for i in range(3)], [payload("a", i) for i in range(3)])
    with a._ledger.locked():
        a._ledger.write(123)  # as a writer killed between rename and update leaves it
    assert FileBackend(root).stats()["bytes_used"] == 3 * OBJ


def test_a_stuck_holder_fails_writes_instead_of_hanging(tmp_path):
    root = tmp_path / "store"
    a, b = FileBackend(root), FileBackend(root)
    b._ledger.timeout_s = 0.2
    with a._ledger.locked():  # another process would block the same way
        assert b.put_from([key("b", 0)], [payload("b", 0)]) == [False]
    assert "held the ledger" in b.stats()["last_error"]
    assert [p for p in root.rglob(f"{TMP_PREFIX}*")] == []
    assert b.put_from([key("b", 0)], [payload("b", 0)]) == [True]


def test_a_stuck_holder_fails_a_batch_in_one_timeout(tmp_path):
    """The objects of one write share the ledger's timeout: a write of 40
    blocks against a stuck holder fails after one timeout, not forty (a
    worker's write must end long before its task times out)."""
    root = tmp_path / "store"
    a, b = FileBackend(root), FileBackend(root)
    b._ledger.timeout_s = 0.1
    n = 40
    with a._ledger.locked():
        t0 = time.monotonic()
        assert b.put_from([key("b", i) for i in range(n)],
                          [payload("b", i) for i in range(n)]) == [False] * n
        took = time.monotonic() - t0
    assert took < n * b._ledger.timeout_s / 4, took  # one timeout each: 4 s
    assert [p for p in root.rglob(f"{TMP_PREFIX}*")] == []


# ------------------------------------------------------------------ SIGKILL
def _store_then_tear(root: str, n_whole: int, torn, results) -> None:
    """Store ``n_whole`` blocks, then start one more and stop halfway through
    writing it (until killed)."""
    import threading

    from kvcached.storage import file as file_mod

    bs = make_store(FileBackend(root), layout=SMALL)
    pool, hashes = make_pool(n_whole + 1, layout=SMALL), make_hashes(n_whole + 1)
    assert all(bs.store(hashes[:n_whole], pool, list(range(n_whole))))

    def half(fd, parts):
        os.write(fd, bytes(parts[0])[:HEADER_SIZE] + bytes(100))
        torn.set()
        threading.Event().wait(DEADLINE)  # killed here

    file_mod._writev_all = half
    results.put(os.getpid())
    bs.store(hashes[n_whole:], pool, [n_whole])


def test_sigkill_mid_write_leaves_only_whole_objects(tmp_path):
    root = tmp_path / "store"
    torn, results = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_store_then_tear, args=(str(root), 3, torn, results))
    proc.start()
    assert torn.wait(DEADLINE), "the writer never reached its torn write"
    os.kill(proc.pid, signal.SIGKILL)
    assert join(proc, "killed writer") == -signal.SIGKILL

    temps = list(root.rglob(f"{TMP_PREFIX}{proc.pid}-*"))
    assert len(temps) == 1  # the torn object exists, under a temporary name only
    reader = make_store(FileBackend(root), layout=SMALL)
    pool, hashes = make_pool(4, layout=SMALL), make_hashes(4)
    assert reader.lookup(hashes) == 3 and reader.backend.exists(reader.keys(hashes[3:])) == [False]
    out = make_pool(4, seed=9, layout=SMALL)
    assert reader.load(hashes, out, [0, 1, 2, 3]) == 3
    assert bool((out[:3] == pool[:3]).all())
    obj = HEADER_SIZE + SMALL.block_bytes
    assert reader.backend.stats()["bytes_used"] == 3 * obj  # the temp file is not counted
    # A temp file older than any write in progress is a crashed writer's: removed.
    os.utime(temps[0], (0, 0))
    FileBackend(root)
    assert not temps[0].exists()


def _write_forever(root: str, written) -> None:
    bs = make_store(FileBackend(root), layout=SMALL)
    pool = make_pool(8, layout=SMALL)
    for i in range(100_000):
        h = hashlib.blake2b(f"obj/{i}".encode(), digest_size=16).digest()
        bs.store([h], pool, [i % 8])
        written.value = i + 1


def test_sigkill_at_any_moment_then_a_reader_sees_only_whole_objects(tmp_path):
    root = tmp_path / "store"
    written = CTX.Value("i", 0)
    proc = CTX.Process(target=_write_forever, args=(str(root), written))
    proc.start()
    wait_until(lambda: written.value >= 40, DEADLINE, "40 objects written")
    os.kill(proc.pid, signal.SIGKILL)
    assert join(proc, "killed writer") == -signal.SIGKILL

    n = written.value + 1  # the one in progress, maybe renamed already
    hashes = [hashlib.blake2b(f"obj/{i}".encode(), digest_size=16).digest() for i in range(n)]
    pool = make_pool(8, layout=SMALL)
    reader = make_store(FileBackend(root), layout=SMALL)
    present = reader.backend.exists(reader.keys(hashes))
    assert all(present[:-1])  # every completed store is there
    for i in [i for i, p in enumerate(present) if p]:  # each one intact
        out = make_pool(1, seed=7, layout=SMALL)
        assert reader.load([hashes[i]], out, [0]) == 1, f"object {i} is not whole"
        assert bool((out[0] == pool[i % 8]).all())
    assert reader.stats()["damaged_deleted"] == 0
    assert ledger_total(root) == sum(on_disk(root).values())


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    for p in multiprocessing.active_children():
        p.kill()
