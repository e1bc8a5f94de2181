"""The connector's configuration: kvcached's keys from vLLM's
``kv_connector_extra_config``, the layout and identity from vLLM's own config
(real vLLM spec classes; no engine started)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed by `make test`")
import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvcached.integrations.vllm import config as vconfig  # noqa: E402


def kv_config(groups=None, num_blocks=100, hash_block_size=None) -> KVCacheConfig:
    """vLLM's KV cache config: each group's layers overlaid on the same pages,
    as vLLM's hybrid allocator lays them (layer i of every group at one place)."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = groups or [KVCacheGroupSpec([f"layers.{i}.attn" for i in range(3)], spec)]
    page = groups[0].kv_cache_spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks * len(g.layer_names), layers=g.layer_names,
                             layer_stride=page * num_blocks, block_stride=page) for g in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups,
                         hash_block_size=hash_block_size)


def engine_config(tmp_path, extra=None, tp=1, pp=1, model="org/model") -> SimpleNamespace:
    hf = SimpleNamespace(to_json_string=lambda use_diff=False: '{"hidden_size": 128}')
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {},
                                           engine_id="e1"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(model=model, revision=None, dtype=torch.bfloat16,
                                     quantization=None, hf_config=hf),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256",
                                     enable_prefix_caching=True))


def test_layout_and_identity_come_from_vllm(tmp_path):
    cfg = vconfig.cache_config(engine_config(tmp_path, {"num_cpu_blocks": 64}), kv_config(),
                               fused_kv=True)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.block_size) == (3, 2, 64, 32)
    assert (cfg.dtype, cfg.num_gpu_blocks, cfg.tp_size, cfg.fused_kv) == ("bfloat16", 100, 1, True)
    assert cfg.external_gpu_tier and not cfg.create_cache and cfg.num_cpu_blocks == 64
    assert cfg.model_id.startswith("org/model@")
    assert cfg.run_dir.endswith("kvcached-vllm-e1")


def test_two_models_never_share_a_namespace(tmp_path):
    a = vconfig.cache_config(engine_config(tmp_path, model="org/a"), kv_config(), True)
    b = vconfig.cache_config(engine_config(tmp_path, model="org/b"), kv_config(), True)
    assert a.model_id != b.model_id


def test_local_weights_are_part_of_the_identity(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    mc = engine_config(tmp_path, model=str(tmp_path)).model_config
    before = vconfig.model_identity(mc)
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # new weights, same path
    assert vconfig.model_identity(mc) != before


@pytest.mark.parametrize("key,value,vllm_value", [("block_size", 64, 32), ("num_layers", 2, 3),
                                                  ("dtype", "float16", "bfloat16"),
                                                  ("tp_size", 2, 1)])
def test_a_key_contradicting_vllm_names_both_values(tmp_path, key, value, vllm_value):
    with pytest.raises(ValueError, match=f"{key}={value!r} contradicts vLLM's "
                                         f"{key}={vllm_value!r}"):
        vconfig.cache_config(engine_config(tmp_path, {key: value}), kv_config(), True)


def test_a_key_repeating_vllm_is_accepted(tmp_path):
    cfg = vconfig.cache_config(engine_config(tmp_path, {"block_size": 32}), kv_config(), True)
    assert cfg.block_size == 32


@pytest.mark.parametrize("extra,match", [
    ({"bogus": 1}, r"unknown config key\(s\) \['bogus'\]"),
    ({"num_cpu_blocks": -5}, "num_cpu_blocks"),
    ({"storage_backend": "tape"}, "storage_backend"),
    ({"external_gpu_tier": False}, "external_gpu_tier=False: inside vLLM it is always True"),
    ({"create_cache": True}, "create_cache=True"),
])
def test_bad_extra_config_names_the_key(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match) as err:
        vconfig.cache_config(engine_config(tmp_path, extra), kv_config(), True)
    assert "kv_connector_extra_config" in str(err.value)


FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                        sliding_window=128)


def test_a_hybrid_model_caches_every_group_in_shared_pages(tmp_path):
    """Gemma 3's shape: sliding-window groups and a full one, overlaid on the
    same pages: kvcached's planes are the distinct page regions (two here, as
    each group has two layers), every group cached."""
    groups = [KVCacheGroupSpec([f"l{g}.{i}" for i in range(2)], SWA if g < 2 else FULL)
              for g in range(3)]
    kv = kv_config(groups)
    assert [(g.kind, g.window) for g in vconfig.cached_groups(kv)] == \
        [("sliding", 128), ("sliding", 128), ("full", None)]
    assert vconfig.physical_layers(kv) == ["l0.0", "l0.1"]
    cfg = vconfig.cache_config(engine_config(tmp_path), kv, True)
    assert (cfg.num_layers, cfg.block_size, cfg.fused_kv, cfg.mla) == (2, 32, True, False)


def test_an_mla_model_caches_one_latent_plane_per_layer(tmp_path):
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    cfg = vconfig.cache_config(engine_config(tmp_path),
                               kv_config([KVCacheGroupSpec(["a", "b"], mla)]), True)
    assert (cfg.num_layers, cfg.head_dim, cfg.block_size) == (2, 576, 16)
    assert cfg.mla and not cfg.fused_kv  # one plane per layer, K only
    assert [p.name for p in cfg.layout.planes] == ["layer0.k", "layer1.k"]


def test_mla_loads_nothing_where_vllm_cannot_prefill_on_a_cached_prefix(tmp_path):
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    ec = engine_config(tmp_path)
    cfg = vconfig.cache_config(ec, kv_config([KVCacheGroupSpec(["a"], mla)]), True)
    assert cfg.device == "cpu" and vconfig.loads_unsupported(ec, cfg) is None
    ec.cache_config.enable_prefix_caching = False  # what vLLM's CPU platform does for MLA
    assert "serves no hits" in vconfig.loads_unsupported(ec, cfg)
    full = vconfig.cache_config(ec, kv_config(), True)
    assert vconfig.loads_unsupported(ec, full) is None  # attention prefills on any prefix


def mamba_spec(mode="align", page=FULL.page_size_bytes, **kw) -> MambaSpec:
    """A gated delta-net layer's state, its page padded to the attention page
    (as vLLM pads it)."""
    return MambaSpec(block_size=32, shapes=((3, 64), (2, 16, 16)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=page,
                     mamba_cache_mode=mode, **kw)


def test_a_mamba_hybrid_caches_its_states_in_the_attention_pages(tmp_path):
    """Qwen3-Next's shape: three gated delta-net groups and a full-attention
    one, all over the same pages: one page region, named by the attention
    layer (its tensor is the pages; a Mamba layer's is a list of states)."""
    groups = [KVCacheGroupSpec([f"m{g}"], mamba_spec()) for g in range(3)]
    groups.append(KVCacheGroupSpec(["attn"], FULL))
    kv = kv_config(groups)
    assert [g.kind for g in vconfig.cached_groups(kv)] == ["mamba"] * 3 + ["full"]
    assert vconfig.physical_layers(kv) == ["attn"]
    cfg = vconfig.cache_config(engine_config(tmp_path), kv, True)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (1, 2, 64)
    assert cfg.layout.block_bytes == FULL.page_size_bytes


def test_the_cuda_checks_hybrid_pages_are_vllms(tmp_path):
    """The hybrid layout the CUDA copy engine is checked on (tests/copy/hybrid_pages.py,
    scripts/gpu_check.sh's hybrid step) is vLLM's: vLLM groups the same layers,
    lays them out and allocates them (LBHNC, its CPU and layer-outermost layout),
    and kvcached's planes over that allocation (physical_layers, planes_of) are
    the helper's, byte for byte, in kvcached's layout; each Mamba layer's
    states start its region's pages."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "copy"))
    import hybrid_pages as hp
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvcached.integrations.vllm.worker import planes_of
    attn = {"block_size": hp.BLOCK, "num_kv_heads": hp.HEADS, "head_size": hp.HEAD_SIZE,
            "dtype": hp.DTYPE}
    specs = {"sliding": SlidingWindowSpec(**attn, sliding_window=128),
             "full": FullAttentionSpec(**attn),
             "mamba": MambaSpec(block_size=hp.BLOCK, shapes=(hp.CONV[0], hp.SSM[0]),
                                dtypes=(hp.CONV[1], hp.SSM[1]), page_size_padded=hp.PAGE,
                                mamba_cache_mode="align")}
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    groups = get_kv_cache_groups(vllm_config, {name: specs[kind] for kind, names in
                                               hp.GROUPS.items() for name in names})
    assert [g.layer_names for g in groups] == list(hp.GROUPS.values())
    kv = get_kv_cache_config_from_groups(vllm_config, groups,
                                         hp.NUM_BLOCKS * hp.REGIONS * hp.PAGE)
    assert kv.num_blocks == hp.NUM_BLOCKS
    caches = allocate_kv_cache(kv, torch.device("cpu"), vllm_config.cache_config
                               .get_resolved_kv_cache_layout())
    layers = vconfig.physical_layers(kv)
    planes = planes_of(caches, layers, kv.num_blocks)
    buf = torch.empty(0, dtype=torch.int8).set_(planes[0].untyped_storage())
    pages = hp.HybridPages(buf, kv.num_blocks)
    assert len(planes) == len(pages.planes) == hp.REGIONS
    for mine, theirs in zip(pages.planes, planes, strict=True):
        assert (mine.data_ptr(), mine.shape, mine.stride(), mine.dtype) == \
            (theirs.data_ptr(), theirs.shape, theirs.stride(), theirs.dtype)
    for r, name in enumerate(hp.GROUPS["mamba"]):
        assert caches[name].data_ptr() == pages.region(r).data_ptr()
        assert caches[name].stride(0) == hp.PAGE
    cfg = vconfig.cache_config(engine_config(tmp_path), kv, fused_kv=True)
    assert cfg.layout == pages.layout()


def test_mamba_groups_kvcached_cannot_cache_are_refused_with_the_fix(tmp_path):
    def refused(groups, match):
        with pytest.raises(ValueError, match=match):
            vconfig.cache_config(engine_config(tmp_path), kv_config(groups), True)
    attn = KVCacheGroupSpec(["attn"], FULL)
    refused([KVCacheGroupSpec(["m"], mamba_spec("all")), attn],
            r"mamba_cache_mode \"align\" \(--mamba-cache-mode align.*it is 'all'")
    refused([KVCacheGroupSpec(["m"], mamba_spec(num_speculative_blocks=1)), attn],
            "speculative decoding")
    refused([KVCacheGroupSpec(["m"], mamba_spec(page=FULL.page_size_bytes * 2)), attn],
            r"group 0 \(MambaSpec\) has \(32, 32768\), the attention layers \(32, 16384\)")
    refused([KVCacheGroupSpec(["m"], mamba_spec())], "has only Mamba layers")
    padded = replace(FULL, page_size_padded=FULL.page_size_bytes * 2)
    refused([KVCacheGroupSpec(["m"], mamba_spec(page=FULL.page_size_bytes * 2)),
             KVCacheGroupSpec(["attn"], padded)], "vLLM padded every attention page")


def vllm_grouped(layers: dict, layout: str = "LBHNC") -> KVCacheConfig:
    """vLLM's own grouping and placement of these layers' specs (no engine)."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    vllm_config = VllmConfig()
    vllm_config.cache_config.kv_cache_layout = layout
    groups = get_kv_cache_groups(vllm_config, dict(layers))
    return get_kv_cache_config_from_groups(vllm_config, groups, 64 << 20)


def attention(cls=FullAttentionSpec, heads: int = 2, **kw):
    return cls(block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16, **kw)


def test_pages_of_different_sizes_are_refused_with_the_fix(tmp_path):
    """vLLM 0.32 makes KV cache groups of different page sizes: in a
    block-outermost layout it packs a sliding-window group and a full one of
    half the KV heads side by side in a block; one group holds full-attention
    layers of different KV heads (UniformTypeKVCacheSpecs); in the default
    layout the full group gets twice the block size (the same page). kvcached
    refuses each at start-up, naming the kind and the fix."""
    sliding = attention(SlidingWindowSpec, sliding_window=128)
    for kv, match in [
        (vllm_grouped({"s": sliding, "f": attention(heads=1)}, "BLHNC"),
         r"\['UniformTypeKVCacheSpecs', 'UniformTypeKVCacheSpecs'\].*names one \(BLHNC"),
        (vllm_grouped({"a": attention(), "b": attention(heads=1)}),
         r"\['UniformTypeKVCacheSpecs'\]: pages of different sizes in a group"),
        (vllm_grouped({"s": sliding, "f": attention(heads=1)}),
         r"group 1 \(FullAttentionSpec\) has \(64, 16384\), the attention layers \(32, "
         r"16384\)\. Serve org/model without --kv-transfer-config"),
    ]:
        with pytest.raises(ValueError, match=match):
            vconfig.cache_config(engine_config(tmp_path), kv, True)


@pytest.mark.parametrize("order", [["s", "f"], ["f", "s"]])
def test_a_padded_attention_page_is_copied_through_the_layer_that_fills_it(tmp_path, order):
    """Sliding-window layers of 2 KV heads, full-attention ones of 3: vLLM pads
    the smaller page to the larger (3:2 does not divide). kvcached's plane is
    the full-attention layer's whole page, whichever group comes first (the
    padded layer's view misses a third of a full-attention block)."""
    layers = {"s": attention(SlidingWindowSpec, sliding_window=128), "f": attention(heads=3)}
    kv = vllm_grouped({name: layers[name] for name in order})
    assert vconfig.physical_layers(kv) == ["f"]
    cfg = vconfig.cache_config(engine_config(tmp_path), kv, True)
    assert cfg.num_kv_heads == 3 and cfg.layout.block_bytes == layers["f"].page_size_bytes


def test_vllm_lays_its_kv_cache_out_as_kvcached_copies_it():
    """Where the attention backends take any layout (FlashAttention on a GPU)
    vLLM 0.32 prefers tokens outside heads (LBNHC), whose blocks the worker
    half refuses as planes; with kvcached it lays heads outside (LBHNC), the
    layout the CPU backend and the CUDA check's pages use."""
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    any_layout = [[layout.name for layout in get_supported_kv_cache_layouts([])]]
    assert resolve_kv_cache_layout(VllmConfig(), any_layout).name == "LBNHC"
    served = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KvcachedConnector", kv_connector_module_path="kvcached.integrations.vllm",
        kv_role="kv_both"))
    assert resolve_kv_cache_layout(served, any_layout).name == "LBHNC"


def test_unsupported_models_are_refused_with_the_reason(tmp_path):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    local = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                      dtype=torch.bfloat16, attention_chunk_size=128)
    with pytest.raises(ValueError, match=r"org/model has ChunkedLocalAttentionSpec \(groups: "
                                         r"\['FullAttentionSpec', 'ChunkedLocalAttentionSpec'\]\)"):
        vconfig.cache_config(engine_config(tmp_path), kv_config(
            [KVCacheGroupSpec(["a"], FULL), KVCacheGroupSpec(["b"], local)]), True)
    other = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16,
                              sliding_window=128)
    with pytest.raises(ValueError, match=r"share one page layout.*group 1 \(SlidingWindowSpec\) "
                                         r"has \(32, 32768\)"):
        vconfig.cache_config(engine_config(tmp_path), kv_config(
            [KVCacheGroupSpec(["a"], FULL), KVCacheGroupSpec(["b"], other)]), True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        vconfig.cache_config(engine_config(tmp_path, pp=2), kv_config(), True)
    with pytest.raises(ValueError, match="hashes blocks of 16 tokens.*--prefix-match-unit"):
        vconfig.cache_config(engine_config(tmp_path), kv_config(hash_block_size=16), True)
    fp8 = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                            dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8"):
        vconfig.cache_config(engine_config(tmp_path), kv_config([KVCacheGroupSpec(["a"], fp8)]),
                             True)


def test_per_process_hash_seed_warns_when_storage_is_on(tmp_path, monkeypatch):
    ec = engine_config(tmp_path, {"storage_backend": "file", "storage_url": str(tmp_path)})
    cfg = vconfig.cache_config(ec, kv_config(), True)
    assert vconfig.check_hashes_reproducible(ec, cfg) is None
    ec.cache_config.prefix_caching_hash_algo = "xxhash"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert "never found by the next" in vconfig.check_hashes_reproducible(ec, cfg)


def test_in_step_loads_ask_vllm_for_piecewise_cuda_graphs(monkeypatch):
    """A full CUDA graph replays the forward without wait_for_layer_load: while
    loads inside the step are on, the connector asks vLLM (its
    requires_piecewise_for_cudagraph hook, read from the extra config before
    any engine starts) to keep to piecewise graphs; with them off
    (step_load_max_blocks = 0, in the extra config or the environment) vLLM
    keeps its full graphs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcached.integrations.vllm.connector import KvcachedConnector
    assert "requires_piecewise_for_cudagraph" in vars(KVConnectorBase_V1)  # vLLM's hook
    hook = KvcachedConnector.requires_piecewise_for_cudagraph
    assert hook({}) and hook({"step_load_max_blocks": 16})
    assert not hook({"step_load_max_blocks": 0})
    monkeypatch.setenv("KVCACHED_STEP_LOAD_MAX_BLOCKS", "0")
    assert not hook({}) and hook({"step_load_max_blocks": "8"})
