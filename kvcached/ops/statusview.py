"""The text ``kvcached status`` prints for a ``CacheManager.status()`` dict.

Every column and counter that is not self-explanatory is explained under its
table. Imports nothing heavy (the control client uses it).
"""

from __future__ import annotations

from typing import Any

from kvcached.transfer.lanes import LANES as LANE_NAMES

# What each storage counter of the manager (stats.storage) means.
STORAGE_COUNTERS = {
    "stored": "blocks written to storage",
    "store_failed": "blocks whose write failed (never visible to reads)",
    "lookup_failed": "storage lookups that failed or timed out (served as misses)",
    "skip_paused_or_no_cpu_tier": "reads skipped: paused, asleep or no CPU tier",
    "skip_below_min_load_blocks": "reads skipped: hit shorter than storage_min_load_blocks",
    "skip_not_in_storage": "reads skipped: storage does not hold the next block",
    "short_of_cpu_blocks": "loads cut short: no free host block to stage into",
    "write_skipped_policy": "blocks computed but not written then (storage_write_policy)",
    "write_selected": "blocks written once reused storage_write_threshold times",
    "write_back": "blocks written on leaving the CPU tier (write_back, selective)",
}
# Why a rank refused a stored object (storage.objects.MISS_REASONS); each is a miss.
REJECTION_WORDS = {
    "checksum_mismatch": "checksum mismatch", "bad_magic": "bad header",
    "bad_header_crc": "bad header", "bad_version": "other format version",
    "unknown_checksum": "unknown checksum", "layout_mismatch": "other layout",
    "wrong_block": "wrong block", "length_mismatch": "short read", "short_read": "short read",
    "bad_mac": "bad MAC (forged, moved, replayed or another secret's)",
    "oversize": "larger than a block",
}


def render_status(st: dict) -> str:
    """The text `kvcached status` prints for a manager.status() dict."""
    stats = st.get("stats") or {}
    state = ("ASLEEP" if st.get("asleep") else "DRAINING" if st.get("draining")
             else "PAUSED" if st.get("paused") else "serving")
    lines = [f"kvcached: {state}   run_dir {st.get('run_dir', '?')}   "
             f"({st.get('transfer_mode', '?')}, tp={st.get('tp_size', '?')}, "
             f"weights {st.get('weight_version', '?')}, "
             f"cpu tier {'on' if st.get('cpu_tier', True) else 'OFF'})",
             f"logs: {st.get('log_dir', '?')}", ""]
    coord = st.get("transfer") or {}
    if coord:
        lines += [f"coordinator: {coord.get('held', 0)} tasks held, "
                  f"{coord.get('inflight', 0)} in flight, "
                  f"{'healthy' if coord.get('healthy', True) else _unhealthy()}"]
    workers = st.get("workers") or stats.get("workers") or []
    lines += _workers_table(workers)
    lines += _tiers_table(stats.get("tiers") or {})
    lines += _policy_lines(stats.get("policy") or {})
    lines += _hits_lines(stats)
    lines += _transfers_table(stats.get("transfers") or {})
    lines += _storage_lines(st.get("storage") or stats.get("storage") or {},
                            storage_health(st))
    if stats.get("evictions"):
        lines.append("evictions (blocks): " + pairs(stats["evictions"]))
    step = st.get("scheduler_step_us")
    if step:
        lines.append(f"engine scheduler time in kvcached per step: p50 {step['p50']} us, "
                     f"p99 {step['p99']} us, max {step['max']} us ({step['steps']} steps); "
                     f"CPU p50 {step['cpu_p50']} us, p99 {step['cpu_p99']} us")
    return "\n".join(lines)


def _unhealthy() -> str:
    return "UNHEALTHY (CPU tier off; `kvcached ctl restart-workers` brings it back)"


def pairs(d: dict) -> str:
    """``{"a": 1, "b": 2}`` as ``a 1, b 2`` (sorted by key)."""
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def _table(header: list[str], rows: list[list], indent: str = "  ") -> list[str]:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _workers_table(workers: list[dict]) -> list[str]:
    if not workers:
        return ["workers: none (in-process transfer)", ""]
    rows = []
    for w in workers:
        queues = w.get("queues") or {}
        rows.append([w.get("rank", "?"), w.get("pid", "?"), w.get("state", "?"),
                     f"{w.get('last_seen_s', 0):.1f}s ago",
                     "/".join(str(queues.get(k, 0)) for k in LANE_NAMES),
                     w.get("restarts", 0), w.get("done", "-"), w.get("fast", "-"),
                     w.get("failed", "-"), w.get("lost_reason", "")])
    return (["workers:"]
            + _table(["rank", "pid", "state", "heartbeat", "queues " + "/".join(LANE_NAMES),
                      "restarts", "done", "fast", "failed", "lost reason"], rows)
            + ["  queues: tasks waiting or running per lane; restarts: since start; "
               "done/failed: tasks this",
               "  process ran; fast: of those, the ones run on the socket thread as they "
               "arrived (small copies, noops)", ""])


def _tiers_table(tiers: dict) -> list[str]:
    rows = [[name, t.get("total", "?"), t.get("used", "?"), t.get("free", "?"),
             t.get("cached", "?")] for name, t in tiers.items() if isinstance(t, dict)]
    return (["tiers (blocks):"] + _table(["tier", "total", "used", "free", "cached"], rows)
            + ["  cached: held by the cache tree; the rest of used: running requests' "
               "own blocks", ""])


def _policy_lines(policy: dict) -> list[str]:
    """The eviction policy; adaptive: each tier's ghost and the reuses it remembered."""
    if not policy:
        return []
    lines = [f"eviction policy: {policy.get('name', '?')}"]
    tiers = [(t, policy[t]) for t in ("gpu", "cpu") if isinstance(policy.get(t), dict)]
    for tier, p in tiers:
        lines.append(
            f"  {tier}: ghost {p.get('ghost_entries', 0)} of {p.get('ghost_slots', 0)} entries "
            f"({human_bytes(p.get('ghost_bytes', 0))}); reuses {p.get('hits', 0)} hits + "
            f"{p.get('ghost_hits', 0)} evicted blocks back = "
            f"{100 * p.get('ghost_hit_share', 0.0):.1f}% remembered by the ghost")
    if tiers:
        lines.append("  ghost: keys of recently evicted blocks; a block it remembers came back "
                     "too late (a larger tier would have served it)")
    return lines + [""]


def _hits_lines(stats: dict) -> list[str]:
    prompt = stats.get("prompt_tokens", 0) or 0
    hits = stats.get("hit_tokens") or {}
    rates = "  ".join(f"{t} {100 * n / prompt:.1f}%" if prompt else f"{t} -"
                      for t, n in hits.items())
    total = f"{100 * sum(hits.values()) / prompt:.1f}%" if prompt else "-"
    return [f"hit rate: {total} of {prompt} prompt tokens in {stats.get('requests', 0)} "
            f"requests ({stats.get('running', 0)} running)   by tier: {rates or '-'}", ""]


def _transfers_table(transfers: dict) -> list[str]:
    if not transfers:
        return ["transfers: none yet", ""]
    rows = [[kind, t.get("submitted", 0), t.get("done", 0), t.get("failed", 0),
             t.get("blocks", 0), human_bytes(t.get("bytes", 0)), f"{t.get('p50_ms', 0):.2f}",
             f"{t.get('p99_ms', 0):.2f}"] for kind, t in sorted(transfers.items())]
    return ["transfers:"] + _table(["kind", "submitted", "done", "failed", "blocks", "moved",
                                    "p50 ms", "p99 ms"], rows) + [""]


def storage_health(st: dict) -> list[tuple[Any, dict]]:
    """``(rank, health)`` of every rank with storage: from the workers' heartbeats,
    or, with in-process transfer, from the transfer's own report."""
    workers = st.get("workers") or (st.get("stats") or {}).get("workers") or []
    found = [(w.get("rank", "?"), w["storage"]) for w in workers if w.get("storage")]
    ranks = (st.get("transfer") or {}).get("storage_ranks") or []
    return found + [(h.get("rank", "?"), h) for h in ranks if isinstance(h, dict)]


def _storage_lines(counts: dict, health: list[tuple[Any, dict]]) -> list[str]:
    """The manager's storage counters, explained, then each rank's storage health."""
    if not counts and not health:
        return ["storage: no activity (or off)"]
    lines = ["storage:"]
    rows = [[k, v, STORAGE_COUNTERS.get(k, "")] for k, v in sorted(counts.items())]
    if rows:
        lines += _table(["counter", "count", "meaning"], rows)
    for rank, h in health:
        lines.append(f"  rank {rank}: {_health_line(h)}")
    return lines + [""]


def _health_line(h: dict[str, Any]) -> str:
    used, cap = h.get("used_bytes"), h.get("max_bytes")
    space = (f"{h.get('objects', 0)} objects known, {human_bytes(used)} used"
             + (f" of {human_bytes(cap)} cap" if cap else ", no cap")
             if used is not None else f"{h.get('kind', '?')} backend")
    rejected = h.get("rejected") or {}
    words: dict[str, int] = {}
    for reason, n in rejected.items():
        word = REJECTION_WORDS.get(reason, reason)
        words[word] = words.get(word, 0) + n
    rej = f"rejected {sum(rejected.values())} ({pairs(words)})" if rejected else "rejected 0"
    extra = [f"{k} {h[k]}" for k in ("errors", "timeouts") if h.get(k)]
    if h.get("encrypted"):
        extra.append("objects signed and encrypted (storage secret)")
    elif h.get("authenticated"):
        extra.append("objects signed (storage secret)")
    if h.get("breaker") not in (None, "", "closed"):
        extra.append(f"breaker {h['breaker']}")
    stored = f"stored {h.get('stored', 0)}"
    if h.get("already_stored"):
        stored += f" (+{h['already_stored']} already there)"
    looked = f"{h.get('lookups', 0)} lookups found {h.get('found', 0)} blocks"
    return ", ".join([space, looked, f"loaded {h.get('loaded', 0)}", stored, rej, *extra])


def human_bytes(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB / TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
