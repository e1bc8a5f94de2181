/* Every state transition of the cache: matching, freeing, inserting,
 * eviction (GPU -> CPU -> dropped), fetches (swap-in, storage load),
 * write-through, and the whole-tier drops of sleep and tier failure.
 *
 * set_state / ref_node / unref_node / refresh are the general bookkeeping:
 * they keep the parent counters, the idle count and both leaf heaps exact.
 * The per-block hot paths (match, unref_path, begin_swap_out,
 * land_swap_out, plan_swap_in, land_fetch, new_gpu_node) do only what can
 * change there, and say why. tests/reference/model.py models the state
 * machine these transitions make up (states and transitions, not this
 * code); the differential tests run the manager and the model on the same
 * workloads and compare every node, pool and heap. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define KEEP INT32_MIN

/* ------------------------------------------------------------- events */

static void emit(core_t *c, int stored, int tier, const uint8_t *hash) {
    if (c->n_events == c->events_cap) {
        int32_t cap = c->events_cap ? c->events_cap * 2 : 64;
        event_t *grown = realloc(c->events, sizeof(event_t) * (size_t)cap);
        if (grown == NULL) return; /* an event lost to memory pressure; the cache is fine */
        c->events = grown;
        c->events_cap = cap;
    }
    event_t *e = &c->events[c->n_events++];
    e->stored = (uint8_t)stored;
    e->tier = (uint8_t)tier;
    memcpy(e->hash, hash, HASH_LEN);
}

/* A block became usable in, or left, the GPU or the CPU tier. */
static void publish_change(core_t *c, int32_t i, int old_state, int old_cpu) {
    const node_t *n = N(c, i);
    int was_g = old_state == S_GPU, is_g = n->state == S_GPU;
    int was_c = old_cpu && (old_state == S_GPU || old_state == S_CPU);
    int is_c = n->cpu >= 0 && (n->state == S_GPU || n->state == S_CPU);
    if (was_g != is_g) emit(c, is_g, 0, n->hash);
    if (was_c != is_c) emit(c, is_c, 1, n->hash);
}

#define PUBLISH(c, i, old_state, old_cpu) \
    do {                                  \
        if ((c)->events_on) publish_change(c, i, old_state, old_cpu); \
    } while (0)

/* --------------------------------------------------------- bookkeeping */

/* Put a node in exactly the leaf heaps it is evictable from: a GPU leaf is
 * an unreferenced GPU node with no child on GPU; a CPU leaf is a CPU copy no
 * CPU child depends on (a GPU node's backup always qualifies). */
static void refresh(core_t *c, int32_t i) {
    const node_t *n = N(c, i);
    if (n->parent == NIL) return; /* the root is never evicted */
    int st = n->state;
    if (st == S_GPU && !(n->ref || n->n_gpu_children || n->busy)) {
        leaves_add(c, T_GPU, i);
    } else {
        leaves_remove(c, T_GPU, i);
    }
    if (n->cpu >= 0 && !(n->n_cpu_children || n->busy) &&
        (st == S_GPU || (st == S_CPU && !(n->ref || n->n_gpu_children)))) {
        leaves_add(c, T_CPU, i);
    } else {
        leaves_remove(c, T_CPU, i);
    }
}

/* A request used node i's copy in tier t (matched it, or a commit or save
 * found it cached): the tier's adaptive policy counts the hit, the node
 * leaving the leaf set first (it is referenced now). Nothing under LRU,
 * whose key (last_access) moves when the request lets go. */
static inline void pol_hit(core_t *c, int t, int32_t i) {
    policy_t *p = c->pol[t];
    if (p == NULL) return;
    leaves_remove(c, t, i);
    pol_on_hit(p, i, c->clock);
    if (c->pol_log_on) pol_log_at(c, t, PL_HIT, node_key(c, i), c->clock);
}

/* Change a node's state and copies (KEEP leaves one as it is). */
static void set_state(core_t *c, int32_t i, int state, int32_t gpu, int32_t cpu) {
    node_t *n = N(c, i);
    int old_state = n->state;
    int old_g = old_state == S_GPU || old_state == S_SWAP_IN;
    int old_c = n->cpu >= 0;
    int old_idle = old_state == S_GPU && n->ref == 0;
    n->state = (uint8_t)state;
    if (gpu != KEEP) n->gpu = gpu;
    if (cpu != KEEP) n->cpu = cpu;
    pol_sync(c, i); /* a copy gained or lost: the tiers' policies hear of it first */
    int new_g = state == S_GPU || state == S_SWAP_IN;
    int new_c = n->cpu >= 0;
    PUBLISH(c, i, old_state, old_c);
    c->n_gpu_idle += (state == S_GPU && n->ref == 0) - old_idle;
    if (new_g != old_g || new_c != old_c) {
        node_t *p = N(c, n->parent);
        p->n_gpu_children += new_g - old_g;
        p->n_cpu_children += new_c - old_c;
        refresh(c, n->parent);
    }
    refresh(c, i);
}

static void ref_node(core_t *c, int32_t i) {
    node_t *n = N(c, i);
    if (++n->ref == 1) { /* referenced nodes leave the GPU heap (a CPU-only one the CPU heap) */
        if (n->state == S_GPU) {
            c->n_gpu_idle--;
            leaves_remove(c, T_GPU, i);
        } else if (n->state == S_CPU) {
            leaves_remove(c, T_CPU, i);
        }
    }
}

static void unref_node(core_t *c, int32_t i) {
    node_t *n = N(c, i);
    n->ref--;
    n->last_access = c->clock;
    if (n->ref == 0) {
        if (n->state == S_GPU) c->n_gpu_idle++;
        refresh(c, i);
    } else if (n->cpu >= 0) { /* still referenced: only a backup's key moves */
        refresh(c, i);
    }
}

/* Whether `p`, which just lost a GPU child, is now an evictable GPU leaf
 * (it holds a GPU block: GPU is prefix-closed). */
static inline int new_gpu_leaf(const core_t *c, int32_t p) {
    const node_t *n = N(c, p);
    return !(n->n_gpu_children || n->ref || n->busy) && n->state == S_GPU && n->parent != NIL;
}

/* ------------------------------------------------------------ subtrees */

/* The nodes of the subtree at i (i first), in a stack walk's order (callers
 * that care sort them: sort_deepest_first). *out is malloc'd (NULL: no
 * memory). */
static int32_t subtree(core_t *c, int32_t i, int32_t **out) {
    int32_t cap = 64, n = 0, sp = 0;
    int32_t *res = malloc(sizeof(int32_t) * (size_t)cap);
    int32_t *stack = malloc(sizeof(int32_t) * (size_t)cap);
    if (res == NULL || stack == NULL) goto fail;
    stack[sp++] = i;
    while (sp > 0) {
        int32_t x = stack[--sp];
        if (n == cap) {
            cap *= 2;
            int32_t *r2 = realloc(res, sizeof(int32_t) * (size_t)cap);
            int32_t *s2 = r2 ? realloc(stack, sizeof(int32_t) * (size_t)cap) : NULL;
            if (r2) res = r2;
            if (s2 == NULL) goto fail;
            stack = s2;
        }
        res[n++] = x;
        kid_iter it;
        for (kid_first(c, x, &it); it.node != NIL; kid_next(c, &it)) {
            int32_t ch = it.node;
            if (sp == cap) { /* the stack holds at most n_nodes entries: grow with res */
                int32_t *s2 = realloc(stack, sizeof(int32_t) * (size_t)cap * 2);
                int32_t *r2 = s2 ? realloc(res, sizeof(int32_t) * (size_t)cap * 2) : NULL;
                if (s2) stack = s2;
                if (r2 == NULL) goto fail;
                res = r2;
                cap *= 2;
            }
            stack[sp++] = ch;
        }
    }
    free(stack);
    *out = res;
    return n;
fail:
    free(res);
    free(stack);
    *out = NULL;
    return 0;
}

/* Every node but the root. */
static int32_t walk_all(core_t *c, int32_t **out) {
    int32_t n = subtree(c, ROOT, out);
    if (*out == NULL || n == 0) return 0;
    memmove(*out, *out + 1, sizeof(int32_t) * (size_t)(n - 1));
    return n - 1;
}

/* Whether node a goes before node b when dropping: deeper first, then by hash. */
static int drop_before(const core_t *c, int32_t a, int32_t b) {
    const node_t *x = N(c, a), *y = N(c, b);
    if (x->depth != y->depth) return x->depth > y->depth;
    return memcmp(x->hash, y->hash, HASH_LEN) < 0;
}

static void sift_down(const core_t *c, int32_t *v, int32_t root, int32_t n) {
    for (int32_t child; (child = 2 * root + 1) < n; root = child) {
        if (child + 1 < n && drop_before(c, v[child], v[child + 1])) child++;
        if (!drop_before(c, v[root], v[child])) return;
        int32_t t = v[root];
        v[root] = v[child];
        v[child] = t;
    }
}

/* The order whole-subtree and whole-tier drops take nodes in: deepest first
 * (a parent after its children), then by hash (a fixed order, so the blocks
 * go back to the pools in an order the reference shares; the children of a
 * wide node have no order of their own). A heapsort: in place, no
 * allocation, and no shared state (qsort's comparator would need the core in
 * a static, which two cores sorting at once would race on). */
static void sort_deepest_first(const core_t *c, int32_t *v, int32_t n) {
    for (int32_t k = n / 2 - 1; k >= 0; k--) sift_down(c, v, k, n);
    for (int32_t end = n - 1; end > 0; end--) {
        int32_t t = v[0];
        v[0] = v[end];
        v[end] = t;
        sift_down(c, v, 0, end);
    }
}

/* ------------------------------------------------------------ removing */

/* A node leaves the tree (it holds no block any more; remove_node clears
 * the CPU copies below without telling the policy: here it hears of them). */
static void release(core_t *c, int32_t i) {
    pol_sync(c, i);
    leaves_remove(c, T_GPU, i);
    leaves_remove(c, T_CPU, i);
    node_release(c, i);
}

/* Unlink `i` and its subtree (BlockTree.remove): no removed node holds a block. */
static void tree_remove(core_t *c, int32_t i) {
    if (N(c, i)->n_children == 0) {
        release(c, i);
        return;
    }
    int32_t *nodes;
    int32_t n = subtree(c, i, &nodes);
    for (int32_t k = n - 1; k >= 0; k--) release(c, nodes[k]); /* children before their parent */
    free(nodes);
}

/* A node that holds no copy leaves the tree; CPU copies below it (unreachable
 * without it) are dropped with it (_remove). */
static void remove_node(core_t *c, int32_t i) {
    if (N(c, i)->n_children == 0) {
        tree_remove(c, i);
        return;
    }
    int32_t *nodes;
    int32_t n = subtree(c, i, &nodes);
    sort_deepest_first(c, nodes, n);
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    int32_t m = 0;
    for (int32_t k = 0; k < n; k++) {
        node_t *x = N(c, nodes[k]);
        if (x->cpu >= 0) {
            if (cpus != NULL) cpus[m++] = x->cpu;
            x->cpu = NIL;
            c->evictions[EV_CPU_DROPPED]++;
        }
    }
    free(nodes);
    tree_remove(c, i);
    for (int32_t k = 0; k < m; k++) pool_put(&c->pools[T_CPU], cpus[k]);
    free(cpus);
}

static void drop_cpu(core_t *c, int32_t i);

/* `i` just lost its last local copy but stays for storage: the CPU copies
 * below it are unreachable now (a match stops at a STORAGE node), so they go
 * too, deepest first (a parent after its children). */
static void drop_cpu_below(core_t *c, int32_t i) {
    int32_t *nodes;
    int32_t n = subtree(c, i, &nodes), m = 0;
    for (int32_t k = 1; k < n; k++) { /* nodes[0] is i */
        if (N(c, nodes[k])->cpu >= 0) nodes[m++] = nodes[k];
    }
    sort_deepest_first(c, nodes, m);
    for (int32_t k = 0; k < m; k++) {
        if (N(c, nodes[k])->live && N(c, nodes[k])->cpu >= 0) drop_cpu(c, nodes[k]);
    }
    free(nodes);
}

/* ------------------------------------------------------------ dropping */

static void release_gpu(core_t *c, int32_t i, int state) {
    int32_t gpu = N(c, i)->gpu;
    set_state(c, i, state, NIL, KEEP);
    pool_put(&c->pools[T_GPU], gpu);
}

/* Forget the GPU copy; the node survives only if storage still has it. */
static void drop_gpu(core_t *c, int32_t i) {
    release_gpu(c, i, S_STORAGE);
    c->evictions[EV_GPU_DROPPED]++;
    if (!N(c, i)->in_storage) {
        remove_node(c, i);
    } else if (N(c, i)->n_cpu_children) {
        drop_cpu_below(c, i);
    }
}

/* drop_gpu for a leaf just popped off the GPU heap, with no CPU copy (the
 * eviction hot path without a CPU tier). Returns the parent when it just
 * became a GPU leaf, else NIL. */
static int32_t drop_gpu_leaf(core_t *c, int32_t i) {
    leaves_remove(c, T_GPU, i); /* re-listed when taking a host block dropped a CPU child */
    node_t *n = N(c, i);
    pool_put(&c->pools[T_GPU], n->gpu);
    n->gpu = NIL;
    n->state = S_STORAGE;
    pol_sync(c, i);
    c->n_gpu_idle--;
    PUBLISH(c, i, S_GPU, 0);
    c->evictions[EV_GPU_DROPPED]++;
    int32_t p = n->parent;
    __builtin_prefetch((const char *)N(c, p) + 64, 1); /* releasing i unlinks it there */
    N(c, p)->n_gpu_children--;
    if (!n->in_storage) {
        if (n->n_children) {
            remove_node(c, i);
        } else { /* a leaf in no heap (no CPU copy: never in the CPU one) */
            node_release(c, i);
        }
    } else if (n->n_cpu_children) {
        drop_cpu_below(c, i);
    }
    return new_gpu_leaf(c, p) ? p : NIL;
}

static void drop_cpu(core_t *c, int32_t i) {
    int32_t cpu = N(c, i)->cpu;
    if (N(c, i)->state == S_GPU) {
        set_state(c, i, S_GPU, KEEP, NIL); /* only a backup goes */
    } else {
        set_state(c, i, S_STORAGE, KEEP, NIL);
        if (!N(c, i)->in_storage) remove_node(c, i);
    }
    pool_put(&c->pools[T_CPU], cpu);
    c->evictions[EV_CPU_DROPPED]++;
}

/* drop_cpu for a CPU-only leaf just popped off the CPU heap: only the
 * parent's CPU-leaf status can change (it lost a CPU child, not a GPU one). */
static void drop_cpu_leaf(core_t *c, int32_t i) {
    node_t *n = N(c, i);
    int32_t cpu = n->cpu;
    n->cpu = NIL;
    n->state = S_STORAGE;
    pol_sync(c, i);
    PUBLISH(c, i, S_CPU, 1);
    node_t *p = N(c, n->parent);
    p->n_cpu_children--;
    if (!p->n_cpu_children && p->cpu >= 0) refresh(c, n->parent); /* a CPU leaf now, unless held */
    if (!N(c, i)->in_storage) remove_node(c, i);
    pool_put(&c->pools[T_CPU], cpu);
    c->evictions[EV_CPU_DROPPED]++;
}

/* Whether a CPU-tier victim must reach storage before it leaves: its only
 * copy (a GPU node's backup is not), not in storage, and wanted by the write
 * policy. Under write_through_selective: a block the eviction policy rates
 * worth keeping, i.e. one that was used again (any tier), or whose class in
 * the adaptive CPU policy is above the lowest (it was hit there, or the
 * ghost saw it come back after an eviction). A failed write-back is not
 * retried (a broken store must not pin the tier). */
static inline int wants_write_back(const core_t *c, int32_t i) {
    const node_t *n = N(c, i);
    if (c->wb_mode == WB_NONE || n->state != S_CPU || n->in_storage || n->wb_failed) return 0;
    if (c->wb_mode == WB_ALL || n->uses > 0) return 1;
    const policy_t *p = c->pol[T_CPU];
    return p != NULL && ((p->pnode[i].meta >> 56) & 0xF) > 0;
}

static void hold_for_write_back(core_t *c, int32_t i) {
    N(c, i)->busy++;
    c->n_busy++;
    c->wb[c->n_wb++] = i;
}

/* Hold victim i for write-back, and the parents that become the next
 * victims once it is gone (CPU copies with no other CPU child, unused): a
 * chain is written in one store, not one block per eviction, and storage
 * gets the prefix its lookups need. */
static void hold_chain(core_t *c, int32_t i) {
    hold_for_write_back(c, i);
    for (int32_t p = N(c, i)->parent; p != ROOT && c->n_wb < WB_HOLD_MAX; p = N(c, p)->parent) {
        const node_t *n = N(c, p);
        if (n->n_cpu_children != 1 || n->n_gpu_children || n->ref || n->busy ||
            !wants_write_back(c, p))
            break;
        hold_for_write_back(c, p);
    }
}

/* A free host block, dropping the least recently used CPU leaf when none is
 * free; NIL when no CPU leaf is evictable either, or when WB_HOLD_MAX victims
 * are held for write-back. A victim to write back is held (busy: no tier
 * evicts it) and listed in core.wb instead of dropped: the caller stores it
 * from its host block (core_take_writebacks), and the next eviction after
 * that store landed drops it as a clean copy. */
static int32_t take_cpu_block(core_t *c) {
    while (c->pools[T_CPU].count == 0) {
        if (c->n_wb == WB_HOLD_MAX) return NIL;
        int32_t i = leaves_pop(c, T_CPU);
        if (i == NIL) return NIL;
        if (wants_write_back(c, i)) {
            hold_chain(c, i);
        } else if (N(c, i)->state == S_CPU) {
            drop_cpu_leaf(c, i);
        } else {
            drop_cpu(c, i); /* a GPU node's backup */
        }
    }
    return pool_take(&c->pools[T_CPU]);
}

/* Hand the victims held for write-back to the caller (who must store them and
 * call core_finish_store with staged = 0). Returns how many. */
int32_t core_take_writebacks(core_t *c, int32_t *nodes, int32_t *cpus) {
    int32_t n = c->n_wb;
    for (int32_t k = 0; k < n; k++) {
        nodes[k] = c->wb[k];
        cpus[k] = N(c, c->wb[k])->cpu;
    }
    c->n_wb = 0;
    return n;
}

int32_t core_take_cpu_blocks(core_t *c, int32_t n, int32_t *out) {
    int32_t k = 0;
    for (; k < n; k++) {
        int32_t b = take_cpu_block(c);
        if (b == NIL) break;
        out[k] = b;
    }
    return k;
}

/* ------------------------------------------------------------- matching */

/* Block k's node under `node`: the one the hash walk found, when it is still
 * that node (a slot can be reused after a removal), else looked up. */
static inline int32_t walked_child(const core_t *c, const request_t *r, int32_t node, int32_t k) {
    const uint8_t *h = r->hashes + (size_t)k * HASH_LEN;
    int32_t ch = r->walk[k];
    if (ch != NIL && ch < c->n_slots) {
        const node_t *n = N(c, ch);
        if (n->live && n->parent == node && memcmp(n->hash, h, HASH_LEN) == 0) return ch;
    }
    return child_by_hash(c, node, h);
}

/* Reference the longest prefix of ready nodes, GPU nodes then CPU nodes (GPU
 * is prefix-closed), at most `limit` blocks; stops at in-flight nodes (a
 * second request recomputes rather than sharing an unfinished copy). The
 * nodes the hash walk found are checked, not looked up again. Fills
 * gpu_ids with the GPU hits' block ids. At most the deepest GPU and the
 * deepest CPU node can be leaves (every other one has a child on the
 * path): their heap keys are kept for core_undo_match. Without with_cpu
 * (paused: a swap-in would wait for resume) only GPU hits are taken. */
int core_match(core_t *c, request_t *r, int32_t limit, int with_cpu, int32_t *n_gpu,
               int32_t *gpu_ids) {
    if (limit > r->n_hashes) limit = r->n_hashes;
    if (r->path_cap < limit) {
        int32_t *grown = realloc(r->path, sizeof(int32_t) * (size_t)(limit > 0 ? limit : 1));
        if (grown == NULL) return -1;
        r->path = grown;
        r->path_cap = limit;
    }
    r->n_path = 0;
    r->unlisted[0].node = r->unlisted[1].node = NIL;
    int32_t node = ROOT, k = 0, idle = 0;
    for (; k < limit; k++) {
        int32_t ch = walked_child(c, r, node, k);
        if (ch == NIL || N(c, ch)->state != S_GPU) break;
        node_t *n = N(c, ch);
        if (n->ref == 0) {
            idle++;
            int32_t pos = heap_pos(&c->lru[T_GPU], ch); /* LRU only: NIL under another policy */
            if (pos != NIL) {
                r->unlisted[0] = c->lru[T_GPU].a[pos];
                heap_remove(c, &c->lru[T_GPU], ch);
            }
        }
        n->ref++;
        r->path[r->n_path++] = ch;
        gpu_ids[k] = n->gpu;
        node = ch;
    }
    *n_gpu = k;
    for (; with_cpu && k < limit; k++) {
        int32_t ch = walked_child(c, r, node, k);
        if (ch == NIL || N(c, ch)->state != S_CPU) break;
        node_t *n = N(c, ch);
        int32_t pos = heap_pos(&c->lru[T_CPU], ch);
        if (pos != NIL) {
            r->unlisted[1] = c->lru[T_CPU].a[pos];
            heap_remove(c, &c->lru[T_CPU], ch);
        }
        n->ref++;
        r->path[r->n_path++] = ch;
        node = ch;
    }
    c->n_gpu_idle -= idle;
    return 0;
}

/* A request used the node's cached copy (a hit, or a commit or save that
 * found it cached): what write_through_selective counts. */
static inline void count_use(node_t *n) {
    if (n->uses < UINT8_MAX) n->uses++;
}

/* The request's matched path is taken (allocate went ahead): each node
 * counts a use and its tier a hit, in path order. Under LRU, no hit:
 * core_match unlisted the leaves already, and the keys move at unref. Under
 * the adaptive policy core_match leaves the leaves listed (so a refused
 * allocate changes nothing and undoes nothing) and they are unlisted here. */
void core_hit(core_t *c, request_t *r) {
    for (int32_t k = 0; k < r->n_path; k++) count_use(N(c, r->path[k]));
    if (c->policy == POLICY_LRU) return;
    for (int32_t k = 0; k < r->n_path; k++) {
        int32_t i = r->path[k];
        int st = N(c, i)->state;
        if (st == S_GPU) {
            pol_hit(c, T_GPU, i);
        } else if (st == S_CPU) {
            pol_hit(c, T_CPU, i);
        }
    }
}

/* Exactly undo core_match (allocate refused): the unlisted leaves go back
 * with their old keys, so every heap order is as before. */
int core_undo_match(core_t *c, request_t *r) {
    for (int32_t k = 0; k < r->n_path; k++) {
        node_t *n = N(c, r->path[k]);
        n->ref--;
        if (n->ref == 0 && n->state == S_GPU) c->n_gpu_idle++;
    }
    for (int t = 0; t < 2; t++) {
        heap_entry e = r->unlisted[t];
        if (e.node != NIL) heap_insert_key(c, &c->lru[t], e.node, e.hi, e.lo);
        r->unlisted[t].node = NIL;
    }
    r->n_path = 0;
    return 0;
}

/* Unreference a request's path, deepest first, stamping the clock (free's
 * per-block loop). Only nodes whose heap membership can change are
 * refreshed: an inner node stays in no heap, a held node without a backup
 * in the CPU heap has nothing to re-key. */
void core_unref_path(core_t *c, request_t *r) {
    int32_t idle = 0;
    for (int32_t k = r->n_path - 1; k >= 0; k--) {
        int32_t i = r->path[k];
        node_t *n = N(c, i);
        n->ref--;
        n->last_access = c->clock;
        if (n->ref) {
            if (n->cpu < 0 || n->n_cpu_children || n->busy) continue;
        } else {
            if (n->state == S_GPU) idle++;
            if (n->n_gpu_children && (n->cpu < 0 || n->n_cpu_children)) continue;
        }
        refresh(c, i);
    }
    c->n_gpu_idle += idle;
    r->n_path = 0;
}

/* ------------------------------------------------------------- eviction */

/* Whether a node below i is being stored from its host block (a write-back
 * or a selective store held across calls): then i must not be dropped, since
 * dropping it drops the host copies below it. O(subtree); the caller checks
 * the cheap conditions first. */
static int subtree_busy(core_t *c, int32_t i) {
    int32_t *nodes;
    int32_t n = subtree(c, i, &nodes), busy = nodes == NULL; /* no memory: assume so */
    for (int32_t k = 1; k < n && !busy; k++) busy = N(c, nodes[k])->busy != 0;
    free(nodes);
    return busy;
}

/* set_state(i, SWAP_OUT, cpu) for a leaf just popped off the GPU heap (state
 * GPU, unreferenced, no GPU child): the eviction hot path. cpu is the new
 * host block, or NIL when a backup already holds the bytes. Returns the
 * parent when it just became a GPU leaf, else NIL. */
static int32_t begin_swap_out(core_t *c, int32_t i, int32_t cpu) {
    leaves_remove(c, T_GPU, i); /* re-listed when taking its host block dropped a CPU child */
    node_t *n = N(c, i);
    if (cpu == NIL) {
        leaves_remove(c, T_CPU, i); /* a backup in flight is not evictable */
    } else {
        n->cpu = cpu;
        pol_sync(c, i); /* the CPU tier gains a copy */
    }
    n->state = S_SWAP_OUT;
    c->n_gpu_idle--;
    PUBLISH(c, i, S_GPU, cpu == NIL);
    int32_t p = n->parent; /* holds a GPU block: GPU is prefix-closed */
    N(c, p)->n_gpu_children--; /* a SWAP_OUT child no longer keeps it on GPU */
    if (cpu != NIL) {
        N(c, p)->n_cpu_children++;
        leaves_remove(c, T_CPU, p); /* no longer a CPU leaf */
    }
    return new_gpu_leaf(c, p) ? p : NIL;
}

/* Free GPU blocks from least recently used leaves until `*freed` reaches
 * `count`. With `swap`, a victim moves to the CPU tier: it joins the batch
 * (core.batch), which the caller copies and lands with core_land_swap_out
 * (or rolls back); a victim that already has a CPU backup joins without a
 * copy, so a failed batch rolls every victim back together. Returns
 * EVICT_DONE, EVICT_FLUSH (no host block is free and the CPU leaves may be
 * this batch's own victims: land the batch, then call again) or EVICT_EMPTY
 * (no GPU leaf: idle blocks are still being written through). */
int core_evict(core_t *c, int32_t count, int swap, int32_t *freed_io) {
    int32_t freed = *freed_io, leaf = c->carry_leaf;
    c->carry_leaf = NIL;
    while (freed < count) {
        int32_t i = leaves_push_pop(c, T_GPU, leaf);
        leaf = NIL;
        if (i == NIL) {
            *freed_io = freed;
            return EVICT_EMPTY;
        }
        int32_t cpu = NIL, copy = 0;
        if (N(c, i)->cpu < 0) {
            cpu = swap ? take_cpu_block(c) : NIL;
            if (cpu == NIL && (c->n_batch || c->n_wb)) { /* land, or write back, first */
                refresh(c, i);
                *freed_io = freed;
                return EVICT_FLUSH;
            }
            if (cpu == NIL && N(c, i)->n_cpu_children && c->n_busy && subtree_busy(c, i)) {
                refresh(c, i); /* dropping it would drop host copies a store is reading */
                *freed_io = freed;
                return EVICT_EMPTY;
            }
            if (cpu == NIL) {
                leaf = drop_gpu_leaf(c, i);
                freed++;
                continue;
            }
            copy = 1;
        }
        leaf = begin_swap_out(c, i, cpu);
        c->batch[c->n_batch] = i;
        c->batch_copy[c->n_batch++] = copy;
        freed++;
    }
    if (leaf != NIL) leaves_add(c, T_GPU, leaf);
    *freed_io = freed;
    return EVICT_DONE;
}

/* Every rank holds the batch in host blocks: SWAP_OUT -> CPU, GPU blocks freed. */
void core_land_swap_out(core_t *c) {
    for (int32_t k = 0; k < c->n_batch; k++) {
        int32_t i = c->batch[k];
        node_t *n = N(c, i);
        pool_put(&c->pools[T_GPU], n->gpu);
        n->gpu = NIL;
        n->state = S_CPU;
        pol_sync(c, i); /* the GPU copy is gone */
        if (!(n->n_cpu_children || n->busy || n->ref || n->n_gpu_children))
            leaves_add(c, T_CPU, i); /* a CPU leaf now */
        PUBLISH(c, i, S_SWAP_OUT, 1);
        if (c->batch_copy[k]) {
            c->evictions[EV_GPU_TO_CPU]++;
        } else {
            c->evictions[EV_GPU_TO_CPU_BACKUP]++;
        }
    }
    c->n_batch = 0;
}

/* The copy failed: the victims stay on GPU, their new host blocks go back. */
void core_rollback_swap_out(core_t *c) {
    int32_t m = 0;
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)(c->n_batch ? c->n_batch : 1));
    for (int32_t k = 0; k < c->n_batch; k++) {
        if (c->batch_copy[k] && cpus != NULL) cpus[m++] = N(c, c->batch[k])->cpu;
    }
    for (int32_t k = c->n_batch - 1; k >= 0; k--)
        set_state(c, c->batch[k], S_GPU, KEEP, c->batch_copy[k] ? NIL : KEEP);
    if (cpus != NULL) pool_put_front(&c->pools[T_CPU], cpus, m);
    free(cpus);
    c->n_batch = 0;
}

/* --------------------------------------------------------------- fetches */

/* set_state(SWAP_IN, gpu) for path[start .. start+count): a chain of CPU
 * nodes this request references, so none is in a heap before or after, and
 * only the first one's parent sees a new GPU child from outside. */
void core_plan_swap_in(core_t *c, request_t *r, int32_t start, int32_t count,
                       const int32_t *gpu_ids, int32_t *cpu_ids) {
    for (int32_t k = 0; k < count; k++) {
        int32_t i = r->path[start + k];
        node_t *n = N(c, i);
        n->state = S_SWAP_IN;
        n->gpu = gpu_ids[k];
        pol_sync(c, i);
        N(c, n->parent)->n_gpu_children++;
        PUBLISH(c, i, S_CPU, 1);
        cpu_ids[k] = n->cpu;
    }
    if (count) refresh(c, N(c, r->path[start])->parent);
}

static int ensure_path(request_t *r, int32_t n) {
    if (r->path_cap >= n) return 0;
    int32_t cap = r->path_cap ? r->path_cap : 8;
    while (cap < n) cap *= 2;
    int32_t *grown = realloc(r->path, sizeof(int32_t) * (size_t)cap);
    if (grown == NULL) return -1;
    r->path = grown;
    r->path_cap = cap;
    return 0;
}

/* Give a new node the memo record the request's hash walk made for block k
 * (it moves: the request no longer needs it once the node exists). */
static void take_record(core_t *c, request_t *r, int32_t i, int32_t k) {
    if (r->records == NULL || r->records[k] == NULL) return;
    N(c, i)->record = r->records[k];
    N(c, i)->record_len = r->record_lens[k];
    r->records[k] = NULL;
}

/* Start loading request blocks start .. start+n-1 from storage (the caller
 * looked them up): take host blocks (evicting CPU leaves as needed), then
 * STORAGE nodes (existing, or new ones) under path[start-1], stopping at
 * one another request is fetching. The nodes go SWAP_IN with gpu_ids and
 * join the path. Returns how many; nodes and cpus hold them, *got_out how
 * many host blocks there were. */
int32_t core_plan_load(core_t *c, request_t *r, int32_t start, int32_t n, const int32_t *gpu_ids,
                       int32_t *nodes, int32_t *cpus, int32_t *got_out) {
    int32_t got = core_take_cpu_blocks(c, n, cpus);
    *got_out = got;
    if (ensure_path(r, start + got) < 0) got = 0;
    int32_t m = 0, parent = start ? r->path[start - 1] : ROOT;
    for (int32_t k = start; k < start + got; k++) {
        const uint8_t *h = r->hashes + (size_t)k * HASH_LEN;
        int32_t ch = child_by_hash(c, parent, h);
        if (ch == NIL) {
            ch = node_new(c, parent, h);
            if (ch == NIL) break;
            take_record(c, r, ch, k);
        } else if (N(c, ch)->state != S_STORAGE) {
            break; /* another request is fetching it: stop here */
        }
        nodes[m++] = ch;
        parent = ch;
    }
    if (got > m) pool_put_front(&c->pools[T_CPU], cpus + m, got - m);
    for (int32_t k = 0; k < m; k++) {
        N(c, nodes[k])->in_storage = 1;
        N(c, nodes[k])->ref++;
        set_state(c, nodes[k], S_SWAP_IN, c->external ? NIL : gpu_ids[k], cpus[k]);
        r->path[r->n_path++] = nodes[k];
    }
    return m;
}

/* SWAP_IN -> GPU for nodes the request still references (no parent counter
 * changes, no GPU heap); the host copy stays as a backup. With an external
 * GPU tier the host copy is what the node holds: SWAP_IN -> CPU. */
static void land_fetch(core_t *c, const int32_t *nodes, int32_t n) {
    if (c->external) {
        for (int32_t k = 0; k < n; k++) set_state(c, nodes[k], S_CPU, KEEP, KEEP);
        return;
    }
    for (int32_t k = 0; k < n; k++) {
        node_t *x = N(c, nodes[k]);
        x->state = S_GPU;
        PUBLISH(c, nodes[k], S_SWAP_IN, 1);
        if (!(x->n_cpu_children || x->busy)) refresh(c, nodes[k]); /* the backup may be a CPU leaf now */
    }
}

/* Cut the request's path at `first`: from there on it recomputes. A node
 * fetched fine after the gap gives its GPU block to the request. */
static void truncate_path(core_t *c, request_t *r, int32_t first) {
    for (int32_t k = r->n_path - 1; k >= first; k--) {
        int32_t i = r->path[k];
        if (N(c, i)->state == S_GPU) set_state(c, i, N(c, i)->cpu >= 0 ? S_CPU : S_STORAGE, NIL, KEEP);
        unref_node(c, i);
    }
    r->n_path = first;
}

/* Undo unfinished fetches; their GPU blocks already belong to the request. */
static void roll_back(core_t *c, const int32_t *nodes, int32_t n, int is_load, int32_t gone) {
    if (!is_load) {
        for (int32_t k = n - 1; k >= 0; k--) set_state(c, nodes[k], S_CPU, NIL, KEEP);
        return;
    }
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    for (int32_t k = 0; k < n; k++) {
        if (cpus != NULL) cpus[k] = N(c, nodes[k])->cpu;
    }
    for (int32_t k = n - 1; k >= 0; k--) set_state(c, nodes[k], S_STORAGE, NIL, NIL);
    for (int32_t k = 0; k < n && cpus != NULL; k++) pool_put(&c->pools[T_CPU], cpus[k]);
    free(cpus);
    if (gone < n) { /* the objects are gone or bad: storage no longer has them */
        for (int32_t k = gone; k < n; k++) N(c, nodes[k])->in_storage = 0;
        if (N(c, nodes[gone])->ref == 0) remove_node(c, nodes[gone]);
    }
}

/* A fetch of nodes (placed at path[start ..] when planned) finished with its
 * first `ok` blocks arrived: land those the request still holds, cut the
 * request where the first unusable one still sits in its path, roll back the
 * rest. `missing`: the task ran but storage lacked the blocks past `ok` (those
 * objects go from the tree; a block that arrived after the request was cut
 * stays in storage). Returns where the path was cut, or -1. */
int32_t core_finish_fetch(core_t *c, request_t *r, int32_t start, const int32_t *nodes,
                          int32_t count, int32_t ok, int is_load, int missing) {
    int32_t arrived = ok, k = 0;
    while (k < ok && start + k < r->n_path && r->path[start + k] == nodes[k]) k++;
    ok = k; /* a node cut from the path meanwhile is not landed */
    land_fetch(c, nodes, ok);
    if (ok == count) return -1;
    int32_t cut = -1;
    if (start + ok < r->n_path && r->path[start + ok] == nodes[ok]) {
        cut = start + ok;
        truncate_path(c, r, cut);
    }
    roll_back(c, nodes + ok, count - ok, is_load, missing ? arrived - ok : count - ok);
    return cut;
}

/* ---------------------------------------------------------------- insert */

/* A node for block k that the request just computed into `gpu`: referenced,
 * so in no heap, and so is its parent (the request's previous node or the
 * root), so the parent's heap membership does not change. */
static int32_t new_gpu_node(core_t *c, request_t *r, int32_t parent, int32_t k, int32_t gpu) {
    int32_t i = node_new(c, parent, r->hashes + (size_t)k * HASH_LEN);
    if (i == NIL) return NIL;
    take_record(c, r, i, k);
    node_t *n = N(c, i);
    n->ref = 1;
    n->state = S_GPU;
    n->gpu = gpu;
    pol_sync(c, i);
    N(c, parent)->n_gpu_children++;
    PUBLISH(c, i, S_STORAGE, 0);
    return i;
}

/* Put the request's blocks n_path .. full-1 in the tree: a new node for a new
 * block; for a block already cached, dedup onto it (our copy goes back to
 * the pool and blocks[k] names the cached one), adopt our copy (a CPU or
 * STORAGE node), or stop when it is in flight (its copy might roll back, so
 * nothing may hang under it: later blocks stay private). Running out of
 * memory for a node stops the same way. -2 with *err: a block id that
 * cannot be freed (the engine's block table is corrupt). */
int core_insert(core_t *c, request_t *r, int32_t *blocks, int32_t full, const char **err) {
    if (full > r->n_hashes) full = r->n_hashes;
    if (ensure_path(r, full) < 0) return -1;
    int32_t parent = r->n_path ? r->path[r->n_path - 1] : ROOT;
    policy_t *pol = c->pol[T_GPU];
    for (int32_t k = r->n_path; k < full; k++) {
        if (pol != NULL && k + GHOST_AHEAD < full) /* a new block's insert reads its ghost set */
            pol_prefetch(pol, policy_key(r->hashes + (size_t)(k + GHOST_AHEAD) * HASH_LEN));
        int32_t i = child_by_hash(c, parent, r->hashes + (size_t)k * HASH_LEN);
        if (i == NIL) {
            i = new_gpu_node(c, r, parent, k, blocks[k]);
            if (i == NIL) {
                r->chain_open = 0;
                return 0;
            }
        } else if (N(c, i)->state == S_GPU) {
            if (N(c, i)->gpu != blocks[k]) {
                if (pool_check_free(&c->pools[T_GPU], &blocks[k], 1) >= 0) {
                    *err = "a block of the request is free already or out of range";
                    return -2;
                }
                pool_put(&c->pools[T_GPU], blocks[k]);
                blocks[k] = N(c, i)->gpu;
                c->dedup_blocks++;
            }
            ref_node(c, i);
            pol_hit(c, T_GPU, i); /* a commit that found it cached used it */
            count_use(N(c, i));
        } else if (N(c, i)->state == S_CPU || N(c, i)->state == S_STORAGE) {
            count_use(N(c, i)); /* computed again: the block was wanted again */
            N(c, i)->ref++; /* adopt our copy: no swap-in needed for it any more */
            set_state(c, i, S_GPU, blocks[k], KEEP);
        } else {
            r->chain_open = 0;
            return 0;
        }
        r->path[r->n_path++] = i;
        parent = i;
    }
    return 0;
}

/* ---------------------------------------------------------- write-through */

/* Stage the request's GPU blocks (path[start ..]) used at least min_uses
 * times into host blocks for a store task; a staged node is busy (neither
 * tier evicts it) until core_finish_store. Returns how many; nodes and cpus
 * hold them. */
int32_t core_plan_store(core_t *c, request_t *r, int32_t start, int32_t min_uses,
                        int32_t *nodes, int32_t *cpus) {
    int32_t m = 0;
    for (int32_t k = start; k < r->n_path; k++) {
        const node_t *n = N(c, r->path[k]);
        if (n->state == S_GPU && n->cpu < 0 && n->busy == 0 && !n->in_storage &&
            n->uses >= min_uses)
            nodes[m++] = r->path[k];
    }
    m = core_take_cpu_blocks(c, m, cpus);
    for (int32_t k = 0; k < m; k++) {
        N(c, nodes[k])->busy++;
        c->n_busy++;
        set_state(c, nodes[k], S_GPU, KEEP, cpus[k]);
    }
    return m;
}

/* A store task finished: stored[k] says whether every rank stored node k.
 * A failed task may have left a staging copy torn: it is not kept (a store
 * that was not staged only read the host copy, which stays). */
void core_finish_store(core_t *c, const int32_t *nodes, int32_t n, const uint8_t *stored,
                       int ok, int staged) {
    for (int32_t k = 0; k < n; k++) {
        int32_t i = nodes[k];
        N(c, i)->busy--;
        c->n_busy--;
        if (!ok || !stored[k]) N(c, i)->wb_failed = 1;
        if (ok) {
            N(c, i)->in_storage = stored[k] != 0;
            if (stored[k] && c->events_on) emit(c, 1, 2, N(c, i)->hash);
        } else if (staged) {
            int32_t cpu = N(c, i)->cpu;
            set_state(c, i, N(c, i)->state, KEEP, NIL);
            pool_put(&c->pools[T_CPU], cpu);
        }
        refresh(c, i);
    }
}

/* ------------------------------------------------------------ whole tiers */

/* Forget every GPU copy (sleep: the planes may be freed): a node with a
 * backup stays in the CPU tier. Deepest first. */
void core_drop_gpu_tier(core_t *c) {
    int32_t *nodes;
    int32_t n = walk_all(c, &nodes), m = 0;
    for (int32_t k = 0; k < n; k++) {
        if (N(c, nodes[k])->state == S_GPU) nodes[m++] = nodes[k];
    }
    sort_deepest_first(c, nodes, m);
    for (int32_t k = 0; k < m; k++) {
        int32_t i = nodes[k];
        if (!N(c, i)->live || N(c, i)->state != S_GPU) continue;
        if (N(c, i)->cpu >= 0) {
            release_gpu(c, i, S_CPU);
        } else {
            drop_gpu(c, i);
        }
    }
    free(nodes);
}

/* Forget every CPU copy (the host pool is released, or the workers are gone). */
void core_drop_cpu_tier(core_t *c) {
    for (int32_t k = 0; k < c->n_wb; k++) N(c, c->wb[k])->busy--; /* never handed out */
    c->n_busy -= c->n_wb;
    c->n_wb = 0;
    int32_t *nodes;
    int32_t n = walk_all(c, &nodes), m = 0;
    for (int32_t k = 0; k < n; k++) {
        if (N(c, nodes[k])->cpu >= 0) nodes[m++] = nodes[k];
    }
    sort_deepest_first(c, nodes, m);
    for (int32_t k = 0; k < m; k++) {
        if (N(c, nodes[k])->live && N(c, nodes[k])->cpu >= 0) drop_cpu(c, nodes[k]);
    }
    free(nodes);
}

/* Storage was detached: nothing is known to be there any more. */
void core_forget_storage(core_t *c) {
    int32_t *nodes;
    int32_t n = walk_all(c, &nodes);
    sort_deepest_first(c, nodes, n);
    for (int32_t k = 0; k < n; k++) {
        int32_t i = nodes[k];
        if (!N(c, i)->live) continue;
        N(c, i)->in_storage = 0;
        if (N(c, i)->state == S_STORAGE && !N(c, i)->n_children) tree_remove(c, i);
    }
    free(nodes);
}

/* Return ids to a tier's pool (all checked first; front: undo an allocation). */
int core_free_blocks(core_t *c, int tier, const int32_t *ids, int32_t n, int front) {
    pool_t *p = &c->pools[tier];
    int bad = pool_check_free(p, ids, n);
    if (bad >= 0) return bad;
    if (front) {
        pool_put_front(p, ids, n);
    } else {
        for (int32_t k = 0; k < n; k++) pool_put(p, ids[k]);
    }
    return -1;
}

/* -------------------------------------------------- external GPU tier */

/* How many of the request's first blocks (at most limit) the CPU tier holds,
 * ready to copy: the lookup of a connector, which must change nothing.
 * *moving is set when the prefix stops at a block on its way into or out of
 * the CPU tier (a fetch or save of another request): it lands soon, and the
 * caller may ask again then rather than lose the rest of the hit. */
int32_t core_cpu_prefix(const core_t *c, const request_t *r, int32_t limit, int *moving) {
    int32_t node = ROOT, k = 0;
    *moving = 0;
    if (limit > r->n_hashes) limit = r->n_hashes;
    for (; k < limit; k++) {
        int32_t ch = child_by_hash(c, node, r->hashes + (size_t)k * HASH_LEN);
        if (ch == NIL) break;
        if (N(c, ch)->state != S_CPU) {
            *moving = N(c, ch)->state == S_SWAP_IN || N(c, ch)->state == S_SWAP_OUT;
            break;
        }
        node = ch;
    }
    return k;
}

/* Save the engine's computed blocks n_path .. upto-1 of the request into the
 * CPU tier, extending the path it holds: a block the CPU tier has is only
 * referenced; a new block (or one only storage holds) gets a host block and
 * goes SWAP_OUT, to be copied from the engine's block. Stops at a block
 * another request is moving (nothing hangs under an unfinished copy; a later
 * save retries) or when no host block can be had. Returns how many copies;
 * nodes/cpus name them and blocks their positions in the request. */
int32_t core_ext_save(core_t *c, request_t *r, int32_t upto, int32_t *nodes, int32_t *cpus,
                      int32_t *blocks) {
    if (upto > r->n_hashes) upto = r->n_hashes;
    if (ensure_path(r, upto) < 0) return 0;
    int32_t m = 0, parent = r->n_path ? r->path[r->n_path - 1] : ROOT;
    for (int32_t k = r->n_path; k < upto; k++) {
        const uint8_t *h = r->hashes + (size_t)k * HASH_LEN;
        int32_t i = child_by_hash(c, parent, h);
        if (i != NIL && N(c, i)->state == S_CPU) {
            ref_node(c, i);
            pol_hit(c, T_CPU, i); /* the engine used it again */
            count_use(N(c, i));
        } else if (i == NIL || N(c, i)->state == S_STORAGE) {
            if (i != NIL) count_use(N(c, i)); /* computed again: wanted again */
            int32_t cpu = take_cpu_block(c);
            if (cpu == NIL) break;
            if (i == NIL) {
                i = node_new(c, parent, h);
                if (i == NIL) {
                    pool_put_front(&c->pools[T_CPU], &cpu, 1);
                    break;
                }
                take_record(c, r, i, k);
            }
            N(c, i)->ref++;
            set_state(c, i, S_SWAP_OUT, KEEP, cpu);
            nodes[m] = i;
            cpus[m] = cpu;
            blocks[m++] = k;
        } else {
            break; /* in flight for another request */
        }
        r->path[r->n_path++] = i;
        parent = i;
    }
    return m;
}

/* A save's copy finished: its nodes go SWAP_OUT -> CPU. When it failed, the
 * request's path is cut at the first of them and they go back to what
 * storage holds (or leave the tree). */
void core_ext_finish_save(core_t *c, request_t *r, const int32_t *nodes, const int32_t *blocks,
                          int32_t n, int ok) {
    if (ok) {
        for (int32_t k = 0; k < n; k++) set_state(c, nodes[k], S_CPU, KEEP, KEEP);
        return;
    }
    if (n && blocks[0] < r->n_path && r->path[blocks[0]] == nodes[0]) truncate_path(c, r, blocks[0]);
    for (int32_t k = n - 1; k >= 0; k--) { /* deepest first: a parent after its children */
        int32_t i = nodes[k], cpu = N(c, i)->cpu;
        set_state(c, i, S_STORAGE, KEEP, NIL);
        pool_put(&c->pools[T_CPU], cpu);
        if (!N(c, i)->in_storage && N(c, i)->ref == 0) remove_node(c, i);
    }
}

/* The request's host copies (a CPU node's, or a GPU node's backup) used at
 * least min_uses times that storage lacks, to be stored straight from their
 * host blocks (busy until the store lands, so no tier evicts them): the
 * write-through of an external GPU tier, and write_through_selective.
 * Returns how many. */
int32_t core_plan_store_host(core_t *c, request_t *r, int32_t min_uses, int32_t *nodes,
                             int32_t *cpus) {
    int32_t m = 0;
    for (int32_t k = 0; k < r->n_path; k++) {
        int32_t i = r->path[k];
        node_t *n = N(c, i);
        if (n->cpu >= 0 && (n->state == S_CPU || n->state == S_GPU) && n->busy == 0 &&
            !n->in_storage && n->uses >= min_uses) {
            n->busy++;
            c->n_busy++;
            refresh(c, i);
            nodes[m] = i;
            cpus[m++] = n->cpu;
        }
    }
    return m;
}
