"""CacheConfig: TOML, then env KVCACHED_*, then kwargs; every bad value named at load time;
the KV layout (bytes per plane, planes per layer, digest) derived from the model settings."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import kvcached.config as config_mod
from kvcached import CacheConfig
from kvcached.config import DEFAULT_TOML

REPO = Path(__file__).resolve().parents[1]

# Every key of the contract (DESIGN §10), with a value other than the TOML file's below.
CONTRACT = {
    "num_gpu_blocks": 100,
    "num_cpu_blocks": 300,
    "block_size": 32,
    "tp_size": 2,
    "transfer_mode": "inprocess",
    "storage_backend": None,
    "storage_url": "/tmp/kvcached-test-store",
    "run_dir": "/tmp/kvcached-test-run",
    "create_cache": True,
    "engine_timeout_s": 2.5,
    "num_layers": 3,
    "num_kv_heads": 2,
    "head_dim": 128,
    "dtype": "bfloat16",
    "mla": True,
}
# A third value per key, used in the TOML file so that kwargs must win over it.
TOML_VALUES = {
    "model_id": "toml-model",  # storage needs the model named
    "num_gpu_blocks": 77, "num_cpu_blocks": 16, "block_size": 8, "tp_size": 4,
    "transfer_mode": "workers", "storage_backend": "file", "storage_url": "/tmp/elsewhere",
    "run_dir": "/tmp/kvcached-toml-run", "create_cache": False, "engine_timeout_s": 7.0,
    "num_layers": 5, "num_kv_heads": 8, "head_dim": 32, "dtype": "float16", "mla": False,
}


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def write_toml(path: Path, values: dict) -> Path:
    path.write_text("".join(f"{k} = {toml_literal(v)}\n" for k, v in values.items()))
    return path


@pytest.fixture
def toml_file(tmp_path) -> Path:
    return write_toml(tmp_path / "kv.toml", TOML_VALUES)


# ---------------------------------------------------------------- defaults
def test_embedded_default_is_configs_default_toml():
    shipped = REPO / "configs" / "default.toml"
    assert shipped.resolve() == DEFAULT_TOML.resolve()
    assert shipped.read_bytes() == DEFAULT_TOML.read_bytes()
    assert CacheConfig.load() == CacheConfig.load(shipped)


def test_embedded_default_matches_dataclass_defaults():
    # default.toml documents the defaults; the two must not drift apart.
    assert CacheConfig.load() == CacheConfig()


def test_round_trip_through_dict():
    cfg = CacheConfig.load(**CONTRACT)
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(num_gpu_blocks=64).num_gpu_blocks == 64


# ------------------------------------------------------------- precedence
@pytest.mark.parametrize("key", sorted(CONTRACT))
def test_contract_key_as_kwarg_without_toml(key):
    cfg = CacheConfig.load(**{key: CONTRACT[key]})
    assert getattr(cfg, key) == CONTRACT[key]


@pytest.mark.parametrize("key", sorted(CONTRACT))
def test_contract_key_kwarg_beats_toml(key, toml_file):
    assert getattr(CacheConfig.load(toml_file), key) == TOML_VALUES[key]
    assert getattr(CacheConfig.load(toml_file, **{key: CONTRACT[key]}), key) == CONTRACT[key]


def test_toml_then_env_then_kwargs(toml_file, monkeypatch):
    assert CacheConfig.load(toml_file).num_gpu_blocks == 77
    monkeypatch.setenv("KVCACHED_NUM_GPU_BLOCKS", "123")
    monkeypatch.setenv("KVCACHED_DTYPE", "float32")
    cfg = CacheConfig.load(toml_file)
    assert (cfg.num_gpu_blocks, cfg.dtype) == (123, "float32")
    assert cfg.num_layers == 5  # untouched by env: still the TOML's
    cfg = CacheConfig.load(toml_file, num_gpu_blocks=5)
    assert (cfg.num_gpu_blocks, cfg.dtype) == (5, "float32")
    # Env applies on top of the embedded default too.
    assert CacheConfig.load().num_gpu_blocks == 123


def test_env_values_are_parsed_to_field_types(monkeypatch):
    env = {"KVCACHED_BLOCK_SIZE": "32", "KVCACHED_ENGINE_TIMEOUT_S": "2.5",
           "KVCACHED_CREATE_CACHE": "yes", "KVCACHED_STORAGE_BACKEND": "file",
           "KVCACHED_MODEL_ID": "env-model",
           "KVCACHED_RUN_DIR": "/tmp/x", "KVCACHED_TRANSFER_MODE": "inprocess"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = CacheConfig.load()
    assert cfg.block_size == 32 and cfg.engine_timeout_s == 2.5 and cfg.create_cache is True
    assert cfg.storage_backend == "file" and cfg.run_dir == "/tmp/x"
    assert cfg.transfer_mode == "inprocess"
    monkeypatch.setenv("KVCACHED_STORAGE_BACKEND", "none")
    assert CacheConfig.load().storage_backend is None


def test_other_kvcached_env_vars_are_not_config(monkeypatch):
    for name in config_mod.OTHER_ENV:
        monkeypatch.setenv(name, "1")
    assert CacheConfig.load() == CacheConfig()


@pytest.mark.parametrize("var,closest", [
    ("KVCACHED_NUM_GPU_BLOCK", "KVCACHED_NUM_GPU_BLOCKS"),
    ("KVCACHED_STORAGE_BACKENDS", "KVCACHED_STORAGE_BACKEND"),
    ("KVCACHED_LOGLEVEL", "KVCACHED_LOG_LEVEL"),
    ("KVCACHED_SOMETHING_ELSE", None),
])
def test_unknown_kvcached_env_var_is_an_error_naming_the_closest(monkeypatch, var, closest):
    """A misspelled variable is an error: ignored, the setting it meant to
    change would silently never take effect."""
    monkeypatch.setenv(var, "64")
    with pytest.raises(ValueError, match=f"unknown environment variable {var}") as e:
        CacheConfig.load()
    if closest:
        assert f"did you mean {closest}?" in str(e.value)
    else:
        assert "did you mean" not in str(e.value)
    assert "unset it" in str(e.value)


@pytest.mark.parametrize("text,expected", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_env_bool_parsing(monkeypatch, text, expected):
    monkeypatch.setenv("KVCACHED_MLA", text)
    assert CacheConfig.load().mla is expected


@pytest.mark.parametrize("text", ["maybe", "", "2", "tru"])
def test_env_bad_bool(monkeypatch, text):
    monkeypatch.setenv("KVCACHED_MLA", text)
    with pytest.raises(ValueError, match=rf"mla must be a boolean \(true/false\), got {re.escape(repr(text))}"):
        CacheConfig.load()


@pytest.mark.parametrize("var,field,text,kind", [
    ("KVCACHED_NUM_GPU_BLOCKS", "num_gpu_blocks", "abc", "an integer"),
    ("KVCACHED_BLOCK_SIZE", "block_size", "1.5", "an integer"),
    ("KVCACHED_ENGINE_TIMEOUT_S", "engine_timeout_s", "soon", "a number"),
])
def test_env_bad_number(monkeypatch, var, field, text, kind):
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=rf"{field} must be {kind}, got '{re.escape(text)}'"):
        CacheConfig.load()


# ------------------------------------------------------------ bad values
@pytest.mark.parametrize("key,value,message", [
    ("num_gpu_blocks", 0, "num_gpu_blocks must be > 0, got 0"),
    ("num_gpu_blocks", -3, "num_gpu_blocks must be > 0, got -3"),
    ("num_cpu_blocks", -1, "num_cpu_blocks must be >= 0, got -1"),
    ("block_size", 0, "block_size must be > 0, got 0"),
    ("tp_size", 0, "tp_size must be > 0, got 0"),
    ("num_layers", 0, "num_layers must be > 0, got 0"),
    ("num_kv_heads", 0, "num_kv_heads must be > 0, got 0"),
    ("head_dim", -1, "head_dim must be > 0, got -1"),
    ("engine_timeout_s", 0, "engine_timeout_s must be > 0, got 0"),
    ("dtype", "int8", "dtype must be one of 'bfloat16', 'float16', 'float32', "
                      "'float8_e4m3fn'; got 'int8'"),
    ("transfer_mode", "threads", "transfer_mode must be one of 'workers', 'inprocess'; "
                                 "got 'threads'"),
    ("storage_backend", "s3", "storage_backend must be one of none, 'file', 'mooncake', "
                              "'redis'; got 's3'"),
    ("num_gpu_blocks", 1.5, "num_gpu_blocks must be an integer, got 1.5"),
    ("num_gpu_blocks", True, "num_gpu_blocks must be an integer, got True"),
    ("num_gpu_blocks", "abc", "num_gpu_blocks must be an integer, got 'abc'"),
    ("engine_timeout_s", "soon", "engine_timeout_s must be a number, got 'soon'"),
    ("mla", 1, "mla must be a boolean (true/false), got 1"),
    ("create_cache", "maybe", "create_cache must be a boolean (true/false), got 'maybe'"),
    ("run_dir", 5, "run_dir must be a string, got 5"),
    ("storage_url", None, "storage_url must be a string, got None"),
    ("cuda_copy_d2h", "dma", "cuda_copy_d2h must be one of 'kernel', 'direct', 'batch'; "
                             "got 'dma'"),
    ("cuda_copy_h2d", "", "cuda_copy_h2d must be one of 'kernel', 'direct', 'batch'; got ''"),
    ("eviction_policy", "lfu", "eviction_policy must be one of 'lru', 'adaptive'; got 'lfu'"),
    ("eviction_policy", 1, "eviction_policy must be a string, got 1"),
    ("cuda_grid_blocks", 0, "cuda_grid_blocks must be in 1..1024"),
    ("cuda_grid_blocks", 1025, "got 1025"),
    ("cuda_block_threads", 48, "cuda_block_threads must be a multiple of 32 in 32..512, got 48"),
    ("cuda_block_threads", 1024, "cuda_block_threads must be a multiple of 32 in 32..512, "
                                 "got 1024"),
    ("cuda_block_threads", 0, "got 0"),
])
def test_invalid_value_names_field_value_and_allowed(key, value, message):
    with pytest.raises(ValueError) as e:
        CacheConfig.load(**{key: value})
    assert message in str(e.value)


def test_eviction_policy_reaches_the_core(monkeypatch, tmp_path):
    from kvcached import CacheManager
    kw = dict(num_gpu_blocks=8, num_cpu_blocks=4, transfer_mode="inprocess",
              check_host_memory=False)
    for policy, tiers in (("adaptive", {"policy", "params", "gpu", "cpu"}), ("lru", {"policy"})):
        if policy == "lru":
            monkeypatch.setenv("KVCACHED_EVICTION_POLICY", "lru")
        cfg = CacheConfig.load(run_dir=str(tmp_path / policy), **kw)
        assert cfg.eviction_policy == policy  # adaptive: the default
        mgr = CacheManager(cfg)
        try:
            assert mgr.core.policy == policy
            assert set(mgr.core.policy_stats()) == tiers
        finally:
            mgr.close()


@pytest.mark.parametrize("backend", ["mooncake", "redis"])
def test_remote_storage_needs_url(backend):
    with pytest.raises(ValueError, match=f"storage_url must be set for storage_backend='{backend}'"):
        CacheConfig.load(storage_backend=backend, model_id="m")
    assert CacheConfig.load(storage_backend=backend, storage_url="127.0.0.1:1",
                            model_id="m").storage_url


@pytest.mark.parametrize("backend", ["file", "mooncake", "redis"])
def test_storage_needs_the_model_named(backend):
    """Two models of the same layout under the old default model_id shared
    storage: the second was served the first one's KV."""
    with pytest.raises(ValueError, match=f"storage_backend='{backend}' needs model_id"):
        CacheConfig.load(storage_backend=backend, storage_url="127.0.0.1:1")
    cfg = CacheConfig.load(storage_backend=backend, storage_url="127.0.0.1:1", model_id="m")
    assert cfg.model_id == "m"


def test_defaults_keep_storage_off_and_the_file_store_capped():
    cfg = CacheConfig()
    assert cfg.storage_backend is None and cfg.model_id == ""
    assert cfg.storage_max_bytes == 0  # 0: a share of the free disk, not unlimited
    assert CacheConfig.load(storage_max_bytes=-1).storage_max_bytes == -1  # explicit: no cap
    with pytest.raises(ValueError, match="storage_max_bytes must be > 0 .* got -2"):
        CacheConfig.load(storage_max_bytes=-2)


@pytest.mark.parametrize("key", ["engine_timeout_s", "task_timeout_s", "worker_stable_s",
                                 "storage_load_timeout_s", "worker_timeout_s"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_float_settings_must_be_finite(key, value):
    with pytest.raises(ValueError, match=f"{key} must be"):
        CacheConfig.load(**{key: value})


def test_replace_does_not_check_host_memory_again(monkeypatch):
    """A running config's host pools exist: a runtime change (weights, storage)
    must not fail because those pools now take the memory they were checked for."""
    cfg = CacheConfig.load(num_cpu_blocks=64)
    monkeypatch.setattr(config_mod, "available_host_memory", lambda: 0)
    with pytest.raises(ValueError, match="host memory"):
        CacheConfig.load(num_cpu_blocks=64)
    assert cfg.replace(weight_version="v2").weight_version == "v2"


def test_storage_needs_a_cpu_tier():
    with pytest.raises(ValueError, match="storage_backend='file' needs a CPU tier .*"
                                         "set num_cpu_blocks > 0"):
        CacheConfig.load(storage_backend="file", num_cpu_blocks=0)
    assert CacheConfig.load(storage_backend=None, num_cpu_blocks=0).num_cpu_blocks == 0


def test_metrics_port_range():
    with pytest.raises(ValueError, match="metrics_port must be in 0..65535 .*got 70000"):
        CacheConfig.load(metrics_port=70000)
    with pytest.raises(ValueError, match="metrics_port must be >= 0, got -1"):
        CacheConfig.load(metrics_port=-1)


def test_heartbeat_must_be_shorter_than_worker_timeout():
    with pytest.raises(ValueError, match=r"heartbeat_interval_s \(3.0\) must be smaller than "
                                         r"worker_timeout_s \(3.0\)"):
        CacheConfig.load(heartbeat_interval_s=3.0, worker_timeout_s=3.0)


def test_unknown_key_as_kwarg_and_in_toml(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['num_gpu_blokcs'\] "
                                         r"\('num_gpu_blokcs': did you mean 'num_gpu_blocks'\?\); "
                                         r"allowed keys: \[.*'num_gpu_blocks'"):
        CacheConfig.load(num_gpu_blokcs=5)
    path = write_toml(tmp_path / "typo.toml", {"blocksize": 16})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['blocksize'\]"):
        CacheConfig.load(path)


def test_toml_values_are_type_checked(tmp_path):
    with pytest.raises(ValueError, match="num_gpu_blocks must be an integer, got 'many'"):
        CacheConfig.load(write_toml(tmp_path / "a.toml", {"num_gpu_blocks": "many"}))
    # A whole float is an integer; TOML booleans must be booleans.
    assert CacheConfig.load(write_toml(tmp_path / "b.toml", {"num_gpu_blocks": 64.0})
                            ).num_gpu_blocks == 64
    with pytest.raises(ValueError, match="mla must be a boolean"):
        CacheConfig.load(write_toml(tmp_path / "c.toml", {"mla": 1}))


def test_missing_toml_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match=f"config file '{re.escape(str(path))}' does not exist"):
        CacheConfig.load(path)


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("num_gpu_blocks = = 4\n")
    with pytest.raises(ValueError, match=f"config file '{re.escape(str(path))}' is not valid TOML"):
        CacheConfig.load(path)


def test_host_memory_check(monkeypatch):
    monkeypatch.setattr(config_mod, "available_host_memory", lambda: 64 << 20)  # 64 MiB
    # 1000 blocks x 128 KiB = 125 MiB of host pool: too much.
    with pytest.raises(ValueError) as e:
        CacheConfig.load(num_cpu_blocks=1000, num_gpu_blocks=16)
    msg = str(e.value)
    assert "num_cpu_blocks=1000" in msg and "lower num_cpu_blocks" in msg
    assert "131072 bytes per block" in msg
    # The CPU backend's device planes live in host memory too.
    with pytest.raises(ValueError, match="lower num_cpu_blocks or num_gpu_blocks"):
        CacheConfig.load(num_cpu_blocks=0, num_gpu_blocks=1000, storage_backend=None)
    with pytest.raises(ValueError, match="for 2 rank"):
        CacheConfig.load(num_cpu_blocks=300, num_gpu_blocks=16, tp_size=2)
    assert CacheConfig.load(num_cpu_blocks=300, num_gpu_blocks=16).num_cpu_blocks == 300
    assert CacheConfig.load(num_cpu_blocks=1000, check_host_memory=False).num_cpu_blocks == 1000


def test_cuda_copy_settings():
    """Per-direction copy modes and the kernel's grid, from kwargs and env; the CUDA
    module's modes and limits are what the config allows."""
    from kvcached.copy import cuda as kvc
    assert config_mod.CUDA_COPY_MODES == kvc.MODES
    assert (config_mod.CUDA_MAX_GRID_BLOCKS, config_mod.CUDA_MAX_BLOCK_THREADS) == (
        kvc.MAX_GRID_BLOCKS, kvc.MAX_BLOCK_THREADS)
    cfg = CacheConfig.load(cuda_copy_d2h="kernel", cuda_copy_h2d="direct", cuda_grid_blocks=16,
                           cuda_block_threads=512)
    assert (cfg.cuda_copy_d2h, cfg.cuda_copy_h2d, cfg.cuda_grid_blocks,
            cfg.cuda_block_threads) == ("kernel", "direct", 16, 512)
    default = CacheConfig.load()
    assert (default.cuda_copy_d2h, default.cuda_copy_h2d) == ("batch", "kernel")


def test_every_field_can_be_set_from_env(monkeypatch):
    """Each field's env spelling is KVCACHED_<FIELD>; string forms round-trip."""
    cfg = CacheConfig.load(**CONTRACT)
    for f in dataclasses.fields(CacheConfig):
        value = getattr(cfg, f.name)
        text = "none" if value is None else str(value).lower() if isinstance(value, bool) \
            else str(value)
        monkeypatch.setenv(f"KVCACHED_{f.name.upper()}", text)
    assert CacheConfig.load() == cfg


# ----------------------------------------------------------------- layout
def layout_of(**kw):
    base = dict(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32",
                storage_backend=None)
    return CacheConfig.load(**{**base, **kw}).layout


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_bytes_per_block_per_plane(dtype, size):
    lay = layout_of(dtype=dtype)
    assert [p.name for p in lay.planes] == ["layer0.k", "layer0.v", "layer1.k", "layer1.v"]
    assert lay.plane_bytes == (4 * 16 * 64 * size,) * 4
    assert lay.block_bytes == 4 * 4 * 16 * 64 * size
    assert lay.host_offsets == tuple(i * 4 * 16 * 64 * size for i in range(4))


def test_fp8_adds_a_scale_plane_per_layer():
    lay = layout_of(dtype="float8_e4m3fn")
    assert [p.name for p in lay.planes] == ["layer0.k", "layer0.v", "layer0.scale",
                                            "layer1.k", "layer1.v", "layer1.scale"]
    kv, scale = 4 * 16 * 64, 2 * 4 * 16 * 4  # one fp32 scale per (K/V, head, token)
    assert lay.plane_bytes == (kv, kv, scale) * 2
    assert lay.block_bytes == 2 * (2 * kv + scale)


def test_mla_is_k_only():
    lay = layout_of(mla=True, num_kv_heads=1, head_dim=576, dtype="bfloat16")
    assert [p.name for p in lay.planes] == ["layer0.k", "layer1.k"]
    assert lay.plane_bytes == (16 * 576 * 2,) * 2
    fp8 = layout_of(mla=True, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn")
    assert [p.name for p in fp8.planes] == ["layer0.k", "layer0.scale", "layer1.k",
                                            "layer1.scale"]
    assert fp8.plane_bytes == (16 * 576, 16 * 4) * 2


def test_host_span_planes_are_16_byte_aligned():
    # 1 head x 1 token x 3 fp16 = 6 bytes: padded to 16 in the host span.
    lay = layout_of(num_kv_heads=1, head_dim=3, block_size=1, dtype="float16")
    assert lay.plane_bytes == (6, 6, 6, 6)
    assert lay.host_offsets == (0, 16, 32, 48) and lay.block_bytes == 64


def test_digest_changes_with_the_layout_only():
    base = layout_of().digest
    changes = [dict(num_layers=3), dict(num_kv_heads=8), dict(head_dim=128),
               dict(block_size=32), dict(dtype="bfloat16"), dict(dtype="float8_e4m3fn"),
               dict(mla=True)]
    digests = {layout_of(**c).digest for c in changes}
    assert base not in digests and len(digests) == len(changes)
    # Pool sizes and TP degree are checked separately at handshake, not in the digest.
    assert layout_of(num_gpu_blocks=64, num_cpu_blocks=0, tp_size=2).digest == base
    assert layout_of().digest == base  # stable
