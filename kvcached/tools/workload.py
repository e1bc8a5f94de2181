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

Two more shapes, for eviction policies (``scripts/bench_policy.py``):

- :func:`iter_think_time_workload`: production chat, where a conversation's
  next turn comes back only after a *think time* of many other requests
  (hundreds), not after a geometric gap of a few dozen. This is what LRU
  handles worst: by the time a turn returns, its blocks are the oldest.
- :func:`mix_one_off_prompts`: any workload with one-off long prompts
  (documents pasted once, batch jobs) mixed in, which a scan-resistant
  policy must not let flush the conversations out.
"""

from __future__ import annotations

import heapq
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


# --------------------------------------------------------- think-time chat
def iter_think_time_workload(num_requests: int, seed: int = 0,
                             think_time: tuple[int, int] = (200, 1000),
                             turns: tuple[int, int] = (2, 10), num_system_prompts: int = 8,
                             system_tokens: int = 512, turn_tokens: tuple[int, int] = (64, 256),
                             output_tokens: tuple[int, int] = (64, 256),
                             vocab: int = 32000) -> Iterator[ChatRequest]:
    """Chat turns where a conversation comes back only after ``think_time`` other requests.

    Prompts grow as in :func:`iter_chat_workload`. A conversation has a
    number of turns drawn from ``turns`` (inclusive); after each turn but its
    last, its next turn is due ``think_time`` (inclusive range, in requests)
    later. Each step serves the turn that has been due longest (earliest due
    time, then lowest conversation id), or starts a new conversation when no
    turn is due: the stream is one request per step, and about
    ``mean(think_time)`` conversations are open at once. A seed fixes everything.
    """
    _check_args(num_requests, num_system_prompts, turn_tokens, output_tokens, max(turns),
                1, vocab)
    for name, (lo, hi), low in (("think_time", think_time, 0), ("turns", turns, 1)):
        if not low <= lo <= hi:
            raise ValueError(f"{name} must be a range (low, high) with {low} <= low <= high, "
                             f"got {(lo, hi)}")
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_tokens).tolist()
               for _ in range(num_system_prompts)]
    due: list[tuple[int, int]] = []  # (step the next turn is due, conversation id)
    open_convs: dict[int, _Conversation] = {}
    next_cid = 0
    for step in range(num_requests):
        if due and due[0][0] <= step:
            conv = open_convs[heapq.heappop(due)[1]]
        else:
            conv = _Conversation(next_cid, list(systems[int(rng.integers(num_system_prompts))]),
                                 int(rng.integers(turns[0], turns[1] + 1)))
            open_convs[next_cid] = conv
            next_cid += 1
        user = _tokens(rng, turn_tokens, vocab)
        output = _tokens(rng, output_tokens, vocab)
        prompt = conv.history + user
        yield ChatRequest(step, conv.cid, conv.turn, prompt, output)
        conv.history = prompt + output
        conv.turn += 1
        conv.turns_left -= 1
        if conv.turns_left:
            think = int(rng.integers(think_time[0], think_time[1] + 1))
            heapq.heappush(due, (step + 1 + think, conv.cid))
        else:
            del open_convs[conv.cid]


def mix_one_off_prompts(requests: Iterable[ChatRequest], seed: int = 0, fraction: float = 0.05,
                        prompt_tokens: tuple[int, int] = (2048, 8192),
                        output_tokens: tuple[int, int] = (64, 256),
                        vocab: int = 32000) -> Iterator[ChatRequest]:
    """``requests`` with one-off long prompts mixed in (scan resistance).

    Before each request, with probability ``fraction``, a prompt of random
    tokens (length drawn from ``prompt_tokens``) that shares nothing with
    anything is served first; it has ``conversation_id`` -1 and turn 0.
    Request ids are renumbered in order. The mix is drawn from its own
    Generator, so ``seed`` fixes it whatever ``requests`` is.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    for name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, "
                             f"got {(lo, hi)}")
    rng = np.random.default_rng(seed)
    rid = 0
    for req in requests:
        if rng.random() < fraction:
            yield ChatRequest(rid, -1, 0, _tokens(rng, prompt_tokens, vocab),
                              _tokens(rng, output_tokens, vocab))
            rid += 1
        yield ChatRequest(rid, req.conversation_id, req.turn, req.prompt, req.output)
        rid += 1


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


__all__ = ["ChatRequest", "generate_chat_workload", "iter_chat_workload",
           "iter_think_time_workload", "mix_one_off_prompts", "replay"]
