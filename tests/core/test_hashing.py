"""Chained block hashes: the DESIGN formula, stable across processes, and every input counts.

``h_i = blake2b(h_{i-1} || extra_key || tokens_i as little-endian int64, 16 B)``,
``h_{-1} = namespace_hash(model_id, weight_version, salt)``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from hashlib import blake2b

import numpy as np
import pytest

import kvcached.core.hashing
from kvcached.core.hashing import DIGEST, block_hashes, namespace_hash

BS = 4
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 2**40, -1, 0, 31999, 9]  # 3 full blocks + 1 token


def by_hand(parent: bytes, tokens: list[int], bs: int, extra: bytes = b"") -> list[bytes]:
    """The DESIGN formula written out with struct, independent of the module's numpy path."""
    out, h = [], parent
    for i in range(len(tokens) // bs):
        chunk = b"".join(struct.pack("<q", t) for t in tokens[i * bs:(i + 1) * bs])
        h = blake2b(h + extra + chunk, digest_size=16).digest()
        out.append(h)
    return out


def test_known_answer_vector():
    ns = namespace_hash("m", "1", "")
    assert ns == blake2b(b"kvcached/v1\x00m\x001\x00", digest_size=16).digest()
    assert block_hashes(ns, TOKENS, BS) == by_hand(ns, TOKENS, BS)
    # Pinned bytes: a change of the formula breaks every stored cache, so it must be loud.
    first = blake2b(ns + struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    assert block_hashes(ns, TOKENS, BS)[0] == first
    assert len(first) == DIGEST == 16


def test_known_answer_with_extra_key():
    ns = namespace_hash("m", "1")
    assert block_hashes(ns, TOKENS, BS, extra_key="lora-7") == by_hand(ns, TOKENS, BS, b"lora-7")
    assert block_hashes(ns, TOKENS, BS, extra_key=b"\x00\x01") == by_hand(ns, TOKENS, BS,
                                                                           b"\x00\x01")
    assert block_hashes(ns, TOKENS, BS, extra_key=("a", 5)) == by_hand(ns, TOKENS, BS, b"a\x1f5")


def test_partial_blocks_are_not_hashed():
    ns = namespace_hash("m", "1")
    assert len(block_hashes(ns, TOKENS, BS)) == 3
    assert block_hashes(ns, TOKENS[:3], BS) == []
    assert block_hashes(ns, TOKENS[:12], BS) == block_hashes(ns, TOKENS, BS)
    assert block_hashes(ns, [], BS) == []


def test_start_stop_chaining_equals_hashing_at_once():
    ns = namespace_hash("m", "1")
    tokens = list(range(10 * BS + 2))
    whole = block_hashes(ns, tokens, BS, extra_key="x")
    for cut in range(0, 11):
        head = block_hashes(ns, tokens, BS, "x", start=0, stop=cut)
        parent = head[-1] if head else ns
        tail = block_hashes(parent, tokens, BS, "x", start=cut)
        assert head + tail == whole, cut
    # Three pieces, and a stop beyond the full blocks is clipped.
    a = block_hashes(ns, tokens, BS, "x", stop=3)
    b = block_hashes(a[-1], tokens, BS, "x", start=3, stop=7)
    c = block_hashes(b[-1], tokens, BS, "x", start=7, stop=99)
    assert a + b + c == whole
    assert block_hashes(ns, tokens, BS, start=5, stop=5) == []


def test_numpy_and_list_inputs_agree():
    ns = namespace_hash("m", "1")
    assert block_hashes(ns, np.array(TOKENS), BS) == block_hashes(ns, TOKENS, BS)
    assert block_hashes(ns, tuple(TOKENS), BS) == block_hashes(ns, TOKENS, BS)


@pytest.mark.parametrize("change", [("model-b", "1", ""), ("model-a", "2", ""),
                                    ("model-a", "1", "salt")])
def test_namespace_changes_every_hash(change):
    base = block_hashes(namespace_hash("model-a", "1", ""), TOKENS, BS)
    other = block_hashes(namespace_hash(*change), TOKENS, BS)
    assert all(x != y for x, y in zip(base, other, strict=True))


def test_namespace_fields_do_not_run_together():
    # A separator keeps ("ab", "c") and ("a", "bc") apart.
    assert namespace_hash("ab", "c") != namespace_hash("a", "bc")
    assert namespace_hash("a", "b", "") != namespace_hash("a", "b", "\x00")


@pytest.mark.parametrize("extra", ["lora-1", b"mm:abc", 7, ("lora-1", "img")])
def test_extra_key_changes_every_hash(extra):
    ns = namespace_hash("m", "1")
    base = block_hashes(ns, TOKENS, BS)
    other = block_hashes(ns, TOKENS, BS, extra_key=extra)
    assert all(x != y for x, y in zip(base, other, strict=True))
    assert block_hashes(ns, TOKENS, BS, extra_key=extra) == other  # deterministic


def test_distinct_extra_keys_differ():
    ns = namespace_hash("m", "1")
    hashes = {tuple(block_hashes(ns, TOKENS, BS, extra_key=k))
              for k in ("lora-1", "lora-2", b"lora-1x", ("lora-1", "x"))}
    assert len(hashes) == 4


def test_chaining_makes_a_block_depend_on_its_prefix():
    ns = namespace_hash("m", "1")
    a = block_hashes(ns, [1] * BS + [2] * BS, BS)
    b = block_hashes(ns, [3] * BS + [2] * BS, BS)
    assert a[1] != b[1]  # same tokens in block 1, different prefix


def test_bad_extra_key_type():
    with pytest.raises(TypeError, match="extra_key must be bytes, str, int or a tuple"):
        block_hashes(namespace_hash("m", "1"), TOKENS, BS, extra_key=1.5)


# The child loads hashing.py by path: importing the package would pull in torch
# (seconds per process) for a module that needs only numpy and hashlib.
CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("kvc_hashing", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
ns = mod.namespace_hash("model-x", "v3", "s")
out = [[h.hex() for h in mod.block_hashes(ns, list(range(37)), 8, extra_key=key)]
       for key in (None, "lora", ("lora", 3), b"mm")]
print(json.dumps(out + [hash("kvcached")]))
"""


def test_stable_across_processes_with_different_hash_seeds():
    """Python's hash() differs between these children; block hashes must not."""
    ns = namespace_hash("model-x", "v3", "s")
    mine = [[h.hex() for h in block_hashes(ns, list(range(37)), 8, extra_key=key)]
            for key in (None, "lora", ("lora", 3), b"mm")]
    results = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", CHILD, kvcached.core.hashing.__file__],
                             env=env, capture_output=True, text=True, timeout=120, check=True)
        results.append(json.loads(out.stdout))
    assert results[0][-1] != results[1][-1]  # the salt really differed
    assert results[0][:-1] == results[1][:-1] == mine
