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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
    int stream; /* a large copy: streaming stores (copy_bytes) */
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

/* memcpy, or with streaming stores, which write whole lines to memory without
 * reading them first and without evicting the cache: a copy larger than the
 * cache would otherwise spend part of its bandwidth reading the lines it is
 * about to overwrite. Only where SSE2 is (every x86-64); elsewhere memcpy. */
static void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n, int stream) {
#if defined(__SSE2__)
    if (stream) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* streaming stores need 16-byte alignment */
        if (head > n) head = n;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
            _mm_stream_si128((__m128i*)(dst + i), a);
            _mm_stream_si128((__m128i*)(dst + i + 16), b);
            _mm_stream_si128((__m128i*)(dst + i + 32), c);
            _mm_stream_si128((__m128i*)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, n);
}

static void copy_items(const kvc_task* t, int64_t begin, int64_t end) {
    const int64_t np = t->num_planes;
    for (int64_t item = begin; item < end; ++item) {
        int64_t i = item / np, p = item % np;
        uint8_t* dev = (uint8_t*)(uintptr_t)t->plane_ptrs[p]
                       + t->device_ids[i] * t->plane_stride_bytes[p];
        uint8_t* hst = t->host + t->host_ids[i] * t->host_block_bytes + t->host_offsets[p];
        if (t->direction == KVC_DIR_TO_HOST) {
            copy_bytes(hst, dev, (size_t)t->plane_bytes[p], t->stream);
        } else {
            copy_bytes(dev, hst, (size_t)t->plane_bytes[p], t->stream);
        }
    }
#if defined(__SSE2__)
    /* Streaming stores are weakly ordered: they must all be visible before the
     * copy counts as done (and its Done goes out). */
    if (t->stream) _mm_sfence();
#endif
}

static void* copy_chunk(void* arg) {
    const kvc_chunk* c = (const kvc_chunk*)arg;
    copy_items(c->task, c->begin, c->end);
    return NULL;
}

static int64_t pick_threads(const kvc_task* t, int64_t n, int64_t total, int32_t num_threads) {
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
                  host, host_block_bytes, device_ids, host_ids, direction, 0};
    int rc = check_planes(&t, num_device_blocks, err_index);
    if (rc != KVC_OK) return rc;
    if (check_ids(device_ids, n, num_device_blocks, err_index)) return KVC_ERR_DEVICE_ID;
    if (check_ids(host_ids, n, num_host_blocks, err_index)) return KVC_ERR_HOST_ID;

    int64_t total = 0; /* bytes this call moves; the planes' sizes are checked */
    for (int32_t p = 0; p < num_planes; ++p) total += plane_bytes[p];
    total *= n;
    t.stream = total >= KVC_STREAM_MIN_BYTES;
    int64_t threads = pick_threads(&t, n, total, num_threads);
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
