/* The adaptive eviction policy: learned hit density with a ghost.
 *
 * A port of AdaptivePolicy in tests/reference/policy.py, whose docstring is
 * the specification; every step here has its counterpart there, and the
 * differential tests replay the reference's calls into this code (and the
 * core's calls into the reference), comparing every victim. In short:
 *
 * - Each leaf is ranked by the expected hits per unit of cache space-time
 *   of blocks of its class (how often it was used) at its age (windows since
 *   its last use, on the caller's clock: the manager's, two ticks per
 *   request), learned online (LHD) and maximised over the age at which it
 *   would be dropped; the lowest goes first.
 * - Leaves sit in lists per (class, window of last use): a ring of the bins-1
 *   youngest windows per class, then one "old" list per class. Within a list
 *   the order is LRU's, and a parent uncovered by evicting its child goes to
 *   the head (next), so a branch goes tail first.
 * - `ranks` orders the (class, age bin) cells by density; victim() walks it
 *   from a cursor below which every list is empty: O(1) amortised.
 * - The tables decay each window (capacity / 600 ticks, at least 4) and are
 *   rebuilt at least 16 ticks apart, O(classes x bins), in 128-bit
 *   arithmetic.
 * - Every eviction counts as an end ("not reused within the horizon") and
 *   the ghost remembers the key (set-associative, a fingerprint, the class
 *   and the window of last use per entry); a block that comes back within
 *   the horizon takes its end back, teaches the tables its reuse age and is
 *   promoted.
 *
 * Per entry: pnode_t (16 bytes): list links, and stamp, class, listed and
 * tracked packed in one word. Everything is integer arithmetic; every tie has
 * a rule, so the port is exact. */
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define ONE (1ULL << 16) /* one event in the tables' fixed point */
#define REBUILD_TICKS 16 /* the fewest clock ticks between two rebuilds of the densities */
#define STAMP_MASK ((1ULL << 56) - 1)
#define CLS_SHIFT 56

static inline uint64_t stamp_of(const pnode_t *n) { return n->meta & STAMP_MASK; }
static inline int cls_of(const pnode_t *n) { return (int)((n->meta >> CLS_SHIFT) & 0xF); }

void pol_default_params(pol_params_t *p) {
    p->classes = 4;
    p->bins = 256;
    p->windows_per_capacity = 600;
    p->min_window = 4;
    p->ghost_factor = 8;
    p->ways = 8;
    p->decay_shift = 7;
    p->ghost_bits = 32;
    p->ghost_win_bits = 12;
}

static int bits_for(int32_t n) { /* bits of n, as Python's int.bit_length() */
    int b = 0;
    while (n > 0) {
        b++;
        n >>= 1;
    }
    return b;
}

const char *pol_check_params(const pol_params_t *p) {
    if (p->classes < 1 || p->classes > 16) return "classes must be in 1..16";
    if (p->bins < 2 || p->bins > 2048) return "bins must be in 2..2048";
    if (p->windows_per_capacity < 1) return "windows_per_capacity must be >= 1";
    if (p->min_window < 1) return "min_window must be >= 1";
    if (p->ways < 1) return "ways must be >= 1";
    if (p->decay_shift < 1 || p->decay_shift > 63) return "decay_shift must be in 1..63";
    if (p->ghost_factor < 0) return "ghost_factor must be >= 0";
    if (p->ghost_bits != 8 && p->ghost_bits != 16 && p->ghost_bits != 32)
        return "ghost_bits must be 8, 16 or 32";
    if (p->ghost_win_bits < 1 || p->ghost_win_bits > 16) return "ghost_win_bits must be in 1..16";
    if (p->ghost_bits - bits_for(p->classes - 1) - p->ghost_win_bits < 1)
        return "ghost_bits leave no room for a fingerprint beside the class and window";
    return NULL;
}

/* ------------------------------------------------------------- ghost */

static inline uint64_t splitmix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static inline uint32_t g_get(const policy_t *p, uint64_t k) {
    switch (p->prm.ghost_bits) {
    case 8: return ((const uint8_t *)p->ghost)[k];
    case 16: return ((const uint16_t *)p->ghost)[k];
    default: return ((const uint32_t *)p->ghost)[k];
    }
}

static inline void g_set(policy_t *p, uint64_t k, uint32_t v) {
    switch (p->prm.ghost_bits) {
    case 8: ((uint8_t *)p->ghost)[k] = (uint8_t)v; break;
    case 16: ((uint16_t *)p->ghost)[k] = (uint16_t)v; break;
    default: ((uint32_t *)p->ghost)[k] = v; break;
    }
}

static inline void g_locate(const policy_t *p, uint64_t key, uint64_t *base, uint32_t *fp) {
    uint64_t h = splitmix64(key);
    *base = ((h >> 32) % p->sets) * (uint64_t)p->prm.ways;
    *fp = (uint32_t)(h & ((1ULL << p->fp_bits) - 1));
    if (*fp == 0) *fp = 1;
}

/* The key's entry: its class and window (mod 2^win_bits), cleared. */
static int ghost_take(policy_t *p, uint64_t key, int *cls, uint64_t *win) {
    if (p->sets == 0) return 0;
    uint64_t base;
    uint32_t fp;
    g_locate(p, key, &base, &fp);
    int shift = p->cls_bits + p->prm.ghost_win_bits;
    for (uint64_t k = base; k < base + (uint64_t)p->prm.ways; k++) {
        uint32_t e = g_get(p, k);
        if (e >> shift == fp) {
            g_set(p, k, 0);
            p->ghost_size--;
            *cls = (int)((e >> p->prm.ghost_win_bits) & ((1u << p->cls_bits) - 1));
            *win = e & ((1u << p->prm.ghost_win_bits) - 1);
            return 1;
        }
    }
    return 0;
}

/* Remember the key; returns 1 with the class and age of the entry it
 * overwrote (the first empty way, else the oldest, the first on ties). */
static int ghost_put(policy_t *p, uint64_t key, int cls, uint64_t win, int *end_cls,
                     uint64_t *end_age) {
    if (p->sets == 0) return 0;
    uint64_t base;
    uint32_t fp;
    g_locate(p, key, &base, &fp);
    uint32_t wmask = (1u << p->prm.ghost_win_bits) - 1;
    uint32_t entry = fp << (p->cls_bits + p->prm.ghost_win_bits) |
                     (uint32_t)cls << p->prm.ghost_win_bits | (uint32_t)(win & wmask);
    uint64_t oldest = base;
    int64_t oldest_age = -1;
    for (uint64_t k = base; k < base + (uint64_t)p->prm.ways; k++) {
        uint32_t e = g_get(p, k);
        if (e == 0) {
            g_set(p, k, entry);
            p->ghost_size++;
            return 0;
        }
        int64_t age = (int64_t)((p->cur_win - (e & wmask)) & wmask);
        if (age > oldest_age) {
            oldest = k;
            oldest_age = age;
        }
    }
    uint32_t e = g_get(p, oldest);
    g_set(p, oldest, entry);
    *end_cls = (int)((e >> p->prm.ghost_win_bits) & ((1u << p->cls_bits) - 1));
    *end_age = (uint64_t)oldest_age;
    return 1;
}

/* Start fetching the ghost set `key` maps to: an insert looks there, and in a
 * ghost larger than the CPU's caches that load is most of an insert's time. */
void pol_prefetch(const policy_t *p, uint64_t key) {
    if (p->sets == 0) return;
    uint64_t base;
    uint32_t fp;
    g_locate(p, key, &base, &fp);
    __builtin_prefetch((const char *)p->ghost + base * (uint64_t)(p->prm.ghost_bits / 8));
}

int64_t pol_ghost_slots(const policy_t *p) { return (int64_t)(p->sets * (uint64_t)p->prm.ways); }

int64_t pol_ghost_bytes(const policy_t *p) { return pol_ghost_slots(p) * (p->prm.ghost_bits / 8); }

/* ------------------------------------------------------------- lists */

static inline void count(policy_t *p, uint64_t *table, int c, uint64_t age) {
    uint64_t last = (uint64_t)(p->prm.bins - 1);
    table[(size_t)c * (size_t)p->prm.bins + (age < last ? age : last)] += ONE;
}

/* The list a leaf of class c last used at `stamp` belongs in, and its age bin. */
static inline int32_t list_of(const policy_t *p, int c, uint64_t stamp, int32_t *bin) {
    int32_t bins = p->prm.bins, last = bins - 1;
    uint64_t win = stamp / p->window, age = p->cur_win - win;
    if (age >= (uint64_t)last) {
        *bin = last;
        return c * bins + last;
    }
    *bin = (int32_t)age;
    return c * bins + (int32_t)(win % (uint64_t)last);
}

static inline void unlink_entry(policy_t *p, plist_t *l, int32_t i) {
    pnode_t *n = &p->pnode[i];
    if (n->prev != NIL) {
        p->pnode[n->prev].next = n->next;
    } else {
        l->head = n->next;
    }
    if (n->next != NIL) {
        p->pnode[n->next].prev = n->prev;
    } else {
        l->tail = n->prev;
    }
    n->prev = n->next = NIL;
}

void pol_add_leaf(policy_t *p, int32_t i) {
    pnode_t *n = &p->pnode[i];
    int c = cls_of(n);
    uint64_t stamp = stamp_of(n);
    int32_t bin, L = list_of(p, c, stamp, &bin);
    plist_t *l = &p->lists[L];
    if (l->tail != NIL && stamp <= stamp_of(&p->pnode[l->tail])) {
        /* older than the youngest: an exposed parent, next to go */
        n->prev = NIL;
        n->next = l->head;
        p->pnode[l->head].prev = i;
        l->head = i;
    } else {
        n->next = NIL;
        n->prev = l->tail;
        if (l->tail != NIL) {
            p->pnode[l->tail].next = i;
        } else {
            l->head = i;
        }
        l->tail = i;
    }
    n->meta |= PN_LISTED;
    p->n_leaves++;
    int32_t r = p->rank_of[c * p->prm.bins + bin];
    if (r < p->cursor) p->cursor = r;
}

void pol_remove_leaf(policy_t *p, int32_t i) {
    pnode_t *n = &p->pnode[i];
    int32_t bin, L = list_of(p, cls_of(n), stamp_of(n), &bin);
    unlink_entry(p, &p->lists[L], i);
    n->meta &= ~PN_LISTED;
    p->n_leaves--;
}

int32_t pol_victim(policy_t *p) {
    int32_t bins = p->prm.bins, last = bins - 1;
    /* the walk restarts after every window: no division per rank (the cell
     * from its sort key, the ring slot from the current window's) */
    int32_t now_slot = (int32_t)(p->cur_win % (uint64_t)last);
    for (int32_t r = p->cursor; r < p->n_ranks; r++) {
        uint64_t k = p->keys[r];
        int32_t c = (int32_t)(k & 0xF), b = last - (int32_t)((k >> 4) & 0x7FF), L;
        if (b == last) {
            L = c * bins + last;
        } else {
            if (p->cur_win < (uint64_t)b) continue; /* no such window yet */
            int32_t slot = now_slot - b;
            L = c * bins + (slot < 0 ? slot + last : slot);
        }
        plist_t *l = &p->lists[L];
        if (l->head != NIL) {
            int32_t i = l->head;
            unlink_entry(p, l, i);
            p->pnode[i].meta &= ~PN_LISTED;
            p->n_leaves--;
            p->cursor = r;
            return i;
        }
    }
    p->cursor = p->n_ranks;
    return NIL;
}

/* The leaves in the order victim() would take them (no change); returns how many. */
int64_t pol_order(const policy_t *p, int32_t *out) {
    int32_t bins = p->prm.bins, last = bins - 1;
    int64_t m = 0;
    for (int32_t r = 0; r < p->n_ranks; r++) {
        int32_t cb = p->ranks[r], c = cb / bins, b = cb % bins, L;
        if (b == last) {
            L = c * bins + last;
        } else {
            if (p->cur_win < (uint64_t)b) continue;
            L = c * bins + (int32_t)((p->cur_win - (uint64_t)b) % (uint64_t)last);
        }
        for (int32_t i = p->lists[L].head; i != NIL; i = p->pnode[i].next) out[m++] = i;
    }
    return m;
}

/* ------------------------------------------------------------- tables */

/* ranks: every (c, b) by (density, -b, c). A density is at most 2^32, so
 * (density, last - b, c) packs into one word and sorts as a number. `keys`
 * keeps the last ranking: each key takes its cell's new density in place and
 * the keys are insertion-sorted. Every cell decays alike each window, so the
 * order barely moves and the sort is about one pass (a full sort was most of
 * a rebuild in a small tier, whose windows are a few inserts long). */
static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void rank_cells(policy_t *p) {
    int32_t bins = p->prm.bins, last = bins - 1, n = p->n_ranks;
    uint64_t *keys = p->keys;
    for (int32_t r = 0; r < n; r++) {
        uint64_t cell = keys[r] & 0x7FFF;
        int32_t c = (int32_t)(cell & 0xF), b = last - (int32_t)(cell >> 4);
        keys[r] = p->density[c * bins + b] << 15 | cell;
    }
    /* keys are distinct (each holds its cell), so any sort gives one order:
     * insertion while the order barely moved, else qsort (in a small tier
     * the densities of a rebuild can reorder most cells) */
    int64_t moves = 0, budget = 16 * (int64_t)n;
    for (int32_t r = 1; r < n && moves <= budget; r++) {
        uint64_t k = keys[r];
        int32_t j = r;
        for (; j > 0 && keys[j - 1] > k; j--) keys[j] = keys[j - 1];
        keys[j] = k;
        moves += r - j;
    }
    if (moves > budget) qsort(keys, (size_t)n, sizeof *keys, cmp_u64);
    for (int32_t r = 0; r < n; r++) {
        int32_t c = (int32_t)(keys[r] & 0xF), b = last - (int32_t)((keys[r] >> 4) & 0x7FF);
        p->ranks[r] = (uint16_t)(c * bins + b);
        p->rank_of[c * bins + b] = (uint16_t)r;
    }
    p->cursor = 0;
}

typedef unsigned __int128 u128;

/* (h << 32) / life: in 64 bits where it fits (a 128-bit division is a
 * library call, and a rebuild makes up to three per cell). */
static inline uint64_t density_of(u128 h, u128 life) {
    if ((h >> 32) == 0 && (life >> 64) == 0) return ((uint64_t)h << 32) / (uint64_t)life;
    return (uint64_t)((h << 32) / life);
}

/* The densities of one class: dens[a] = max over A in (a, last] of the hits
 * in [a, A), << 32, over U[A] - U[a] (the space-time of holding every block
 * of age a until it is reused or reaches A; U[A] sums, over the bins before
 * A, the events at or past each): the slope from point a to the upper hull
 * of the points past it, built from the last bin down on a stack. */
static void densities(policy_t *p, const uint64_t *hits, const uint64_t *ends, uint64_t *dens) {
    int32_t last = p->prm.bins - 1;
    u128 *ph = p->scratch, *u = ph + p->prm.bins;
    int32_t *hull = (int32_t *)(u + p->prm.bins), top = 0;
    u128 alive = 0; /* events at or past bin b */
    for (int32_t b = 0; b <= last; b++) alive += (u128)hits[b] + ends[b];
    ph[0] = u[0] = 0;
    for (int32_t b = 0; b < last; b++) {
        ph[b + 1] = ph[b] + hits[b];
        u[b + 1] = u[b] + alive;
        alive -= (u128)hits[b] + ends[b];
    }
#define SLOPE(a, b) (u[b] > u[a] ? density_of(ph[b] - ph[a], u[b] - u[a]) : 0)
    hull[0] = last;
    for (int32_t a = last - 1; a >= 0; a--) {
        while (top > 0 && SLOPE(a, hull[top]) <= SLOPE(a, hull[top - 1])) top--;
        dens[a] = SLOPE(a, hull[top]);
        hull[++top] = a;
    }
#undef SLOPE
    dens[last] = 0;
}

/* Every `rebuild_every` windows (so at least
 * REBUILD_TICKS clock ticks apart: in a small tier, whose windows are a few
 * ticks, a rebuild per window was most of the policy's cost) the tables
 * decay once per window since the last and the densities and ranks are
 * rebuilt. Between rebuilds the ranks stand (cells are age
 * bins: a leaf still moves through them as it ages), and the cursor restarts,
 * since every list moved one bin on. */
static void rebuild(policy_t *p) {
    int32_t bins = p->prm.bins, shift = p->prm.decay_shift;
    if (p->cur_win % p->rebuild_every != 0) {
        p->cursor = 0;
        return;
    }
    for (int32_t c = 0; c < p->prm.classes; c++) {
        uint64_t *hits = p->hits + (size_t)c * bins, *ends = p->ends + (size_t)c * bins;
        for (uint64_t k = 0; k < p->rebuild_every; k++) {
            for (int32_t b = 0; b < bins; b++) {
                hits[b] -= hits[b] >> shift;
                ends[b] -= ends[b] >> shift;
            }
        }
        densities(p, hits, ends, p->density + (size_t)c * bins);
    }
    rank_cells(p);
}

/* A new window: the buckets that just reached the last bin join the old
 * lists (younger than all they hold: at the tail); then the rebuild. */
static void advance(policy_t *p) {
    int32_t bins = p->prm.bins, last = bins - 1;
    p->cur_win++;
    if (p->cur_win >= (uint64_t)last) {
        int32_t slot = (int32_t)((p->cur_win - (uint64_t)last) % (uint64_t)last);
        for (int32_t c = 0; c < p->prm.classes; c++) {
            plist_t *from = &p->lists[c * bins + slot], *old = &p->lists[c * bins + last];
            if (from->head == NIL) continue;
            if (old->tail == NIL) {
                old->head = from->head;
            } else {
                p->pnode[old->tail].next = from->head;
                p->pnode[from->head].prev = old->tail;
            }
            old->tail = from->tail;
            from->head = from->tail = NIL;
        }
    }
    rebuild(p);
}

/* ------------------------------------------------------------- events */

/* The caller's clock reached `now`: the windows it passed go by (each one
 * advance). A gap of more than `bins` windows (an idle tier) is cut to its
 * last `bins`: those splice every ring slot into the old lists and decay the
 * tables as far as anything older could matter, at a bounded cost. */
static void clock_to(policy_t *p, uint64_t now) {
    if (now > p->tick) p->tick = now;
    uint64_t target = p->tick / p->window;
    if (target - p->cur_win > (uint64_t)p->prm.bins) p->cur_win = target - (uint64_t)p->prm.bins;
    while (p->cur_win < target) advance(p);
}

void pol_on_insert(policy_t *p, int32_t i, uint64_t key, uint64_t now) {
    clock_to(p, now);
    p->inserts++;
    int cls = 0, back;
    uint64_t win;
    if (ghost_take(p, key, &back, &win)) {
        p->ghost_hits++;
        uint64_t age = (p->cur_win - win) & ((1ULL << p->prm.ghost_win_bits) - 1);
        uint64_t last = (uint64_t)(p->prm.bins - 1);
        if (age < last) { /* reused within the horizon: a hit, and no end after all */
            size_t at = (size_t)back * (size_t)p->prm.bins;
            p->hits[at + age] += ONE;
            p->ends[at + last] -= p->ends[at + last] < ONE ? p->ends[at + last] : ONE;
        }
        cls = back + 1 < p->prm.classes ? back + 1 : p->prm.classes - 1;
    }
    pnode_t *n = &p->pnode[i];
    n->prev = n->next = NIL;
    n->meta = (p->tick & STAMP_MASK) | (uint64_t)cls << CLS_SHIFT | PN_TRACKED;
}

void pol_on_hit(policy_t *p, int32_t i, uint64_t now) {
    clock_to(p, now);
    int leaf = pol_listed(p, i);
    if (leaf) pol_remove_leaf(p, i);
    pnode_t *n = &p->pnode[i];
    int c = cls_of(n);
    count(p, p->hits, c, p->cur_win - stamp_of(n) / p->window);
    int cls = c + 1 < p->prm.classes ? c + 1 : p->prm.classes - 1;
    n->meta = (p->tick & STAMP_MASK) | (uint64_t)cls << CLS_SHIFT | PN_TRACKED;
    p->hits_seen++;
    if (leaf) pol_add_leaf(p, i);
}

void pol_on_evict(policy_t *p, int32_t i, uint64_t key) {
    pnode_t *n = &p->pnode[i];
    int end_cls;
    uint64_t end_age;
    /* an end (not reused within the horizon) until the ghost sees the block
     * return; an entry the ghost overwrites was counted here */
    count(p, p->ends, cls_of(n), (uint64_t)(p->prm.bins - 1));
    ghost_put(p, key, cls_of(n), stamp_of(n) / p->window, &end_cls, &end_age);
    n->meta = 0;
    n->prev = n->next = NIL;
}

/* ------------------------------------------------------------- memory */

int pol_reserve(policy_t *p, int32_t n) {
    if (n <= p->cap) return 0;
    int32_t cap = p->cap ? p->cap : 1024;
    while (cap < n) cap *= 2;
    pnode_t *grown = realloc(p->pnode, sizeof(pnode_t) * (size_t)cap);
    if (grown == NULL) return -1;
    memset(grown + p->cap, 0, sizeof(pnode_t) * (size_t)(cap - p->cap));
    for (int32_t k = p->cap; k < cap; k++) grown[k].prev = grown[k].next = NIL;
    p->pnode = grown;
    p->cap = cap;
    return 0;
}

int pol_init(policy_t *p, int64_t capacity, const pol_params_t *prm) {
    memset(p, 0, sizeof *p);
    p->prm = *prm;
    int32_t cells = prm->classes * prm->bins;
    int64_t w = capacity / prm->windows_per_capacity;
    p->window = (uint64_t)(w > prm->min_window ? w : prm->min_window);
    p->rebuild_every = (REBUILD_TICKS + p->window - 1) / p->window;
    p->n_ranks = cells;
    p->cls_bits = bits_for(prm->classes - 1);
    p->fp_bits = prm->ghost_bits - p->cls_bits - prm->ghost_win_bits;
    int64_t entries = (int64_t)prm->ghost_factor * capacity;
    p->sets = entries ? (uint64_t)((entries + prm->ways - 1) / prm->ways) : 0;
    if (entries && p->sets == 0) p->sets = 1;
    p->hits = calloc((size_t)cells, sizeof(uint64_t));
    p->ends = calloc((size_t)cells, sizeof(uint64_t));
    p->density = calloc((size_t)cells, sizeof(uint64_t));
    p->ranks = calloc((size_t)cells, sizeof(uint16_t));
    p->rank_of = calloc((size_t)cells, sizeof(uint16_t));
    p->keys = malloc(sizeof(uint64_t) * (size_t)cells);
    p->lists = malloc(sizeof(plist_t) * (size_t)cells);
    p->ghost = calloc((size_t)(p->sets * (uint64_t)prm->ways) + 1, (size_t)(prm->ghost_bits / 8));
    p->scratch = malloc((sizeof(unsigned __int128) * 2 + sizeof(int32_t)) * (size_t)prm->bins);
    if (p->hits == NULL || p->ends == NULL || p->density == NULL || p->ranks == NULL ||
        p->rank_of == NULL || p->keys == NULL || p->lists == NULL || p->ghost == NULL || p->scratch == NULL || pol_reserve(p, 1024) < 0) {
        pol_free(p);
        return -1;
    }
    for (int32_t k = 0; k < cells; k++) {
        int32_t c = k / prm->bins, b = k % prm->bins;
        p->lists[k].head = p->lists[k].tail = NIL;
        p->keys[k] = (uint64_t)(prm->bins - 1 - b) << 4 | (uint64_t)c;
    }
    rank_cells(p);
    return 0;
}

void pol_free(policy_t *p) {
    free(p->hits);
    free(p->ends);
    free(p->density);
    free(p->ranks);
    free(p->rank_of);
    free(p->keys);
    free(p->lists);
    free(p->ghost);
    free(p->scratch);
    free(p->pnode);
    memset(p, 0, sizeof *p);
}
