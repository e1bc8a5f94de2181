"""The native core's own contract (kvcached.core._core): its pools, what it
accepts and refuses, how it reads tokens, and what it costs the process.

How it manages the tree is tested through the manager (scenarios, the
differential test against tests/reference/, the property test)."""

from __future__ import annotations

import array
import gc
import sys
from hashlib import blake2b

import numpy as np
import pytest
from reference.hashing import block_hashes as reference_hashes

from kvcached.core import _core

NS = blake2b(b"namespace", digest_size=16).digest()
GPU, CPU = 0, 1


def core(gpu: int = 8, cpu: int = 4, bs: int = 4, memo: bool = True) -> _core.Core:
    return _core.Core(gpu, cpu, bs, memo=memo)


def cache(c: _core.Core, tokens: list[int]) -> _core.Request:
    """Serve a prompt whose blocks are all computed: match, allocate, insert, free."""
    r = c.request(NS, tokens, b"")
    n_gpu, _, blocks = c.match(r, r.n_hashes)
    blocks += c.alloc(GPU, r.n_hashes - n_gpu)
    c.tick()
    c.insert(r, blocks, r.n_hashes)
    c.tick()
    c.unref_path(r)
    return r


# ------------------------------------------------------------------ pools
def test_allocation_takes_the_oldest_freed_ids_first():
    c = core(gpu=6)
    assert c.alloc(GPU, 3) == [0, 1, 2]
    assert c.gpu_free == 3
    c.free(GPU, [1, 0])
    assert c.alloc(GPU, 4) == [3, 4, 5, 1]
    assert c.snapshot()["gpu_free"] == [0]


def test_asking_for_more_than_is_free_changes_nothing():
    c = core(cpu=3)
    c.alloc(CPU, 2)
    with pytest.raises(ValueError, match="cpu pool: asked for 2 blocks, 1 free"):
        c.alloc(CPU, 2)
    assert c.snapshot()["cpu_free"] == [2]
    with pytest.raises(ValueError, match="asked for -1 blocks"):
        c.alloc(CPU, -1)


@pytest.mark.parametrize("ids,message", [([1, 1], "double free of block 1"),
                                         ([0, 5], "block id 5 out of range 0..3"),
                                         ([-1], "block id -1 out of range"),
                                         ([2, 9], "double free of block 2")])
def test_a_bad_free_raises_before_freeing_any_id(ids, message):
    """A double free or an id out of range means two owners of one block: it
    raises, and none of the batch is freed (the others are still owned)."""
    c = core(gpu=4)
    c.alloc(GPU, 2)  # 0 and 1 are owned; 2 and 3 are free
    with pytest.raises(ValueError, match=message):
        c.free(GPU, ids)
    assert c.snapshot()["gpu_free"] == [2, 3]


def test_front_undoes_an_allocation_exactly():
    c = core(gpu=5)
    c.alloc(GPU, 2)
    before = c.snapshot()["gpu_free"]
    taken = c.alloc(GPU, 2)
    c.free(GPU, taken, True)
    assert c.snapshot()["gpu_free"] == before


def test_the_ring_wraps_around():
    c = core(gpu=3)
    for _ in range(5):
        ids = c.alloc(GPU, 2)
        c.free(GPU, ids[::-1])
    assert sorted(c.snapshot()["gpu_free"]) == [0, 1, 2] and c.gpu_free == 3


# ---------------------------------------------------------------- requests
@pytest.mark.parametrize("make", [list, tuple, lambda t: np.array(t, dtype=np.int64),
                                  lambda t: np.array(t, dtype=np.int32),
                                  lambda t: np.array(t, dtype=np.uint16),
                                  lambda t: array.array("q", t), lambda t: array.array("i", t)],
                         ids=["list", "tuple", "int64", "int32", "uint16", "array-q", "array-i"])
def test_tokens_are_read_from_lists_tuples_and_integer_buffers(make):
    tokens = [5, 60000, 7, 8] * 3 + [1, 2]
    r = core().request(NS, make(tokens), b"x")
    assert r.hashes() == reference_hashes(NS, tokens, 4, b"x")


@pytest.mark.parametrize("bad,error,match", [
    ([1, 2, 3, 4.0], TypeError, "token 3 is a float, not an int"),
    ([1, 2, None, 4], TypeError, "token 2 is a NoneType"),
    ([1, 2, 3, 2**63], OverflowError, "token 3 is outside int64"),
    (np.array([1, 2, 3, 4], dtype=np.float32), TypeError, "signed ints"),
    (np.array([1, 2, 3, 4], dtype=np.uint64), TypeError, "signed ints"),
    (np.zeros((2, 4), dtype=np.int64), TypeError, "1-d"),
    ("abcd", TypeError, "list or tuple of ints"),
])
def test_bad_tokens_are_refused_naming_the_token(bad, error, match):
    c = core()
    with pytest.raises(error, match=match):
        c.request(NS, bad, b"")
    assert c.num_nodes == 0


def test_negative_and_wide_ids_hash_as_int64():
    tokens = [-1, 2**40, -(2**63), 2**63 - 1] * 2
    assert core().request(NS, tokens, b"").hashes() == reference_hashes(NS, tokens, 4)


def test_requests_belong_to_their_core():
    a, b = core(), core()
    r = a.request(NS, [1] * 8, b"")
    with pytest.raises(ValueError, match="another Core"):
        b.match(r, 2)
    with pytest.raises(TypeError, match="Request"):
        a.match("not a request", 2)


def test_plans_name_only_live_nodes():
    c = core()
    r = cache(c, [1] * 8)
    with pytest.raises(ValueError, match="not a live node"):
        c.finish_store([99], None)
    with pytest.raises(ValueError, match="not a live node"):
        c.finish_fetch(r, 0, [0], 1, False, True)  # the root is not a node of a plan
    with pytest.raises(ValueError, match="no store in flight"):
        c.finish_store([c.find(r.hashes()[0])], None)
    with pytest.raises(ValueError, match="path range"):
        c.plan_swap_in(r, 0, [1, 2])  # the request holds no path any more


def test_insert_refuses_a_block_table_it_cannot_trust():
    """A duplicate whose block id is free already is a corrupt block table:
    the error says so instead of freeing the id twice."""
    c = core()
    cache(c, [1] * 4 + [2] * 4)
    r = c.request(NS, [1] * 4 + [2] * 4, b"")
    c.match(r, 0)  # match nothing: both blocks look new to the request
    free_id = c.snapshot()["gpu_free"][0]
    with pytest.raises(ValueError, match="free already or out of range"):
        c.insert(r, [free_id, free_id], 2)


def test_a_new_request_hashes_only_full_blocks():
    r = core(bs=4).request(NS, list(range(11)), b"")
    assert r.n_hashes == 2 and r.hashes(1) == r.hashes()[1:]


# ------------------------------------------------------------------ costs
def test_the_tree_holds_no_python_objects():
    """Nodes are C structs: caching blocks adds nothing the collector walks,
    so a full collection costs the same at any cache size."""
    c = core(gpu=5000, cpu=0, bs=4)
    gc.collect()
    before = len(gc.get_objects())
    for k in range(400):
        cache(c, [k] * 4 + [k + 1] * 4 + [k + 2] * 4)
    gc.collect()
    assert c.num_nodes == 1200
    assert len(gc.get_objects()) - before < 50  # a few test locals, not 1200 nodes


# What the public macros of CPython's headers expand to (refcounts, None, the
# size_t variants of the argument parsers): the only private names it may use.
MACRO_SYMBOLS = {"_Py_Dealloc", "_Py_NoneStruct", "_Py_TrueStruct", "_Py_FalseStruct",
                 "_PyArg_ParseTuple_SizeT", "_PyArg_ParseTupleAndKeywords_SizeT",
                 "_Py_BuildValue_SizeT"}


def test_the_extension_uses_the_public_c_api_only():
    """No private (_Py*) or unstable (PyUnstable_*) function is called: the core
    builds on every CPython from 3.11 on (the before-stop hook greps the
    sources too; this checks what the compiler actually linked against)."""
    import shutil
    import subprocess
    if shutil.which("nm") is None:
        pytest.skip("no nm to list the extension's symbols")
    out = subprocess.run(["nm", "-D", "--undefined-only", _core.__file__], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    private = {n for n in names if n.startswith(("_Py", "PyUnstable"))} - MACRO_SYMBOLS
    assert not private, private
    assert "PyList_GetItem" in names or "PyTuple_GetItem" in names  # the slow paths exist


def test_the_core_module_is_small_and_self_contained():
    """No import of torch or numpy: the core is usable anywhere."""
    import subprocess
    code = ("import sys; from kvcached.core import _core; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_bench_memory_reports_bytes_per_cached_block():
    """scripts/bench_memory.py runs and measures something sane (its number goes
    in docs/benchmarks.md: ~380 B per 64-token block; a node is 128 B)."""
    import json
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_memory.py"
    res = subprocess.run([sys.executable, str(script), "--blocks", "40000"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["bench"] == "memory" and out["cached_blocks"] == 40000
    assert 128 <= out["bytes_per_cached_block"] < 4096, out
