"""The core's BLAKE2b chains (kvcached.core._core) against hashlib and the
reference (tests/reference/hashing.py: numpy bytes + hashlib): byte-identical
for every input form the engine may hand over, with every compress
implementation this CPU runs, at every alignment; clear errors otherwise."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from hashlib import blake2b

import numpy as np
import pytest
from reference.hashing import block_hashes as reference_hashes

from kvcached.core import _core
from kvcached.core.hashing import block_hashes, namespace_hash

I64_MIN, I64_MAX = -2**63, 2**63 - 1
EXTRA_KEYS = (None, "lora-7", b"\x00mm:\xff", ("lora", 3, b"img"), 42, "x" * 300)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randrange(0, 200_000) for _ in range(n)]
    if kind == 1:
        return [rng.randrange(I64_MIN, I64_MAX + 1) for _ in range(n)]
    if kind == 2:  # every size of int, both signs, the edges, bools
        pool = [0, 1, -1, 2**30 - 1, 2**30, -2**30, 2**60, -2**60, 2**62, I64_MIN, I64_MAX,
                True, False]
        return [rng.choice(pool) for _ in range(n)]
    return [rng.randrange(-2**40, 2**40) for _ in range(n)]


def as_input(rng: random.Random, tokens: list[int]):
    """The same tokens as a list, a tuple, numpy arrays of a few layouts, or numpy
    scalars in a list."""
    kind = rng.randrange(6)
    if kind == 0:
        return tuple(tokens)
    if kind == 1:
        return np.array(tokens, dtype=np.int64)
    if kind == 2:  # a strided view: every other element of a twice-as-long array
        twice = np.zeros(2 * len(tokens), dtype=np.int64)
        twice[::2] = tokens
        return twice[::2]
    if kind == 3:
        return np.array([t % 2**31 for t in tokens], dtype=np.int32)
    if kind == 4:
        return [np.int64(t) for t in tokens]
    return tokens


@pytest.fixture
def each_impl():
    """Runs the test body once per compress implementation, then restores the pick."""
    def names():
        for name in _core.impls():
            _core.set_impl(name)
            assert _core.impl() == name
            yield name
    before = _core.impl()
    try:
        yield names
    finally:
        _core.set_impl(before)


def test_every_impl_matches_the_reference_at_every_alignment(each_impl):
    """Extra keys of 0..300 bytes put the tokens at every byte offset of a
    128-byte BLAKE2b block, so tokens straddle blocks in every way."""
    rng = random.Random(7)
    ns = namespace_hash("model", "v1", "salt")
    cases = []
    for extra_len in range(0, 301):
        bs = (1, 2, 16, 64, 128)[extra_len % 5]
        n = bs * rng.randrange(1, 5) + rng.randrange(bs)  # a partial tail block too
        extra = bytes(rng.randrange(256) for _ in range(extra_len))
        cases.append((random_tokens(rng, n), bs, extra))
    for name in each_impl():
        for tokens, bs, extra in cases:
            want = reference_hashes(ns, tokens, bs, extra)
            full = len(tokens) // bs
            for data in (tokens, tuple(tokens), np.array(tokens, dtype=np.int64)):
                assert _core.chain(ns, data, bs, extra, 0, full) == want, (name, len(extra), bs)
            if full > 1:  # resumed mid-chain
                assert _core.chain(want[0], tokens, bs, extra, 1, full) == want[1:], name


@pytest.mark.parametrize("seed", range(3))
def test_every_impl_matches_on_random_prompts(each_impl, seed):
    rng = random.Random(100 + seed)
    ns = namespace_hash("m", str(seed))
    inputs = []
    for _ in range(25):
        n = rng.choice([rng.randrange(0, 300), rng.randrange(0, 13_000)])
        bs = rng.choice((1, 2, 16, 64, 128))
        data = as_input(rng, random_tokens(rng, n))
        extra = rng.choice(EXTRA_KEYS)
        inputs.append((data, bs, extra, reference_hashes(ns, list(data), bs, extra)))
    for name in each_impl():
        for data, bs, extra, want in inputs:
            assert block_hashes(ns, data, bs, extra) == want, (name, len(data), bs, extra)


def test_known_answers_against_hashlib():
    assert _core.chain(bytes(16), [1], 1, b"", 0, 1) == [
        blake2b(bytes(16) + struct.pack("<q", 1), digest_size=16).digest()]
    # Every message length 24..524 through the 128-byte block boundaries: the
    # last block is compressed with the final flag even when it is full.
    parent = bytes(range(16))
    for n in range(0, 501):
        extra = bytes(range(256)) * 2
        extra = extra[:n]
        want = blake2b(parent + extra + struct.pack("<q", n - 300), digest_size=16).digest()
        assert _core.chain(parent, [n - 300], 1, extra, 0, 1) == [want], n
    ns = namespace_hash("m", "1")
    tokens = list(range(1000))
    h, want = ns, []
    for i in range(len(tokens) // 64):
        h = blake2b(h + struct.pack("<64q", *tokens[i * 64:(i + 1) * 64]), digest_size=16).digest()
        want.append(h)
    assert _core.chain(ns, tokens, 64, b"", 0, len(want)) == want


def test_impl_selection():
    impls = _core.impls()
    assert impls[-1] == "portable" and set(impls) <= {"avx512", "avx2", "portable"}
    flags = cpu_flags()
    if sys.platform == "linux" and os.uname().machine == "x86_64":
        assert ("avx512" in impls) == ({"avx512f", "avx512vl"} <= flags), (impls, flags)
        assert ("avx2" in impls) == ("avx2" in flags), (impls, flags)
    # A fresh process picks the best one this CPU runs.
    out = subprocess.run([sys.executable, "-c", "from kvcached.core import _core; "
                          "print(_core.impl())"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == impls[0]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_set_impl_switches_and_rejects_bad_names():
    before = _core.impl()
    try:
        assert _core.set_impl("portable") == before and _core.impl() == "portable"
        with pytest.raises(ValueError, match="unknown or not supported"):
            _core.set_impl("sse9")
        with pytest.raises(TypeError):
            _core.set_impl(2)
        assert _core.impl() == "portable"  # a failed switch changes nothing
    finally:
        _core.set_impl(before)


def test_bad_arguments_are_named():
    ns = namespace_hash("m", "1")
    with pytest.raises(OverflowError, match="token 2 is outside int64"):
        _core.chain(ns, [1, 2, 2**63, 3], 2, b"", 0, 2)
    with pytest.raises(TypeError, match="token 1 is a NoneType"):
        _core.chain(ns, (1, None), 2, b"", 0, 1)
    with pytest.raises(TypeError, match="signed ints"):
        _core.chain(ns, np.zeros(4, dtype=np.float64), 2, b"", 0, 1)
    with pytest.raises(TypeError, match="tokens must be"):
        _core.chain(ns, {1, 2}, 1, b"", 0, 1)
    with pytest.raises(TypeError, match="parent must be bytes"):
        _core.chain("ns", [1, 2], 1, b"", 0, 1)
    with pytest.raises(TypeError, match="extra must be bytes"):
        _core.chain(ns, [1, 2], 1, "x", 0, 1)
    with pytest.raises(ValueError, match="ends past"):
        _core.chain(ns, [1, 2, 3], 2, b"", 0, 2)  # only one full block
    with pytest.raises(ValueError, match="block_size > 0"):
        _core.chain(ns, [1, 2, 3], 0, b"", 0, 1)
    with pytest.raises(ValueError, match="16 bytes"):
        _core.chain(b"short", [1, 2], 1, b"", 0, 1)
    # Outside the hashed range a bad item is never read.
    assert block_hashes(ns, list(range(8)) + [None], 4) == reference_hashes(ns, list(range(8)), 4)
