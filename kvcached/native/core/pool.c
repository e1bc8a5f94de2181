/* Free block ids of one tier: a FIFO ring (allocation takes the oldest freed
 * id) and a bitmap, so a double free is caught, never a silent second owner
 * of a block (which would later corrupt KV). O(1) take and put. The bitmap
 * is one bit per block (128 KiB for a million blocks): it stays in cache
 * while eviction frees blocks all over the pool. */
#include "core.h"

#include <stdlib.h>
#include <string.h>

static inline int is_free(const pool_t *p, int32_t id) {
    return (p->free_bits[id >> 6] >> (id & 63)) & 1;
}

static inline void set_free(pool_t *p, int32_t id, int on) {
    uint64_t bit = (uint64_t)1 << (id & 63);
    if (on) {
        p->free_bits[id >> 6] |= bit;
    } else {
        p->free_bits[id >> 6] &= ~bit;
    }
}

int pool_init(pool_t *p, int32_t n) {
    size_t words = (size_t)n / 64 + 1;
    p->num_blocks = n;
    p->ring = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    p->free_bits = calloc(words, sizeof(uint64_t));
    if (p->ring == NULL || p->free_bits == NULL) return -1;
    for (int32_t i = 0; i < n; i++) {
        p->ring[i] = i;
        set_free(p, i, 1);
    }
    p->head = 0;
    p->count = n;
    return 0;
}

void pool_free_all(pool_t *p) {
    free(p->ring);
    free(p->free_bits);
    p->ring = NULL;
    p->free_bits = NULL;
}

int32_t pool_take(pool_t *p) {
    if (p->count == 0) return NIL;
    int32_t id = p->ring[p->head];
    p->head = p->head + 1 == p->num_blocks ? 0 : p->head + 1;
    p->count--;
    set_free(p, id, 0);
    return id;
}

void pool_put(pool_t *p, int32_t id) {
    int32_t tail = p->head + p->count;
    if (tail >= p->num_blocks) tail -= p->num_blocks;
    p->ring[tail] = id;
    p->count++;
    set_free(p, id, 1);
}

/* Undo takes exactly: the ids go back to the head, in their original order. */
void pool_put_front(pool_t *p, const int32_t *ids, int32_t n) {
    for (int32_t k = n - 1; k >= 0; k--) {
        p->head = p->head == 0 ? p->num_blocks - 1 : p->head - 1;
        p->ring[p->head] = ids[k];
        p->count++;
        set_free(p, ids[k], 1);
    }
}

/* Whether ids may all be freed: in range, not free, no repeat. Returns the
 * index of the first bad one, or -1. Leaves the bitmap as it found it. */
int pool_check_free(pool_t *p, const int32_t *ids, int32_t n) {
    int32_t k = 0, bad = -1;
    for (; k < n; k++) {
        int32_t id = ids[k];
        if (id < 0 || id >= p->num_blocks || is_free(p, id)) {
            bad = k;
            break;
        }
        set_free(p, id, 1); /* seen in this batch: a repeat reads as free */
    }
    for (int32_t j = 0; j < k; j++) set_free(p, ids[j], 0);
    return bad;
}
