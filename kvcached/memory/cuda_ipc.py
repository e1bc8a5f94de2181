"""CUDA hooks of kvcached: sharing KV planes across processes and pinning the host pool.

:mod:`kvcached.memory.kvshare` imports this module lazily, only for CUDA planes.

Sharing (DESIGN §5) uses PyTorch's own CUDA IPC, the mechanism behind
``torch.multiprocessing``: ``UntypedStorage._share_cuda_()`` gives the
``cudaIpcMemHandle_t`` of the caching allocator's segment plus the storage's
byte offset in it (a tensor rarely starts at an allocation base, and only
torch knows the base), and ``rebuild_cuda_tensor`` / ``_new_shared_cuda``
opens it in another process with the right offset, dtype, shape and stride,
caching one ``cudaIpcOpenMemHandle`` per segment and closing it when the last
tensor over it is gone. We chose it over opening raw handles with our
library and wrapping pointers (``__cuda_array_interface__`` cannot express
bf16/fp8 and would leave unmapping to us). Every field is JSON-friendly
(bytes as hex) so it fits the descriptor kvshare writes.

Caveats, all inherent to CUDA IPC: a process cannot open its own handles (so
:func:`open_cuda_planes` in the exporting process returns the exported
tensors), the exporter must keep the planes alive while others use them, and
the memory stays mapped in a consumer until it drops every tensor over it
(:func:`close_cuda_planes` is how a sleeping worker lets go).

Device numbering differs between processes (``CUDA_VISIBLE_DEVICES``, its
order): a descriptor names the GPU by UUID and PCI bus id, and the consumer
maps the handle on its own index of that GPU (:func:`map_device`).

Pinning: :func:`pin_host_memory` registers an existing mapping (the host
pool's ``/dev/shm`` mmap) with ``cudaHostRegister`` in chunks: PyTorch's
pinned allocator rounds up to a power of two (vLLM #48436) and one huge
registration can fail (vLLM #51080). Without a GPU every function here
raises ``RuntimeError("no CUDA device: ...")``; none crashes.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcached import cuda_lib as kvc
from kvcached.cuda_lib import CudaCopyError
from kvcached.layout import TORCH_DTYPES, KVLayout

logger = logging.getLogger(__name__)

PLANE_ALIGN = 256  # bytes between planes of one allocation (>= any vector width)
PAGE = os.sysconf("SC_PAGE_SIZE")
DEFAULT_CHUNK = 1 << 30

# (ipc handle hex, byte offset) -> tensor exported by this process; CUDA cannot
# open a process's own handles, so open_cuda_planes here returns these.
_EXPORTED: dict[tuple[str, int], weakref.ref] = {}
_EXPORTED_LOCK = threading.Lock()


# --------------------------------------------------------------------- checks
def _require_torch_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() "
            "== False (a CPU-only torch build, or no GPU/driver); CUDA KV planes need a "
            "CUDA build of torch on a machine with a GPU")


def _require_device() -> kvc.KvcLib:
    """The CUDA copy library, once we know a device is there; RuntimeError otherwise."""
    if not kvc.driver_present():
        raise RuntimeError("no CUDA device: the NVIDIA driver (libcuda.so) is not installed")
    try:
        lib = kvc.load()
        count = lib.device_count()
    except RuntimeError as e:  # CudaCopyError is one too
        raise RuntimeError(f"no CUDA device: {e}") from e
    if count < 1:
        raise RuntimeError("no CUDA device: cudaGetDeviceCount found 0 GPUs")
    return lib


# ------------------------------------------------------------------ sharing
def export_cuda_planes(planes: list[torch.Tensor]) -> list[dict]:
    """Per plane, what another process needs to map it (JSON-friendly dict).

    Keys: ``shape``, ``stride``, ``storage_offset`` (elements), ``dtype``,
    ``element_size``, ``block_bytes``, ``device_index`` (the exporter's number),
    ``device_uuid`` and ``pci_bus_id`` (the GPU itself), ``ipc_handle`` (hex of
    the allocation's cudaIpcMemHandle_t), ``byte_offset`` (of the plane's first
    byte from the allocation base), torch's ``storage_size_bytes``,
    ``storage_offset_bytes``, ``ref_counter_*``, ``event_*``, and ``pid``.
    """
    _require_torch_cuda()
    out = []
    ids = {}
    for i, t in enumerate(planes):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise ValueError(f"plane {i} must be a CUDA tensor, got "
                             f"{getattr(t, 'device', type(t).__name__)}")
        (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
         event_sync) = t.untyped_storage()._share_cuda_()
        byte_offset = offset_bytes + t.storage_offset() * t.element_size()
        entry = {
            "shape": list(t.shape), "stride": list(t.stride()),
            "storage_offset": t.storage_offset(), "dtype": str(t.dtype).removeprefix("torch."),
            "element_size": t.element_size(),
            "block_bytes": t[0].numel() * t.element_size() if t.shape[0] else 0,
            "device_index": int(device), "ipc_handle": bytes(handle).hex(),
            "byte_offset": byte_offset, "storage_size_bytes": int(size_bytes),
            "storage_offset_bytes": int(offset_bytes),
            "ref_counter_handle": bytes(ref_handle).hex(), "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle).hex() if event_handle else None,
            "event_sync_required": bool(event_sync), "pid": os.getpid(), "ipc": "torch",
        }
        if int(device) not in ids:
            ids[int(device)] = device_identity(int(device))
        entry.update(ids[int(device)])
        with _EXPORTED_LOCK:
            _EXPORTED[(entry["ipc_handle"], byte_offset)] = weakref.ref(t)
        out.append(entry)
    logger.debug("exported %d CUDA planes", len(out))
    return out


_export_cuda = export_cuda_planes  # the name kvshare calls


def open_cuda_planes(desc: dict | list[dict]) -> list[torch.Tensor]:
    """Map planes exported by :func:`export_cuda_planes` (a descriptor or its plane list).

    The tensors alias the exporter's memory; writes are seen by both sides.
    """
    _require_torch_cuda()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    entries = desc["planes"] if isinstance(desc, dict) else list(desc)
    out = []
    for i, e in enumerate(entries):
        if e.get("pid") == os.getpid():
            out.append(_own_export(i, e))
            continue
        device = map_device(e, local_devices())
        dtype = TORCH_DTYPES.get(e["dtype"]) or getattr(torch, e["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"plane {i}: unknown dtype {e['dtype']!r}")
        event = e.get("event_handle")
        try:
            t = rebuild_cuda_tensor(
                torch.Tensor, torch.Size(e["shape"]), tuple(e["stride"]), e["storage_offset"],
                torch.storage.TypedStorage, dtype, device,
                bytes.fromhex(e["ipc_handle"]), e["storage_size_bytes"],
                e["storage_offset_bytes"], False, bytes.fromhex(e["ref_counter_handle"]),
                e["ref_counter_offset"], bytes.fromhex(event) if event else None,
                e["event_sync_required"])
        except RuntimeError as err:
            raise RuntimeError(f"plane {i}: cannot open its CUDA IPC handle from pid "
                               f"{e.get('pid')} ({err}); is the exporting process alive and "
                               "on this machine?") from err
        out.append(t)
    return out


def _own_export(i: int, e: dict) -> torch.Tensor:
    with _EXPORTED_LOCK:
        ref = _EXPORTED.get((e["ipc_handle"], e["byte_offset"]))
    t = ref() if ref is not None else None
    if t is None:
        raise RuntimeError(f"plane {i} was exported by this process but its tensor is gone; "
                           "keep exported planes alive while they are shared")
    return t


def close_cuda_planes(planes: list[torch.Tensor]) -> None:
    """Drop the references in ``planes`` (the list is cleared) and let torch unmap them.

    Torch closes an opened IPC handle (``cudaIpcCloseMemHandle``) when the last
    tensor over it goes; callers must have dropped every other reference (a
    copy engine's, a fast path's) and finished every copy that uses them.
    """
    if isinstance(planes, list):
        planes.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # no kernel may still use memory we are about to unmap
        torch.cuda.ipc_collect()


# ------------------------------------------------------------------ devices
@dataclass(frozen=True)
class DeviceInfo:
    """A CUDA device as this process numbers it, and what names it everywhere."""

    index: int
    uuid: str  # 32 hex digits (cudaDeviceProp.uuid)
    pci_bus_id: str  # "0000:3b:00.0"


def device_identity(index: int) -> dict:
    """``device_uuid`` and ``pci_bus_id`` of this process's device ``index``."""
    lib = _require_device()
    return {"device_uuid": lib.device_uuid(index).hex(),
            "pci_bus_id": normalize_pci_bus_id(lib.device_pci_bus_id(index))}


@functools.lru_cache(maxsize=1)
def local_devices() -> tuple[DeviceInfo, ...]:
    """Every device this process can see (they do not change while it runs)."""
    lib = _require_device()
    return tuple(DeviceInfo(i, lib.device_uuid(i).hex(),
                            normalize_pci_bus_id(lib.device_pci_bus_id(i)))
                 for i in range(lib.device_count()))


def normalize_pci_bus_id(bus_id: str) -> str:
    """``domain:bus:device.function`` in lower case with a 4-digit domain, whatever
    the source wrote ("00000000:3B:00.0" from nvidia-smi, "0000:3b:00.0" from CUDA)."""
    try:
        domain, bus, rest = bus_id.strip().lower().split(":")
        dev, fn = rest.split(".")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"
    except ValueError:
        return bus_id.strip().lower()


def map_device(entry: dict, devices: Sequence[DeviceInfo]) -> int:
    """This process's index of the GPU a descriptor entry names (UUID, else PCI bus id).

    The exporter's ``device_index`` counts in the exporter's numbering, which
    differs from ours whenever ``CUDA_VISIBLE_DEVICES`` does; it is used only
    for descriptors that carry no identity (written by an older kvcached).
    """
    uuid, pci = entry.get("device_uuid"), entry.get("pci_bus_id")
    if uuid:
        for d in devices:
            if d.uuid == uuid:
                return d.index
    if pci:
        want = normalize_pci_bus_id(pci)
        for d in devices:
            if d.pci_bus_id == want:
                return d.index
    if uuid or pci:
        seen = ", ".join(f"{d.index}: {d.uuid} ({d.pci_bus_id})" for d in devices) or "none"
        raise RuntimeError(
            f"the KV planes live on GPU {uuid} ({pci}; device {entry.get('device_index')} of "
            f"the exporting process), which this process cannot see (visible: {seen}); "
            "start it with a CUDA_VISIBLE_DEVICES that includes that GPU")
    logger.warning("KV descriptor names its GPU by index only (%s): assuming this process "
                   "numbers devices the same way", entry.get("device_index"))
    return int(entry["device_index"])


def allocate_cuda_planes(layout: KVLayout, num_blocks: int,
                         device: torch.device | str | int | None = None) -> list[torch.Tensor]:
    """Zeroed planes ``[num_blocks, *plane.shape]`` on the current (or given) CUDA device.

    All planes are views of one allocation, at 256-byte aligned offsets: one
    IPC handle to open instead of one per plane.
    """
    _require_torch_cuda()
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    sizes = [num_blocks * p.block_bytes for p in layout.planes]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += (n + PLANE_ALIGN - 1) // PLANE_ALIGN * PLANE_ALIGN
    buf = torch.zeros(pos, dtype=torch.uint8, device=dev)
    return [buf[off:off + n].view(TORCH_DTYPES[spec.dtype]).view(num_blocks, *spec.shape)
            for spec, off, n in zip(layout.planes, offsets, sizes, strict=True)]


# ------------------------------------------------------------------ pinning
@dataclass
class PinnedHost:
    """A host range registered with CUDA in ``chunks`` ((address, bytes) each)."""

    ptr: int
    nbytes: int
    device_ptr: int
    chunks: list[tuple[int, int]] = field(default_factory=list)
    _owner: object = None  # the tensor, kept alive while pinned


def _chunks(ptr: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split [ptr, ptr + nbytes) at page-aligned cuts: no page in two registrations."""
    step = max(PAGE, chunk_bytes // PAGE * PAGE)
    out, start, end = [], ptr, ptr + nbytes
    cut = ptr - ptr % PAGE + step
    while start < end:
        stop = min(cut, end)
        out.append((start, stop - start))
        start, cut = stop, cut + step
    return out


def pin_host_memory(tensor_or_ptr, nbytes: int | None = None,
                    chunk_bytes: int = DEFAULT_CHUNK) -> PinnedHost:
    """Register an existing host mapping (e.g. an mmap of /dev/shm) as pinned and mapped.

    ``tensor_or_ptr``: a CPU tensor (``nbytes`` defaults to its size) or an
    address (``nbytes`` required). Registration goes in ``chunk_bytes`` pieces;
    on any failure the chunks done so far are unregistered again.
    """
    owner = None
    if isinstance(tensor_or_ptr, torch.Tensor):
        owner, ptr = tensor_or_ptr, tensor_or_ptr.data_ptr()
        size = tensor_or_ptr.numel() * tensor_or_ptr.element_size()
        nbytes = size if nbytes is None else nbytes
        if nbytes > size:
            raise ValueError(f"nbytes {nbytes} exceeds the tensor's {size} bytes")
    else:
        ptr = int(tensor_or_ptr)
    if not ptr or not nbytes or nbytes <= 0 or chunk_bytes <= 0:
        raise ValueError(f"pin_host_memory needs a non-null address and nbytes, chunk_bytes "
                         f"> 0; got ptr={ptr:#x}, nbytes={nbytes}, chunk_bytes={chunk_bytes}")
    lib = _require_device()
    pinned = PinnedHost(ptr, int(nbytes), 0, [], owner)
    try:
        for cptr, cn in _chunks(ptr, int(nbytes), chunk_bytes):
            lib.host_register(cptr, cn)
            pinned.chunks.append((cptr, cn))
        pinned.device_ptr = lib.host_device_pointer(ptr)
        _check_contiguous(lib, pinned)
    except RuntimeError as e:
        unpin(pinned)
        raise RuntimeError(f"pinning {nbytes} bytes at {ptr:#x} failed after "
                           f"{len(pinned.chunks)} chunk(s): {e} (is the locked-memory limit, "
                           "`ulimit -l`, large enough?)") from e
    logger.info("pinned %.2f GiB of host memory in %d chunk(s)", nbytes / 2**30,
                len(pinned.chunks))
    return pinned


def _check_contiguous(lib: kvc.KvcLib, pinned: PinnedHost) -> None:
    # The kernel addresses the pool as one span: the chunks' device addresses
    # must line up as the host ones do (always true with UVA on 64-bit Linux).
    for cptr, _ in pinned.chunks[1:]:
        if lib.host_device_pointer(cptr) != pinned.device_ptr + (cptr - pinned.ptr):
            raise RuntimeError("the chunks' device addresses are not contiguous; pin with "
                               "chunk_bytes >= nbytes")


def unpin(pinned: PinnedHost) -> None:
    """Unregister every chunk of ``pinned`` (idempotent)."""
    if not pinned.chunks:
        return
    lib = kvc.load()
    errors = []
    for cptr, _ in pinned.chunks:
        try:
            lib.host_unregister(cptr)
        except CudaCopyError as e:
            errors.append(str(e))
    pinned.chunks.clear()
    pinned._owner = None
    if errors:
        logger.warning("unpinning %#x: %d chunk(s) failed: %s", pinned.ptr, len(errors),
                       errors[0])


def device_pointer(host_ptr: int) -> int:
    """The device address of pinned, mapped host memory (cudaHostGetDevicePointer)."""
    return _require_device().host_device_pointer(int(host_ptr))
