"""kvcached's configuration for a vLLM engine: its own keys from
``kv_connector_extra_config``, the layout and identity from vLLM's config.

The extra config takes ``CacheConfig``'s keys (``num_cpu_blocks``,
``storage_backend``, ``storage_url``, ``run_dir``, ...), validated as
``CacheConfig.load`` validates them: an unknown key or a bad value stops
vLLM at start-up with the error naming the key. What vLLM decides (layers,
KV heads per rank, head size, dtype, block size, TP size, the number of
engine blocks) comes from vLLM; a key that contradicts it is an error
naming both values. The model's identity (its name, revision, config and,
for a local directory, its weight files) becomes the storage namespace, so
two models never share KV.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached.config import CacheConfig, env_name

# Keys vLLM's config decides; the extra config may repeat them, not change them.
DERIVED = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "tp_size",
           "num_gpu_blocks", "device", "fused_kv", "mla")
# What a connector always is: vLLM owns the KV planes and the GPU tier.
FIXED = {"external_gpu_tier": True, "create_cache": False}
DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def run_dir_of(vllm_config) -> Path:
    """Where this engine's kvcached lives: the extra config's ``run_dir``, or one
    named after vLLM's engine id (the scheduler and every worker process see the
    same id, so they meet there without talking)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    if extra.get("run_dir"):
        return Path(str(extra["run_dir"]))
    return Path(tempfile.gettempdir()) / f"kvcached-vllm-{vllm_config.kv_transfer_config.engine_id}"


# The KV cache group kinds kvcached caches, by vLLM's spec class: a block of
# each is keyed by (vLLM's block hash, group) and restored whole. A Mamba
# group's block is a recurrent state (Mamba-2, gated delta-net), kept by vLLM
# where a chunk of the prompt ended ("align" mode).
CACHED_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding",
                "MLAAttentionSpec": "mla", "MambaSpec": "mamba"}


@dataclass(frozen=True)
class Group:
    """One of vLLM's KV cache groups as kvcached caches it."""

    index: int
    kind: str  # "full", "sliding", "mla" or "mamba"
    layer_names: tuple[str, ...]
    window: int | None = None  # tokens, for a sliding-window group


def cached_groups(kv_cache_config, model: str = "this model") -> list[Group]:
    """The model's KV cache groups, or ValueError naming what kvcached cannot
    cache. Every group's blocks live in the same pages (vLLM overlays the
    groups: a block id belongs to one group at a time), so the groups must
    agree on the page: block size and bytes."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if "UniformTypeKVCacheSpecs" in kinds:
        # vLLM 0.32 builds these for layers of one kind whose pages differ in
        # size (KV heads or head size per layer), and for every group it packs
        # side by side in a block-outermost layout (pages of different sizes)
        raise ValueError(
            f"kvcached caches KV cache groups whose pages are one size; vLLM groups "
            f"{model}'s layers as {kinds}: pages of different sizes in a group (KV heads "
            f"or head size differ between layers) or groups of different page sizes packed "
            f"into one block (a block-outermost KV cache layout). If VLLM_KV_CACHE_LAYOUT "
            f"names one (BLHNC, BLNHC, BHLNC), unset it; otherwise serve {model} without "
            f"--kv-transfer-config")
    unknown = sorted({k for k in kinds if k not in CACHED_KINDS})
    if unknown:
        raise ValueError(
            f"kvcached caches full-attention, sliding-window, MLA and Mamba KV cache groups; "
            f"{model} has {', '.join(unknown)} (groups: {kinds}). Serve it without "
            f"--kv-transfer-config, or with a connector that supports these layers")
    if "MLAAttentionSpec" in kinds and len(groups) > 1:
        raise ValueError(f"kvcached caches an MLA model whose layers form one KV cache group; "
                         f"{model} has {len(groups)}: {kinds}")
    _check_mamba(groups, kinds, model)
    first = _attention_spec(kv_cache_config, model)
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        page = (spec.block_size, spec.page_size_bytes)
        if page != (first.block_size, first.page_size_bytes):
            # vLLM 0.32 gives a group whose KV bytes per token are a fraction
            # of another's a larger block (the same page): kvcached keys and
            # restores blocks of one size
            raise ValueError(
                f"kvcached needs every KV cache group of {model} to share one page layout "
                f"(block size, bytes per page); group {i} ({kinds[i]}) has {page}, the "
                f"attention layers ({first.block_size}, {first.page_size_bytes}). Serve "
                f"{model} without --kv-transfer-config")
        if kinds[i] in ("FullAttentionSpec", "SlidingWindowSpec") \
                and spec.head_size_v != spec.head_size:
            raise ValueError(f"kvcached caches K and V of one head size; {model}'s are "
                             f"{spec.head_size} and {spec.head_size_v}")
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block not in (None, first.block_size):
        # kvcached keys one block by one of vLLM's block hashes
        raise ValueError(f"vLLM hashes blocks of {hash_block} tokens but caches blocks of "
                         f"{first.block_size}; kvcached needs the two equal: unset "
                         f"--prefix-match-unit (or set it to {first.block_size})")
    return [Group(i, CACHED_KINDS[k], tuple(g.layer_names),
                  getattr(g.kv_cache_spec, "sliding_window", None) if k == "SlidingWindowSpec"
                  else None)
            for i, (g, k) in enumerate(zip(groups, kinds, strict=True))]


def _check_mamba(groups, kinds: list[str], model: str) -> None:
    """A Mamba group is cached in vLLM's "align" mode only: there vLLM keeps a
    state at the block boundaries where a chunk of the prompt ended, and hands
    each one to the connector; in the other modes no state has a block of its
    own to save or to restore into."""
    for g, k in zip(groups, kinds, strict=True):
        if k != "MambaSpec":
            continue
        mode = getattr(g.kv_cache_spec, "mamba_cache_mode", None)
        if mode != "align":
            raise ValueError(
                f"kvcached caches {model}'s Mamba layers with vLLM's mamba_cache_mode "
                f"\"align\" (--mamba-cache-mode align, and prefix caching on); it is {mode!r}")
        if getattr(g.kv_cache_spec, "num_speculative_blocks", 0):
            raise ValueError(f"kvcached does not cache {model}'s Mamba layers with "
                             "speculative decoding (their state blocks move as drafts are "
                             "accepted); serve it without --kv-transfer-config or without it")


def _fills_page(spec) -> bool:
    """Whether an attention layer's K|V fill its whole page: vLLM pads a page
    to the largest one of the model (a Mamba state's, or an attention page
    that the smaller one does not divide), and a padded layer's view misses
    the bytes another group's block keeps there."""
    return (type(spec).__name__ != "MambaSpec"
            and getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
            == spec.page_size_bytes)


def _attention_spec(kv_cache_config, model: str):
    """The spec of the model's first attention group whose K|V fill the page:
    its page (KV heads, head size, dtype) is kvcached's layout; vLLM pads
    every other group's page to it."""
    groups = kv_cache_config.kv_cache_groups
    for g in groups:
        if _fills_page(g.kv_cache_spec):
            return g.kv_cache_spec
    if all(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in groups):
        raise ValueError(f"kvcached caches models with attention layers; {model} has only "
                         "Mamba layers")
    raise ValueError(f"kvcached copies a block through an attention layer whose K and V fill "
                     f"the page; vLLM padded every attention page of {model} (groups: "
                     f"{[type(g.kv_cache_spec).__name__ for g in groups]}). Serve it without "
                     f"--kv-transfer-config")


def physical_layers(kv_cache_config) -> list[str]:
    """One layer name per distinct page region, in vLLM's order: the layers of
    different groups that vLLM lays over the same bytes count once (copying a
    block copies whichever group owns it). A region is named by an attention
    layer whose K|V fill the page (its tensor is the region's pages; a Mamba
    layer's is a list of states, a padded attention layer's view misses the
    page's tail). A model of one group has one per layer."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1:
        return list(groups[0].layer_names)
    whole = {name for g in groups if _fills_page(g.kv_cache_spec) for name in g.layer_names}
    seen: dict[tuple[int, int], str] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(tensor.layers):
            key = (tensor.offset + i * tensor.layer_stride, tensor.block_stride)
            if key not in seen or (seen[key] not in whole and name in whole):
                seen[key] = name
    lone = [name for name in seen.values() if name not in whole]
    if lone:
        raise ValueError(f"kvcached needs an attention layer whose K and V fill the page over "
                         f"every page region; {lone[0]}'s region has none (Mamba states or "
                         f"an attention page vLLM padded)")
    return list(seen.values())


def derived_settings(vllm_config, kv_cache_config, fused_kv: bool) -> dict[str, Any]:
    """The CacheConfig fields vLLM decides."""
    model = str(vllm_config.model_config.model)
    groups = cached_groups(kv_cache_config, model)
    spec = _attention_spec(kv_cache_config, model)
    dtype = DTYPES.get(str(spec.dtype))
    if dtype is None:
        raise ValueError(f"kvcached caches bfloat16, float16 or float32 KV; vLLM's KV cache "
                         f"dtype is {spec.dtype}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("kvcached runs one transfer worker per tensor-parallel rank; "
                         f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not "
                         "supported")
    mla = groups[0].kind == "mla"
    from vllm.platforms import current_platform
    return {"num_layers": len(physical_layers(kv_cache_config)),
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_size, "dtype": dtype,
            "block_size": spec.block_size, "tp_size": parallel.tensor_parallel_size,
            "num_gpu_blocks": kv_cache_config.num_blocks,
            "device": "cpu" if current_platform.is_cpu() else "cuda",
            "fused_kv": fused_kv and not mla, "mla": mla}


def model_identity(model_config) -> str:
    """A readable name and a digest of what makes the weights these weights: the
    model name or path, its revision, dtype, quantization and HF config, and for a
    local directory the names, sizes and times of its weight files."""
    parts = [str(model_config.model), str(getattr(model_config, "revision", "") or ""),
             str(model_config.dtype), str(getattr(model_config, "quantization", "") or "")]
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is not None:
        parts.append(hf_config.to_json_string(use_diff=False))
    path = Path(str(model_config.model))
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).hexdigest()
    return f"{model_config.model}@{digest}"


def cache_config(vllm_config, kv_cache_config, fused_kv: bool) -> CacheConfig:
    """The validated CacheConfig of this engine's kvcached (see the module docstring)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    derived = derived_settings(vllm_config, kv_cache_config, fused_kv)
    for key in DERIVED:
        if key in extra and extra[key] != derived[key]:
            raise ValueError(
                f"kv_connector_extra_config {key}={extra[key]!r} contradicts vLLM's "
                f"{key}={derived[key]!r}: kvcached takes it from vLLM; drop the key")
    for key, value in FIXED.items():
        if key in extra and extra[key] != value:
            raise ValueError(f"kv_connector_extra_config {key}={extra[key]!r}: inside vLLM "
                             f"it is always {value!r} (vLLM owns the GPU tier); drop the key")
    extra.setdefault("model_id", model_identity(vllm_config.model_config))
    extra["run_dir"] = str(run_dir_of(vllm_config))
    try:
        return CacheConfig.load(**{**extra, **derived, **FIXED})
    except ValueError as e:
        raise ValueError(f"kvcached (kv_connector_extra_config): {e}") from None


def step_loads_enabled(extra: dict[str, Any] | None) -> bool:
    """Whether loads inside the step are on (``step_load_max_blocks`` > 0: from the
    extra config, else its environment variable, else the default), as vLLM's
    config asks before the model runs (``requires_piecewise_for_cudagraph``)."""
    key = "step_load_max_blocks"
    value = (extra or {}).get(key, os.environ.get(env_name(key),
                                                  CacheConfig.__dataclass_fields__[key].default))
    try:
        return int(value) > 0
    except (TypeError, ValueError):
        return True  # CacheConfig.load names the bad value when the connector starts


def check_hashes_reproducible(vllm_config, cfg: CacheConfig) -> str | None:
    """Why storage cannot serve across restarts, or None: vLLM's block hashes
    are reproducible across processes for cryptographic algorithms (the
    default) or with PYTHONHASHSEED set; a restart otherwise only misses."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if cfg.storage_backend and not algo.startswith("sha") and "PYTHONHASHSEED" not in os.environ:
        return (f"prefix_caching_hash_algo={algo!r} hashes blocks with a per-process seed: KV "
                "stored by one vLLM process is never found by the next; use sha256 (vLLM's "
                "default) or set PYTHONHASHSEED")
    return None


def loads_unsupported(vllm_config, cfg: CacheConfig) -> str | None:
    """Why vLLM cannot compute a prompt on top of KV kvcached loads, or None.
    vLLM's reference MLA backend on CPU (no AMX) prefills without a cached
    context, and vLLM turns its own prefix caching off for it: a hit there
    would change the model's output. kvcached then saves (a producer's KV
    serves another instance) and loads nothing."""
    if cfg.mla and cfg.device == "cpu" and not vllm_config.cache_config.enable_prefix_caching:
        return ("vLLM's CPU MLA backend cannot prefill on top of a cached prefix (vLLM turned "
                "its own prefix caching off for this model): kvcached saves this model's KV "
                "but serves no hits here")
    return None


def check_load_failure_policy(kv_transfer_config) -> None:
    """kvcached is a cache: a block that fails to load (a dead worker, a bad or
    vanished storage object) is recomputed by vLLM, which needs its
    ``kv_load_failure_policy = "recompute"``; with "fail" every such miss
    would fail its request."""
    policy = kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        raise ValueError(
            f"kvcached needs kv_transfer_config.kv_load_failure_policy = \"recompute\" "
            f"(a block that fails to load is recomputed); it is {policy!r}: add "
            f"\"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config")
