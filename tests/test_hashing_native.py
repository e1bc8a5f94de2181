"""Native block hashing (cuda/block_hash.c) against the pure-Python reference.

``kvcached.core.hashing.block_hashes`` routes to the C extension when it builds;
``_block_hashes_py`` (numpy + hashlib) is the reference. Every result must be
byte-identical, errors must have the reference's exception types, and the
Python path must still work when the native one is off or cannot be built.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import sysconfig
import time
from hashlib import blake2b

import numpy as np
import pytest

import kvcached.core.hashing as hashing
from kvcached.core.hashing import _block_hashes_py, block_hashes, namespace_hash

I64_MIN, I64_MAX = -2**63, 2**63 - 1
BLOCK_SIZES = (1, 2, 16, 64, 256)
EXTRA_KEYS = (None, "lora-7", b"\x00mm:\xff", ("lora", 3, b"img"), 42, "x" * 300)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randrange(0, 200_000) for _ in range(n)]
    if kind == 1:
        return [rng.randrange(I64_MIN, I64_MAX + 1) for _ in range(n)]
    if kind == 2:  # every size of int: 1, 2 and 3 CPython digits, both signs, the edges
        pool = [0, 1, -1, 2**30 - 1, 2**30, -2**30, 2**60 - 1, 2**60, -2**60, 2**62,
                I64_MIN, I64_MAX, I64_MIN + 1, I64_MAX - 1, True, False]
        return [rng.choice(pool) for _ in range(n)]
    return [rng.randrange(-2**40, 2**40) for _ in range(n)]


def as_input(rng: random.Random, tokens: list[int]):
    """The same tokens as a list, a tuple or a numpy array of a few layouts."""
    kind = rng.randrange(6)
    if kind == 0:
        return tuple(tokens)
    if kind == 1:
        return np.array(tokens, dtype=np.int64)
    if kind == 2:  # a non-contiguous view: every other element of a twice-as-long array
        twice = np.zeros(2 * len(tokens), dtype=np.int64)
        twice[::2] = tokens
        return twice[::2]
    if kind == 3:
        small = [t % 2**31 for t in tokens]
        return np.array(small, dtype=np.int32)
    if kind == 4:  # numpy scalars in a list: not ints, so the reference path (same bytes)
        return [np.int64(t) for t in tokens]
    return tokens


# ------------------------------------------------------------- equivalence
def test_native_is_used(native):
    assert hashing.load_native() is native
    assert hashing._native is native  # cached in the module global: built and loaded once
    assert hashing.native_error() is None


@pytest.mark.parametrize("seed", range(8))
def test_random_inputs_match_the_reference(native, seed):
    rng = random.Random(seed)
    ns = namespace_hash("model", str(seed))
    for _ in range(40):
        n = rng.choice([0, 1, rng.randrange(0, 300), rng.randrange(0, 5001)])
        bs = rng.choice(BLOCK_SIZES)
        tokens = random_tokens(rng, n)
        data = as_input(rng, tokens)
        extra = rng.choice(EXTRA_KEYS)
        full = n // bs
        start = rng.choice([0, 0, rng.randrange(0, full + 2)])
        stop = rng.choice([None, rng.randrange(0, full + 3), full + 10])
        parent = rng.choice([ns, b"", b"ideal", os.urandom(rng.randrange(0, 300))])
        want = _block_hashes_py(parent, data, bs, extra, start, stop)
        got = block_hashes(parent, data, bs, extra, start, stop)
        assert got == want, (n, bs, type(data).__name__, extra, start, stop)


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_direct_chain_matches_for_lists_tuples_and_arrays(native, bs):
    rng = random.Random(bs)
    tokens = random_tokens(rng, 5000)
    ns = namespace_hash("m", "1")
    full = len(tokens) // bs
    want = _block_hashes_py(ns, tokens, bs, "k")
    arr = np.array(tokens, dtype=np.int64)
    for data in (tokens, tuple(tokens), arr, memoryview(arr)):
        assert native.chain(ns, data, bs, b"k", 0, full) == want, type(data).__name__
    mid = full // 2
    assert native.chain(want[mid - 1], tokens, bs, b"k", mid, full) == want[mid:]
    assert native.chain(ns, tokens, bs, b"k", 3, 3) == []


def test_chaining_in_pieces_equals_at_once(native):
    ns = namespace_hash("m", "1")
    tokens = list(range(-500, 500))
    whole = block_hashes(ns, tokens, 16, "x")
    assert whole == _block_hashes_py(ns, tokens, 16, "x")
    for cut in (0, 1, 7, 30, 62, 99):
        head = block_hashes(ns, tokens, 16, "x", stop=cut)
        tail = block_hashes(head[-1] if head else ns, tokens, 16, "x", start=cut)
        assert head + tail == whole


def test_known_answers_against_hashlib(native):
    # Pinned bytes (an independent check of the BLAKE2b parameter block).
    assert native.chain(bytes(16), [1], 1, b"", 0, 1) == [
        bytes.fromhex("8d7ec495a76038357ec1ff0d6f5f3ba8")]
    assert native.chain(b"kvc", [-1, I64_MAX], 2, b"x" * 125, 0, 1) == [
        bytes.fromhex("ea5b88d8dd3b0d93f32b20aff40f6028")]
    # Every message length 8..520 through the 128-byte block boundaries: the
    # last block is compressed with the final flag even when it is full.
    for plen in range(0, 513):
        parent = bytes(range(256)) * 2
        parent = parent[:plen]
        for extra in (b"", b"e" * (plen % 7)):
            msg = parent + extra + struct.pack("<q", plen - 300)
            want = blake2b(msg, digest_size=16).digest()
            assert native.chain(parent, [plen - 300], 1, extra, 0, 1) == [want], (plen, extra)
    # Long messages (one 64-token block is 4 full 128-byte blocks plus the rest).
    ns = namespace_hash("m", "1")
    tokens = list(range(1000))
    h, want = ns, []
    for i in range(len(tokens) // 64):
        h = blake2b(h + struct.pack("<64q", *tokens[i * 64:(i + 1) * 64]), digest_size=16).digest()
        want.append(h)
    assert native.chain(ns, tokens, 64, b"", 0, len(want)) == want


# ------------------------------------------------------- compress impls
# The extension picks its BLAKE2b compress at import (AVX-512VL, AVX2 or
# portable C, by what the CPU runs); set_impl switches it process-wide. Every
# impl this machine runs is checked against the reference, not only the pick.
def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.fixture
def each_impl(native):
    """Runs the test body once per impl (a generator of names), then restores the pick."""
    def names():
        for name in native.impls():
            native.set_impl(name)
            assert native.impl() == name
            yield name
    before = native.impl()
    try:
        yield names
    finally:
        native.set_impl(before)


def test_every_impl_matches_the_reference_at_every_alignment(native, each_impl):
    """Prefix (parent || extra) lengths 16..316 put the tokens at every byte
    offset of a 128-byte block, so tokens straddle blocks in every way."""
    rng = random.Random(7)
    ns = namespace_hash("model", "v1", "salt")
    cases = []
    for extra_len in range(0, 301):
        bs = (1, 2, 16, 64, 128)[extra_len % 5]
        n = bs * rng.randrange(1, 5) + rng.randrange(bs)  # a partial tail block too
        tokens = random_tokens(rng, n)
        parent = ns if extra_len % 3 else os.urandom(rng.randrange(0, 300))
        extra = bytes(rng.randrange(256) for _ in range(extra_len))
        cases.append((parent, tokens, bs, extra))
    for name in each_impl():
        for parent, tokens, bs, extra in cases:
            want = _block_hashes_py(parent, tokens, bs, extra)
            full = len(tokens) // bs
            arr = np.array(tokens, dtype=np.int64)
            for data in (tokens, tuple(tokens), arr):
                assert native.chain(parent, data, bs, extra, 0, full) == want, \
                    (name, len(parent), len(extra), bs, type(data).__name__)
            assert block_hashes(parent, tokens, bs, extra) == want, name
            if full > 1:  # resumed mid-chain, as the manager does
                assert native.chain(want[0], arr, bs, extra, 1, full) == want[1:], name


@pytest.mark.parametrize("seed", range(3))
def test_every_impl_matches_on_random_prompts(native, each_impl, seed):
    rng = random.Random(100 + seed)
    ns = namespace_hash("m", str(seed))
    inputs = []
    for _ in range(25):
        n = rng.choice([rng.randrange(0, 300), rng.randrange(0, 13_000)])
        bs = rng.choice((1, 2, 16, 64, 128))
        data = as_input(rng, random_tokens(rng, n))  # lists, tuples, arrays of a few layouts
        extra = rng.choice(EXTRA_KEYS)
        inputs.append((data, bs, extra, _block_hashes_py(ns, data, bs, extra)))
    for name in each_impl():
        for data, bs, extra, want in inputs:
            assert block_hashes(ns, data, bs, extra) == want, (name, len(data), bs, extra)


def test_impl_selection(native):
    impls = native.impls()
    assert impls[-1] == "portable" and len(set(impls)) == len(impls)
    assert set(impls) <= {"avx512", "avx2", "portable"}
    flags = cpu_flags()
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert ("avx512" in impls) == ({"avx512f", "avx512vl"} <= flags), (impls, flags)
        assert ("avx2" in impls) == ("avx2" in flags), (impls, flags)
    else:
        assert impls == ("portable",)
    # A fresh process picks the best one this CPU runs.
    code = ("import importlib.util, sys, json\n"
            "spec = importlib.util.spec_from_file_location('kvc_hashing', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
            "nat = mod.load_native()\n"
            "print(json.dumps([nat.impl(), list(nat.impls())]))\n")
    proc = subprocess.run([sys.executable, "-c", code, hashing.__file__], capture_output=True,
                          text=True, timeout=300, check=True)
    picked, listed = json.loads(proc.stdout)
    assert listed == list(impls) and picked == impls[0]


def test_set_impl_switches_and_rejects_bad_names(native):
    before = native.impl()
    try:
        assert native.set_impl("portable") == before
        assert native.impl() == "portable"
        assert native.set_impl(before) == "portable"
        assert native.impl() == before
        with pytest.raises(ValueError, match="unknown or unsupported"):
            native.set_impl("sse9")
        with pytest.raises(TypeError, match="str"):
            native.set_impl(2)
        assert native.impl() == before  # a failed switch changes nothing
    finally:
        native.set_impl(before)


# ---------------------------------------------------------------- errors
def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - the exception type is what is compared
        return ("raised", type(e))


@pytest.mark.parametrize("bad", [2**63, I64_MIN - 1, 2**64 - 1, 2**100, -2**100,
                                 None, "x", object(), 1 + 0j, [1], 1.5, float("nan"),
                                 1e30, "5", b"7", np.int64(5), np.uint64(2**64 - 1),
                                 np.float64(2.5), np.int32(-3), True])
@pytest.mark.parametrize("container", [list, tuple])
def test_odd_items_behave_as_in_the_reference(native, bad, container):
    """Same result or same exception type as the numpy path, item by item."""
    ns = namespace_hash("m", "1")
    for pos in (0, 5, 13):
        tokens = list(range(16))
        tokens[pos] = bad
        data = container(tokens)
        want = outcome(_block_hashes_py, ns, data, 4, "k")
        got = outcome(block_hashes, ns, data, 4, "k")
        assert got == want, (bad, pos)
    # Outside the hashed range a bad item is never read, as in the reference.
    data = container(list(range(8)) + [bad])
    assert block_hashes(ns, data, 4) == _block_hashes_py(ns, data, 4)
    assert block_hashes(ns, container([bad] + list(range(8))), 4, start=1) == \
        _block_hashes_py(ns, container([bad] + list(range(8))), 4, start=1)


def test_native_raises_overflow_and_type_errors_itself(native):
    ns = namespace_hash("m", "1")
    for big in (2**63, I64_MIN - 1, 2**200):
        with pytest.raises(OverflowError, match="int64"):
            native.chain(ns, [1, 2, big, 3], 2, b"", 0, 2)
    assert native.chain(ns, [I64_MIN, I64_MAX], 2, b"", 0, 1) == \
        _block_hashes_py(ns, [I64_MIN, I64_MAX], 2)
    with pytest.raises(TypeError, match="token 1 is a NoneType"):
        native.chain(ns, (1, None), 2, b"", 0, 1)
    with pytest.raises(TypeError, match="token 0 is a float"):
        native.chain(ns, [1.0, 2], 2, b"", 0, 1)
    with pytest.raises(TypeError, match="int64"):
        native.chain(ns, np.zeros(4, dtype=np.float64), 2, b"", 0, 1)
    with pytest.raises(TypeError, match="int64"):
        native.chain(ns, np.zeros(4, dtype=np.int32), 2, b"", 0, 1)
    with pytest.raises(TypeError):
        native.chain(ns, np.zeros(8, dtype=np.int64)[::2], 2, b"", 0, 1)  # not contiguous
    with pytest.raises(TypeError, match="tokens must be"):
        native.chain(ns, {1, 2}, 1, b"", 0, 1)
    with pytest.raises(TypeError, match="parent must be bytes"):
        native.chain("ns", [1, 2], 1, b"", 0, 1)
    with pytest.raises(TypeError, match="extra must be bytes"):
        native.chain(ns, [1, 2], 1, "x", 0, 1)
    with pytest.raises(TypeError, match="6 arguments"):
        native.chain(ns, [1, 2], 1)
    with pytest.raises(ValueError, match="not within"):
        native.chain(ns, [1, 2, 3], 2, b"", 0, 2)  # only one full block
    with pytest.raises(ValueError, match="not within"):
        native.chain(ns, [1, 2, 3], 1, b"", -1, 2)
    with pytest.raises(ValueError, match="block_size"):
        native.chain(ns, [1, 2, 3], 0, b"", 0, 1)


def test_odd_arguments_behave_as_in_the_reference(native):
    ns = namespace_hash("m", "1")
    tokens = list(range(40))
    cases = [
        (bytearray(ns), tokens, 4, None, 0, None),     # parent not bytes: works in both
        (memoryview(ns), tokens, 4, None, 0, None),    # ... raises in both
        ("ns", tokens, 4, None, 0, None),
        (ns, tokens, 4, None, -3, None),               # negative start: the slice semantics
        (ns, tokens, 4, None, np.int64(2), np.int64(6)),
        (ns, tokens, 4, 1.5, 0, None),                 # bad extra key
        (ns, tokens, 4, 1.5, 5, 5),                    # ... not looked at when nothing is hashed
        (ns, tokens, 0, None, 0, None),                # ZeroDivisionError in both
        (ns, tokens, -4, None, 0, None),
        (ns, range(40), 4, "r", 1, None),
        (ns, np.arange(40).reshape(10, 4), 4, None, 0, None),  # 2-D: the reference's bytes
        (ns, np.arange(40, dtype=np.uint64), 4, None, 0, None),
        (ns, np.linspace(0, 10, 40), 4, None, 0, None),
    ]
    for case in cases:
        assert outcome(block_hashes, *case) == outcome(_block_hashes_py, *case), case


# -------------------------------------------------------------- fallback
# The children load hashing.py by path, as test_hashing.py does: no torch import.
CHILD = """
import importlib.util, json, logging, sys
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
spec = importlib.util.spec_from_file_location("kvc_hashing", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
ns = mod.namespace_hash("model-x", "v3", "s")
tokens = list(range(-100, 1000))
out = [h.hex() for h in mod.block_hashes(ns, tokens, 16, extra_key="lora")]
out += [h.hex() for h in mod.block_hashes(ns, tokens, 16, extra_key="lora")]  # warns once only
nb = sys.modules.get("_kvcached_native_build")
print(json.dumps({"hashes": out, "native": mod._native is not None, "error": mod.native_error(),
                  "compiles": nb.compile_count if nb else None}))
"""


def run_child(**env: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", CHILD, hashing.__file__],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(proc.stdout), proc.stderr


def expected_child_hashes() -> list[str]:
    ns = namespace_hash("model-x", "v3", "s")
    one = [h.hex() for h in _block_hashes_py(ns, list(range(-100, 1000)), 16, "lora")]
    return one + one


def test_kvcached_no_native_forces_the_python_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    out, err = run_child(**env, KVCACHED_NO_NATIVE="1", KVCACHED_CACHE_DIR=str(tmp_path))
    assert out["native"] is False
    assert "KVCACHED_NO_NATIVE" in out["error"]
    assert out["hashes"] == expected_child_hashes()
    assert "LOG WARNING" not in err  # asked for: nothing to warn about
    assert list(tmp_path.iterdir()) == []  # and nothing was built


@pytest.mark.parametrize("how", ["no_compiler", "build_error"])
def test_falls_back_with_one_warning_when_it_cannot_build(tmp_path, how):
    env = {**os.environ, "KVCACHED_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVCACHED_NO_NATIVE", None)
    if how == "no_compiler":
        empty = tmp_path / "bin"
        empty.mkdir()
        env.update(PATH=str(empty), CC="")
    else:
        env.update(CC="false")  # found, but every build fails
    proc = subprocess.run([sys.executable, "-c", CHILD, hashing.__file__], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    out = json.loads(proc.stdout)
    assert out["native"] is False
    assert out["error"].startswith("CompilerNotFound" if how == "no_compiler" else "BuildError")
    assert out["hashes"] == expected_child_hashes()
    assert proc.stderr.count("LOG WARNING") == 1, proc.stderr
    assert "native block hashing unavailable" in proc.stderr


def test_child_reuses_the_cached_build(native, tmp_path):
    cache = tmp_path / "cache"
    first, _ = run_child(KVCACHED_CACHE_DIR=str(cache))
    again, _ = run_child(KVCACHED_CACHE_DIR=str(cache))
    assert first["native"] and again["native"]
    assert first["compiles"] == 1 and again["compiles"] == 0
    assert first["hashes"] == again["hashes"] == expected_child_hashes()
    [lib] = cache.glob("kvc_block_hash*.so")
    assert sysconfig.get_config_var("EXT_SUFFIX").removesuffix(".so") in lib.name


# ----------------------------------------------------------------- speed
def per_block_us(fn, tokens: list[int], bs: int, reps: int = 20) -> float:
    blocks = len(tokens) // bs
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(b"\x00" * 16, tokens, bs)
        best = min(best, (time.perf_counter() - t0) / reps / blocks * 1e6)
    return best


def test_speed_report(native):
    """Printed, not asserted (shared CI cores): µs per 64-token block, 12,544 tokens."""
    rng = random.Random(0)
    tokens = [rng.randrange(0, 128_000) for _ in range(12_544)]
    assert block_hashes(b"\x00" * 16, tokens, 64) == _block_hashes_py(b"\x00" * 16, tokens, 64)
    nat = per_block_us(block_hashes, tokens, 64)
    py = per_block_us(_block_hashes_py, tokens, 64)
    arr = np.array(tokens)
    nat_arr = per_block_us(lambda p, t, bs: block_hashes(p, arr, bs), tokens, 64)
    print(f"\nblock_hashes, 12,544 tokens, 64-token blocks: native {nat:.2f} us/block "
          f"(numpy array {nat_arr:.2f}), python {py:.2f} us/block, {py / nat:.1f}x")
