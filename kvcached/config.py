"""CacheConfig: one validated configuration for the manager and the workers.

Sources, later ones win: the TOML file (the embedded ``default.toml`` when no
path is given), environment variables ``KVCACHED_<FIELD>``, keyword overrides.
Everything is checked at load time; an error names the field, the value and
what is allowed, so a bad setting never surfaces later as a crash. A
``KVCACHED_*`` variable that is neither a field nor one of :data:`OTHER_ENV`
is an error naming the closest valid one (a misspelling must not be ignored).

Safe defaults: storage is off, and turning it on requires ``model_id`` (the
storage namespace of two models with the same layout must never be the same:
the second would be served the first one's KV); the file store is capped
(``storage_max_bytes = 0``: a tenth of the free disk space).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached.layout import DTYPE_SIZES, KVLayout

DEFAULT_TOML = Path(__file__).with_name("default.toml")
ENV_PREFIX = "KVCACHED_"

TRANSFER_MODES = ("workers", "inprocess")
STORAGE_BACKENDS = (None, "file", "mooncake", "redis")
DEVICES = ("cpu", "cuda")
LOAD_POLICIES = ("best_effort", "wait_complete", "timeout")
# Which blocks go to storage, and when (kvcached.core.planner.WRITE_BACK_MODE).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "adaptive")  # the native core's (kvcached.core._core.Core policy)
CUDA_COPY_MODES = ("kernel", "direct", "batch")  # kvcached.copy.cuda.MODES
CUDA_MAX_GRID_BLOCKS, CUDA_MAX_BLOCK_THREADS = 1024, 512  # kv_copy.h
# KVCACHED_* environment variables that are not config fields, and what they do.
OTHER_ENV = {
    "KVCACHED_LOG_LEVEL": "log level of kvcached's processes (DEBUG, INFO, ...)",
    "KVCACHED_CACHE_DIR": "where the CUDA copy library is built (default ~/.cache/kvcached)",
    "KVCACHED_SHM_DIR": "where shared-memory segments live (default /dev/shm)",
    "KVCACHED_CUDA_ARCHS": "SM versions to build the CUDA kernel for (e.g. 80;90)",
    "KVCACHED_NVCC": "the nvcc to build the CUDA kernel with",
    "KVCACHED_MOONCAKE_NETNS": "tests only: the Mooncake tests run in a network namespace",
}


@dataclass(slots=True)
class CacheConfig:
    """All settings of one kvcached deployment (see ``default.toml`` for docs)."""

    model_id: str = ""
    weight_version: str = "0"
    salt: str = ""
    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    mla: bool = False
    fused_kv: bool = False
    tp_size: int = 1
    block_size: int = 16
    num_gpu_blocks: int = 512
    num_cpu_blocks: int = 2048
    device: str = "cpu"
    transfer_mode: str = "workers"
    create_cache: bool = False
    external_gpu_tier: bool = False
    run_dir: str = ""
    log_dir: str = ""
    spawn_workers: bool = True
    worker_start_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 3.0
    engine_timeout_s: float = 10.0
    task_timeout_s: float = 30.0
    max_worker_restarts: int = 3
    worker_stable_s: float = 30.0
    copy_threads: int = 2
    cuda_copy_d2h: str = "batch"
    cuda_copy_h2d: str = "kernel"
    cuda_grid_blocks: int = 4
    cuda_block_threads: int = 256
    hash_memo: bool = True
    eviction_policy: str = "adaptive"
    storage_backend: str | None = None
    storage_url: str = ""
    storage_load_policy: str = "timeout"
    storage_load_timeout_s: float = 1.0
    storage_lookup_timeout_s: float = 0.1
    step_load_max_blocks: int = 128
    step_load_timeout_s: float = 2.0
    storage_min_load_blocks: int = 1
    storage_max_bytes: int = 0
    storage_write_policy: str = "write_through"
    storage_write_threshold: int = 1
    storage_secret_file: str = ""
    storage_secret_env: str = ""
    storage_encrypt: bool = False
    check_host_memory: bool = True
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    kv_events_endpoint: str = ""
    control_socket: bool = True

    # ------------------------------------------------------------------ load
    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides: Any) -> CacheConfig:
        """TOML (embedded default when ``path`` is None), then env, then kwargs."""
        values = _read_toml(Path(path) if path else DEFAULT_TOML)
        values.update(_read_env())
        values.update(overrides)
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any], check_host_memory: bool = True) -> CacheConfig:
        """Build and validate from a plain dict (unknown keys are an error).
        ``check_host_memory=False`` skips the host memory check (see ``replace``)."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            hints = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k in unknown
                            if (m := difflib.get_close_matches(k, known, n=1)))
            raise ValueError(
                f"unknown config key(s) {unknown}{hints}; allowed keys: {sorted(known)}")
        kwargs = {k: _coerce(k, v, known[k]) for k, v in values.items()}
        cfg = cls(**kwargs)
        cfg.validate(check_host_memory=check_host_memory)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (msgpack/JSON friendly) that ``from_dict`` accepts back."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> CacheConfig:
        """A validated copy with some fields changed. Host memory is not checked
        again: the pools of a running config exist already (they would count
        against themselves), and a runtime change (weights, storage) adds none."""
        return CacheConfig.from_dict({**self.to_dict(), **changes}, check_host_memory=False)

    # -------------------------------------------------------------- validate
    def validate(self, check_host_memory: bool = True) -> None:
        """Raise ValueError naming the first bad field, its value and the fix."""
        _finite(self)
        _positive(self, "num_layers", "num_kv_heads", "head_dim", "tp_size",
                  "block_size", "num_gpu_blocks", "copy_threads")
        _non_negative(self, "num_cpu_blocks", "max_worker_restarts",
                      "storage_min_load_blocks", "metrics_port", "step_load_max_blocks")
        if self.storage_max_bytes < -1:
            raise ValueError(f"storage_max_bytes must be > 0 (a cap in bytes), 0 (a tenth of "
                             f"the free disk) or -1 (no cap), got {self.storage_max_bytes}")
        if self.metrics_port > 65535:
            raise ValueError(f"metrics_port must be in 0..65535 (0 = off), got {self.metrics_port}")
        _positive(self, "worker_start_timeout_s", "heartbeat_interval_s",
                  "worker_timeout_s", "engine_timeout_s", "task_timeout_s",
                  "storage_load_timeout_s", "storage_lookup_timeout_s",
                  "worker_stable_s", "step_load_timeout_s")
        if self.heartbeat_interval_s >= self.worker_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be smaller than "
                f"worker_timeout_s ({self.worker_timeout_s})")
        _choice(self, "dtype", tuple(DTYPE_SIZES))
        _choice(self, "device", DEVICES)
        _choice(self, "transfer_mode", TRANSFER_MODES)
        _choice(self, "storage_backend", STORAGE_BACKENDS)
        _choice(self, "storage_load_policy", LOAD_POLICIES)
        _choice(self, "storage_write_policy", WRITE_POLICIES)
        if self.storage_write_threshold < 1:
            raise ValueError(f"storage_write_threshold must be >= 1 (the reuses after which "
                             f"write_through_selective writes a block), got "
                             f"{self.storage_write_threshold}")
        _choice(self, "eviction_policy", EVICTION_POLICIES)
        self.storage_secrets()  # a secret that cannot be read is an error now, not later
        if self.storage_encrypt and not (self.storage_secret_file or self.storage_secret_env):
            raise ValueError("storage_encrypt = true needs a fleet secret to derive its keys "
                             "from: set storage_secret_file (or storage_secret_env), the same "
                             "on every instance, or set storage_encrypt = false")
        _check_cuda_copy(self)
        if self.storage_backend in ("mooncake", "redis") and not self.storage_url:
            raise ValueError(
                f"storage_url must be set for storage_backend={self.storage_backend!r} "
                "(e.g. 127.0.0.1:50051 for mooncake, redis://127.0.0.1:6379 for redis)")
        if self.storage_backend and not self.num_cpu_blocks:
            raise ValueError(f"storage_backend={self.storage_backend!r} needs a CPU tier "
                             "(host blocks stage every storage transfer): set num_cpu_blocks > 0")
        if self.storage_backend and not self.model_id:
            raise ValueError(
                f"storage_backend={self.storage_backend!r} needs model_id: name the model "
                "(e.g. model_id = \"meta-llama/Llama-3.1-8B\", and weight_version for "
                "fine-tunes), so that KV stored for other weights of the same layout is "
                "never served; or set storage_backend = \"none\"")
        if self.fused_kv and self.mla:
            raise ValueError("fused_kv (K and V of a layer in one plane) and mla (K only) "
                             "exclude each other: set one of them")
        if self.external_gpu_tier and self.create_cache:
            raise ValueError("external_gpu_tier: the engine owns the KV planes, so kvcached "
                             "cannot create them: set create_cache = false")
        if self.check_host_memory and check_host_memory:
            _check_host_memory(self)

    # --------------------------------------------------------------- derived
    @property
    def layout(self) -> KVLayout:
        """The per-rank KV plane layout derived from the model settings."""
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, block_size=self.block_size,
                        dtype=self.dtype, mla=self.mla, fused_kv=self.fused_kv)

    @property
    def cpu_tier_enabled(self) -> bool:
        return self.num_cpu_blocks > 0

    def storage_secrets(self) -> list[bytes]:
        """The fleet secrets that sign (the first) and verify (all) storage objects,
        read from ``storage_secret_file`` or the variable ``storage_secret_env``
        names; [] when neither is set. Raises ValueError naming the field and the
        fix; the message never contains a secret."""
        return _storage_secrets(self.storage_secret_file, self.storage_secret_env)


# ------------------------------------------------------------------ helpers
MIN_STORAGE_SECRET_BYTES = 32
_MAKE_SECRET = "e.g. openssl rand -hex 32"


def _storage_secrets(path: str, env: str) -> list[bytes]:
    """Secrets separated by whitespace or commas (one per line in a file, ``#``
    comment lines allowed), each at least MIN_STORAGE_SECRET_BYTES bytes."""
    if path and env:
        raise ValueError("storage_secret_file and storage_secret_env are both set: set one "
                         "(the file, or the name of the environment variable)")
    if path:
        field = f"storage_secret_file ({_shown(path)})"
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as e:
            raise ValueError(f"{field} cannot be read ({e.strerror or type(e).__name__}): "
                             "point it at a readable file of secrets, one per line "
                             f"({_MAKE_SECRET})") from None
        lines = [ln for ln in raw.splitlines() if not ln.lstrip().startswith(b"#")]
        text = b"\n".join(lines)
    elif env:
        field = f"storage_secret_env ({_shown(env)})"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env) or env.startswith(ENV_PREFIX):
            raise ValueError(f"{field} must be the name of the environment variable that "
                             "holds the secret, not the secret itself, and not a "
                             f"{ENV_PREFIX}* name (those are config fields): e.g. "
                             "KV_FLEET_SECRET")
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"{field}: that environment variable is not set; export it in "
                             f"every kvcached process ({_MAKE_SECRET}), or unset "
                             "storage_secret_env")
        text = value.encode()
    else:
        return []
    secrets = [s for s in text.replace(b",", b" ").split() if s]
    if not secrets:
        raise ValueError(f"{field} holds no secret: write one ({_MAKE_SECRET}); several, "
                         "separated by newlines, rotate (the first signs, all verify)")
    for i, s in enumerate(secrets):
        if len(s) < MIN_STORAGE_SECRET_BYTES:
            raise ValueError(f"{field}: secret #{i + 1} is {len(s)} bytes, shorter than "
                             f"{MIN_STORAGE_SECRET_BYTES}: use a longer random one "
                             f"({_MAKE_SECRET})")
    return secrets


def _shown(value: str) -> str:
    """A path or variable name for an error message, unless it looks like a secret
    pasted into the config by mistake (then it must not reach a log)."""
    if len(value) >= MIN_STORAGE_SECRET_BYTES and "/" not in value and "." not in value:
        return "value not shown: it looks like a secret, which belongs in the file or variable"
    return repr(value)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from e


def env_name(field: str) -> str:
    """The environment variable of config field ``field``."""
    return ENV_PREFIX + field.upper()


def _read_env() -> dict[str, Any]:
    """Config fields from ``KVCACHED_<FIELD>``; any other ``KVCACHED_*`` that is not
    in OTHER_ENV is a misspelling, reported with the closest valid name."""
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    names = set(fields)
    out: dict[str, Any] = {}
    for key, value in os.environ.items():
        if not key.startswith(ENV_PREFIX) or key in OTHER_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in names:
            # Compared without the prefix, which every candidate shares.
            valid = {n.upper(): env_name(n) for n in names}
            valid.update({k[len(ENV_PREFIX):]: k for k in OTHER_ENV})
            close = difflib.get_close_matches(key[len(ENV_PREFIX):], valid, n=1, cutoff=0.75)
            hint = f"; did you mean {valid[close[0]]}?" if close else ""
            raise ValueError(f"unknown environment variable {key}{hint} (kvcached reads "
                             f"KVCACHED_<CONFIG FIELD> and {', '.join(sorted(OTHER_ENV))}; "
                             "unset it)")
        try:  # named here, where the variable is known
            out[name] = _coerce(name, value, fields[name])
        except ValueError as e:
            raise ValueError(f"environment variable {key}={value!r}: {e}") from None
    return out


def _coerce(name: str, value: Any, f: dataclasses.Field) -> Any:
    """Turn TOML/env values into the field's type; strings come from env vars."""
    default = f.default if f.default is not dataclasses.MISSING else None
    if name == "storage_backend":
        return None if value in (None, "", "none", "None") else value
    if isinstance(default, bool):
        if isinstance(value, str):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ValueError(f"{name} must be a boolean (true/false), got {value!r}")
    if isinstance(default, int):
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(default, float):
        try:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def _finite(cfg: CacheConfig) -> None:
    """Every float field is a finite number (inf and nan are never a setting)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


def _positive(cfg: CacheConfig, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        if not v > 0:
            raise ValueError(f"{n} must be > 0, got {v}")


def _non_negative(cfg: CacheConfig, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        if v < 0:
            raise ValueError(f"{n} must be >= 0, got {v}")


def _choice(cfg: CacheConfig, name: str, allowed: tuple) -> None:
    v = getattr(cfg, name)
    if v not in allowed:
        shown = ", ".join("none" if a is None else repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {shown}; got {v!r}")


def _check_cuda_copy(cfg: CacheConfig) -> None:
    _choice(cfg, "cuda_copy_d2h", CUDA_COPY_MODES)
    _choice(cfg, "cuda_copy_h2d", CUDA_COPY_MODES)
    if not 1 <= cfg.cuda_grid_blocks <= CUDA_MAX_GRID_BLOCKS:
        raise ValueError(f"cuda_grid_blocks must be in 1..{CUDA_MAX_GRID_BLOCKS} (a small grid "
                         f"leaves the SMs to the model), got {cfg.cuda_grid_blocks}")
    t = cfg.cuda_block_threads
    if not 32 <= t <= CUDA_MAX_BLOCK_THREADS or t % 32:
        raise ValueError(f"cuda_block_threads must be a multiple of 32 in 32.."
                         f"{CUDA_MAX_BLOCK_THREADS}, got {t}")


def available_host_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_host_memory(cfg: CacheConfig) -> None:
    """Host pools of every rank (and CPU-backend device planes) must fit in RAM."""
    layout = cfg.layout
    need = cfg.num_cpu_blocks * layout.block_bytes * cfg.tp_size
    if cfg.device == "cpu" and not cfg.external_gpu_tier:  # an engine's planes exist already
        need += cfg.num_gpu_blocks * layout.block_bytes * cfg.tp_size
    avail = available_host_memory()
    if need > avail:
        raise ValueError(
            f"num_cpu_blocks={cfg.num_cpu_blocks} needs {need / 2**30:.2f} GiB of host memory "
            f"for {cfg.tp_size} rank(s) ({layout.block_bytes} bytes per block), but only "
            f"{avail / 2**30:.2f} GiB is available; lower num_cpu_blocks"
            + (" or num_gpu_blocks" if cfg.device == "cpu" else ""))
