/* Nodes, and the index that finds a node by its block hash.
 *
 * A block hash chains every block before it (and the namespace), so it names
 * one prefix: one global table replaces a dict of children per node, and
 * child_by_hash checks the parent only as a guard. */
#include "core.h"

#include <stdlib.h>
#include <string.h>

/* Block hashes are BLAKE2b output, uniform already: 4 of their bytes index. */
static inline uint32_t hash_key(const uint8_t h[HASH_LEN]) {
    uint32_t v;
    memcpy(&v, h, 4);
    return v;
}

static int index_init(index_t *t) {
    t->mask = 1023;
    t->count = 0;
    t->slots = malloc(sizeof(slot_t) * (t->mask + 1));
    if (t->slots == NULL) return -1;
    for (uint32_t i = 0; i <= t->mask; i++) t->slots[i].node = NIL;
    return 0;
}

static int index_grow(index_t *t) {
    uint32_t old_cap = t->mask + 1, cap = old_cap * 2;
    slot_t *old = t->slots, *slots = malloc(sizeof(slot_t) * cap);
    if (slots == NULL) return -1;
    for (uint32_t i = 0; i < cap; i++) slots[i].node = NIL;
    t->slots = slots;
    t->mask = cap - 1;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (old[i].node == NIL) continue;
        uint32_t s = old[i].key & t->mask;
        while (slots[s].node != NIL) s = (s + 1) & t->mask;
        slots[s] = old[i];
    }
    free(old);
    return 0;
}

/* Load factor at most 1/2: probes stay short on a hit and on a miss. */
int index_add(core_t *c, int32_t node) {
    index_t *t = &c->by_hash;
    if ((t->count + 1) * 2 > t->mask + 1 && index_grow(t) < 0) return -1;
    uint32_t key = hash_key(N(c, node)->hash), s = key & t->mask;
    while (t->slots[s].node != NIL) s = (s + 1) & t->mask;
    t->slots[s].key = key;
    t->slots[s].node = node;
    t->count++;
    return 0;
}

void index_remove(core_t *c, int32_t node) {
    index_t *t = &c->by_hash;
    uint32_t s = hash_key(N(c, node)->hash) & t->mask;
    while (t->slots[s].node != node) {
        if (t->slots[s].node == NIL) return; /* not indexed */
        s = (s + 1) & t->mask;
    }
    /* backward shift: move later entries of the run into the hole unless their
     * home slot lies cyclically in (hole, their slot] */
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

int32_t find_by_hash(const core_t *c, const uint8_t hash[HASH_LEN]) {
    const index_t *t = &c->by_hash;
    uint32_t key = hash_key(hash);
    for (uint32_t s = key & t->mask;; s = (s + 1) & t->mask) {
        const slot_t *e = &t->slots[s];
        if (e->node == NIL) return NIL;
        if (e->key == key && memcmp(N(c, e->node)->hash, hash, HASH_LEN) == 0) return e->node;
    }
}

int32_t child_by_hash(const core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]) {
    int32_t n = find_by_hash(c, hash);
    return n != NIL && N(c, n)->parent == parent ? n : NIL;
}

static void link_child(core_t *c, int32_t parent, int32_t child) {
    node_t *p = N(c, parent), *ch = N(c, child);
    ch->prev_sib = p->last_child;
    ch->next_sib = NIL;
    if (p->last_child != NIL) {
        N(c, p->last_child)->next_sib = child;
    } else {
        p->first_child = child;
    }
    p->last_child = child;
    p->n_children++;
}

static void unlink_child(core_t *c, int32_t child) {
    node_t *ch = N(c, child), *p = N(c, ch->parent);
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
    p->n_children--;
    ch->prev_sib = ch->next_sib = NIL;
}

static void node_reset(node_t *n, int32_t parent, int32_t depth, const uint8_t *hash) {
    memset(n, 0, sizeof *n);
    if (hash != NULL) memcpy(n->hash, hash, HASH_LEN);
    n->parent = parent;
    n->first_child = n->last_child = n->next_sib = n->prev_sib = NIL;
    n->gpu = n->cpu = NIL;
    n->heap_pos[0] = n->heap_pos[1] = NIL;
    n->state = S_STORAGE;
    n->depth = depth;
    n->live = 1;
}

/* A new node (state STORAGE, no copies) under `parent`, indexed by hash; the
 * caller sets its state and, for the memo, its record. NIL when out of memory.
 * `hash` must not point into the node array (it may move). */
int32_t node_new(core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]) {
    int32_t i;
    if (c->n_free_nodes > 0) {
        i = c->free_nodes[--c->n_free_nodes];
    } else {
        if (c->n_slots == c->cap) {
            int32_t cap = c->cap * 2;
            node_t *grown = realloc(c->nodes, sizeof(node_t) * (size_t)cap);
            if (grown == NULL) return NIL;
            c->nodes = grown;
            int32_t *free_grown = realloc(c->free_nodes, sizeof(int32_t) * (size_t)cap);
            if (free_grown == NULL) return NIL; /* nodes grew: harmless */
            c->free_nodes = free_grown;
            c->cap = cap; /* the free stack never holds more than cap slots */
        }
        i = c->n_slots++;
    }
    node_reset(N(c, i), parent, N(c, parent)->depth + 1, hash);
    if (index_add(c, i) < 0) {
        N(c, i)->live = 0;
        c->free_nodes[c->n_free_nodes++] = i; /* room: it came from there or from n_slots */
        return NIL;
    }
    link_child(c, parent, i);
    c->num_nodes++;
    return i;
}

/* Unlink a node from its parent and the indexes and free its slot. The
 * caller has emptied its children, its copies and its heap places. */
void node_release(core_t *c, int32_t i) {
    node_t *n = N(c, i);
    index_remove(c, i);
    free(n->record);
    n->record = NULL;
    unlink_child(c, i);
    n->live = 0;
    n->parent = NIL;
    c->free_nodes[c->n_free_nodes++] = i;
    c->num_nodes--;
}

int core_init(core_t *c, int32_t gpu_blocks, int32_t cpu_blocks, int32_t block_size, int memo,
              int external) {
    memset(c, 0, sizeof *c);
    c->cap = 1024;
    c->nodes = malloc(sizeof(node_t) * (size_t)c->cap);
    c->free_nodes = malloc(sizeof(int32_t) * (size_t)c->cap);
    c->batch_cap = 64;
    c->batch = malloc(sizeof(int32_t) * (size_t)c->batch_cap);
    c->batch_copy = malloc(sizeof(int32_t) * (size_t)c->batch_cap);
    if (c->nodes == NULL || c->free_nodes == NULL || c->batch == NULL || c->batch_copy == NULL ||
        index_init(&c->by_hash) < 0 ||
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
            if (c->nodes[i].live) free(c->nodes[i].record);
        }
    }
    free(c->nodes);
    free(c->free_nodes);
    free(c->by_hash.slots);
    free(c->batch);
    free(c->batch_copy);
    free(c->events);
    pool_free_all(&c->pools[T_GPU]);
    pool_free_all(&c->pools[T_CPU]);
    heap_free_all(&c->lru[T_GPU]);
    heap_free_all(&c->lru[T_CPU]);
    memset(c, 0, sizeof *c);
}
