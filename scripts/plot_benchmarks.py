"""Draw PNG charts from the JSON lines that kvcached's benchmarks print.

    python scripts/plot_benchmarks.py RESULTS.jsonl [MORE.jsonl ...] [--out DIR]

Every line of the given files that parses as a JSON object with a ``bench``
key is used; other lines (tables, progress) are skipped, so the benchmarks'
whole output can be saved and passed as is. Charts, one per kind found:

- ``copy_cpu.png``: CPU copy engine bandwidth vs blocks per task
  (``scripts/bench_copy_cpu.py``), next to memcpy;
- ``cuda_count.png`` / ``cuda_block_size.png``: CUDA copy bandwidth vs block
  count per block size, and vs block size at the largest count
  (``scripts/bench_cuda.py``);
- ``trace_hit_rate.png``: hit rate (total and per tier) vs GPU tier capacity
  (``kvcached bench trace``, one line per capacity);
- ``vllm.png``: TTFT of a hit by where it comes from, and multi-turn chat
  TTFT and prefill computed per mode, LMCache's too where the run had it
  (``scripts/bench_vllm.py``);
- ``policy.png``: hit rate of LRU, the adaptive policy, the study it was
  modelled on (when the rows have it) and the offline optimum at each cache
  size, per workload (``scripts/bench_policy.py``);
- ``write_policy.png``: bytes written to storage per request and the fleet's
  hit rate, per storage write policy, fleet size and routing
  (``scripts/bench_write_policy.py``);
- ``serve.png``: TTFT p50 and requests/s per mode and workload behind vLLM's
  OpenAI server (``scripts/bench_serve.py``);
- ``serve_trace.png``: a Mooncake slice through vLLM's OpenAI server: tokens
  from the CPU tier and prefill computed per mode, measured beside the
  manager's prediction (``scripts/bench_serve_trace.py``).

matplotlib is optional: without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


# ------------------------------------------------------------------ input
def read_results(paths: list[str]) -> dict[str, list[dict]]:
    """Benchmark results by kind (``bench`` value), in file order."""
    out: dict[str, list[dict]] = defaultdict(list)
    for p in paths:
        for line in Path(p).read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a progress line that happens to start with "{"
            if isinstance(obj, dict) and "bench" in obj and not obj.get("skipped"):
                out[obj["bench"]].append(obj)
    return dict(out)


def copy_cpu_series(res: dict) -> tuple[list[int], dict[str, list[float]]]:
    """x = blocks per task; one series per engine and direction, plus memcpy."""
    counts = sorted(int(n) for n in res["results"])
    series: dict[str, list[float]] = defaultdict(list)
    for n in counts:
        row = res["results"][str(n)]
        series["memcpy"].append(row["memcpy_gbps"])
        if "memcpy_1t_gbps" in row:
            series["memcpy 1 thread"].append(row["memcpy_1t_gbps"])
        for name, v in row.items():
            if isinstance(v, dict):
                series[f"{name} swap_out"].append(v["swap_out_gbps"])
                series[f"{name} swap_in"].append(v["swap_in_gbps"])
    return counts, dict(series)


def cuda_by_block(rows: list[dict], key: str) -> dict[int, tuple[list[int], list[float]]]:
    """block_bytes -> (counts, GB/s of ``key``), e.g. ``kernel_h2d_gbps``."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for r in sorted(rows, key=lambda r: (r["block_bytes"], r["count"])):
        if key in r:
            xs, ys = out.setdefault(r["block_bytes"], ([], []))
            xs.append(r["count"])
            ys.append(r[key])
    return out


def trace_series(results: list[dict]) -> dict[tuple, list[dict]]:
    """Replays grouped by everything but the GPU capacity, sorted by capacity."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        key = (Path(r["trace"]).name, r["block_size"], r["num_cpu_blocks"],
               r.get("storage_backend"))
        groups[key].append(r)
    return {k: sorted(v, key=lambda r: r["num_gpu_blocks"]) for k, v in groups.items()}


# ------------------------------------------------------------------ draw
def plot_copy_cpu(plt, results: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    res = results[-1]
    counts, series = copy_cpu_series(res)
    for name, ys in series.items():
        ax.plot(counts, ys, marker="o", label=name,
                linestyle="--" if name.startswith("memcpy") else "-")
    ax.set(xscale="log", xlabel="blocks per task", ylabel="GB/s",
           title=f"CPU copy engine ({res.get('planes')} planes x "
                 f"{res.get('plane_bytes', 0) // 1024} KiB per block)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "copy_cpu.png")


def plot_cuda(plt, results: list[dict], out: Path) -> list[Path]:
    rows = results[-1]["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, d in zip(axes, ("d2h", "h2d")):
        for block, (xs, ys) in cuda_by_block(rows, f"kernel_{d}_gbps").items():
            ax.plot(xs, ys, marker="o", label=f"kernel, {_kib(block)}")
        ax.set(xscale="log", xlabel="blocks per task", title=f"CUDA kernel {d}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    paths = [_save(fig, out / "cuda_count.png")]
    top = max(r["count"] for r in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for eng in ("kernel", "direct", "batch", "contiguous"):
        for d in ("d2h", "h2d"):
            pts = sorted((r["block_bytes"], r[f"{eng}_{d}_gbps"]) for r in rows
                         if r["count"] == top and f"{eng}_{d}_gbps" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        label=f"{eng} {d}")
    ax.set(xscale="log", xlabel="bytes per block and plane", ylabel="GB/s",
           title=f"CUDA copy bandwidth at {top} blocks per task")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "cuda_block_size.png"))
    return paths


def plot_trace(plt, results: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, bs, cpu, storage), rs in trace_series(results).items():
        xs = [r["num_gpu_blocks"] * r["block_size"] for r in rs]
        label = f"{name}, block {bs}, CPU {cpu}" + (f", {storage}" if storage else "")
        line, = ax.plot(xs, [r["hit_rate"] for r in rs], marker="o", label=f"{label}: total")
        for tier, style in (("gpu", ":"), ("cpu", "-."), ("storage", "--")):
            ys = [r[f"hit_rate_{tier}"] for r in rs]
            if any(ys) and (tier != "gpu" or cpu or storage):
                ax.plot(xs, ys, linestyle=style, color=line.get_color(), label=f"  {tier}")
        ax.axhline(rs[-1]["ideal_hit_rate"], color=line.get_color(), alpha=0.3)
    ax.set(xscale="log", xlabel="GPU tier capacity (tokens)", ylabel="prompt tokens served",
           ylim=(0, 1), title="Trace replay: hit rate vs capacity (faint line: unbounded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out / "trace_hit_rate.png")


def plot_vllm(plt, results: list[dict], out: Path) -> Path:
    """Per-hit TTFT by source, and chat TTFT / prefill tokens computed by mode."""
    res = results[-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    hit = res["per_hit_ttft_s"]
    sources = [("vllm_own_hit", "vLLM's own\nprefix cache"), ("kvcached_cpu", "kvcached\nCPU tier"),
               ("lmcache_cpu", "LMCache\n(its server)"),
               ("example_connector", "vLLM\nExampleConnector"),
               ("kvcached_storage_after_restart", "kvcached storage\n(new process)"),
               ("full_prefill", "no cache\n(full prefill)")]
    sources = [(n, label) for n, label in sources if n in hit]  # --hit-chat-only, no LMCache
    a.bar([label for _, label in sources], [1000 * hit[n] for n, _ in sources], color="tab:blue")
    a.set(ylabel="TTFT ms (median)", title="One prompt served again")
    a.tick_params(axis="x", labelsize=7)
    chat = res["chat"]
    modes = [(m, name) for m, name in [("plain", "no connector"), ("example", "ExampleConnector"),
                                       ("lmcache", "LMCache"), ("kvcached", "kvcached")]
             if m in chat]
    xs = range(len(modes))
    b.bar([x - 0.2 for x in xs], [chat[m]["ttft_mean_s"] * 1000 for m, _ in modes], 0.4,
          label="mean TTFT ms")
    b2 = b.twinx()
    b2.bar([x + 0.2 for x in xs], [chat[m]["computed_tokens"] / chat[m]["prompt_tokens"]
                                   for m, _ in modes], 0.4, color="tab:orange",
           label="prefill computed (share)")
    b2.axhline(chat["kvcached"]["least_computed_tokens"] / chat["kvcached"]["prompt_tokens"],
               color="tab:orange", ls=":", lw=1)
    b2.set_ylim(0, 1)
    b.set_xticks(list(xs), [name for _, name in modes], fontsize=8)
    b.set(ylabel="mean TTFT ms", title="Multi-turn chat (dotted: least computable)")
    b.legend(loc="upper left", fontsize=7)
    b2.legend(loc="upper right", fontsize=7)
    return _save(fig, out / "vllm.png")


def policy_series(res: dict) -> dict[str, dict[str, list[float]]]:
    """workload -> {"target": [...], "lru"/"adaptive"/"optimum" (and "study" when the
    rows have it): mean hit rate over the seeds at each target point}."""
    acc: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in res["rows"]:
        acc[row["workload"]][row["target"]].append(row)
    out = {}
    for name, by_target in acc.items():
        targets = sorted(by_target)
        out[name] = {"target": targets, **{
            p: [sum(r[p] for r in by_target[t]) / len(by_target[t]) for t in targets]
            for p in ("lru", "adaptive", "study", "optimum") if p in res["rows"][0]}}
    return out


def plot_policy(plt, results: list[dict], out: Path) -> Path:
    """Hit rate by cache size (the target points), one panel per workload."""
    series = policy_series(results[-1])
    fig, axes = plt.subplots(1, len(series), figsize=(3.6 * len(series), 3.4), squeeze=False)
    for ax, (name, s) in zip(axes[0], series.items()):
        xs = range(len(s["target"]))
        bars = [(p, c) for p, c in (("lru", "tab:gray"), ("adaptive", "tab:blue"),
                                    ("study", "tab:orange"), ("optimum", "tab:green")) if p in s]
        width = 0.8 / len(bars)
        for k, (policy, color) in enumerate(bars):
            ax.bar([x + (k - (len(bars) - 1) / 2) * width for x in xs], s[policy], width,
                   color=color, label=policy)
        ax.set_xticks(list(xs), [f"{t:.0%}" for t in s["target"]])
        ax.set(title=name, xlabel="cache size (LRU's share of the unbounded hit rate)",
               ylabel="hit rate", ylim=(0, 1))
        ax.xaxis.label.set_size(7)
    axes[0][0].legend(fontsize=7, loc="upper left")
    return _save(fig, out / "policy.png")


def serve_trace_bars(res: dict) -> tuple[list[str], dict[str, list[float | None]]]:
    """Modes in run order, and per figure (CPU tier tokens, prefill computed;
    measured and predicted, None where not predicted) one value per mode."""
    names = list(res["measured"])
    out: dict[str, list[float | None]] = {}
    for key in ("cpu_tier_tokens", "computed_tokens"):
        out[key] = [res["measured"][m][key] for m in names]
        out[f"predicted_{key}"] = [res["predicted"].get(m, {}).get(key) for m in names]
    return names, out


def plot_serve_trace(plt, results: list[dict], out: Path) -> Path:
    """Tokens from the CPU tier and prefill computed per mode; dots: predicted."""
    res = results[-1]
    names, bars = serve_trace_bars(res)
    colors = ["tab:gray" if n == "plain" else "tab:orange" if n.startswith("lmcache") else
              "tab:blue" if n.startswith("adaptive") else "tab:cyan" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "cpu_tier_tokens", "Prompt tokens from the CPU tier"),
                           (axes[1], "computed_tokens", "Prefill tokens computed")):
        xs = list(range(len(names)))
        ax.bar(xs, bars[key], color=colors, label="measured (vLLM)")
        pred = [(x, v) for x, v in zip(xs, bars[f"predicted_{key}"]) if v is not None]
        ax.plot([x for x, _ in pred], [v for _, v in pred], "k_", markersize=14, mew=2,
                linestyle="none", label="manager replay")
        ax.set_xticks(xs, names, fontsize=7, rotation=30)
        ax.set(title=title, ylabel="tokens")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{res['trace']} requests {res['slice']} through vLLM's OpenAI server "
                 f"(CPU tier in % of the working set)", fontsize=9)
    return _save(fig, out / "serve_trace.png")


WRITE_POLICIES = (("write_through", "tab:blue"), ("write_through_selective", "tab:orange"),
                  ("write_back", "tab:green"))


def plot_write_policy(plt, results: list[dict], out: Path) -> Path:
    """Per fleet (instances, routing): KiB written per request, and the fleet's
    hit rate (storage's part hatched), one bar per write policy."""
    rows = results[-1]["rows"]
    fleets = sorted({(r["instances"], r["routing"]) for r in rows})
    by = {(r["instances"], r["routing"], r["policy"]): r for r in rows}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = range(len(fleets))
    for k, (policy, color) in enumerate(WRITE_POLICIES):
        got = [by.get((n, routing, policy)) for n, routing in fleets]
        at = [x + (k - 1) * 0.27 for x in xs]
        a.bar(at, [r["bytes_written_per_request"] / 1024 if r else 0 for r in got], 0.27,
              color=color, label=policy)
        b.bar(at, [r["hit_rate"] if r else 0 for r in got], 0.27, color=color, label=policy)
        b.bar(at, [r["hit_rate_storage"] if r else 0 for r in got], 0.27, color="none",
              edgecolor="black", hatch="//", lw=0)
    labels = [f"{n} instances\n{routing}" for n, routing in fleets]
    a.set_xticks(list(xs), labels, fontsize=8)
    b.set_xticks(list(xs), labels, fontsize=8)
    a.set(ylabel="KiB written to storage / request", title="What each policy writes")
    b.set(ylabel="hit rate (hatched: from storage)", ylim=(0, 1),
          title="What the fleet hits")
    a.legend(fontsize=7)
    return _save(fig, out / "write_policy.png")


SERVE_COLORS = {"plain": "#999999", "kvcached": "#1f77b4", "kvcached_cpu": "#7fb3e0",
                "lmcache": "#ff7f0e"}


def plot_serve(plt, results: list[dict], out: Path) -> Path:
    """Per workload of the latest ``bench_serve`` run: TTFT p50 and requests/s
    per mode (medians over its rounds)."""
    med = results[-1]["medians"]
    modes, wls = list(med), list(med["plain"])
    fig, axes = plt.subplots(2, len(wls), figsize=(2.6 * len(wls), 5.2), squeeze=False)
    for i, wl in enumerate(wls):
        for row, (key, label) in enumerate((("ttft_p50_ms", "TTFT p50 (ms)"),
                                            ("request_throughput", "requests/s"))):
            ax = axes[row][i]
            ax.bar(modes, [med[m].get(wl, {}).get(key, 0) for m in modes],
                   color=[SERVE_COLORS.get(m, "#2ca02c") for m in modes])
            ax.set_title(wl if row == 0 else "", fontsize=9)
            ax.set_ylabel(label if i == 0 else "", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("vLLM's OpenAI server driven by vllm bench serve (CPU build)", fontsize=10)
    return _save(fig, out / "serve.png")


def _kib(n: int) -> str:
    return f"{n // 1024} KiB" if n < 1 << 20 else f"{n >> 20} MiB"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# ------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Read the result files, draw what they hold; exit 0 without matplotlib."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="files of JSON lines printed by the benchmarks")
    ap.add_argument("--out", type=Path, default=Path("bench-plots"), help="output folder")
    args = ap.parse_args(argv)
    results = read_results(args.files)
    found = ", ".join(f"{len(v)} {k}" for k, v in results.items()) or "no results"
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so no charts were drawn ({found} found). "
              "Install it with: pip install matplotlib", file=sys.stderr)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    drawn: list[Path] = []
    if "copy_cpu" in results:
        drawn.append(plot_copy_cpu(plt, results["copy_cpu"], args.out))
    if "cuda" in results:
        drawn.extend(plot_cuda(plt, results["cuda"], args.out))
    if "trace" in results:
        drawn.append(plot_trace(plt, results["trace"], args.out))
    if "vllm" in results:
        drawn.append(plot_vllm(plt, results["vllm"], args.out))
    if "policy" in results:
        drawn.append(plot_policy(plt, results["policy"], args.out))
    if "write_policy" in results:
        drawn.append(plot_write_policy(plt, results["write_policy"], args.out))
    if "serve" in results:
        drawn.append(plot_serve(plt, results["serve"], args.out))
    if "serve_trace" in results:
        drawn.append(plot_serve_trace(plt, results["serve_trace"], args.out))
    for p in drawn:
        print(p)
    if not drawn:
        print(f"nothing to draw ({found}); expected copy_cpu, cuda, trace, vllm, policy, "
              "write_policy, serve or serve_trace results",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
