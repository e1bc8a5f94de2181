/* Free block ids of one tier: a FIFO ring (allocation takes the oldest freed
 * id) and a bitmap, so a double free is caught, never a silent second owner
 * of a block (which would later corrupt KV). O(1) take and put. */
#include "core.h"

#include <stdlib.h>
#include <string.h>

int pool_init(pool_t *p, int32_t n) {
    p->num_blocks = n;
    p->ring = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    p->is_free = malloc((size_t)(n > 0 ? n : 1));
    if (p->ring == NULL || p->is_free == NULL) return -1;
    for (int32_t i = 0; i < n; i++) p->ring[i] = i;
    memset(p->is_free, 1, (size_t)n);
    p->head = 0;
    p->count = n;
    return 0;
}

void pool_free_all(pool_t *p) {
    free(p->ring);
    free(p->is_free);
    p->ring = NULL;
    p->is_free = NULL;
}

int32_t pool_take(pool_t *p) {
    if (p->count == 0) return NIL;
    int32_t id = p->ring[p->head];
    p->head = p->head + 1 == p->num_blocks ? 0 : p->head + 1;
    p->count--;
    p->is_free[id] = 0;
    return id;
}

void pool_put(pool_t *p, int32_t id) {
    int32_t tail = p->head + p->count;
    if (tail >= p->num_blocks) tail -= p->num_blocks;
    p->ring[tail] = id;
    p->count++;
    p->is_free[id] = 1;
}

/* Undo takes exactly: the ids go back to the head, in their original order. */
void pool_put_front(pool_t *p, const int32_t *ids, int32_t n) {
    for (int32_t k = n - 1; k >= 0; k--) {
        p->head = p->head == 0 ? p->num_blocks - 1 : p->head - 1;
        p->ring[p->head] = ids[k];
        p->count++;
        p->is_free[ids[k]] = 1;
    }
}

/* Whether ids may all be freed: in range, not free, no repeat. Returns the
 * index of the first bad one, or -1. Leaves the bitmap as it found it. */
int pool_check_free(pool_t *p, const int32_t *ids, int32_t n) {
    int32_t k = 0, bad = -1;
    for (; k < n; k++) {
        int32_t id = ids[k];
        if (id < 0 || id >= p->num_blocks || p->is_free[id]) {
            bad = k;
            break;
        }
        p->is_free[id] = 2; /* seen in this batch: a repeat reads as free */
    }
    for (int32_t j = 0; j < k; j++) p->is_free[ids[j]] = 0;
    return bad;
}
