/*
 * kvcached CPU copy engine: move KV blocks between device planes and the
 * block-major host pool with memcpy, one call per task (cpu_copy.h has the
 * layout and the API).
 *
 * Plain C, no Python headers: module.c calls it with the GIL released, so a
 * worker's other threads keep running while blocks move. Every argument and
 * every block id is validated before the first byte is copied (module.c
 * checks too, to word the errors; this is defence in depth, so a bug in any
 * caller fails the task instead of corrupting memory).
 */
#define _POSIX_C_SOURCE 200809L

#include "cpu_copy.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* A thread is only worth its start-up cost (~20 us) for this much copying. */
#define KVC_MIN_BYTES_PER_THREAD ((int64_t)256 * 1024)
#define KVC_MAX_THREADS 64

typedef struct {
    const uint64_t* plane_ptrs;
    const int64_t* plane_stride_bytes;
    const int64_t* plane_bytes;
    const int64_t* host_offsets;
    int32_t num_planes;
    uint8_t* host;
    int64_t host_block_bytes;
    const int64_t* device_ids;
    const int64_t* host_ids;
    int32_t direction;
} kvc_task;

typedef struct {
    const kvc_task* task;
    int64_t begin; /* flattened (pair, plane) item range [begin, end) */
    int64_t end;
} kvc_chunk;

const char* kvc_cpu_copy_strerror(int code) {
    switch (code) {
        case KVC_OK: return "ok";
        case KVC_ERR_NULL: return "a required pointer argument is NULL";
        case KVC_ERR_ARG: return "num_planes, n, a block count, host_block_bytes or num_threads is out of range";
        case KVC_ERR_PLANE: return "a plane's bytes, block stride or host offset is inconsistent";
        case KVC_ERR_DEVICE_ID: return "a device block id is out of range";
        case KVC_ERR_HOST_ID: return "a host block id is out of range";
        case KVC_ERR_DIRECTION: return "direction must be 0 (device->host) or 1 (host->device)";
        default: return "unknown error code";
    }
}

static int check_planes(const kvc_task* t, int64_t num_device_blocks, int64_t* err_index) {
    for (int32_t p = 0; p < t->num_planes; ++p) {
        int64_t nbytes = t->plane_bytes[p];
        int64_t off = t->host_offsets[p];
        int ok = t->plane_ptrs[p] != 0 && nbytes >= 0 && off >= 0
                 && off <= t->host_block_bytes - nbytes;
        /* Blocks of one plane must not overlap, or a copy would clobber a neighbour. */
        if (num_device_blocks > 1 && t->plane_stride_bytes[p] < nbytes) ok = 0;
        if (!ok) {
            *err_index = p;
            return KVC_ERR_PLANE;
        }
    }
    return KVC_OK;
}

static int check_ids(const int64_t* ids, int64_t n, int64_t limit, int64_t* err_index) {
    for (int64_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= limit) {
            *err_index = i;
            return -1;
        }
    }
    return 0;
}

static void copy_items(const kvc_task* t, int64_t begin, int64_t end) {
    const int64_t np = t->num_planes;
    for (int64_t item = begin; item < end; ++item) {
        int64_t i = item / np, p = item % np;
        uint8_t* dev = (uint8_t*)(uintptr_t)t->plane_ptrs[p]
                       + t->device_ids[i] * t->plane_stride_bytes[p];
        uint8_t* hst = t->host + t->host_ids[i] * t->host_block_bytes + t->host_offsets[p];
        if (t->direction == KVC_DIR_TO_HOST) {
            memcpy(hst, dev, (size_t)t->plane_bytes[p]);
        } else {
            memcpy(dev, hst, (size_t)t->plane_bytes[p]);
        }
    }
}

static void* copy_chunk(void* arg) {
    const kvc_chunk* c = (const kvc_chunk*)arg;
    copy_items(c->task, c->begin, c->end);
    return NULL;
}

static int64_t pick_threads(const kvc_task* t, int64_t n, int32_t num_threads) {
    int64_t total = 0;
    for (int32_t p = 0; p < t->num_planes; ++p) total += t->plane_bytes[p];
    total *= n;
    int64_t want = total / KVC_MIN_BYTES_PER_THREAD;
    int64_t items = n * t->num_planes;
    if (want > num_threads) want = num_threads;
    if (want > items) want = items;
    if (want > KVC_MAX_THREADS) want = KVC_MAX_THREADS;
    return want < 1 ? 1 : want;
}

/* Split the (pair, plane) items into contiguous ranges, one per thread; the
 * caller's thread takes the first range. A thread that cannot be created has
 * its range copied inline, so the copy always completes. */
static void run_threaded(const kvc_task* t, int64_t items, int64_t threads) {
    pthread_t tids[KVC_MAX_THREADS];
    kvc_chunk chunks[KVC_MAX_THREADS];
    int started[KVC_MAX_THREADS];
    for (int64_t k = 0; k < threads; ++k) {
        chunks[k].task = t;
        chunks[k].begin = items * k / threads;
        chunks[k].end = items * (k + 1) / threads;
        started[k] = 0;
    }
    for (int64_t k = 1; k < threads; ++k) {
        started[k] = pthread_create(&tids[k], NULL, copy_chunk, &chunks[k]) == 0;
    }
    copy_chunk(&chunks[0]);
    for (int64_t k = 1; k < threads; ++k) {
        if (started[k]) {
            pthread_join(tids[k], NULL);
        } else {
            copy_chunk(&chunks[k]);
        }
    }
}

int kvc_cpu_copy(const uint64_t* plane_ptrs, const int64_t* plane_stride_bytes,
                 const int64_t* plane_bytes, const int64_t* host_offsets, int32_t num_planes,
                 int64_t num_device_blocks, uint8_t* host, int64_t host_block_bytes,
                 int64_t num_host_blocks, const int64_t* device_ids, const int64_t* host_ids,
                 int64_t n, int32_t direction, int32_t num_threads, int64_t* err_index) {
    int64_t scratch;
    if (err_index == NULL) err_index = &scratch;
    *err_index = -1;
    if (direction != KVC_DIR_TO_HOST && direction != KVC_DIR_TO_DEVICE) return KVC_ERR_DIRECTION;
    if (num_planes <= 0 || n < 0 || num_device_blocks < 0 || num_host_blocks < 0
        || host_block_bytes < 0 || num_threads < 1) {
        return KVC_ERR_ARG;
    }
    if (n == 0) return KVC_OK;
    if (!plane_ptrs || !plane_stride_bytes || !plane_bytes || !host_offsets || !host
        || !device_ids || !host_ids) {
        return KVC_ERR_NULL;
    }
    kvc_task t = {plane_ptrs, plane_stride_bytes, plane_bytes, host_offsets, num_planes,
                  host, host_block_bytes, device_ids, host_ids, direction};
    int rc = check_planes(&t, num_device_blocks, err_index);
    if (rc != KVC_OK) return rc;
    if (check_ids(device_ids, n, num_device_blocks, err_index)) return KVC_ERR_DEVICE_ID;
    if (check_ids(host_ids, n, num_host_blocks, err_index)) return KVC_ERR_HOST_ID;

    int64_t threads = pick_threads(&t, n, num_threads);
    if (threads == 1) {
        copy_items(&t, 0, n * num_planes);
    } else {
        run_threaded(&t, n * num_planes, threads);
    }
    return KVC_OK;
}

int kvc_cpu_engine_copy(const kvc_cpu_engine* e, const int64_t* device_ids,
                        const int64_t* host_ids, int64_t n, int64_t direction,
                        int64_t* err_index) {
    int64_t scratch;
    if (err_index == NULL) err_index = &scratch;
    *err_index = -1;
    if (e == NULL) return KVC_ERR_NULL;
    if (direction != KVC_DIR_TO_HOST && direction != KVC_DIR_TO_DEVICE) return KVC_ERR_DIRECTION;
    if (e->num_planes <= 0 || e->num_planes > INT32_MAX || e->num_threads < 1
        || e->num_threads > INT32_MAX) {
        return KVC_ERR_ARG;
    }
    return kvc_cpu_copy(e->plane_ptrs, e->plane_stride_bytes, e->plane_bytes, e->host_offsets,
                        (int32_t)e->num_planes, e->num_device_blocks, e->host,
                        e->host_block_bytes, e->num_host_blocks, device_ids, host_ids, n,
                        (int32_t)direction, (int32_t)e->num_threads, err_index);
}
