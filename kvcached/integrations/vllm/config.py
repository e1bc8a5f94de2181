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
from pathlib import Path
from typing import Any

from kvcached.config import CacheConfig

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


def attention_spec(kv_cache_config):
    """The one full-attention KV cache group kvcached can cache, or ValueError."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1 or kinds[0] != "FullAttentionSpec":
        raise ValueError(
            "kvcached caches models whose attention layers share one full-attention KV "
            f"cache group; this model has {len(groups)} group(s): {kinds}")
    spec = groups[0].kv_cache_spec
    if spec.head_size_v != spec.head_size:
        raise ValueError(f"kvcached caches K and V of one head size; this model's are "
                         f"{spec.head_size} and {spec.head_size_v}")
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block not in (None, spec.block_size):
        # kvcached keys one block by one of vLLM's block hashes
        raise ValueError(f"vLLM hashes blocks of {hash_block} tokens but caches blocks of "
                         f"{spec.block_size}; kvcached needs the two equal")
    return groups[0]


def derived_settings(vllm_config, kv_cache_config, fused_kv: bool) -> dict[str, Any]:
    """The CacheConfig fields vLLM decides."""
    group = attention_spec(kv_cache_config)
    spec = group.kv_cache_spec
    dtype = DTYPES.get(str(spec.dtype))
    if dtype is None:
        raise ValueError(f"kvcached caches bfloat16, float16 or float32 KV; vLLM's KV cache "
                         f"dtype is {spec.dtype}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("kvcached runs one transfer worker per tensor-parallel rank; "
                         f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not "
                         "supported")
    from vllm.platforms import current_platform
    return {"num_layers": len(group.layer_names), "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_size, "dtype": dtype, "block_size": spec.block_size,
            "tp_size": parallel.tensor_parallel_size, "num_gpu_blocks": kv_cache_config.num_blocks,
            "device": "cpu" if current_platform.is_cpu() else "cuda", "fused_kv": fused_kv,
            "mla": False}


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
