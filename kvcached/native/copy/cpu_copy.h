/*
 * kvcached CPU copy engine, the C side: move KV blocks between device planes
 * and the block-major host pool with memcpy (cpu_copy.c). No Python here;
 * module.c makes it the extension kvcached.copy._cpu_copy.
 *
 * Layout (see kvcached/layout.py):
 *   device plane p, block b: plane_ptrs[p] + b * plane_stride_bytes[p],
 *                            plane_bytes[p] contiguous bytes
 *   host block h, plane p:   host + h * host_block_bytes + host_offsets[p]
 *
 * Both entries validate every argument and every block id before the first
 * byte moves and return a KVC_ERR_* code (err_index: the bad plane or id's
 * index, -1 if none), so a bug in a caller fails the task instead of
 * corrupting memory. Neither touches Python state: callers may run them
 * without the GIL.
 */
#ifndef KVCACHED_CPU_COPY_H
#define KVCACHED_CPU_COPY_H

#include <stdint.h>

#define KVC_OK 0
#define KVC_ERR_NULL (-1)       /* a required pointer is NULL */
#define KVC_ERR_ARG (-2)        /* num_planes, n, sizes or threads out of range */
#define KVC_ERR_PLANE (-3)      /* a plane's bytes/stride/host offset are inconsistent */
#define KVC_ERR_DEVICE_ID (-4)  /* a device block id is out of range */
#define KVC_ERR_HOST_ID (-5)    /* a host block id is out of range */
#define KVC_ERR_DIRECTION (-6)  /* direction is neither 0 nor 1 */

/* A call moving at least this many bytes writes with streaming stores: it
 * does not fit in a last-level cache share anyway (cpu_copy.c, copy_bytes). */
#define KVC_STREAM_MIN_BYTES ((int64_t)8 << 20)

#define KVC_DIR_TO_HOST 0   /* swap out: device -> host */
#define KVC_DIR_TO_DEVICE 1 /* swap in: host -> device */

/* Everything about an engine that does not change between calls: a call
 * passes one pointer instead of nine arguments. */
typedef struct {
    const uint64_t* plane_ptrs;
    const int64_t* plane_stride_bytes;
    const int64_t* plane_bytes;
    const int64_t* host_offsets;
    int64_t num_planes;
    int64_t num_device_blocks;
    uint8_t* host;
    int64_t host_block_bytes;
    int64_t num_host_blocks;
    int64_t num_threads;
} kvc_cpu_engine;

/* A short description of a KVC_* code. */
const char* kvc_cpu_copy_strerror(int code);

/* Copy n blocks: device_ids[i] <-> host_ids[i] for every plane, in the given
 * direction, split over up to num_threads threads when it is large. */
int kvc_cpu_copy(const uint64_t* plane_ptrs, const int64_t* plane_stride_bytes,
                 const int64_t* plane_bytes, const int64_t* host_offsets, int32_t num_planes,
                 int64_t num_device_blocks, uint8_t* host, int64_t host_block_bytes,
                 int64_t num_host_blocks, const int64_t* device_ids, const int64_t* host_ids,
                 int64_t n, int32_t direction, int32_t num_threads, int64_t* err_index);

/* kvc_cpu_copy with the engine's tables taken from *e; the same checks and
 * codes. n and direction are int64_t so callers can pass any integer. */
int kvc_cpu_engine_copy(const kvc_cpu_engine* e, const int64_t* device_ids,
                        const int64_t* host_ids, int64_t n, int64_t direction,
                        int64_t* err_index);

#endif
