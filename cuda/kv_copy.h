/*
 * kvcached CUDA copy engine: C API of libkvc_copy.so.
 *
 * One call moves a list of (src block, dst block) pairs for every KV plane
 * between the engine's layer-first device planes and the block-major host
 * pool (docs/architecture.md, "Memory" and "The CUDA copy path"):
 *
 *   device: plane p, block b  at  dev_base_p + b * dev_stride_p   (nbytes_p contiguous)
 *   host:   block h, plane p  at  host_base + h * host_block_bytes + host_offset_p
 *
 * host_base is the device-visible (UVA) address of pinned host memory.
 *
 * Every entry point validates all of its inputs before its first CUDA call
 * and returns a kvc_status; kvc_last_error() then explains the failure. The
 * header has no CUDA or framework dependency so it can be read from ctypes,
 * C or C++.
 */
#ifndef KVCACHED_KV_COPY_H_
#define KVCACHED_KV_COPY_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature or struct below changes; Python checks it. */
#define KVC_ABI_VERSION 2

#define KVC_HOST_ALIGN 16          /* host pool base, block bytes, plane offsets */
#define KVC_MAX_PLANES 4096        /* layers x (K, V, scale) of any real model fits */
#define KVC_MAX_PAIRS (1 << 22)    /* per call; keeps unit counts far from overflow */
#define KVC_MAX_GRID_BLOCKS 1024   /* the grid is meant to be small: it shares SMs */
#define KVC_MAX_BLOCK_THREADS 512  /* the kernel's __launch_bounds__ (spill-free registers) */
#define KVC_IPC_HANDLE_BYTES 64    /* cudaIpcMemHandle_t / cudaIpcEventHandle_t */
#define KVC_INLINE_PAIRS 64        /* tasks this small carry their ids in the kernel parameters */
#define KVC_UUID_BYTES 16          /* cudaUUID_t */

typedef enum kvc_status {
  KVC_OK = 0,
  KVC_ERR_NULL_POINTER = 1,    /* a required pointer (task, plane base, ids, ...) is null */
  KVC_ERR_MISALIGNED = 2,      /* host base/offset/size not 16-byte aligned, ids not 4 */
  KVC_ERR_BAD_COUNT = 3,       /* pair count <= 0 or > KVC_MAX_PAIRS */
  KVC_ERR_ID_OUT_OF_RANGE = 4, /* a block id outside its pool */
  KVC_ERR_DUPLICATE_DST = 5,   /* two pairs write the same destination block */
  KVC_ERR_BAD_PLANE_COUNT = 6, /* num_planes <= 0 or > KVC_MAX_PLANES */
  KVC_ERR_BAD_PLANE = 7,       /* a plane entry is inconsistent (size, stride, span) */
  KVC_ERR_BAD_DIRECTION = 8,   /* direction is neither KVC_D2H nor KVC_H2D */
  KVC_ERR_BAD_GRID = 9,        /* grid blocks / threads per block out of range */
  KVC_ERR_WORKSPACE = 10,      /* id staging smaller than kvc_ids_bytes(), or a plane
                                  table that was packed for other planes */
  KVC_ERR_BAD_POOL = 11,       /* pool sizes <= 0, host block bytes 0, address overflow */
  KVC_ERR_HOST_ALLOC = 12,     /* the launcher could not allocate host scratch memory */
  KVC_ERR_BAD_ARGUMENT = 13,   /* any other invalid argument (sizes, flags) */
  KVC_ERR_CUDA_BASE = 1000     /* KVC_ERR_CUDA_BASE + cudaError_t: a CUDA call failed */
} kvc_status;

typedef enum kvc_direction {
  KVC_D2H = 0, /* swap_out: device planes -> host pool */
  KVC_H2D = 1  /* swap_in:  host pool -> device planes */
} kvc_direction;

/* One KV plane. Any device alignment works (the kernel picks the widest
 * vector both sides allow); host offsets must be 16-byte aligned. */
typedef struct kvc_plane {
  uint64_t dev_base;    /* device address of block 0 of this plane */
  uint64_t dev_stride;  /* bytes between consecutive blocks (>= nbytes) */
  uint64_t nbytes;      /* bytes of one block of this plane, contiguous */
  uint64_t host_offset; /* offset of this plane inside a host block span */
} kvc_plane_t;

/* One copy task. All arrays are host memory owned by the caller; the call
 * does not keep them (the kernel path stages them into the workspace). */
typedef struct kvc_task {
  const kvc_plane_t* planes;
  int32_t num_planes;
  int32_t direction;        /* kvc_direction */
  const int32_t* src_ids;   /* device ids for D2H, host ids for H2D */
  const int32_t* dst_ids;   /* host ids for D2H, device ids for H2D */
  int32_t count;            /* number of pairs */
  int32_t reserved;         /* must be 0 */
  int64_t num_dev_blocks;   /* device pool size: ids are in [0, num_dev_blocks) */
  int64_t num_host_blocks;  /* host pool size */
  uint64_t host_base;       /* device-visible address of host block 0 */
  uint64_t host_block_bytes;/* bytes of one host block span (all planes) */
} kvc_task_t;

/* ---- introspection (no CUDA calls) ------------------------------------ */
int kvc_abi_version(void);
int kvc_cudart_build_version(void);      /* CUDART_VERSION this library was built with */
int kvc_has_batch_memcpy(void);          /* 1 if cudaMemcpyBatchAsync is compiled in */
const char* kvc_status_name(int status); /* "KVC_ERR_MISALIGNED", "cudaErrorNoDevice", ... */
const char* kvc_last_error(void);        /* detail of this thread's last failure */

/* ---- copies --------------------------------------------------------------- */
/* The kernel path reads a packed plane table from device memory. An engine
 * packs it once (kvc_pack_plane_table), uploads it once, and passes its
 * device address and fingerprint with every launch: no per-task upload of
 * the table. A task's ids travel in the kernel parameters when it has at most
 * KVC_INLINE_PAIRS pairs; larger tasks stage them in pinned host memory
 * (ids_host) from which one asynchronous copy moves them to ids_dev, so the
 * caller never waits for a pageable upload. */
typedef struct kvc_launch {
  const void* plane_table;    /* device address of the uploaded table (host address to emulate) */
  uint64_t table_fingerprint; /* what kvc_pack_plane_table returned for these planes */
  void* ids_host;             /* pinned staging for ids (NULL: inline tasks only) */
  void* ids_dev;              /* device buffer the staging is copied to (host to emulate) */
  uint64_t ids_bytes;         /* capacity of ids_host and of ids_dev, each */
  void* staging_event;        /* cudaEvent_t: recorded after each staging copy and waited
                                 for before the staging is rewritten (NULL: never waits) */
  int32_t grid_blocks;        /* <= KVC_MAX_GRID_BLOCKS (fewer are launched for small tasks) */
  int32_t block_threads;      /* a multiple of 32, <= KVC_MAX_BLOCK_THREADS */
} kvc_launch_t;

/* Bytes of a packed plane table, or -1 for a plane count out of range. */
int64_t kvc_plane_table_bytes(int32_t num_planes);

/* Packs the kernel's plane table into `out` (host memory, 16-byte aligned,
 * kvc_plane_table_bytes() long) and returns its fingerprint, which every
 * launch must quote: a launch whose task names other planes is refused. */
int kvc_pack_plane_table(const kvc_plane_t* planes, int32_t num_planes, void* out,
                         uint64_t out_bytes, uint64_t* fingerprint);

/* Staging bytes (ids_host / ids_dev each) a task of `count` pairs needs:
 * 0 when its ids go inline, -1 for a count out of range. */
int64_t kvc_ids_bytes(int32_t count);

/* Validates a task without touching any device. */
int kvc_validate_task(const kvc_task_t* task);

/* Kernel path: one launch on `stream` (a cudaStream_t; NULL = legacy default
 * stream) after waiting on `wait_event` (a cudaEvent_t, may be NULL). The id
 * staging is used stream-ordered: one launch struct per stream. Returns once
 * the work is enqueued. */
int kvc_copy_kernel(const kvc_task_t* task, const kvc_launch_t* launch, void* stream,
                    void* wait_event);

/* Direct path: cudaMemcpy2DAsync per (run of consecutive ids, plane), or
 * one cudaMemcpyBatchAsync when use_batch and the toolkit has it (falls
 * back to per-run copies on the legacy default stream). */
int kvc_copy_direct(const kvc_task_t* task, int32_t use_batch, void* stream, void* wait_event);

/* The kernel path on the CPU: the same validation and parameter packing as
 * kvc_copy_kernel (ids inline or staged, the staging "uploaded" with memcpy),
 * then the kernel's exact per-thread code over host addresses (plane_table,
 * ids_dev, dev_base and host_base are plain host pointers). For tests without a GPU. */
int kvc_emulate_kernel(const kvc_task_t* task, const kvc_launch_t* launch);

/* Runs the direct path's copy plan (runs / batch segments) with memcpy on the CPU. */
int kvc_emulate_direct(const kvc_task_t* task, int32_t use_batch);

/* 1 when `status` is a CUDA error after which the context is unusable (an
 * illegal address in a kernel, ...): every later call fails the same way and
 * only a new process can use the GPU again. */
int kvc_is_sticky(int status);

/* ---- thin CUDA runtime helpers (each returns a kvc_status) -------------- */
int kvc_device_count(int32_t* count);
int kvc_set_device(int32_t device);
int kvc_get_device(int32_t* device);
int kvc_device_uuid(int32_t device, uint8_t* out_uuid);           /* KVC_UUID_BYTES */
int kvc_device_pci_bus_id(int32_t device, char* out, int32_t len); /* "0000:3b:00.0" */
int kvc_pointer_type(const void* ptr, int32_t* type); /* cudaMemoryType: 0 = not CUDA memory */
int kvc_malloc(uint64_t nbytes, void** out);
int kvc_free(void* ptr);
int kvc_host_alloc(uint64_t nbytes, void** out); /* pinned, mapped, portable */
int kvc_host_free(void* ptr);
int kvc_host_register(void* ptr, uint64_t nbytes); /* mapped + portable */
int kvc_host_unregister(void* ptr);
int kvc_host_device_pointer(void* host_ptr, void** out);
int kvc_memcpy_async(void* dst, const void* src, uint64_t nbytes, void* stream);
int kvc_stream_create(void** out);               /* non-blocking stream */
int kvc_stream_destroy(void* stream);
int kvc_stream_synchronize(void* stream);
int kvc_stream_wait_event(void* stream, void* event);
int kvc_event_create(int32_t interprocess, void** out); /* timing disabled */
int kvc_event_destroy(void* event);
int kvc_event_record(void* event, void* stream);
int kvc_event_synchronize(void* event);
int kvc_event_query(void* event);                /* KVC_OK when done */
int kvc_event_ipc_handle(void* event, uint8_t* out_handle);
int kvc_event_open_ipc(const uint8_t* handle, void** out);
int kvc_ipc_get_mem_handle(void* dev_ptr, uint8_t* out_handle);
int kvc_ipc_open_mem_handle(const uint8_t* handle, void** out);
int kvc_ipc_close_mem_handle(void* dev_ptr);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHED_KV_COPY_H_ */
