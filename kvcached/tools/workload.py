"""A synthetic multi-turn chat workload, and a driver that replays it through a manager.

The shape (what makes prefix caching pay off in chat serving)::

    system prompt s (one of a few, shared by many conversations)
    conversation c, turn 0:  prompt = s + u0                  output o0
    conversation c, turn 1:  prompt = s + u0 + o0 + u1        output o1
    conversation c, turn 2:  prompt = s + u0 + o0 + u1 + o1 + u2 ...

Every prompt extends the previous turn's prompt plus its output, so a cache
that kept the previous turn hits all of it; different conversations share
only their system prompt. About ``concurrent_conversations`` conversations
are open at once; each step picks one at random (so turns of different
conversations interleave and a conversation's next turn may come long after
its previous one, by when eviction may have moved or dropped it), and a
conversation that reached its number of turns (drawn from 1..max_turns) is
replaced by a fresh one. Everything is drawn from one numpy Generator, so a
seed fixes the whole workload, outputs included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kvcached.errors import NoFreeBlocks


@dataclass(slots=True)
class ChatRequest:
    """One turn: ``prompt`` goes to ``allocate``; ``output`` is what the model "generates"."""

    request_id: int
    conversation_id: int
    turn: int
    prompt: list[int]
    output: list[int]


@dataclass(slots=True)
class _Conversation:
    cid: int
    history: list[int]  # system prompt + all previous turns and outputs
    turns_left: int
    turn: int = 0


def iter_chat_workload(num_requests: int, seed: int = 0, num_system_prompts: int = 4,
                       system_tokens: int = 512, turn_tokens: tuple[int, int] = (64, 256),
                       output_tokens: tuple[int, int] = (32, 128), max_turns: int = 8,
                       concurrent_conversations: int = 32,
                       vocab: int = 32000) -> Iterator[ChatRequest]:
    """Yield the requests of :func:`generate_chat_workload` one by one.

    Memory stays bounded by the open conversations, which matters for long
    benchmark runs. Prompts are built by list concatenation, so consecutive
    turns share their int objects instead of copying them.
    """
    _check_args(num_requests, num_system_prompts, turn_tokens, output_tokens, max_turns,
                concurrent_conversations, vocab)
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_tokens).tolist()
               for _ in range(num_system_prompts)]
    next_cid = 0

    def start() -> _Conversation:
        nonlocal next_cid
        conv = _Conversation(next_cid, list(systems[int(rng.integers(num_system_prompts))]),
                             int(rng.integers(1, max_turns + 1)))
        next_cid += 1
        return conv

    active = [start() for _ in range(concurrent_conversations)]
    for rid in range(num_requests):
        slot = int(rng.integers(len(active)))
        conv = active[slot]
        user = _tokens(rng, turn_tokens, vocab)
        output = _tokens(rng, output_tokens, vocab)
        prompt = conv.history + user
        yield ChatRequest(rid, conv.cid, conv.turn, prompt, output)
        conv.history = prompt + output
        conv.turn += 1
        conv.turns_left -= 1
        if conv.turns_left == 0:
            active[slot] = start()


def generate_chat_workload(num_requests: int, seed: int = 0, num_system_prompts: int = 4,
                           system_tokens: int = 512, turn_tokens: tuple[int, int] = (64, 256),
                           output_tokens: tuple[int, int] = (32, 128), max_turns: int = 8,
                           concurrent_conversations: int = 32,
                           vocab: int = 32000) -> list[ChatRequest]:
    """``num_requests`` chat turns, fully determined by ``seed`` (see the module docstring).

    ``turn_tokens`` and ``output_tokens`` are inclusive (low, high) ranges of
    a user turn's and of a model output's length.
    """
    return list(iter_chat_workload(
        num_requests, seed=seed, num_system_prompts=num_system_prompts,
        system_tokens=system_tokens, turn_tokens=turn_tokens, output_tokens=output_tokens,
        max_turns=max_turns, concurrent_conversations=concurrent_conversations, vocab=vocab))


def _tokens(rng: np.random.Generator, length: tuple[int, int], vocab: int) -> list[int]:
    return rng.integers(0, vocab, int(rng.integers(length[0], length[1] + 1))).tolist()


def _check_args(num_requests, num_system_prompts, turn_tokens, output_tokens, max_turns,
                concurrent_conversations, vocab) -> None:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    for name, value in (("num_system_prompts", num_system_prompts), ("max_turns", max_turns),
                        ("concurrent_conversations", concurrent_conversations),
                        ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, (lo, hi) in (("turn_tokens", turn_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, "
                             f"got {(lo, hi)}")


# ------------------------------------------------------------------- replay
def replay(mgr, requests: Iterable[ChatRequest],
           on_progress: Callable[[int, dict], None] | None = None) -> dict:
    """Serve ``requests`` one after another through ``mgr`` (a started CacheManager).

    Per request: ``allocate(prompt, reserve_tokens=len(output))``, ``wait()``,
    ``commit(prompt + output)`` with every token computed, ``free``. A request
    that gets NoFreeBlocks is counted as rejected and skipped. Returns counts,
    per-operation wall times in microseconds (allocate includes the wait for
    swap-ins) and the process CPU time of the calls (``cpu_s``);
    ``on_progress(done, result_so_far)`` runs after each request, outside the
    timed calls.
    """
    res = {"requests": 0, "served": 0, "rejected": 0, "prompt_tokens": 0,
           "prompt_blocks": 0, "hit_tokens": {"gpu": 0, "cpu": 0, "storage": 0},
           "allocate_us": [], "commit_us": [], "free_us": [], "cpu_s": 0.0, "total_s": 0.0}
    bs = mgr.block_size
    clock, cpu = time.perf_counter, time.process_time
    start = clock()
    for req in requests:
        res["requests"] += 1
        tokens = req.prompt + req.output  # the engine's token list: not manager time
        c0 = cpu()
        t0 = clock()
        try:
            a = mgr.allocate(req.request_id, req.prompt, reserve_tokens=len(req.output))
            a.wait()
        except NoFreeBlocks:
            res["cpu_s"] += cpu() - c0
            res["rejected"] += 1
        else:
            t1 = clock()
            mgr.commit(req.request_id, tokens, len(tokens))
            t2 = clock()
            mgr.free(req.request_id)
            t3 = clock()
            res["cpu_s"] += cpu() - c0  # the calls only, not the bookkeeping below
            _record(res, req, a, bs, (t1 - t0, t2 - t1, t3 - t2))
        if on_progress is not None:
            on_progress(res["requests"], res)
    res["total_s"] = clock() - start
    return res


def _record(res: dict, req: ChatRequest, a, bs: int, secs: tuple[float, float, float]) -> None:
    res["served"] += 1
    res["prompt_tokens"] += len(req.prompt)
    res["prompt_blocks"] += -(-len(req.prompt) // bs)
    hit = res["hit_tokens"]
    hit["gpu"] += a.hit.gpu_tokens
    hit["cpu"] += a.hit.cpu_tokens
    hit["storage"] += a.hit.storage_tokens
    for key, s in zip(("allocate_us", "commit_us", "free_us"), secs):
        res[key].append(s * 1e6)


__all__ = ["ChatRequest", "generate_chat_workload", "iter_chat_workload", "replay"]
