/* Nodes, the children of a node by block hash, and the memory of memo records.
 *
 * A node's children are a sibling list. Most nodes are links of a chain (one
 * child) and a lookup under them reads that child. A node with more than
 * WIDE children (the root, the first blocks of popular prefixes) keeps them
 * in a hash table of its own instead, and goes back to a list when it is
 * down to WIDE/2: a lookup stays O(1) at any fan-out, and removing a node
 * touches its parent (and, in a list, its two neighbours), never anything
 * that grows with the size of the cache.
 *
 * Memo records are a few hundred bytes each, made and dropped with every
 * cached block; they come from per-size free stacks of slots carved out of
 * 64 KiB chunks (a free is a push, an allocation a pop), not from malloc.
 * The stacks are arrays beside the chunks, so that freeing a record does not
 * touch it (eviction frees one per block). */
#include "core.h"

#include <stdlib.h>
#include <string.h>

#define WIDE 8 /* more children than this: the node indexes them */

/* ------------------------------------------------------------- records */

enum { REC_MIN = 64, REC_CLASSES = 6, REC_CHUNK = 64 * 1024 }; /* 64 B .. 2 KiB */

static int rec_class(uint32_t len) {
    int k = 0;
    for (uint32_t size = REC_MIN; size < len; size <<= 1) k++;
    return k;
}

void *rec_alloc(core_t *c, uint32_t len) {
    int k = rec_class(len);
    if (k >= REC_CLASSES) return malloc(len);
    recpool_t *p = &c->records;
    if (p->n_free[k] == 0) { /* carve a new chunk into slots of this class */
        size_t size = (size_t)REC_MIN << k, slots = REC_CHUNK / size;
        if (p->n_chunks == p->cap_chunks) {
            size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 16;
            void **grown = realloc(p->chunks, sizeof(void *) * cap);
            if (grown == NULL) return NULL;
            p->chunks = grown;
            p->cap_chunks = cap;
        }
        /* the stack holds every slot of the class: a free never has to grow it */
        size_t need = p->cap_free[k] + slots;
        void **stack = realloc(p->free[k], sizeof(void *) * need);
        if (stack == NULL) return NULL;
        p->free[k] = stack;
        p->cap_free[k] = need;
        char *chunk = malloc(REC_CHUNK);
        if (chunk == NULL) return NULL;
        p->chunks[p->n_chunks++] = chunk;
        for (size_t s = slots; s-- > 0;) stack[p->n_free[k]++] = chunk + s * size;
    }
    return p->free[k][--p->n_free[k]];
}

void rec_free(core_t *c, void *rec, uint32_t len) {
    if (rec == NULL) return;
    int k = rec_class(len);
    if (k >= REC_CLASSES) {
        free(rec);
        return;
    }
    c->records.free[k][c->records.n_free[k]++] = rec;
}

/* ----------------------------------------------------------- children */

/* Block hashes are BLAKE2b output, uniform already: 4 of their bytes index. */
static inline uint32_t hash_key(const uint8_t h[HASH_LEN]) {
    uint32_t v;
    memcpy(&v, h, 4);
    return v;
}

/* A wide node's children table: open addressing, linear probing, load at
 * most 1/2, deletion by backward shift (no tombstones). A slot keeps 32 bits
 * of the hash beside the child, so a probe reads a node only on a likely hit. */
static int kids_put(kids_t *t, uint32_t key, int32_t child) {
    if ((t->count + 1) * 2 > t->mask + 1) {
        uint32_t cap = (t->mask + 1) * 2;
        slot_t *old = t->slots, *slots = malloc(sizeof(slot_t) * cap);
        if (slots == NULL) return -1;
        for (uint32_t i = 0; i < cap; i++) slots[i].node = NIL;
        for (uint32_t i = 0; i <= t->mask; i++) {
            if (old[i].node == NIL) continue;
            uint32_t s = old[i].key & (cap - 1);
            while (slots[s].node != NIL) s = (s + 1) & (cap - 1);
            slots[s] = old[i];
        }
        free(old);
        t->slots = slots;
        t->mask = cap - 1;
    }
    uint32_t s = key & t->mask;
    while (t->slots[s].node != NIL) s = (s + 1) & t->mask;
    t->slots[s].key = key;
    t->slots[s].node = child;
    t->count++;
    return 0;
}

static void kids_del(kids_t *t, uint32_t key, int32_t child) {
    uint32_t s = key & t->mask;
    while (t->slots[s].node != child) {
        if (t->slots[s].node == NIL) return;
        s = (s + 1) & t->mask;
    }
    /* move later entries of the run into the hole unless their home slot
     * lies cyclically in (hole, their slot] */
    uint32_t hole = s, j = s;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->slots[j].node == NIL) break;
        uint32_t home = t->slots[j].key & t->mask;
        int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole].node = NIL;
    t->count--;
}

/* A node just got its (WIDE+1)-th child: its children move from the list
 * into a table. -1: no memory (it stays a list: correct, only slower). */
static int kids_build(core_t *c, int32_t parent) {
    kids_t *t = malloc(sizeof *t);
    if (t == NULL) return -1;
    t->mask = 31;
    t->count = 0;
    t->slots = malloc(sizeof(slot_t) * (t->mask + 1));
    if (t->slots == NULL) {
        free(t);
        return -1;
    }
    for (uint32_t i = 0; i <= t->mask; i++) t->slots[i].node = NIL;
    for (int32_t ch = N(c, parent)->first_child; ch != NIL; ch = N(c, ch)->next_sib) {
        if (kids_put(t, hash_key(N(c, ch)->hash), ch) < 0) {
            free(t->slots);
            free(t);
            return -1;
        }
    }
    for (int32_t ch = N(c, parent)->first_child, next; ch != NIL; ch = next) {
        next = N(c, ch)->next_sib;
        N(c, ch)->prev_sib = N(c, ch)->next_sib = NIL;
    }
    N(c, parent)->first_child = N(c, parent)->last_child = NIL;
    N(c, parent)->kids = t;
    return 0;
}

static void kids_drop(node_t *n) {
    if (n->kids == NULL) return;
    free(n->kids->slots);
    free(n->kids);
    n->kids = NULL;
}

static void list_append(core_t *c, int32_t parent, int32_t child) {
    node_t *p = N(c, parent), *ch = N(c, child);
    ch->prev_sib = p->last_child;
    ch->next_sib = NIL;
    if (p->last_child != NIL) {
        N(c, p->last_child)->next_sib = child;
    } else {
        p->first_child = child;
    }
    p->last_child = child;
}

/* A wide node down to WIDE/2 children: back to a list (then a node with one
 * child has it as first_child, as the memo walk expects). */
static void kids_to_list(core_t *c, int32_t parent) {
    kids_t *t = N(c, parent)->kids;
    for (uint32_t s = 0; s <= t->mask; s++) {
        if (t->slots[s].node != NIL) list_append(c, parent, t->slots[s].node);
    }
    kids_drop(N(c, parent));
}

int32_t child_by_hash(const core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]) {
    const node_t *p = N(c, parent);
    if (p->kids != NULL) {
        const kids_t *t = p->kids;
        uint32_t key = hash_key(hash);
        for (uint32_t s = key & t->mask;; s = (s + 1) & t->mask) {
            const slot_t *e = &t->slots[s];
            if (e->node == NIL) return NIL;
            if (e->key == key && memcmp(N(c, e->node)->hash, hash, HASH_LEN) == 0)
                return e->node;
        }
    }
    for (int32_t ch = p->first_child; ch != NIL; ch = N(c, ch)->next_sib) {
        if (memcmp(N(c, ch)->hash, hash, HASH_LEN) == 0) return ch;
    }
    return NIL;
}

void kid_first(const core_t *c, int32_t parent, kid_iter *it) {
    it->t = N(c, parent)->kids;
    it->slot = 0;
    if (it->t == NULL) {
        it->node = N(c, parent)->first_child;
        return;
    }
    it->node = NIL;
    kid_next(c, it);
}

void kid_next(const core_t *c, kid_iter *it) {
    if (it->t == NULL) {
        it->node = N(c, it->node)->next_sib;
        return;
    }
    while (it->slot <= it->t->mask) {
        int32_t ch = it->t->slots[it->slot++].node;
        if (ch != NIL) {
            it->node = ch;
            return;
        }
    }
    it->node = NIL;
}

/* The node of a block hash anywhere in the tree: a walk (tests and checks). */
int32_t find_by_hash(const core_t *c, const uint8_t hash[HASH_LEN]) {
    for (int32_t i = 1; i < c->n_slots; i++) {
        if (c->nodes[i].live && memcmp(c->nodes[i].hash, hash, HASH_LEN) == 0) return i;
    }
    return NIL;
}

static void link_child(core_t *c, int32_t parent, int32_t child) {
    node_t *p = N(c, parent);
    p->n_children++;
    if (p->kids != NULL && kids_put(p->kids, hash_key(N(c, child)->hash), child) == 0) {
        N(c, child)->prev_sib = N(c, child)->next_sib = NIL;
        return;
    }
    if (p->kids != NULL) kids_to_list(c, parent); /* no memory for the table: a list again */
    list_append(c, parent, child);
    if (N(c, parent)->n_children > WIDE) kids_build(c, parent);
}

static void unlink_child(core_t *c, int32_t child) {
    node_t *ch = N(c, child), *p = N(c, ch->parent);
    p->n_children--;
    if (p->kids != NULL) {
        kids_del(p->kids, hash_key(ch->hash), child);
        if (p->n_children <= WIDE / 2) kids_to_list(c, ch->parent);
        return;
    }
    if (ch->prev_sib != NIL) {
        N(c, ch->prev_sib)->next_sib = ch->next_sib;
    } else {
        p->first_child = ch->next_sib;
    }
    if (ch->next_sib != NIL) {
        N(c, ch->next_sib)->prev_sib = ch->prev_sib;
    } else {
        p->last_child = ch->prev_sib;
    }
    ch->prev_sib = ch->next_sib = NIL;
}

/* --------------------------------------------------------------- nodes */

static void node_reset(node_t *n, int32_t parent, int32_t depth, const uint8_t *hash) {
    memset(n, 0, sizeof *n);
    if (hash != NULL) memcpy(n->hash, hash, HASH_LEN);
    n->parent = parent;
    n->first_child = n->last_child = n->next_sib = n->prev_sib = NIL;
    n->gpu = n->cpu = NIL;
    n->state = S_STORAGE;
    n->depth = depth;
    n->live = 1;
}

/* Room for cap nodes, cache-line aligned (NULL: no memory). */
static node_t *node_array(int32_t cap) {
    return aligned_alloc(64, sizeof(node_t) * (size_t)cap); /* a multiple of 64: C11 */
}

/* A new node (state STORAGE, no copies) under `parent`; the caller sets its
 * state and, for the memo, its record. NIL when out of memory. `hash` must
 * not point into the node array (it may move). */
int32_t node_new(core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]) {
    int32_t i;
    if (c->n_free_nodes > 0) {
        i = c->free_nodes[--c->n_free_nodes];
    } else {
        if (c->n_slots == c->cap) {
            int32_t cap = c->cap * 2;
            node_t *grown = node_array(cap);
            if (grown == NULL) return NIL;
            memcpy(grown, c->nodes, sizeof(node_t) * (size_t)c->n_slots);
            free(c->nodes);
            c->nodes = grown;
            int32_t *free_grown = realloc(c->free_nodes, sizeof(int32_t) * (size_t)cap);
            if (free_grown == NULL) return NIL; /* nodes grew: harmless */
            c->free_nodes = free_grown;
            c->cap = cap; /* the free stack never holds more than cap slots */
        }
        for (int t = 0; t < 2; t++) { /* heap positions and policy entries follow the slots */
            if (heap_reserve(&c->lru[t], c->n_slots + 1) < 0) return NIL;
            if (c->pol[t] != NULL && pol_reserve(c->pol[t], c->n_slots + 1) < 0) return NIL;
        }
        i = c->n_slots++;
    }
    node_reset(N(c, i), parent, N(c, parent)->depth + 1, hash);
    link_child(c, parent, i);
    c->num_nodes++;
    return i;
}

/* Unlink a node from its parent and free its slot. The caller has emptied
 * its children, its copies and its heap places. */
void node_release(core_t *c, int32_t i) {
    node_t *n = N(c, i);
    rec_free(c, n->record, n->record_len);
    n->record = NULL;
    kids_drop(n);
    unlink_child(c, i);
    n->live = 0;
    n->parent = NIL;
    c->free_nodes[c->n_free_nodes++] = i;
    c->num_nodes--;
}

int core_init(core_t *c, int32_t gpu_blocks, int32_t cpu_blocks, int32_t block_size, int memo,
              int external, int policy, const pol_params_t *params) {
    memset(c, 0, sizeof *c);
    c->policy = policy;
    if (policy != POLICY_LRU) { /* one adaptive policy per tier that has blocks */
        c->pol_params = *params;
        int32_t blocks[2] = {gpu_blocks, cpu_blocks};
        for (int t = 0; t < 2; t++) {
            if (blocks[t] == 0) continue;
            c->pol[t] = malloc(sizeof(policy_t));
            if (c->pol[t] == NULL || pol_init(c->pol[t], blocks[t], params) < 0) {
                free(c->pol[t]);
                c->pol[t] = NULL;
                core_free(c);
                return -1;
            }
        }
    }
    c->cap = 1024;
    c->nodes = node_array(c->cap);
    c->free_nodes = malloc(sizeof(int32_t) * (size_t)c->cap);
    c->batch_cap = 64;
    c->batch = malloc(sizeof(int32_t) * (size_t)c->batch_cap);
    c->batch_copy = malloc(sizeof(int32_t) * (size_t)c->batch_cap);
    c->wb = malloc(sizeof(int32_t) * WB_HOLD_MAX);
    if (c->nodes == NULL || c->free_nodes == NULL || c->batch == NULL || c->batch_copy == NULL ||
        c->wb == NULL ||
        pool_init(&c->pools[T_GPU], gpu_blocks) < 0 ||
        pool_init(&c->pools[T_CPU], cpu_blocks) < 0 || heap_init(&c->lru[T_GPU], T_GPU) < 0 ||
        heap_init(&c->lru[T_CPU], T_CPU) < 0) {
        core_free(c);
        return -1;
    }
    node_reset(N(c, ROOT), NIL, 0, NULL);
    N(c, ROOT)->state = S_GPU; /* the sentinel "holds" everything */
    c->n_slots = 1;
    c->block_size = block_size;
    c->memo = memo;
    c->external = external;
    c->carry_leaf = NIL;
    return 0;
}

void core_free(core_t *c) {
    if (c->nodes != NULL) {
        for (int32_t i = 0; i < c->n_slots; i++) {
            if (!c->nodes[i].live) continue;
            kids_drop(&c->nodes[i]);
            if (rec_class(c->nodes[i].record_len) >= REC_CLASSES) free(c->nodes[i].record);
        }
    }
    for (size_t k = 0; k < c->records.n_chunks; k++) free(c->records.chunks[k]);
    free(c->records.chunks);
    for (int k = 0; k < REC_CLASSES; k++) free(c->records.free[k]);
    free(c->nodes);
    free(c->free_nodes);
    free(c->batch);
    free(c->batch_copy);
    free(c->wb);
    free(c->events);
    pool_free_all(&c->pools[T_GPU]);
    pool_free_all(&c->pools[T_CPU]);
    heap_free_all(&c->lru[T_GPU]);
    heap_free_all(&c->lru[T_CPU]);
    for (int t = 0; t < 2; t++) {
        if (c->pol[t] == NULL) continue;
        pol_free(c->pol[t]);
        free(c->pol[t]);
    }
    free(c->pol_log);
    memset(c, 0, sizeof *c);
}
