/* The cache core's data: nodes of the prefix tree, the two block pools and
 * the two tiers' evictable-leaf heaps. Plain C integers throughout; no
 * Python object per node, so the garbage collector never sees the tree.
 *
 * A node is an index into one growable array (`core.nodes`): never keep a
 * node_t pointer across a call that may add a node (node_new reallocates).
 * Index 0 is the root, a sentinel that "holds" every tier and is never
 * evicted.
 *
 * Files: table.c (nodes, children by hash, record memory), pool.c, lru.c (heaps, and
 * the leaf-set calls that pick the heap or the policy), policy.c (the adaptive
 * eviction policy), hashing.c (chained hashes and the memo), ops.c (every state
 * transition); module.h lists the files of the Python binding. The states and
 * transitions are modelled in tests/reference/model.py; the differential tests
 * hold the manager and the model to the same results. */
#ifndef KVC_CORE_H
#define KVC_CORE_H

#include <stddef.h>
#include <stdint.h>

#define HASH_LEN 16
#define NIL (-1)
#define ROOT 0

/* Tier states (kvcached.core.types.Tier has the same numbers). */
enum { S_GPU = 0, S_SWAP_OUT = 1, S_CPU = 2, S_SWAP_IN = 3, S_STORAGE = 4 };
/* The two local tiers, as indexes of core.pools / core.lru / core.pol. */
enum { T_GPU = 0, T_CPU = 1 };

/* A wide node's children by hash (table.c): 32 bits of the child's hash
 * beside the child, so probing reads a child only on a likely hit. */
typedef struct {
    uint32_t key;
    int32_t node; /* NIL: empty */
} slot_t;

typedef struct {
    slot_t *slots;
    uint32_t mask;
    uint32_t count;
} kids_t;

/* Two cache lines, aligned: the first holds what eviction, matching and
 * freeing read and write (an evicted node then costs one miss, not two or
 * three), the second what hashing and the tree's links by hash read. */
typedef struct __attribute__((aligned(64))) {
    int32_t parent;
    int32_t gpu, cpu;  /* block ids, NIL when the node holds no copy there */
    int32_t ref;       /* live requests whose path holds the node */
    int32_t depth;
    int32_t n_children;
    int32_t n_gpu_children; /* children in GPU or SWAP_IN */
    int32_t n_cpu_children; /* children holding a CPU block */
    uint8_t uses;      /* reuses seen, saturating: the write policy's evidence (see ops.c) */
    uint8_t wb_failed; /* a store from its host block failed: eviction drops it, no retry */
    uint8_t spare[6];
    /* children: a doubly linked sibling list, or (a wide node) kids */
    int32_t first_child, next_sib;
    uint64_t last_access;
    int32_t prev_sib;
    uint16_t busy;     /* write-through tasks reading its blocks */
    uint8_t state;
    uint8_t in_storage;
    /* --- second line */
    uint8_t hash[HASH_LEN];
    int32_t last_child;
    uint8_t live;      /* 0: on the free list of node slots */
    /* hash memo: the exact input this node's hash was computed from, less
     * the parent's hash (see hashing.h); NULL when it has none */
    uint32_t record_len;
    uint8_t *record;
    kids_t *kids;  /* its children by hash, once it has more than a few */
} node_t;

_Static_assert(sizeof(node_t) == 128, "node_t is two cache lines");

/* Memo records by size class (table.c): 64 KiB chunks carved into slots, the
 * free ones on a stack per class (an array: freeing a record never touches
 * its memory, a cache miss per evicted block when the free list ran through
 * the records). */
typedef struct {
    void **free[6];
    size_t n_free[6], cap_free[6];
    void **chunks;
    size_t n_chunks, cap_chunks;
} recpool_t;

/* Free block ids of one tier: a ring in FIFO order (allocation takes the
 * oldest freed id; a rollback puts ids back at the head) and a bitmap that
 * refuses double frees. */
typedef struct {
    int32_t num_blocks;
    int32_t *ring;
    int32_t head, count;
    uint64_t *free_bits; /* one bit per block: 1 = free */
} pool_t;

/* One heap entry: the key (last_access, then inverted depth and insertion
 * order packed in lo: deeper and older go first) and the node. */
typedef struct {
    uint64_t hi, lo;
    int32_t node;
} heap_entry;

/* The evictable leaves of one tier, a 4-ary min-heap that knows where each
 * node is (pos, by node slot: NIL when not listed): add, remove and pop are
 * O(log n) and the order is the key's. The positions are an array of their
 * own, not a node field: a pop moves ~log4(n) entries, and writing each one's
 * position into its node was a cache miss per level at a million blocks. */
typedef struct {
    heap_entry *a;
    int32_t size, cap;
    int32_t *pos;
    int32_t pos_cap;
    uint64_t seq;
    int tier;
} leafheap_t;

/* The adaptive eviction policy (policy.c; the algorithm is the docstring of
 * tests/reference/policy.py, which it follows step by step). One instance per
 * tier, over entries indexed like the nodes; the core passes node indexes
 * and, for the ghost, each node's key (the first 8 bytes of its hash,
 * little-endian). Its per-entry state lives in its own array (`pnode`, 16
 * bytes per node slot per tier), allocated only under this policy: node_t
 * stays two cache lines and LRU pays nothing for it. */
typedef struct {
    int32_t classes, bins, windows_per_capacity, ghost_factor, ways, decay_shift;
    int32_t ghost_bits, ghost_win_bits; /* a ghost entry's width, and its window's bits */
    int32_t min_window;                 /* the fewest clock ticks per window */
} pol_params_t;

typedef struct {
    int32_t prev, next; /* links in its leaf list (NIL at the ends) */
    uint64_t meta;      /* stamp (bits 0-55), class (56-59), listed (62), tracked (63) */
} pnode_t;

typedef struct {
    int32_t head, tail; /* oldest first */
} plist_t;

typedef struct {
    pol_params_t prm;
    uint64_t window;        /* ticks per age bin */
    uint64_t rebuild_every; /* windows between rebuilds of the densities */
    uint64_t tick, cur_win; /* the caller's clock (its latest now); tick / window */
    int64_t inserts;        /* on_insert calls */
    uint64_t *hits, *ends;  /* [classes][bins], fixed point (ONE = one event) */
    uint64_t *density;      /* [classes][bins]: expected hits per lifetime, << 32 */
    void *scratch;          /* a rebuild's sums and hull ([bins] u128 x 2, int32) */
    uint16_t *ranks;        /* rank -> c * bins + b, lowest density first */
    uint16_t *rank_of;      /* c * bins + b -> rank */
    uint64_t *keys;         /* the ranking as sort keys, kept for the next */
    int32_t n_ranks, cursor; /* every rank below cursor has an empty list */
    plist_t *lists;         /* [classes][bins]: a ring of bins - 1 windows, then old */
    void *ghost;            /* sets x ways entries of ghost_bits bits; 0 = empty */
    uint64_t sets;
    int32_t cls_bits, fp_bits;
    int64_t ghost_size;     /* entries held */
    int64_t ghost_hits;     /* inserts the ghost remembered */
    int64_t hits_seen;      /* on_hit calls */
    int64_t n_leaves;
    pnode_t *pnode;         /* per entry */
    int32_t cap;
} policy_t;

enum { POLICY_LRU = 0, POLICY_ADAPTIVE = 1 };

/* Which CPU-tier victims are written to storage before they leave it
 * (kvcached.config storage_write_policy): none (write_through wrote them at
 * commit), those reused at least once (write_through_selective), all that
 * storage lacks (write_back). */
enum { WB_NONE = 0, WB_REUSED = 1, WB_ALL = 2 };
#define WB_HOLD_MAX 64 /* victims held for write-back at once: a burst never pins the tier */

/* Eviction counters, in the order of EVICTION_NAMES (type_core.c). */
enum { EV_GPU_DROPPED, EV_CPU_DROPPED, EV_GPU_TO_CPU, EV_GPU_TO_CPU_BACKUP, EV_COUNT };

/* KV events: a block became usable in, or left, a tier. */
typedef struct {
    uint8_t stored; /* 1 stored, 0 removed */
    uint8_t tier;   /* 0 gpu, 1 cpu, 2 storage */
    uint8_t hash[HASH_LEN];
} event_t;

typedef struct {
    node_t *nodes;
    int32_t n_slots, cap;   /* slots in use (live or free) and allocated */
    int32_t *free_nodes;    /* a stack of free slots (room for cap) */
    int32_t n_free_nodes;
    int32_t num_nodes;      /* live nodes, the root excluded */
    recpool_t records;
    pool_t pools[2];
    leafheap_t lru[2];      /* LRU's leaves (empty under another policy) */
    int policy;             /* POLICY_LRU or POLICY_ADAPTIVE */
    policy_t *pol[2];       /* the adaptive policy of each tier (NULL: LRU, or no blocks) */
    pol_params_t pol_params;
    int pol_log_on;         /* tests: record every policy call (pol_log) */
    int64_t *pol_log;       /* (tier << 8 | op, key or result) pairs */
    int32_t n_pol_log, pol_log_cap;
    uint64_t clock;
    int32_t n_gpu_idle;     /* nodes in state GPU with ref 0 */
    int32_t block_size;
    int memo;               /* remember hash inputs (hash_memo) */
    /* The engine owns the GPU tier (the vLLM connector): no GPU pool; nodes
     * hold CPU copies and storage only. A save is SWAP_OUT (engine block ->
     * host block in flight), a storage load SWAP_IN (storage -> host, then
     * on to the engine's block), and neither holds a GPU block id. */
    int external;
    int64_t evictions[EV_COUNT];
    int64_t dedup_blocks;
    int64_t memo_hits;      /* blocks whose hash the memo supplied */
    int64_t blocks_hashed;  /* blocks hashed with BLAKE2b */
    /* the swap-out batch of the eviction in progress */
    int32_t *batch, *batch_copy; /* nodes, and whether each needs a copy */
    int32_t n_batch, batch_cap;
    int32_t carry_leaf;     /* a victim's parent that became a leaf, not yet listed */
    /* write-back: CPU victims held (busy) until a store saves them, not yet
     * handed to the caller (core_take_writebacks) */
    int wb_mode;
    int32_t *wb;            /* room for WB_HOLD_MAX */
    int32_t n_wb;
    int64_t n_busy;         /* the sum of every node's busy */
    /* events, when enabled */
    int events_on;
    event_t *events;
    int32_t n_events, events_cap;
} core_t;

#define N(c, i) (&(c)->nodes[(i)])

/* One request's view of the tree: its block hashes (and, for blocks the
 * memo did not know, their records, handed to the nodes commit creates),
 * the path of nodes it references, and what its last match took off the
 * leaf heaps (for an exact undo). Owned by a Python Request object. */
typedef struct {
    uint8_t ns[HASH_LEN];
    uint8_t *extra;
    size_t extra_len;
    uint8_t *hashes;          /* n_hashes x HASH_LEN */
    uint8_t **records;        /* NULL where the block's node existed when hashed */
    uint32_t *record_lens;
    int32_t n_hashes, hash_cap;
    int32_t *walk;            /* the node each block's hash led to when hashed, or NIL */
    int32_t *path;
    int32_t n_path, path_cap;
    int chain_open;           /* 0 once a computed block could not join the tree */
    heap_entry unlisted[2];   /* match's unlisted GPU and CPU leaf (node NIL: none) */
} request_t;

/* table.c */
int core_init(core_t *c, int32_t gpu_blocks, int32_t cpu_blocks, int32_t block_size, int memo,
              int external, int policy, const pol_params_t *params);
void core_free(core_t *c);
int32_t node_new(core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]); /* NIL: no memory */
void node_release(core_t *c, int32_t i);    /* unlink from parent and indexes, free the slot */
int32_t child_by_hash(const core_t *c, int32_t parent, const uint8_t hash[HASH_LEN]);
int32_t find_by_hash(const core_t *c, const uint8_t hash[HASH_LEN]); /* a scan: tests */
void *rec_alloc(core_t *c, uint32_t len);               /* NULL: no memory */
/* The children of a node (list or table): for (kid_first(c, p, &it);
 * it.node != NIL; kid_next(c, &it)). Nothing may be linked or unlinked
 * under p meanwhile. */
typedef struct {
    const kids_t *t;
    uint32_t slot;
    int32_t node;
} kid_iter;
void kid_first(const core_t *c, int32_t parent, kid_iter *it);
void kid_next(const core_t *c, kid_iter *it);
void rec_free(core_t *c, void *rec, uint32_t len);

/* pool.c */
int pool_init(pool_t *p, int32_t n);
void pool_free_all(pool_t *p);
int32_t pool_take(pool_t *p);                          /* NIL when empty */
void pool_put(pool_t *p, int32_t id);                  /* at the tail; the caller checked */
void pool_put_front(pool_t *p, const int32_t *ids, int32_t n);
int pool_check_free(pool_t *p, const int32_t *ids, int32_t n); /* index of a bad id, or -1 */

/* ops.c: the transitions; see ops.c for each. -1: out of memory (Python
 * raises MemoryError), -2: a bad argument described by *err. */
enum { EVICT_DONE = 0, EVICT_FLUSH = 1, EVICT_EMPTY = 2 };
int core_match(core_t *c, request_t *r, int32_t limit, int with_cpu, int32_t *n_gpu,
               int32_t *gpu_ids);
int core_undo_match(core_t *c, request_t *r);
void core_hit(core_t *c, request_t *r);
void core_unref_path(core_t *c, request_t *r);
int core_evict(core_t *c, int32_t count, int swap, int32_t *freed);
void core_land_swap_out(core_t *c);
void core_rollback_swap_out(core_t *c);
void core_plan_swap_in(core_t *c, request_t *r, int32_t start, int32_t count,
                       const int32_t *gpu_ids, int32_t *cpu_ids);
int32_t core_take_cpu_blocks(core_t *c, int32_t n, int32_t *out);
int32_t core_plan_load(core_t *c, request_t *r, int32_t start, int32_t n, const int32_t *gpu_ids,
                       int32_t *nodes, int32_t *cpus, int32_t *got);
int32_t core_finish_fetch(core_t *c, request_t *r, int32_t start, const int32_t *nodes,
                          int32_t count, int32_t ok, int is_load, int missing);
int core_insert(core_t *c, request_t *r, int32_t *blocks, int32_t full, const char **err);
int32_t core_plan_store(core_t *c, request_t *r, int32_t start, int32_t min_uses,
                        int32_t *nodes, int32_t *cpus);
int32_t core_plan_store_host(core_t *c, request_t *r, int32_t min_uses, int32_t *nodes,
                             int32_t *cpus);
void core_finish_store(core_t *c, const int32_t *nodes, int32_t n, const uint8_t *stored,
                       int ok, int staged);
int32_t core_take_writebacks(core_t *c, int32_t *nodes, int32_t *cpus);
void core_drop_gpu_tier(core_t *c);
void core_drop_cpu_tier(core_t *c);
void core_forget_storage(core_t *c);
int core_free_blocks(core_t *c, int tier, const int32_t *ids, int32_t n, int front);
int32_t core_ext_save(core_t *c, request_t *r, int32_t upto, int32_t *nodes, int32_t *cpus,
                      int32_t *blocks);
void core_ext_finish_save(core_t *c, request_t *r, const int32_t *nodes, const int32_t *blocks,
                          int32_t n, int ok);
int32_t core_cpu_prefix(const core_t *c, const request_t *r, int32_t limit, int *moving);

/* lru.c */
int heap_init(leafheap_t *h, int tier);
int heap_reserve(leafheap_t *h, int32_t n); /* positions for node slots 0 .. n-1 */
static inline int32_t heap_pos(const leafheap_t *h, int32_t node) { return h->pos[node]; }
void heap_free_all(leafheap_t *h);
int heap_add(core_t *c, leafheap_t *h, int32_t node);  /* insert or re-key; -1: no memory */
int heap_insert_key(core_t *c, leafheap_t *h, int32_t node, uint64_t hi, uint64_t lo);
void heap_remove(core_t *c, leafheap_t *h, int32_t node);
int32_t heap_pop(core_t *c, leafheap_t *h);            /* NIL when empty */
int heap_peek_key(const leafheap_t *h, uint64_t *hi, uint64_t *lo); /* 0 when empty */
void heap_key_of(core_t *c, leafheap_t *h, int32_t node, uint64_t *hi, uint64_t *lo);

/* policy.c */
void pol_default_params(pol_params_t *p);
const char *pol_check_params(const pol_params_t *p); /* NULL when valid, else what is wrong */
int pol_init(policy_t *p, int64_t capacity, const pol_params_t *params); /* -1: no memory */
void pol_free(policy_t *p);
int pol_reserve(policy_t *p, int32_t n); /* room for entries 0 .. n-1 (new ones zeroed) */
void pol_on_insert(policy_t *p, int32_t i, uint64_t key, uint64_t now);
void pol_prefetch(const policy_t *p, uint64_t key);
void pol_on_hit(policy_t *p, int32_t i, uint64_t now);
void pol_add_leaf(policy_t *p, int32_t i);
void pol_remove_leaf(policy_t *p, int32_t i);
int32_t pol_victim(policy_t *p); /* NIL when no leaf */
void pol_on_evict(policy_t *p, int32_t i, uint64_t key);
int64_t pol_order(const policy_t *p, int32_t *out); /* the leaves in eviction order */
int64_t pol_ghost_slots(const policy_t *p);
int64_t pol_ghost_bytes(const policy_t *p);
#define PN_LISTED (1ULL << 62)
#define PN_TRACKED (1ULL << 63)
static inline int pol_listed(const policy_t *p, int32_t i) {
    return (p->pnode[i].meta & PN_LISTED) != 0;
}
static inline int pol_tracked(const policy_t *p, int32_t i) {
    return (p->pnode[i].meta & PN_TRACKED) != 0;
}

/* The leaves of tier t, whichever policy keeps them (lru.c). */
int leaves_add(core_t *c, int t, int32_t node);    /* list it (LRU: or re-key); -1: no memory */
void leaves_remove(core_t *c, int t, int32_t node);
int32_t leaves_pop(core_t *c, int t);              /* the next victim, unlisted; NIL: none */
int32_t leaves_push_pop(core_t *c, int t, int32_t leaf); /* add(leaf) then pop() */
int32_t leaves_count(const core_t *c, int t);
int leaves_listed(const core_t *c, int t, int32_t node);
/* A node's copies changed: tell each tier's policy about one it gained
 * (on_insert) or lost (unlisted, then on_evict). No-op under LRU. */
void pol_sync_slow(core_t *c, int32_t node);
static inline void pol_sync(core_t *c, int32_t node) {
    if (c->policy != POLICY_LRU) pol_sync_slow(c, node);
}
/* The key a block is known by in the policy's ghost: its hash's first 8
 * bytes, little-endian. */
static inline uint64_t policy_key(const uint8_t *h) {
    uint64_t k = 0;
    for (int b = 7; b >= 0; b--) k = (k << 8) | h[b];
    return k;
}
static inline uint64_t node_key(const core_t *c, int32_t i) { return policy_key(c->nodes[i].hash); }
/* How many blocks ahead an insert loop prefetches the ghost set of. */
#define GHOST_AHEAD 4
/* The policy call log (tests): ops, as in tests/reference/policy.py Recorder. */
enum { PL_INSERT = 1, PL_HIT, PL_ADD, PL_REMOVE, PL_VICTIM, PL_EVICT };
void pol_log(core_t *c, int t, int op, uint64_t key);
void pol_log_at(core_t *c, int t, int op, uint64_t key, uint64_t now);

#endif /* KVC_CORE_H */
