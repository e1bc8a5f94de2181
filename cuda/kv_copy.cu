// kvcached CUDA copy engine: kernel, validating launcher, direct path, helpers.
//
// Three layers, as in sgl-kernel / FlashInfer: a kernel that knows nothing
// but addresses; a launcher that validates every input on the host before
// its first CUDA call (so a bad task can never touch memory, and the checks
// run on machines without a GPU); a C API (kv_copy.h) that Python binds
// with ctypes. No PyTorch headers.
//
// Work split of the kernel: a task is count pairs x num_planes block-planes;
// each block-plane is cut into 4 KiB chunks and one warp copies one chunk
// (32 lanes x 8 vectors x 16 B), walking the chunks grid-stride. Chunking,
// not warp-per-plane, keeps a 4-block grid busy whether a task is one 2 MiB
// block or 1024 small ones, and consecutive warps take consecutive chunks,
// so PCIe sees long sequential runs of the block-major host span.
//
// Per-task metadata never blocks the caller: the plane table is packed and
// uploaded once per engine (kvc_pack_plane_table), a small task's ids ride in
// the kernel parameters (a __grid_constant__ struct, read in place), and a
// large task's ids go through pinned staging with one asynchronous copy.
// kvc_emulate_kernel runs the same packing (pack_params, stage_ids) and the
// same per-thread code on the CPU, so tests without a GPU cover both.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "kv_copy.h"

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
#define KVC_HAVE_BATCH_MEMCPY 1
#else
#define KVC_HAVE_BATCH_MEMCPY 0
#endif

#define KVC_HD __host__ __device__ __forceinline__

// `#pragma unroll` means nothing to the host compiler (which warns on it), and
// the host copy of this code only runs in kvc_emulate_kernel.
#ifdef __CUDA_ARCH__
#define KVC_UNROLL _Pragma("unroll")
#else
#define KVC_UNROLL
#endif

namespace {

constexpr int kLanes = 32;
constexpr int kUnroll = 8;  // vectors in flight per lane: hides PCIe latency
constexpr uint64_t kChunkBytes = kLanes * kUnroll * 16;  // 4 KiB per warp unit

// Plane entry of the packed plane table the kernel reads (48 bytes, 16-aligned).
struct DevPlane {
  uint64_t dev_base;
  uint64_t dev_stride;
  uint64_t nbytes;
  uint64_t host_offset;
  uint64_t chunk_begin;  // first chunk of this plane within one pair's chunks
  uint64_t pad;
};
static_assert(sizeof(DevPlane) == 48, "plane table layout");

struct KernelParams {
  const DevPlane* planes;   // the engine's uploaded plane table
  const int32_t* src_ids;   // staged ids on the device, or null: ids are in inline_ids
  const int32_t* dst_ids;
  uint64_t host_base;
  uint64_t host_block_bytes;
  int64_t units_per_pair;  // sum over planes of ceil(nbytes / kChunkBytes)
  int64_t total_units;     // count * units_per_pair
  int32_t num_planes;
  int32_t direction;
  // Tasks of <= KVC_INLINE_PAIRS pairs: src ids, then dst ids at KVC_INLINE_PAIRS.
  int32_t inline_ids[2 * KVC_INLINE_PAIRS];
};
// Far below the 4 KiB of kernel parameters every supported GPU accepts.
static_assert(sizeof(KernelParams) <= 1024, "kernel parameter size");

// ---------------------------------------------------------------------------
// Kernel body (host + device, so kvc_emulate_kernel runs the same code).

// Every byte is touched once: streaming (evict-first) loads and stores keep
// the copy from flushing the model's working set out of L2. Both sides are
// global memory (device planes, or pinned host memory through UVA).
template <typename T>
KVC_HD T load_stream(const T* p) {
#ifdef __CUDA_ARCH__
  return __ldcs(p);
#else
  return *p;
#endif
}

template <typename T>
KVC_HD void store_stream(T* p, const T& v) {
#ifdef __CUDA_ARCH__
  __stcs(p, v);
#else
  *p = v;
#endif
}

// Lane `lane` of a warp copies its share of [src, src + len) with T-wide
// accesses; both pointers are T-aligned. The bytes past the last whole T
// (only in a plane's last chunk) go one by one.
template <typename T>
KVC_HD void copy_vectors(char* dst, const char* src, uint64_t len, int lane) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const uint64_t n = len / sizeof(T);
  for (uint64_t base = 0; base < n; base += kLanes * kUnroll) {
    T r[kUnroll];
    // All loads before any store: kUnroll independent requests per lane.
    KVC_UNROLL
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = base + static_cast<uint64_t>(j * kLanes + lane);
      if (i < n) r[j] = load_stream(s + i);
    }
    KVC_UNROLL
    for (int j = 0; j < kUnroll; ++j) {
      const uint64_t i = base + static_cast<uint64_t>(j * kLanes + lane);
      if (i < n) store_stream(d + i, r[j]);
    }
  }
  for (uint64_t i = n * sizeof(T) + static_cast<uint64_t>(lane); i < len; i += kLanes) {
    dst[i] = src[i];
  }
}

// Widest access both addresses allow: 16 B for the planes of any real layout,
// narrower for an odd view, so no plane is ever rejected for its alignment.
KVC_HD void copy_span(char* dst, const char* src, uint64_t len, int lane) {
  const uint64_t a = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src);
  if ((a & 15) == 0) {
    copy_vectors<uint4>(dst, src, len, lane);
  } else if ((a & 7) == 0) {
    copy_vectors<uint2>(dst, src, len, lane);
  } else if ((a & 3) == 0) {
    copy_vectors<unsigned int>(dst, src, len, lane);
  } else if ((a & 1) == 0) {
    copy_vectors<unsigned short>(dst, src, len, lane);
  } else {
    copy_vectors<unsigned char>(dst, src, len, lane);
  }
}

// One warp unit: chunk `unit` of the task, in (pair, plane, chunk) order.
KVC_HD void run_unit(const KernelParams& k, int64_t unit, int lane) {
  const int64_t pair = unit / k.units_per_pair;
  const uint64_t c = static_cast<uint64_t>(unit - pair * k.units_per_pair);
  int lo = 0;  // last plane whose first chunk is <= c (binary search: planes can be 1000s)
  int hi = k.num_planes - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (k.planes[mid].chunk_begin <= c) lo = mid; else hi = mid - 1;
  }
  const DevPlane& p = k.planes[lo];
  const uint64_t off = (c - p.chunk_begin) * kChunkBytes;
  const uint64_t len = p.nbytes - off < kChunkBytes ? p.nbytes - off : kChunkBytes;
  const int32_t* src_ids = k.src_ids != nullptr ? k.src_ids : k.inline_ids;
  const int32_t* dst_ids = k.dst_ids != nullptr ? k.dst_ids : k.inline_ids + KVC_INLINE_PAIRS;
  const uint64_t s = static_cast<uint64_t>(src_ids[pair]);
  const uint64_t d = static_cast<uint64_t>(dst_ids[pair]);
  const bool d2h = k.direction == KVC_D2H;
  const uint64_t dev_id = d2h ? s : d;
  const uint64_t host_id = d2h ? d : s;
  char* dev = reinterpret_cast<char*>(p.dev_base + dev_id * p.dev_stride + off);
  char* host = reinterpret_cast<char*>(k.host_base + host_id * k.host_block_bytes +
                                       p.host_offset + off);
  if (d2h) copy_span(host, dev, len, lane); else copy_span(dev, host, len, lane);
}

// __grid_constant__: the parameters are read where they lie (the inline ids
// are indexed by a runtime value, which would otherwise copy them to the stack).
__global__ void __launch_bounds__(KVC_MAX_BLOCK_THREADS)
    kv_copy_kernel(const __grid_constant__ KernelParams k) {
  const int lane = static_cast<int>(threadIdx.x) & (kLanes - 1);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kLanes;
  for (int64_t u = warp; u < k.total_units; u += num_warps) run_unit(k, u, lane);
}

// ---------------------------------------------------------------------------
// Errors: a status plus a per-thread message (ctypes calls from several
// worker threads must not see each other's text).

thread_local char g_error[1024] = "";

int fail(int status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(g_error, sizeof(g_error), fmt, ap);
  va_end(ap);
  return status;
}

int ok() {
  g_error[0] = '\0';
  return KVC_OK;
}

int cuda_fail(cudaError_t err, const char* what) {
  (void)cudaGetLastError();  // clear it so the next launch check is not confused
  return fail(KVC_ERR_CUDA_BASE + static_cast<int>(err), "%s: %s (%s)", what,
              cudaGetErrorName(err), cudaGetErrorString(err));
}

#define KVC_CUDA(call, what)                                   \
  do {                                                         \
    const cudaError_t kvc_err_ = (call);                       \
    if (kvc_err_ != cudaSuccess) return cuda_fail(kvc_err_, what); \
  } while (0)

bool aligned(uint64_t v, uint64_t a) { return v % a == 0; }

// a * b + c without wrapping past 2^64.
bool fits(uint64_t a, uint64_t b, uint64_t c, uint64_t base) {
  if (a != 0 && b > (UINT64_MAX - c) / a) return false;
  return a * b + c <= UINT64_MAX - base;
}

// ---------------------------------------------------------------------------
// Validation: everything the kernel or the DMA engine would trust.

int validate_planes(const kvc_task_t& t) {
  const uint64_t ndev = static_cast<uint64_t>(t.num_dev_blocks);
  std::vector<int> order;
  try {
    order.resize(static_cast<size_t>(t.num_planes));
  } catch (const std::bad_alloc&) {
    return fail(KVC_ERR_HOST_ALLOC, "out of host memory for %d planes", t.num_planes);
  }
  for (int i = 0; i < t.num_planes; ++i) {
    const kvc_plane_t& p = t.planes[i];
    order[static_cast<size_t>(i)] = i;
    if (p.dev_base == 0) return fail(KVC_ERR_NULL_POINTER, "plane %d: dev_base is null", i);
    if (p.nbytes == 0) return fail(KVC_ERR_BAD_PLANE, "plane %d: nbytes is 0", i);
    if (ndev > 1 && p.dev_stride < p.nbytes) {
      return fail(KVC_ERR_BAD_PLANE,
                  "plane %d: dev_stride %llu < nbytes %llu (device blocks would overlap)", i,
                  (unsigned long long)p.dev_stride, (unsigned long long)p.nbytes);
    }
    if (!fits(ndev - 1, p.dev_stride, p.nbytes, p.dev_base)) {
      return fail(KVC_ERR_BAD_PLANE, "plane %d: device span overflows the address space", i);
    }
    if (!aligned(p.host_offset, KVC_HOST_ALIGN)) {
      return fail(KVC_ERR_MISALIGNED, "plane %d: host_offset %llu is not a multiple of %d", i,
                  (unsigned long long)p.host_offset, KVC_HOST_ALIGN);
    }
    if (p.host_offset > t.host_block_bytes || p.nbytes > t.host_block_bytes - p.host_offset) {
      return fail(KVC_ERR_BAD_PLANE,
                  "plane %d: host span [%llu, %llu) exceeds host_block_bytes %llu", i,
                  (unsigned long long)p.host_offset,
                  (unsigned long long)(p.host_offset + p.nbytes),
                  (unsigned long long)t.host_block_bytes);
    }
  }
  // Two planes sharing host bytes would silently overwrite each other.
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return t.planes[a].host_offset < t.planes[b].host_offset;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const kvc_plane_t& a = t.planes[order[i - 1]];
    const kvc_plane_t& b = t.planes[order[i]];
    if (a.host_offset + a.nbytes > b.host_offset) {
      return fail(KVC_ERR_BAD_PLANE, "planes %d and %d overlap in the host block span",
                  order[i - 1], order[i]);
    }
  }
  return KVC_OK;
}

int validate_ids(const int32_t* ids, int32_t count, int64_t limit, const char* which,
                 const char* pool) {
  for (int32_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      return fail(KVC_ERR_ID_OUT_OF_RANGE, "%s id %d at index %d is outside the %s pool [0, %lld)",
                  which, ids[i], i, pool, (long long)limit);
    }
  }
  return KVC_OK;
}

int validate_unique(const int32_t* ids, int32_t count) {
  std::vector<int32_t> sorted;
  try {
    sorted.assign(ids, ids + count);
  } catch (const std::bad_alloc&) {
    return fail(KVC_ERR_HOST_ALLOC, "out of host memory for %d ids", count);
  }
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    return fail(KVC_ERR_DUPLICATE_DST, "destination block %d appears twice in one task", *dup);
  }
  return KVC_OK;
}

int validate(const kvc_task_t* t) {
  if (t == nullptr) return fail(KVC_ERR_NULL_POINTER, "task is null");
  if (t->planes == nullptr) return fail(KVC_ERR_NULL_POINTER, "planes is null");
  if (t->src_ids == nullptr) return fail(KVC_ERR_NULL_POINTER, "src_ids is null");
  if (t->dst_ids == nullptr) return fail(KVC_ERR_NULL_POINTER, "dst_ids is null");
  if (t->host_base == 0) return fail(KVC_ERR_NULL_POINTER, "host_base is null");
  if (t->reserved != 0) return fail(KVC_ERR_BAD_ARGUMENT, "reserved field must be 0");
  if (t->num_planes <= 0 || t->num_planes > KVC_MAX_PLANES) {
    return fail(KVC_ERR_BAD_PLANE_COUNT, "num_planes %d is outside [1, %d]", t->num_planes,
                KVC_MAX_PLANES);
  }
  if (t->direction != KVC_D2H && t->direction != KVC_H2D) {
    return fail(KVC_ERR_BAD_DIRECTION, "direction %d is neither KVC_D2H (0) nor KVC_H2D (1)",
                t->direction);
  }
  if (t->count <= 0 || t->count > KVC_MAX_PAIRS) {
    return fail(KVC_ERR_BAD_COUNT, "count %d is outside [1, %d]", t->count, KVC_MAX_PAIRS);
  }
  const uint64_t id_align = alignof(int32_t);
  if (!aligned(reinterpret_cast<uint64_t>(t->src_ids), id_align) ||
      !aligned(reinterpret_cast<uint64_t>(t->dst_ids), id_align)) {
    return fail(KVC_ERR_MISALIGNED, "id arrays must be %d-byte aligned int32", (int)id_align);
  }
  if (!aligned(reinterpret_cast<uint64_t>(t->planes), alignof(kvc_plane_t))) {
    return fail(KVC_ERR_MISALIGNED, "plane table must be 8-byte aligned");
  }
  if (t->num_dev_blocks <= 0 || t->num_dev_blocks > INT32_MAX ||
      t->num_host_blocks <= 0 || t->num_host_blocks > INT32_MAX) {
    return fail(KVC_ERR_BAD_POOL, "pool sizes (device %lld, host %lld) must be in [1, 2^31)",
                (long long)t->num_dev_blocks, (long long)t->num_host_blocks);
  }
  if (t->host_block_bytes == 0) return fail(KVC_ERR_BAD_POOL, "host_block_bytes is 0");
  if (!aligned(t->host_base, KVC_HOST_ALIGN) || !aligned(t->host_block_bytes, KVC_HOST_ALIGN)) {
    return fail(KVC_ERR_MISALIGNED,
                "host_base 0x%llx and host_block_bytes %llu must be multiples of %d",
                (unsigned long long)t->host_base, (unsigned long long)t->host_block_bytes,
                KVC_HOST_ALIGN);
  }
  if (!fits(static_cast<uint64_t>(t->num_host_blocks), t->host_block_bytes, 0, t->host_base)) {
    return fail(KVC_ERR_BAD_POOL, "host pool span overflows the address space");
  }
  int rc = validate_planes(*t);
  if (rc != KVC_OK) return rc;
  const bool d2h = t->direction == KVC_D2H;
  rc = validate_ids(t->src_ids, t->count, d2h ? t->num_dev_blocks : t->num_host_blocks, "source",
                    d2h ? "device" : "host");
  if (rc != KVC_OK) return rc;
  rc = validate_ids(t->dst_ids, t->count, d2h ? t->num_host_blocks : t->num_dev_blocks,
                    "destination", d2h ? "host" : "device");
  if (rc != KVC_OK) return rc;
  return validate_unique(t->dst_ids, t->count);
}

int validate_grid(int32_t grid_blocks, int32_t block_threads) {
  if (grid_blocks < 1 || grid_blocks > KVC_MAX_GRID_BLOCKS) {
    return fail(KVC_ERR_BAD_GRID, "grid_blocks %d is outside [1, %d]", grid_blocks,
                KVC_MAX_GRID_BLOCKS);
  }
  if (block_threads < kLanes || block_threads > KVC_MAX_BLOCK_THREADS ||
      block_threads % kLanes != 0) {
    return fail(KVC_ERR_BAD_GRID, "block_threads %d must be a multiple of 32 in [32, %d]",
                block_threads, KVC_MAX_BLOCK_THREADS);
  }
  return KVC_OK;
}

// Staged ids: src ids, then dst ids at the next 16-byte boundary.
uint64_t staged_ids_offset(int32_t count) {
  return (static_cast<uint64_t>(count) * 4 + 15) / 16 * 16;
}

// FNV-1a over the plane entries: ties a launch's task to the table it quotes.
uint64_t plane_fingerprint(const kvc_plane_t* planes, int32_t num_planes) {
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
  };
  mix(static_cast<uint64_t>(num_planes));
  for (int32_t i = 0; i < num_planes; ++i) {
    mix(planes[i].dev_base);
    mix(planes[i].dev_stride);
    mix(planes[i].nbytes);
    mix(planes[i].host_offset);
  }
  return h;
}

uint64_t plane_chunks(const kvc_plane_t& p) { return (p.nbytes + kChunkBytes - 1) / kChunkBytes; }

// Everything about a kernel launch except the CUDA calls, shared by
// kvc_copy_kernel and kvc_emulate_kernel: validates the task and the launch
// and fills the kernel parameters. `*upload` is the staging bytes to copy to
// ids_dev (0: the ids are inline). Touches no memory but *k.
int pack_params(const kvc_task_t* task, const kvc_launch_t* launch, KernelParams* k,
                uint64_t* upload) {
  int rc = validate(task);
  if (rc != KVC_OK) return rc;
  if (launch == nullptr) return fail(KVC_ERR_NULL_POINTER, "launch is null");
  rc = validate_grid(launch->grid_blocks, launch->block_threads);
  if (rc != KVC_OK) return rc;
  if (launch->plane_table == nullptr) return fail(KVC_ERR_NULL_POINTER, "plane_table is null");
  if (!aligned(reinterpret_cast<uint64_t>(launch->plane_table), 16)) {
    return fail(KVC_ERR_MISALIGNED, "plane_table must be 16-byte aligned");
  }
  const kvc_task_t& t = *task;
  if (launch->table_fingerprint != plane_fingerprint(t.planes, t.num_planes)) {
    return fail(KVC_ERR_WORKSPACE, "the plane table was packed for other planes than the "
                "task's (fingerprint mismatch): pack and upload it again");
  }
  std::memset(k, 0, sizeof(*k));
  uint64_t chunks = 0;
  for (int32_t i = 0; i < t.num_planes; ++i) chunks += plane_chunks(t.planes[i]);
  k->planes = static_cast<const DevPlane*>(launch->plane_table);
  k->host_base = t.host_base;
  k->host_block_bytes = t.host_block_bytes;
  k->units_per_pair = static_cast<int64_t>(chunks);
  k->total_units = static_cast<int64_t>(chunks) * t.count;
  k->num_planes = t.num_planes;
  k->direction = t.direction;
  if (t.count <= KVC_INLINE_PAIRS) {
    std::memcpy(k->inline_ids, t.src_ids, 4 * static_cast<size_t>(t.count));
    std::memcpy(k->inline_ids + KVC_INLINE_PAIRS, t.dst_ids, 4 * static_cast<size_t>(t.count));
    *upload = 0;
    return KVC_OK;
  }
  const uint64_t need = static_cast<uint64_t>(kvc_ids_bytes(t.count));
  if (launch->ids_host == nullptr || launch->ids_dev == nullptr) {
    return fail(KVC_ERR_NULL_POINTER, "a task of %d pairs (> %d) needs ids_host and ids_dev",
                t.count, KVC_INLINE_PAIRS);
  }
  if (!aligned(reinterpret_cast<uint64_t>(launch->ids_host), 16) ||
      !aligned(reinterpret_cast<uint64_t>(launch->ids_dev), 16)) {
    return fail(KVC_ERR_MISALIGNED, "ids_host and ids_dev must be 16-byte aligned");
  }
  if (launch->ids_bytes < need) {
    return fail(KVC_ERR_WORKSPACE, "id staging has %llu bytes, the task needs %llu",
                (unsigned long long)launch->ids_bytes, (unsigned long long)need);
  }
  const char* dev = static_cast<const char*>(launch->ids_dev);
  k->src_ids = reinterpret_cast<const int32_t*>(dev);
  k->dst_ids = reinterpret_cast<const int32_t*>(dev + staged_ids_offset(t.count));
  *upload = need;
  return KVC_OK;
}

// Writes a staged task's ids into ids_host (the layout pack_params pointed at).
void stage_ids(const kvc_task_t& t, const kvc_launch_t& launch) {
  char* host = static_cast<char*>(launch.ids_host);
  std::memcpy(host, t.src_ids, 4 * static_cast<size_t>(t.count));
  std::memcpy(host + staged_ids_offset(t.count), t.dst_ids, 4 * static_cast<size_t>(t.count));
}

// The grid actually launched: no more blocks than there are units.
unsigned int launch_grid(const KernelParams& k, const kvc_launch_t& launch) {
  const int64_t warps_per_block = launch.block_threads / kLanes;
  const int64_t useful = (k.total_units + warps_per_block - 1) / warps_per_block;
  return static_cast<unsigned int>(std::min<int64_t>(launch.grid_blocks, useful));
}

// ---------------------------------------------------------------------------
// Direct path.

cudaMemcpyKind kind_of(int direction) {
  return direction == KVC_D2H ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
}

// (dst, src) of pair i, plane p.
void pair_ptrs(const kvc_task_t& t, int p, int32_t i, char** dst, const char** src) {
  const kvc_plane_t& pl = t.planes[p];
  const bool d2h = t.direction == KVC_D2H;
  const uint64_t dev_id = static_cast<uint64_t>(d2h ? t.src_ids[i] : t.dst_ids[i]);
  const uint64_t host_id = static_cast<uint64_t>(d2h ? t.dst_ids[i] : t.src_ids[i]);
  char* dev = reinterpret_cast<char*>(pl.dev_base + dev_id * pl.dev_stride);
  char* host = reinterpret_cast<char*>(t.host_base + host_id * t.host_block_bytes + pl.host_offset);
  *dst = d2h ? host : dev;
  *src = d2h ? dev : host;
}

// The direct path's plan is written once against a "copier" so that
// kvc_emulate_direct can run the very same plan with memcpy on the CPU.
struct CudaCopier {
  cudaStream_t stream;
  cudaMemcpyKind kind;
  int copy(char* dst, const char* src, size_t n) {
    KVC_CUDA(cudaMemcpyAsync(dst, src, n, kind, stream), "cudaMemcpyAsync");
    return KVC_OK;
  }
  int copy2d(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width,
             size_t rows) {
    KVC_CUDA(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind, stream),
             "cudaMemcpy2DAsync");
    return KVC_OK;
  }
};

struct HostCopier {
  int copy(char* dst, const char* src, size_t n) {
    std::memcpy(dst, src, n);
    return KVC_OK;
  }
  int copy2d(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width,
             size_t rows) {
    for (size_t r = 0; r < rows; ++r) std::memcpy(dst + r * dpitch, src + r * spitch, width);
    return KVC_OK;
  }
};

// One copy per (plane, run of pairs whose src and dst ids both step by one):
// a run is a 2D copy (rows = blocks, pitches = device stride / host block bytes).
template <typename Copier>
int direct_runs(const kvc_task_t& t, Copier& copier) {
  const bool d2h = t.direction == KVC_D2H;
  for (int p = 0; p < t.num_planes; ++p) {
    const kvc_plane_t& pl = t.planes[p];
    const size_t dpitch = d2h ? t.host_block_bytes : pl.dev_stride;
    const size_t spitch = d2h ? pl.dev_stride : t.host_block_bytes;
    int32_t i = 0;
    while (i < t.count) {
      int32_t j = i + 1;
      while (j < t.count && t.src_ids[j] == t.src_ids[j - 1] + 1 &&
             t.dst_ids[j] == t.dst_ids[j - 1] + 1) {
        ++j;
      }
      char* dst;
      const char* src;
      pair_ptrs(t, p, i, &dst, &src);
      const size_t rows = static_cast<size_t>(j - i);
      const int rc = (rows == 1 || (dpitch == pl.nbytes && spitch == pl.nbytes))
                         ? copier.copy(dst, src, pl.nbytes * rows)
                         : copier.copy2d(dst, dpitch, src, spitch, pl.nbytes, rows);
      if (rc != KVC_OK) return rc;
      i = j;
    }
  }
  return KVC_OK;
}

// The batch path's copy list: one entry per block-plane, neighbours that are
// contiguous on both sides merged.
struct Segments {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

int batch_segments(const kvc_task_t& t, Segments* out) {
  try {
    const size_t n = static_cast<size_t>(t.count) * static_cast<size_t>(t.num_planes);
    out->dsts.reserve(n);
    out->srcs.reserve(n);
    out->sizes.reserve(n);
    for (int p = 0; p < t.num_planes; ++p) {
      for (int32_t i = 0; i < t.count; ++i) {
        char* dst;
        const char* src;
        pair_ptrs(t, p, i, &dst, &src);
        const size_t nb = t.planes[p].nbytes;
        if (!out->sizes.empty() &&
            static_cast<char*>(out->dsts.back()) + out->sizes.back() == dst &&
            static_cast<const char*>(out->srcs.back()) + out->sizes.back() == src) {
          out->sizes.back() += nb;
        } else {
          out->dsts.push_back(dst);
          out->srcs.push_back(src);
          out->sizes.push_back(nb);
        }
      }
    }
  } catch (const std::bad_alloc&) {
    return fail(KVC_ERR_HOST_ALLOC, "out of host memory for the batch copy list");
  }
  return KVC_OK;
}

#if KVC_HAVE_BATCH_MEMCPY
// All block-planes in one cudaMemcpyBatchAsync. The legacy default stream is
// not allowed there (the caller falls back to direct_runs).
int direct_batch(const kvc_task_t& t, cudaStream_t stream) {
  Segments seg;
  const int rc = batch_segments(t, &seg);
  if (rc != KVC_OK) return rc;
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the source may still be written
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
  KVC_CUDA(cudaMemcpyBatchAsync(seg.dsts.data(), seg.srcs.data(), seg.sizes.data(),
                                seg.sizes.size(), &attr, &attr_idx, 1, stream),
           "cudaMemcpyBatchAsync");
#else
  size_t fail_idx = 0;
  KVC_CUDA(cudaMemcpyBatchAsync(seg.dsts.data(), const_cast<void**>(seg.srcs.data()),
                                seg.sizes.data(), seg.sizes.size(), &attr, &attr_idx, 1,
                                &fail_idx, stream),
           "cudaMemcpyBatchAsync");
#endif
  return KVC_OK;
}
#endif

int wait_on(cudaStream_t stream, void* event) {
  if (event != nullptr) {
    KVC_CUDA(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0),
             "cudaStreamWaitEvent");
  }
  return KVC_OK;
}

}  // namespace

// ===========================================================================
// C API

extern "C" {

int kvc_abi_version(void) { return KVC_ABI_VERSION; }

int kvc_cudart_build_version(void) { return CUDART_VERSION; }

int kvc_has_batch_memcpy(void) { return KVC_HAVE_BATCH_MEMCPY; }

const char* kvc_status_name(int status) {
  switch (status) {
    case KVC_OK: return "KVC_OK";
    case KVC_ERR_NULL_POINTER: return "KVC_ERR_NULL_POINTER";
    case KVC_ERR_MISALIGNED: return "KVC_ERR_MISALIGNED";
    case KVC_ERR_BAD_COUNT: return "KVC_ERR_BAD_COUNT";
    case KVC_ERR_ID_OUT_OF_RANGE: return "KVC_ERR_ID_OUT_OF_RANGE";
    case KVC_ERR_DUPLICATE_DST: return "KVC_ERR_DUPLICATE_DST";
    case KVC_ERR_BAD_PLANE_COUNT: return "KVC_ERR_BAD_PLANE_COUNT";
    case KVC_ERR_BAD_PLANE: return "KVC_ERR_BAD_PLANE";
    case KVC_ERR_BAD_DIRECTION: return "KVC_ERR_BAD_DIRECTION";
    case KVC_ERR_BAD_GRID: return "KVC_ERR_BAD_GRID";
    case KVC_ERR_WORKSPACE: return "KVC_ERR_WORKSPACE";
    case KVC_ERR_BAD_POOL: return "KVC_ERR_BAD_POOL";
    case KVC_ERR_HOST_ALLOC: return "KVC_ERR_HOST_ALLOC";
    case KVC_ERR_BAD_ARGUMENT: return "KVC_ERR_BAD_ARGUMENT";
    default: break;
  }
  if (status > KVC_ERR_CUDA_BASE) {
    // cudaGetErrorName is a table lookup: safe without a driver.
    return cudaGetErrorName(static_cast<cudaError_t>(status - KVC_ERR_CUDA_BASE));
  }
  return "KVC_ERR_UNKNOWN";
}

const char* kvc_last_error(void) { return g_error; }

int64_t kvc_plane_table_bytes(int32_t num_planes) {
  if (num_planes <= 0 || num_planes > KVC_MAX_PLANES) return -1;
  return static_cast<int64_t>(sizeof(DevPlane)) * num_planes;
}

int kvc_pack_plane_table(const kvc_plane_t* planes, int32_t num_planes, void* out,
                         uint64_t out_bytes, uint64_t* fingerprint) {
  if (planes == nullptr || out == nullptr || fingerprint == nullptr) {
    return fail(KVC_ERR_NULL_POINTER, "planes, out or fingerprint is null");
  }
  const int64_t need = kvc_plane_table_bytes(num_planes);
  if (need < 0) {
    return fail(KVC_ERR_BAD_PLANE_COUNT, "num_planes %d is outside [1, %d]", num_planes,
                KVC_MAX_PLANES);
  }
  if (out_bytes < static_cast<uint64_t>(need)) {
    return fail(KVC_ERR_WORKSPACE, "plane table buffer has %llu bytes, %lld needed",
                (unsigned long long)out_bytes, (long long)need);
  }
  if (!aligned(reinterpret_cast<uint64_t>(out), 16)) {
    return fail(KVC_ERR_MISALIGNED, "plane table buffer must be 16-byte aligned");
  }
  DevPlane* table = static_cast<DevPlane*>(out);
  uint64_t chunks = 0;
  for (int32_t i = 0; i < num_planes; ++i) {
    const kvc_plane_t& p = planes[i];
    table[i] = DevPlane{p.dev_base, p.dev_stride, p.nbytes, p.host_offset, chunks, 0};
    chunks += plane_chunks(p);
  }
  *fingerprint = plane_fingerprint(planes, num_planes);
  return ok();
}

int64_t kvc_ids_bytes(int32_t count) {
  if (count <= 0 || count > KVC_MAX_PAIRS) return -1;
  if (count <= KVC_INLINE_PAIRS) return 0;
  return static_cast<int64_t>(2 * staged_ids_offset(count));
}

int kvc_validate_task(const kvc_task_t* task) {
  const int rc = validate(task);
  return rc == KVC_OK ? ok() : rc;
}

int kvc_copy_kernel(const kvc_task_t* task, const kvc_launch_t* launch, void* stream,
                    void* wait_event) {
  KernelParams k;
  uint64_t upload = 0;
  int rc = pack_params(task, launch, &k, &upload);
  if (rc != KVC_OK) return rc;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (upload > 0) {
    // The previous task's staging copy must have read ids_host before it is
    // rewritten; it queued right behind that task's predecessor, so this is
    // a wait only when the caller runs several tasks ahead.
    if (launch->staging_event != nullptr) {
      KVC_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(launch->staging_event)),
               "cudaEventSynchronize(staging)");
    }
    stage_ids(*task, *launch);
    // Pinned source: returns at once. Before the event wait: the copy touches
    // only our staging, so it need not queue behind the engine's compute.
    KVC_CUDA(cudaMemcpyAsync(launch->ids_dev, launch->ids_host, upload, cudaMemcpyHostToDevice,
                             s),
             "cudaMemcpyAsync(ids)");
    if (launch->staging_event != nullptr) {
      KVC_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(launch->staging_event), s),
               "cudaEventRecord(staging)");
    }
  }
  rc = wait_on(s, wait_event);
  if (rc != KVC_OK) return rc;
  kv_copy_kernel<<<launch_grid(k, *launch), static_cast<unsigned int>(launch->block_threads), 0,
                   s>>>(k);
  KVC_CUDA(cudaGetLastError(), "kv_copy_kernel launch");
  return ok();
}

int kvc_copy_direct(const kvc_task_t* task, int32_t use_batch, void* stream, void* wait_event) {
  int rc = validate(task);
  if (rc != KVC_OK) return rc;
  if (use_batch != 0 && use_batch != 1) {
    return fail(KVC_ERR_BAD_ARGUMENT, "use_batch must be 0 or 1, got %d", use_batch);
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  rc = wait_on(s, wait_event);
  if (rc != KVC_OK) return rc;
#if KVC_HAVE_BATCH_MEMCPY
  if (use_batch && s != nullptr) {
    rc = direct_batch(*task, s);
    return rc == KVC_OK ? ok() : rc;
  }
#endif
  CudaCopier copier{s, kind_of(task->direction)};
  rc = direct_runs(*task, copier);
  return rc == KVC_OK ? ok() : rc;
}

int kvc_emulate_direct(const kvc_task_t* task, int32_t use_batch) {
  int rc = validate(task);
  if (rc != KVC_OK) return rc;
  if (use_batch != 0 && use_batch != 1) {
    return fail(KVC_ERR_BAD_ARGUMENT, "use_batch must be 0 or 1, got %d", use_batch);
  }
  if (use_batch) {
    Segments seg;
    rc = batch_segments(*task, &seg);
    if (rc != KVC_OK) return rc;
    for (size_t i = 0; i < seg.sizes.size(); ++i) {
      std::memcpy(seg.dsts[i], seg.srcs[i], seg.sizes[i]);
    }
    return ok();
  }
  HostCopier copier;
  rc = direct_runs(*task, copier);
  return rc == KVC_OK ? ok() : rc;
}

int kvc_emulate_kernel(const kvc_task_t* task, const kvc_launch_t* launch) {
  KernelParams k;
  uint64_t upload = 0;
  const int rc = pack_params(task, launch, &k, &upload);
  if (rc != KVC_OK) return rc;
  if (upload > 0) {
    stage_ids(*task, *launch);
    std::memcpy(launch->ids_dev, launch->ids_host, upload);  // the staging copy
  }
  // The same grid-stride walk as kv_copy_kernel over the grid it would launch,
  // one (warp, lane) at a time.
  const int64_t num_warps =
      static_cast<int64_t>(launch_grid(k, *launch)) * launch->block_threads / kLanes;
  for (int64_t warp = 0; warp < num_warps; ++warp) {
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int64_t u = warp; u < k.total_units; u += num_warps) run_unit(k, u, lane);
    }
  }
  return ok();
}

int kvc_is_sticky(int status) {
  if (status <= KVC_ERR_CUDA_BASE) return 0;
  // The errors driver_types.h documents as leaving the process unable to use
  // CUDA ("must be terminated and relaunched"), plus an uncorrectable ECC
  // error. Numbers, not enumerators: some are newer than the oldest toolkit
  // this builds with, and their values never change.
  static const int kSticky[] = {
      214,  // cudaErrorECCUncorrectable
      226,  // cudaErrorContained
      700,  // cudaErrorIllegalAddress
      702,  // cudaErrorLaunchTimeout
      710,  // cudaErrorAssert
      714,  // cudaErrorHardwareStackError
      715,  // cudaErrorIllegalInstruction
      716,  // cudaErrorMisalignedAddress
      717,  // cudaErrorInvalidAddressSpace
      718,  // cudaErrorInvalidPc
      719,  // cudaErrorLaunchFailure
      721,  // cudaErrorTensorMemoryLeak
      810,  // cudaErrorMpsClientTerminated
      911,  // cudaErrorExternalDevice
  };
  const int err = status - KVC_ERR_CUDA_BASE;
  for (const int e : kSticky) {
    if (err == e) return 1;
  }
  return 0;
}

// ---- thin runtime helpers ---------------------------------------------------

#define KVC_REQUIRE(cond, msg) \
  do {                         \
    if (!(cond)) return fail(KVC_ERR_NULL_POINTER, "%s", msg); \
  } while (0)

int kvc_device_count(int32_t* count) {
  KVC_REQUIRE(count != nullptr, "count is null");
  int n = 0;
  KVC_CUDA(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  *count = n;
  return ok();
}

int kvc_set_device(int32_t device) {
  KVC_CUDA(cudaSetDevice(device), "cudaSetDevice");
  return ok();
}

int kvc_get_device(int32_t* device) {
  KVC_REQUIRE(device != nullptr, "device is null");
  int d = 0;
  KVC_CUDA(cudaGetDevice(&d), "cudaGetDevice");
  *device = d;
  return ok();
}

int kvc_device_uuid(int32_t device, uint8_t* out_uuid) {
  KVC_REQUIRE(out_uuid != nullptr, "out_uuid is null");
  cudaDeviceProp prop;
  KVC_CUDA(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  static_assert(sizeof(prop.uuid) == KVC_UUID_BYTES, "cudaUUID_t size");
  std::memcpy(out_uuid, &prop.uuid, KVC_UUID_BYTES);
  return ok();
}

int kvc_device_pci_bus_id(int32_t device, char* out, int32_t len) {
  KVC_REQUIRE(out != nullptr, "out is null");
  if (len < 13) return fail(KVC_ERR_BAD_ARGUMENT, "a PCI bus id needs >= 13 bytes, got %d", len);
  KVC_CUDA(cudaDeviceGetPCIBusId(out, len, device), "cudaDeviceGetPCIBusId");
  return ok();
}

int kvc_pointer_type(const void* ptr, int32_t* type) {
  KVC_REQUIRE(type != nullptr, "type is null");
  cudaPointerAttributes attr;
  KVC_CUDA(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  *type = static_cast<int32_t>(attr.type);
  return ok();
}

int kvc_malloc(uint64_t nbytes, void** out) {
  KVC_REQUIRE(out != nullptr, "out is null");
  if (nbytes == 0) return fail(KVC_ERR_BAD_ARGUMENT, "nbytes is 0");
  KVC_CUDA(cudaMalloc(out, nbytes), "cudaMalloc");
  return ok();
}

int kvc_free(void* ptr) {
  KVC_CUDA(cudaFree(ptr), "cudaFree");
  return ok();
}

int kvc_host_alloc(uint64_t nbytes, void** out) {
  KVC_REQUIRE(out != nullptr, "out is null");
  if (nbytes == 0) return fail(KVC_ERR_BAD_ARGUMENT, "nbytes is 0");
  KVC_CUDA(cudaHostAlloc(out, nbytes, cudaHostAllocMapped | cudaHostAllocPortable),
           "cudaHostAlloc");
  return ok();
}

int kvc_host_free(void* ptr) {
  KVC_CUDA(cudaFreeHost(ptr), "cudaFreeHost");
  return ok();
}

int kvc_host_register(void* ptr, uint64_t nbytes) {
  KVC_REQUIRE(ptr != nullptr, "ptr is null");
  if (nbytes == 0) return fail(KVC_ERR_BAD_ARGUMENT, "nbytes is 0");
  KVC_CUDA(cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
           "cudaHostRegister");
  return ok();
}

int kvc_host_unregister(void* ptr) {
  KVC_REQUIRE(ptr != nullptr, "ptr is null");
  KVC_CUDA(cudaHostUnregister(ptr), "cudaHostUnregister");
  return ok();
}

int kvc_host_device_pointer(void* host_ptr, void** out) {
  KVC_REQUIRE(host_ptr != nullptr && out != nullptr, "host_ptr or out is null");
  KVC_CUDA(cudaHostGetDevicePointer(out, host_ptr, 0), "cudaHostGetDevicePointer");
  return ok();
}

int kvc_memcpy_async(void* dst, const void* src, uint64_t nbytes, void* stream) {
  KVC_REQUIRE(dst != nullptr && src != nullptr, "dst or src is null");
  KVC_CUDA(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
           "cudaMemcpyAsync");
  return ok();
}

int kvc_stream_create(void** out) {
  KVC_REQUIRE(out != nullptr, "out is null");
  cudaStream_t s = nullptr;
  // Non-blocking: no implicit sync with the legacy default stream the engine may use.
  KVC_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  *out = s;
  return ok();
}

int kvc_stream_destroy(void* stream) {
  KVC_REQUIRE(stream != nullptr, "stream is null");
  KVC_CUDA(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy");
  return ok();
}

int kvc_stream_synchronize(void* stream) {
  KVC_CUDA(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
  return ok();
}

int kvc_stream_wait_event(void* stream, void* event) {
  KVC_REQUIRE(event != nullptr, "event is null");
  const int rc = wait_on(static_cast<cudaStream_t>(stream), event);
  return rc == KVC_OK ? ok() : rc;
}

int kvc_event_create(int32_t interprocess, void** out) {
  KVC_REQUIRE(out != nullptr, "out is null");
  // Timing off: cheaper, and required for interprocess events.
  unsigned int flags = cudaEventDisableTiming;
  if (interprocess) flags |= cudaEventInterprocess;
  cudaEvent_t e = nullptr;
  KVC_CUDA(cudaEventCreateWithFlags(&e, flags), "cudaEventCreateWithFlags");
  *out = e;
  return ok();
}

int kvc_event_destroy(void* event) {
  KVC_REQUIRE(event != nullptr, "event is null");
  KVC_CUDA(cudaEventDestroy(static_cast<cudaEvent_t>(event)), "cudaEventDestroy");
  return ok();
}

int kvc_event_record(void* event, void* stream) {
  KVC_REQUIRE(event != nullptr, "event is null");
  KVC_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
           "cudaEventRecord");
  return ok();
}

int kvc_event_synchronize(void* event) {
  KVC_REQUIRE(event != nullptr, "event is null");
  KVC_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
  return ok();
}

int kvc_event_query(void* event) {
  KVC_REQUIRE(event != nullptr, "event is null");
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return KVC_ERR_CUDA_BASE + static_cast<int>(cudaErrorNotReady);
  }
  KVC_CUDA(err, "cudaEventQuery");
  return ok();
}

int kvc_event_ipc_handle(void* event, uint8_t* out_handle) {
  KVC_REQUIRE(event != nullptr && out_handle != nullptr, "event or out_handle is null");
  cudaIpcEventHandle_t h;
  KVC_CUDA(cudaIpcGetEventHandle(&h, static_cast<cudaEvent_t>(event)), "cudaIpcGetEventHandle");
  static_assert(sizeof(h) == KVC_IPC_HANDLE_BYTES, "IPC handle size");
  std::memcpy(out_handle, &h, sizeof(h));
  return ok();
}

int kvc_event_open_ipc(const uint8_t* handle, void** out) {
  KVC_REQUIRE(handle != nullptr && out != nullptr, "handle or out is null");
  cudaIpcEventHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  cudaEvent_t e = nullptr;
  KVC_CUDA(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
  *out = e;
  return ok();
}

int kvc_ipc_get_mem_handle(void* dev_ptr, uint8_t* out_handle) {
  KVC_REQUIRE(dev_ptr != nullptr && out_handle != nullptr, "dev_ptr or out_handle is null");
  cudaIpcMemHandle_t h;
  KVC_CUDA(cudaIpcGetMemHandle(&h, dev_ptr), "cudaIpcGetMemHandle");
  static_assert(sizeof(h) == KVC_IPC_HANDLE_BYTES, "IPC handle size");
  std::memcpy(out_handle, &h, sizeof(h));
  return ok();
}

int kvc_ipc_open_mem_handle(const uint8_t* handle, void** out) {
  KVC_REQUIRE(handle != nullptr && out != nullptr, "handle or out is null");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  KVC_CUDA(cudaIpcOpenMemHandle(out, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return ok();
}

int kvc_ipc_close_mem_handle(void* dev_ptr) {
  KVC_REQUIRE(dev_ptr != nullptr, "dev_ptr is null");
  KVC_CUDA(cudaIpcCloseMemHandle(dev_ptr), "cudaIpcCloseMemHandle");
  return ok();
}

}  // extern "C"
