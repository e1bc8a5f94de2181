"""Publishing a rank's KV planes to other processes: the contract's export/attach.

The model runner of rank r calls :func:`export_kv_cache` (or kvcached creates
the planes with :func:`allocate_kv_cache` when ``create_cache`` is set); the
transfer worker, or the engine, calls :func:`attach_kv_cache` and gets tensors
over the *same* memory (DESIGN §5, §10). Nothing is copied or pickled.

The hand-over is a JSON descriptor ``<run_dir>/kv-rank<r>.json``, written
atomically (temp file + rename) so a reader never sees half of one::

    {"format": 1, "rank": 0, "pid": 1234, "run_id": "a1b2c3d4e5",
     "device": "cpu", "device_type": "cpu", "num_blocks": 512,
     "planes": [{"index": 0, "shape": [512, 4, 16, 64], "dtype": "float32",
                 "stride": [4096, 1024, 64, 1], "storage_offset": 0,
                 "element_size": 4, "block_bytes": 16384,
                 # CPU: where it lives
                 "segment": "kvcached-1234-a1b2c3d4e5-r0-kv",
                 "segment_nbytes": 67108864, "byte_offset": 0}, ...]}

On CUDA the per-plane location fields come from ``kvcached.memory.cuda_ipc`` (IPC
handles, offsets), which this module imports lazily so the CPU backend never
needs it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from kvcached.layout import DTYPE_SIZES, KVLayout
from kvcached.memory import shm

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
PLANE_ALIGN = 64  # bytes between planes of one segment: cache-line / vector friendly
_POLL_MAX_S = 0.05

# (run_dir, rank) -> CUDA planes this process allocated for others to map: the
# memory must live while they do, so it is held here until release_kv_cache.
_CUDA_CREATED: dict[tuple[str, int], list[torch.Tensor]] = {}


# ------------------------------------------------------------------ paths
def descriptor_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """``<run_dir>/kv-rank<rank>.json``."""
    return Path(run_dir) / f"kv-rank{int(rank)}.json"


def read_descriptor(run_dir: str | os.PathLike, rank: int) -> dict:
    """The descriptor of rank ``rank``; FileNotFoundError if it was not exported yet."""
    path = descriptor_path(run_dir, rank)
    desc = _try_read(path)
    if desc is None:
        raise FileNotFoundError(
            f"KV descriptor {path} does not exist: {_who_creates(rank, run_dir)}")
    return desc


def _try_read(path: Path) -> dict | None:
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    try:
        desc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"KV descriptor {path} is not valid JSON: {e}") from e
    if desc.get("format") != FORMAT_VERSION:
        raise ValueError(f"KV descriptor {path} has format {desc.get('format')!r}; "
                         f"this kvcached reads format {FORMAT_VERSION}")
    return desc


def _who_creates(rank: int, run_dir: str | os.PathLike) -> str:
    return (f"the model runner of rank {rank} creates it with "
            f"kvcached.export_kv_cache(planes, rank={rank}, run_dir={str(run_dir)!r}), "
            "or kvcached does when create_cache=true; is it running with that run_dir?")


def _write_atomic(path: Path, desc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(desc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------- validation
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"KV descriptor names unknown dtype {name!r}")
    return dt


def _block_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _contiguous_after_dim0(t: torch.Tensor) -> bool:
    expected = 1
    for d, s in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _validate_planes(planes: list[torch.Tensor]) -> None:
    """Shape rules every exported plane set obeys; errors name the plane index."""
    if not isinstance(planes, (list, tuple)) or not planes:
        raise ValueError("planes must be a non-empty list of tensors (one per KV plane)")
    first = planes[0]
    for i, p in enumerate(planes):
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"plane {i} is a {type(p).__name__}, not a torch.Tensor")
        if p.dim() < 1 or p.shape[0] < 1 or p.numel() == 0:
            raise ValueError(f"plane {i} has shape {tuple(p.shape)}: dim 0 is the block "
                             "and no dimension may be empty")
        if p.shape[0] != first.shape[0]:
            raise ValueError(f"plane {i} has {p.shape[0]} blocks (dim 0) but plane 0 has "
                             f"{first.shape[0]}: every plane must have num_blocks rows")
        if p.device != first.device:
            raise ValueError(f"plane {i} is on {p.device} but plane 0 is on {first.device}")
        if not _contiguous_after_dim0(p):
            raise ValueError(f"plane {i} (shape {tuple(p.shape)}, stride {p.stride()}) must "
                             "be contiguous from dim 1 on: a block is one contiguous span")
        if p.shape[0] > 1 and p.stride(0) < _block_numel(p):
            raise ValueError(f"plane {i}: block stride {p.stride(0)} is smaller than a "
                             f"block ({_block_numel(p)} elements): blocks would overlap")


def check_planes(planes: list[torch.Tensor], layout: KVLayout, num_blocks: int) -> None:
    """Raise ValueError unless ``planes`` match ``layout`` with ``num_blocks`` blocks.

    Checked per plane: count, number of blocks, dtype and bytes per block. The
    per-block shape itself may differ (engines order heads/tokens differently);
    the copy engines only move bytes, so equal bytes per block is what matters.
    """
    specs = layout.planes
    if len(planes) != len(specs):
        raise ValueError(f"expected {len(specs)} KV planes for this layout "
                         f"({specs[0].name} ... {specs[-1].name}), got {len(planes)}")
    for i, (p, spec) in enumerate(zip(planes, specs, strict=True)):
        if p.dim() < 1 or p.shape[0] != num_blocks:
            raise ValueError(f"plane {i} ({spec.name}): expected {num_blocks} blocks in "
                             f"dim 0, got shape {tuple(p.shape)}")
        got = _dtype_name(p.dtype)
        # fp8 caches are often stored as uint8 by engines: same bytes, same copies.
        if got != spec.dtype and not (spec.dtype == "float8_e4m3fn" and got == "uint8"):
            raise ValueError(f"plane {i} ({spec.name}): expected dtype {spec.dtype}, "
                             f"got {got}")
        nbytes = _block_numel(p) * p.element_size()
        if nbytes != spec.block_bytes:
            raise ValueError(
                f"plane {i} ({spec.name}): expected {spec.block_bytes} bytes per block "
                f"(shape {spec.shape} {spec.dtype}), got {nbytes} "
                f"(shape {tuple(p.shape[1:])} {got})")


# ----------------------------------------------------------------- export
def _plane_entry(i: int, p: torch.Tensor) -> dict:
    return {"index": i, "shape": list(p.shape), "dtype": _dtype_name(p.dtype),
            "stride": list(p.stride()), "storage_offset": p.storage_offset(),
            "element_size": p.element_size(),
            "block_bytes": _block_numel(p) * p.element_size()}


def _cpu_locations(planes: list[torch.Tensor]) -> list[dict]:
    out = []
    for i, p in enumerate(planes):
        found = shm.find_segment(p)
        if found is None:
            raise ValueError(
                f"plane {i}: CPU KV planes must live in shared memory: create them with "
                "kvcached.allocate_kv_cache(...) or set create_cache=true")
        name, offset, nbytes = found
        out.append({"segment": name, "byte_offset": offset, "segment_nbytes": nbytes})
    return out


def _cuda_ipc():
    """The CUDA hook module, imported only when CUDA planes are involved."""
    try:  # import_module, not `from kvcached import`: honours a blocked sys.modules entry
        cuda_ipc = importlib.import_module("kvcached.memory.cuda_ipc")
    except ImportError as e:
        raise RuntimeError(f"CUDA KV planes need kvcached.memory.cuda_ipc, which could not be "
                           f"imported ({e})") from e
    return cuda_ipc


def export_kv_cache(planes: list[torch.Tensor], rank: int,
                    run_dir: str | os.PathLike, event=None) -> Path:
    """Publish rank ``rank``'s KV planes for other processes; returns the descriptor path.

    CPU planes must live in a kvcached shared-memory segment (see
    :func:`allocate_kv_cache`); CUDA planes are exported through CUDA IPC by
    ``kvcached.memory.cuda_ipc``. The planes must stay alive while others use them.
    ``event``: on CUDA, the rank's :class:`kvcached.memory.kvevent.KVEvent`,
    recorded on the compute stream after each forward pass and before the
    blocks it wrote are committed; every copy of this rank waits on its
    latest record and checks its generation (see kvevent). A bare
    ``torch.cuda.Event(interprocess=True)`` still orders the copies, without
    the generation checks.
    """
    _validate_planes(planes)
    device = planes[0].device
    if device.type == "cpu":
        locations = _cpu_locations(planes)
    elif device.type == "cuda":
        locations = _cuda_ipc()._export_cuda(list(planes))
        if len(locations) != len(planes):
            raise RuntimeError(f"kvcached.memory.cuda_ipc._export_cuda returned {len(locations)} "
                               f"entries for {len(planes)} planes")
    else:
        raise ValueError(f"plane 0 is on {device}; KV planes must be on cpu or cuda")
    entries = [{**_plane_entry(i, p), **loc}
               for i, (p, loc) in enumerate(zip(planes, locations, strict=True))]
    desc = {"format": FORMAT_VERSION, "rank": int(rank), "pid": os.getpid(),
            "run_id": shm.run_id(run_dir), "device": str(device),
            "device_type": device.type, "num_blocks": planes[0].shape[0],
            "planes": entries}
    if event is not None:
        desc.update(_event_fields(event))
    path = descriptor_path(run_dir, rank)
    _write_atomic(path, desc)
    logger.info("exported %d KV planes of rank %d (%s, %d blocks) to %s",
                len(planes), rank, device, planes[0].shape[0], path)
    return path


def _event_fields(event) -> dict:
    from kvcached.memory import kvevent
    if isinstance(event, kvevent.KVEvent):
        return event.descriptor_fields()
    logger.warning("export_kv_cache: a bare CUDA event orders the copies but cannot be "
                   "checked; pass a kvcached.memory.kvevent.KVEvent for generation checks")
    handle = bytes(event.ipc_handle()).hex()
    kvevent.remember_local_event(handle, event)
    return {"event_ipc_handle": handle, "event_pid": os.getpid()}


def export_kv_event(event, rank: int, run_dir: str | os.PathLike) -> Path:
    """Add rank ``rank``'s KV event to its existing descriptor (an engine whose
    planes kvcached created, ``create_cache``, publishes its event this way)."""
    path = descriptor_path(run_dir, rank)
    desc = _try_read(path)
    if desc is None:
        raise FileNotFoundError(f"KV descriptor {path} does not exist yet: "
                                f"{_who_creates(rank, run_dir)}")
    for key in ("event_ipc_handle", "event_epoch", "event_clock", "event_pid"):
        desc.pop(key, None)
    desc.update(_event_fields(event))
    _write_atomic(path, desc)
    return path


# ----------------------------------------------------------------- attach
def _wait_descriptor(run_dir: str | os.PathLike, rank: int, timeout_s: float) -> dict:
    path = descriptor_path(run_dir, rank)
    deadline = time.monotonic() + max(0.0, timeout_s)
    delay = 0.002
    while True:
        desc = _try_read(path)
        if desc is not None:
            return desc
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"KV descriptor {path} did not appear within {timeout_s}s: "
                               f"{_who_creates(rank, run_dir)}")
        time.sleep(min(delay, left))
        delay = min(delay * 2, _POLL_MAX_S)


def _open_cpu_planes(desc: dict, run_dir: str | os.PathLike) -> list[torch.Tensor]:
    segments: dict[str, torch.Tensor] = {}
    planes = []
    for e in desc["planes"]:
        name = e["segment"]
        if name not in segments:  # one mapping per segment, shared by its planes
            segments[name] = shm.open_shm_tensor(name, (e["segment_nbytes"],), torch.uint8,
                                                 run_dir=run_dir)
        planes.append(_plane_view(segments[name], e))
    return planes


def _plane_view(seg: torch.Tensor, e: dict) -> torch.Tensor:
    """The plane ``e`` as a strided view into the uint8 segment ``seg``."""
    dt = _torch_dtype(e["dtype"])
    span = 1 + sum((d - 1) * s for d, s in zip(e["shape"], e["stride"], strict=True))
    start, end = e["byte_offset"], e["byte_offset"] + span * dt.itemsize
    if start % dt.itemsize or end > seg.numel():
        raise ValueError(f"KV descriptor plane {e['index']}: bytes [{start}, {end}) do not "
                         f"fit segment {e['segment']} ({seg.numel()} bytes) as {e['dtype']}")
    return seg[start:end].view(dt).as_strided(e["shape"], e["stride"])


def attach_kv_cache(run_dir: str | os.PathLike, rank: int,
                    timeout_s: float = 0) -> list[torch.Tensor]:
    """Map rank ``rank``'s exported KV planes; writes are seen by every process.

    Waits up to ``timeout_s`` for the descriptor to appear, then raises
    TimeoutError naming the file and who should create it.
    """
    desc = _wait_descriptor(run_dir, rank, timeout_s)
    if not shm.pid_alive(int(desc.get("pid", 0))):
        logger.warning("KV descriptor of rank %d was written by pid %s, which is gone: "
                       "the planes may be stale", rank, desc.get("pid"))
    kind = desc.get("device_type")
    if kind == "cpu":
        planes = _open_cpu_planes(desc, run_dir)
    elif kind == "cuda":
        planes = list(_cuda_ipc().open_cuda_planes(desc))
    else:
        raise ValueError(f"KV descriptor {descriptor_path(run_dir, rank)} has unknown "
                         f"device_type {kind!r} (expected 'cpu' or 'cuda')")
    logger.debug("attached %d KV planes of rank %d from %s", len(planes), rank, run_dir)
    return planes


# --------------------------------------------------------------- allocate
def _align(n: int) -> int:
    return (n + PLANE_ALIGN - 1) // PLANE_ALIGN * PLANE_ALIGN


def _kv_segment_name(run_dir: str | os.PathLike, rank: int, owner_pid: int) -> str:
    return shm.segment_name(owner_pid, shm.run_id(run_dir), rank, "kv")


def _allocate_cpu(layout: KVLayout, num_blocks: int, rank: int,
                  run_dir: str | os.PathLike, owner_pid: int) -> list[torch.Tensor]:
    sizes = [num_blocks * p.block_bytes for p in layout.planes]
    total = sum(_align(n) for n in sizes)
    seg = shm.create_shm_tensor(_kv_segment_name(run_dir, rank, owner_pid), (total,),
                                torch.uint8, hint="lower num_gpu_blocks")
    planes, pos = [], 0
    for spec, n in zip(layout.planes, sizes, strict=True):
        dt = _torch_dtype(spec.dtype)
        planes.append(seg[pos:pos + n].view(dt).view(num_blocks, *spec.shape))
        pos += _align(n)
    return planes


def rank_device(device: str, rank: int) -> str:
    """Where rank ``rank``'s planes go when kvcached creates them: ``cpu``; for
    ``cuda``, the rank's own GPU (rank modulo the visible GPUs: rank r of a
    one-process TP engine on GPU r); ``cuda:N`` exactly as named."""
    if device != "cuda":
        return device
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("no CUDA device: device='cuda' with create_cache needs a GPU "
                           f"visible to this process (torch {torch.__version__} sees none)")
    return f"cuda:{rank % count}"


def allocate_kv_cache(layout: KVLayout, num_blocks: int, rank: int,
                      run_dir: str | os.PathLike, device: str = "cpu",
                      owner_pid: int | None = None) -> list[torch.Tensor]:
    """Create rank ``rank``'s KV planes (``[num_blocks, *plane.shape]`` each) and export them.

    On CPU all planes share one /dev/shm segment, back to back at 64-byte
    aligned offsets, named after ``owner_pid`` (default: this process). A
    worker that creates the cache for an engine passes the engine's pid, so
    the segment survives the worker's crash (stale cleanup follows the owner).
    On CUDA ``kvcached.memory.cuda_ipc`` allocates them (one allocation, one IPC
    handle) and this module holds them until :func:`release_kv_cache`, since
    other processes map them. Undo with :func:`release_kv_cache`.
    """
    owner_pid = os.getpid() if owner_pid is None else owner_pid
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    for spec in layout.planes:
        if spec.dtype not in DTYPE_SIZES:
            raise ValueError(f"plane {spec.name}: unsupported dtype {spec.dtype!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cpu":
        planes = _allocate_cpu(layout, num_blocks, rank, run_dir, owner_pid)
    elif dev.type == "cuda":
        hook = _cuda_ipc()
        with torch.cuda.device(dev):
            planes = list(hook.allocate_cuda_planes(layout, num_blocks))
    try:
        check_planes(planes, layout, num_blocks)
        export_kv_cache(planes, rank, run_dir)
    except BaseException:
        if dev.type == "cpu":
            shm.remove_segment(_kv_segment_name(run_dir, rank, owner_pid))
        raise
    if dev.type == "cuda":
        _CUDA_CREATED[(str(Path(run_dir)), int(rank))] = planes
    return planes


def release_kv_cache(run_dir: str | os.PathLike, rank: int) -> None:
    """Remove rank ``rank``'s descriptor and its segments that this process created
    or owns (its pid in the name: the engine releasing what a worker made for it).

    Attached processes keep their mappings until they drop their tensors.
    """
    path = descriptor_path(run_dir, rank)
    names = {_kv_segment_name(run_dir, rank, os.getpid())}
    try:
        desc = _try_read(path)
    except ValueError:
        desc = None  # unreadable: still remove it below
    if desc is not None:
        names.update(e["segment"] for e in desc.get("planes", []) if "segment" in e)
    path.unlink(missing_ok=True)
    created = _CUDA_CREATED.pop((str(Path(run_dir)), int(rank)), None)
    if created is not None:
        created.clear()  # torch frees the allocation once its importers let go too
    mine = set(shm.created_segments())
    owned = {n for n in names if n.startswith(f"{shm.PREFIX}{os.getpid()}-")}
    for name in sorted(names & (mine | owned)):
        shm.remove_segment(name)
    logger.debug("released KV planes of rank %d in %s", rank, run_dir)
