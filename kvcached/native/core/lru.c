/* The evictable leaves of one tier, least recently used first: a 4-ary
 * min-heap that records each node's position (h->pos[node], an array by node
 * slot: 4 bytes per node, dense, where writing a position into the node
 * record was a cache miss per level a pop moved), so listing, unlisting,
 * re-keying and popping are all O(log n) and no stale entry is ever kept.
 * Nothing scans the leaves. Four children per entry halve the levels a pop
 * walks through: at a million cached blocks the lower levels are cache
 * misses, and they were most of an eviction's cost.
 *
 * Key: (last_access, inverted depth, insertion order), packed as two words:
 * older first; on a tie the deeper node first (a chain's tail goes before
 * its head); then the earlier listed. Depth saturates at 2^24 - 1 and the
 * insertion order wraps at 2^40: either would only reorder ties. */
#include "core.h"

#include <stdlib.h>

#define DEPTH_BITS 24
#define SEQ_BITS 40
#define DEPTH_MAX ((1ULL << DEPTH_BITS) - 1)
#define SEQ_MASK ((1ULL << SEQ_BITS) - 1)

int heap_init(leafheap_t *h, int tier) {
    h->cap = 256;
    h->size = 0;
    h->seq = 0;
    h->tier = tier;
    h->pos = NULL;
    h->pos_cap = 0;
    h->a = malloc(sizeof(heap_entry) * (size_t)h->cap);
    return h->a == NULL || heap_reserve(h, 1024) < 0 ? -1 : 0;
}

int heap_reserve(leafheap_t *h, int32_t n) {
    if (n <= h->pos_cap) return 0;
    int32_t cap = h->pos_cap ? h->pos_cap : 1024;
    while (cap < n) cap *= 2;
    int32_t *grown = realloc(h->pos, sizeof(int32_t) * (size_t)cap);
    if (grown == NULL) return -1;
    for (int32_t k = h->pos_cap; k < cap; k++) grown[k] = NIL;
    h->pos = grown;
    h->pos_cap = cap;
    return 0;
}

void heap_free_all(leafheap_t *h) {
    free(h->a);
    free(h->pos);
    h->a = NULL;
    h->pos = NULL;
    h->size = h->cap = h->pos_cap = 0;
}

static inline int less(const heap_entry *x, const heap_entry *y) {
    return x->hi < y->hi || (x->hi == y->hi && x->lo < y->lo);
}

static inline void place(core_t *c, leafheap_t *h, int32_t pos, heap_entry e) {
    h->a[pos] = e;
    h->pos[e.node] = pos;
}

static void sift_up(core_t *c, leafheap_t *h, int32_t pos) {
    heap_entry e = h->a[pos];
    while (pos > 0) {
        int32_t up = (pos - 1) / 4;
        if (!less(&e, &h->a[up])) break;
        place(c, h, pos, h->a[up]);
        pos = up;
    }
    place(c, h, pos, e);
}

static void sift_down(core_t *c, leafheap_t *h, int32_t pos) {
    heap_entry e = h->a[pos];
    for (;;) {
        int32_t first = 4 * pos + 1, child = first;
        if (first >= h->size) break;
        int32_t last = first + 3 < h->size - 1 ? first + 3 : h->size - 1;
        for (int32_t k = first + 1; k <= last; k++) {
            if (less(&h->a[k], &h->a[child])) child = k;
        }
        if (!less(&h->a[child], &e)) break;
        place(c, h, pos, h->a[child]);
        pos = child;
    }
    place(c, h, pos, e);
}

/* The key `node` would be listed with now (consumes one insertion number). */
void heap_key_of(core_t *c, leafheap_t *h, int32_t node, uint64_t *hi, uint64_t *lo) {
    const node_t *n = N(c, node);
    uint64_t depth = (uint64_t)n->depth;
    uint64_t inv = depth < DEPTH_MAX ? DEPTH_MAX - depth : 0;
    h->seq++;
    *hi = n->last_access;
    *lo = (inv << SEQ_BITS) | (h->seq & SEQ_MASK);
}

/* List `node` with exactly this key (new entries, and undoing a removal). */
int heap_insert_key(core_t *c, leafheap_t *h, int32_t node, uint64_t hi, uint64_t lo) {
    if (h->size == h->cap) {
        heap_entry *grown = realloc(h->a, sizeof(heap_entry) * (size_t)h->cap * 2);
        if (grown == NULL) return -1;
        h->a = grown;
        h->cap *= 2;
    }
    heap_entry e = {hi, lo, node};
    place(c, h, h->size++, e);
    sift_up(c, h, h->size - 1);
    return 0;
}

/* List `node`, or re-key it when its last access changed since it was
 * listed (an unchanged one keeps its place). */
int heap_add(core_t *c, leafheap_t *h, int32_t node) {
    int32_t pos = h->pos[node];
    uint64_t hi, lo;
    if (pos != NIL) {
        if (h->a[pos].hi == N(c, node)->last_access) return 0;
        heap_key_of(c, h, node, &hi, &lo);
        int up = hi < h->a[pos].hi || (hi == h->a[pos].hi && lo < h->a[pos].lo);
        h->a[pos].hi = hi;
        h->a[pos].lo = lo;
        if (up) {
            sift_up(c, h, pos);
        } else {
            sift_down(c, h, pos);
        }
        return 0;
    }
    heap_key_of(c, h, node, &hi, &lo);
    return heap_insert_key(c, h, node, hi, lo);
}

void heap_remove(core_t *c, leafheap_t *h, int32_t node) {
    int32_t pos = h->pos[node];
    if (pos == NIL) return;
    h->pos[node] = NIL;
    h->size--;
    if (pos == h->size) return;
    heap_entry last = h->a[h->size];
    place(c, h, pos, last);
    if (pos > 0 && less(&last, &h->a[(pos - 1) / 4])) {
        sift_up(c, h, pos);
    } else {
        sift_down(c, h, pos);
    }
}

int32_t heap_pop(core_t *c, leafheap_t *h) {
    if (h->size == 0) return NIL;
    int32_t node = h->a[0].node;
    /* the caller evicts it: its record loads while the heap sifts */
    __builtin_prefetch(N(c, node), 1);
    __builtin_prefetch((const char *)N(c, node) + 64, 1);
    heap_remove(c, h, node);
    return node;
}

int heap_peek_key(const leafheap_t *h, uint64_t *hi, uint64_t *lo) {
    if (h->size == 0) return 0;
    *hi = h->a[0].hi;
    *lo = h->a[0].lo;
    return 1;
}

/* ------------------------------------------------------ leaves, by policy */

/* The calls ops.c makes on a tier's evictable leaves, each answered by the
 * tier's LRU heap or by its adaptive policy (c->pol[t]). Under the adaptive
 * policy the heaps stay empty (every position NIL) and last_access is
 * still stamped (it is cheap, and the snapshot shows it). */

/* The head word: clock << 24 | tier << 8 | op (bit 16: no key). */
void pol_log_at(core_t *c, int t, int op, uint64_t key, uint64_t now) {
    if (c->n_pol_log + 2 > c->pol_log_cap) {
        int32_t cap = c->pol_log_cap ? c->pol_log_cap * 2 : 1024;
        int64_t *grown = realloc(c->pol_log, sizeof(int64_t) * (size_t)cap);
        if (grown == NULL) return; /* a test hook: a lost entry fails the replay */
        c->pol_log = grown;
        c->pol_log_cap = cap;
    }
    c->pol_log[c->n_pol_log++] = (int64_t)(now << 24 | (uint64_t)(t << 8 | op));
    c->pol_log[c->n_pol_log++] = (int64_t)key;
}

void pol_log(core_t *c, int t, int op, uint64_t key) { pol_log_at(c, t, op, key, 0); }

#define LOG(c, t, op, i)                                               \
    do {                                                               \
        if ((c)->pol_log_on) pol_log(c, t, op, node_key(c, i));        \
    } while (0)

int leaves_add(core_t *c, int t, int32_t node) {
    policy_t *p = c->pol[t];
    if (p == NULL) return heap_add(c, &c->lru[t], node);
    if (!pol_listed(p, node)) { /* a listed leaf keeps its place: only a hit moves it */
        pol_add_leaf(p, node);
        LOG(c, t, PL_ADD, node);
    }
    return 0;
}

void leaves_remove(core_t *c, int t, int32_t node) {
    policy_t *p = c->pol[t];
    if (p == NULL) {
        heap_remove(c, &c->lru[t], node);
    } else if (pol_listed(p, node)) {
        pol_remove_leaf(p, node);
        LOG(c, t, PL_REMOVE, node);
    }
}

int32_t leaves_pop(core_t *c, int t) {
    policy_t *p = c->pol[t];
    if (p == NULL) return heap_pop(c, &c->lru[t]);
    int32_t i = pol_victim(p);
    if (c->pol_log_on) pol_log(c, t, PL_VICTIM | (i == NIL ? 0x10000 : 0),
                               i == NIL ? 0 : node_key(c, i));
    return i;
}

/* add(leaf) then pop(); with the heap, when the leaf would come straight back
 * out, the heap is not touched (eviction walking up a chain takes this path). */
int32_t leaves_push_pop(core_t *c, int t, int32_t leaf) {
    leafheap_t *h = &c->lru[t];
    if (c->pol[t] != NULL || leaf == NIL) {
        if (leaf != NIL) leaves_add(c, t, leaf);
        return leaves_pop(c, t);
    }
    if (h->pos[leaf] == NIL) {
        uint64_t mhi, mlo, hi, lo;
        if (!heap_peek_key(h, &mhi, &mlo) || N(c, leaf)->last_access < mhi) return leaf;
        heap_key_of(c, h, leaf, &hi, &lo);
        if (hi < mhi || (hi == mhi && lo < mlo)) return leaf;
        heap_insert_key(c, h, leaf, hi, lo);
    } else {
        heap_add(c, h, leaf);
    }
    return heap_pop(c, h);
}

int32_t leaves_count(const core_t *c, int t) {
    return c->pol[t] != NULL ? (int32_t)c->pol[t]->n_leaves : c->lru[t].size;
}

int leaves_listed(const core_t *c, int t, int32_t node) {
    return c->pol[t] != NULL ? pol_listed(c->pol[t], node) : c->lru[t].pos[node] != NIL;
}

void pol_sync_slow(core_t *c, int32_t i) {
    const node_t *n = N(c, i);
    for (int t = 0; t < 2; t++) {
        policy_t *p = c->pol[t];
        if (p == NULL) continue;
        int has = (t == T_GPU ? n->gpu : n->cpu) >= 0;
        if (has == pol_tracked(p, i)) continue;
        if (has) {
            pol_on_insert(p, i, node_key(c, i), c->clock);
            if (c->pol_log_on) pol_log_at(c, t, PL_INSERT, node_key(c, i), c->clock);
        } else {
            leaves_remove(c, t, i);
            pol_on_evict(p, i, node_key(c, i));
            LOG(c, t, PL_EVICT, i);
        }
    }
}
