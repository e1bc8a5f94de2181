/* Core: the tree, pools and leaf heaps of one manager. Every method is one
 * transition of ops.c, taking and returning plain ints, lists and bytes
 * (plans the manager turns into transfer tasks). */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#include "hashing.h"

static const char *const EVICTION_NAMES[EV_COUNT] = {"gpu_dropped", "cpu_dropped", "gpu_to_cpu",
                                                     "gpu_to_cpu_backup"};
static const char *const TIER_NAMES[2] = {"gpu", "cpu"};
static const char *const POLICY_NAMES[2] = {"lru", "adaptive"};

/* Node ids handed back by a plan: live nodes of this core, or ValueError. */
static int check_nodes(const core_t *c, const int32_t *nodes, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (nodes[k] <= ROOT || nodes[k] >= c->n_slots || !c->nodes[nodes[k]].live) {
            PyErr_Format(PyExc_ValueError, "node %d is not a live node of this cache",
                         (int)nodes[k]);
            return -1;
        }
    }
    return 0;
}


/* ------------------------------------------------------------- hashing */

/* A new block's memo record, for the node commit will make (no memory: the
 * node will have no memo). */
static void keep_record(core_t *c, request_t *r, int32_t b, const uint8_t *rec, uint32_t len) {
    r->records[b] = rec_alloc(c, len);
    if (r->records[b] == NULL) return;
    memcpy(r->records[b], rec, len);
    r->record_lens[b] = len;
}

/* Hash blocks [r->n_hashes, stop) of ids (ids[0] is the first token of block
 * r->n_hashes). With walk, down the tree from the root: where the node the
 * previous block led to has one child, the block is compared with that
 * child's memo record and, when equal, takes its hash; elsewhere it is
 * hashed and looked up (the walk ends at the first block not in the tree).
 * walk[] keeps the node of each block for match(); a new block keeps its
 * record for the node commit makes. rec: room for one record (record_room)
 * when the core memoizes. */
static int hash_blocks(core_t *c, request_t *r, const int64_t *ids, uint8_t *rec, int32_t stop,
                       int walk) {
    int32_t bs = c->block_size, first = r->n_hashes;
    if (request_reserve(r, stop, c->memo) < 0) return -1;
    int32_t node = walk ? ROOT : NIL;
    for (int32_t b = first; b < stop; b++) {
        const int64_t *blk = ids + (size_t)(b - first) * (size_t)bs;
        uint8_t *out = r->hashes + (size_t)b * HASH_LEN;
        int32_t hit = NIL;
        uint32_t len = 0;
        if (c->memo) {
            len = make_record(rec, b == 0 ? r->ns : NULL, r->extra, r->extra_len, blk, bs);
            if (node != NIL && N(c, node)->n_children == 1) {
                int32_t only = N(c, node)->first_child;
                const node_t *x = N(c, only);
                if (x->record_len == len && x->record != NULL && memcmp(x->record, rec, len) == 0) {
                    hit = only;
                    memcpy(out, x->hash, HASH_LEN);
                    c->memo_hits++;
                    if (x->n_children == 1) __builtin_prefetch(N(c, x->first_child));
                }
            }
        }
        if (hit == NIL) {
            const uint8_t *parent_hash = b ? r->hashes + (size_t)(b - 1) * HASH_LEN : r->ns;
            hash_block(parent_hash, r->extra, r->extra_len, blk, bs, out);
            c->blocks_hashed++;
            if (node != NIL) hit = child_by_hash(c, node, out);
            if (hit == NIL && c->memo) keep_record(c, r, b, rec, len);
        }
        r->walk[b] = hit;
        node = hit;
        r->n_hashes = b + 1;
    }
    return 0;
}

/* ------------------------------------------------------------------- Core */

static void core_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    core_free(&((CoreObject *)self)->c);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(self);
    Py_DECREF(tp);
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"gpu_blocks", "cpu_blocks", "block_size", "memo", "external", "policy",
                         "policy_params", NULL};
    int gpu, cpu, bs, memo = 1, external = 0, policy = -1;
    const char *policy_name = "lru";
    PyObject *params_obj = NULL;
    pol_params_t params;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iii|ppsO", kw, &gpu, &cpu, &bs, &memo, &external,
                                     &policy_name, &params_obj))
        return NULL;
    for (int k = 0; k < 2; k++) {
        if (strcmp(policy_name, POLICY_NAMES[k]) == 0) policy = k;
    }
    if (policy < 0) {
        PyErr_Format(PyExc_ValueError, "policy must be 'lru' or 'adaptive', got '%s'", policy_name);
        return NULL;
    }
    if (params_arg(params_obj, &params) < 0) return NULL;
    if (external && gpu != 0) {
        PyErr_Format(PyExc_ValueError, "an external GPU tier has no GPU pool: gpu_blocks must be 0, "
                     "got %d", gpu);
        return NULL;
    }
    if (gpu < 0 || cpu < 0 || bs <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "gpu_blocks and cpu_blocks must be >= 0 and block_size > 0, got %d, %d, %d",
                     gpu, cpu, bs);
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    CoreObject *self = (CoreObject *)alloc(type, 0);
    if (self == NULL) return NULL;
    if (core_init(&self->c, gpu, cpu, bs, memo, external, policy, &params) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    /* a swap-out batch never exceeds the GPU pool */
    int32_t cap = gpu > 64 ? gpu : 64;
    int32_t *b = realloc(self->c.batch, sizeof(int32_t) * (size_t)cap);
    int32_t *bc = b ? realloc(self->c.batch_copy, sizeof(int32_t) * (size_t)cap) : NULL;
    if (b) self->c.batch = b;
    if (bc == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->c.batch_copy = bc;
    self->c.batch_cap = cap;
    return (PyObject *)self;
}

/* Hash tokens' blocks [r->n_hashes, stop) into r (walk: the memo walk). */
static int hash_tokens(core_t *c, request_t *r, PyObject *tokens, int32_t stop, int walk) {
    int32_t bs = c->block_size, first = r->n_hashes;
    if (stop <= first) return 0;
    int64_t *ids;
    uint8_t *rec;
    void *mem = scratch(SCRATCH(&ids, (size_t)(stop - first) * (size_t)bs),
                        SCRATCH(&rec, c->memo ? record_room(r->extra_len, bs) : 0), NULL);
    if (mem == NULL) return -1;
    int rc = read_tokens(tokens, (Py_ssize_t)first * bs, (Py_ssize_t)stop * bs, ids);
    if (rc == 0 && (rc = hash_blocks(c, r, ids, rec, stop, walk)) < 0) PyErr_NoMemory();
    free(mem);
    return rc;
}

static PyObject *Core_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *ns, *extra;
    Py_ssize_t ns_len, extra_len;
    if (parse_args(self, args, nargs, "request(namespace, tokens, extra)", "yOy", &ns, &ns_len,
                   NULL, &extra, &extra_len) < 0)
        return NULL;
    if (ns_len != HASH_LEN) {
        PyErr_Format(PyExc_ValueError, "namespace must be %d bytes, got %zd", HASH_LEN, ns_len);
        return NULL;
    }
    Py_ssize_t n = token_count(args[1]);
    if (n < 0) return NULL;
    PyObject *req = new_request(self, ns, extra, extra_len);
    if (req == NULL) return NULL;
    core_t *c = CORE(self);
    if (hash_tokens(c, &((RequestObject *)req)->r, args[1], (int32_t)(n / c->block_size), 1) < 0) {
        Py_DECREF(req);
        return NULL;
    }
    return req;
}

static PyObject *Core_extend_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t full;
    request_t *r;
    if (parse_args(self, args, nargs, "extend_hashes(req, tokens, full)", "ROi", &r, NULL,
                   &full) < 0)
        return NULL;
    Py_ssize_t n = token_count(args[1]);
    if (n < 0) return NULL;
    if ((Py_ssize_t)full * CORE(self)->block_size > n) {
        PyErr_Format(PyExc_ValueError, "%d full blocks need %zd tokens, got %zd", full,
                     (Py_ssize_t)full * CORE(self)->block_size, n);
        return NULL;
    }
    if (hash_tokens(CORE(self), r, args[1], full, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t limit, n_gpu;
    int with_cpu = 1;
    request_t *r;
    if (parse_args(self, args, nargs, "match(req, limit, with_cpu=True)", "Ri|p", &r, &limit,
                   &with_cpu) < 0)
        return NULL;
    if (r->n_path) {
        PyErr_SetString(PyExc_RuntimeError, "the request already holds its path");
        return NULL;
    }
    int32_t room = limit < r->n_hashes ? limit : r->n_hashes;
    int32_t *gpu_ids;
    if (scratch(SCRATCH(&gpu_ids, room > 0 ? room : 0), NULL) == NULL) return NULL;
    if (core_match(CORE(self), r, limit < 0 ? 0 : limit, with_cpu, &n_gpu, gpu_ids) < 0) {
        free(gpu_ids);
        return PyErr_NoMemory();
    }
    PyObject *ids = list_of(gpu_ids, n_gpu);
    free(gpu_ids);
    if (ids == NULL) return NULL;
    return Py_BuildValue("iiN", n_gpu, r->n_path, ids);
}

#define REQ_METHOD(name, call)                                                 \
    static PyObject *Core_##name(PyObject *self, PyObject *arg) {             \
        request_t *r = request_arg(self, arg);                                \
        if (r == NULL) return NULL;                                           \
        call(CORE(self), r);                                                  \
        Py_RETURN_NONE;                                                       \
    }
REQ_METHOD(undo_match, core_undo_match)
REQ_METHOD(hit, core_hit)
REQ_METHOD(unref_path, core_unref_path)

static PyObject *Core_tick(PyObject *self, PyObject *unused) {
    CORE(self)->clock++;
    Py_RETURN_NONE;
}

static PyObject *Core_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int tier;
    int32_t n;
    if (parse_args(self, args, nargs, "alloc(tier, n)", "ti", &tier, &n) < 0) return NULL;
    pool_t *p = &CORE(self)->pools[tier];
    if (n < 0 || n > p->count) {
        PyErr_Format(PyExc_ValueError, "%s pool: asked for %d blocks, %d free", TIER_NAMES[tier],
                     (int)n, (int)p->count);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (int32_t k = 0; k < n; k++) PyList_SetItem(out, k, PyLong_FromLong(pool_take(p)));
    return out;
}

static PyObject *Core_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int tier, front = 0;
    if (parse_args(self, args, nargs, "free(tier, ids, front=False)", "tO|p", &tier, NULL,
                   &front) < 0)
        return NULL;
    Py_ssize_t n;
    int32_t *ids = ints_of(args[1], "block ids", &n);
    if (ids == NULL) return NULL;
    pool_t *p = &CORE(self)->pools[tier];
    int bad = core_free_blocks(CORE(self), tier, ids, (int32_t)n, front);
    if (bad >= 0) {
        int32_t id = ids[bad];
        if (id < 0 || id >= p->num_blocks) {
            PyErr_Format(PyExc_ValueError, "%s pool: block id %d out of range 0..%d",
                         TIER_NAMES[tier], (int)id, (int)p->num_blocks - 1);
        } else {
            PyErr_Format(PyExc_ValueError, "%s pool: double free of block %d", TIER_NAMES[tier],
                         (int)id);
        }
    }
    free(ids);
    if (bad >= 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_evict(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t count, freed;
    int swap;
    if (parse_args(self, args, nargs, "evict(count, swap, freed)", "ipi", &count, &swap,
                   &freed) < 0)
        return NULL;
    int status = core_evict(CORE(self), count, swap, &freed);
    return Py_BuildValue("ii", status, freed);
}

/* The copies of the swap-out batch in progress: (GPU ids, host ids). */
static PyObject *Core_batch_copies(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *src = PyList_New(0), *dst = PyList_New(0);
    if (src == NULL || dst == NULL) goto fail;
    for (int32_t k = 0; k < c->n_batch; k++) {
        if (!c->batch_copy[k]) continue;
        const node_t *n = N(c, c->batch[k]);
        PyObject *g = PyLong_FromLong(n->gpu), *h = PyLong_FromLong(n->cpu);
        int bad = g == NULL || h == NULL || PyList_Append(src, g) < 0 || PyList_Append(dst, h) < 0;
        Py_XDECREF(g);
        Py_XDECREF(h);
        if (bad) goto fail;
    }
    return Py_BuildValue("NN", src, dst);
fail:
    Py_XDECREF(src);
    Py_XDECREF(dst);
    return NULL;
}

static PyObject *Core_land_swap_out(PyObject *self, PyObject *unused) {
    core_land_swap_out(CORE(self));
    Py_RETURN_NONE;
}

static PyObject *Core_rollback_swap_out(PyObject *self, PyObject *unused) {
    core_rollback_swap_out(CORE(self));
    Py_RETURN_NONE;
}

static int path_range(request_t *r, int32_t start, Py_ssize_t count) {
    if (start < 0 || start + count > r->n_path) {
        PyErr_Format(PyExc_ValueError, "path range %d..%zd is outside the request's %d nodes",
                     (int)start, start + count, (int)r->n_path);
        return -1;
    }
    return 0;
}

static PyObject *Core_plan_swap_in(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start;
    request_t *r;
    if (parse_args(self, args, nargs, "plan_swap_in(req, start, gpu_ids)", "RiO", &r, &start,
                   NULL) < 0)
        return NULL;
    Py_ssize_t n;
    int32_t *gpu = ints_of(args[2], "gpu_ids", &n);
    if (gpu == NULL) return NULL;
    int32_t *cpu = NULL;
    PyObject *out = NULL;
    if (scratch(SCRATCH(&cpu, n), NULL) != NULL && path_range(r, start, n) == 0) {
        core_plan_swap_in(CORE(self), r, start, (int32_t)n, gpu, cpu);
        out = list_of(cpu, n);
    }
    free(gpu);
    free(cpu);
    return out;
}

static PyObject *Core_plan_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, want;
    request_t *r;
    if (parse_args(self, args, nargs, "plan_load(req, start, n, gpu_ids)", "RiiO", &r, &start,
                   &want, NULL) < 0)
        return NULL;
    Py_ssize_t n_gpu;
    int32_t *gpu = ints_of(args[3], "gpu_ids", &n_gpu);
    if (gpu == NULL) return NULL;
    if (start != r->n_path || want < 0 || start + want > r->n_hashes ||
        (!CORE(self)->external && want > n_gpu)) {
        free(gpu);
        PyErr_Format(PyExc_ValueError, "plan_load: blocks %d..%d of a request with %d hashes and "
                     "%d path nodes, %zd gpu ids", (int)start, (int)(start + want),
                     (int)r->n_hashes, (int)r->n_path, n_gpu);
        return NULL;
    }
    int32_t *nodes, *cpus;
    void *mem = scratch(SCRATCH(&nodes, want), SCRATCH(&cpus, want), NULL);
    PyObject *out = NULL;
    if (mem != NULL) {
        int32_t got;
        int32_t m = core_plan_load(CORE(self), r, start, want, gpu, nodes, cpus, &got);
        out = Py_BuildValue("NNi", list_of(nodes, m), list_of(cpus, m), (int)got);
    }
    free(gpu);
    free(mem);
    return out;
}

static PyObject *Core_finish_fetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, ok;
    int is_load, missing;
    request_t *r;
    if (parse_args(self, args, nargs, "finish_fetch(req, start, nodes, ok, is_load, missing)",
                   "RiOipp", &r, &start, NULL, &ok, &is_load, &missing) < 0)
        return NULL;
    Py_ssize_t n;
    int32_t *nodes = ints_of(args[2], "nodes", &n);
    if (nodes == NULL) return NULL;
    if (check_nodes(CORE(self), nodes, n) < 0 || n == 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "finish_fetch of no nodes");
        free(nodes);
        return NULL;
    }
    if (ok < 0) ok = 0;
    if (ok > n) ok = (int32_t)n;
    int32_t cut = core_finish_fetch(CORE(self), r, start, nodes, (int32_t)n, ok, is_load, missing);
    free(nodes);
    return PyLong_FromLong(cut);
}

static PyObject *Core_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t full;
    request_t *r;
    static const char usage[] = "insert(req, blocks: list, full)";
    if (parse_args(self, args, nargs, usage, "ROi", &r, NULL, &full) < 0) return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    PyObject *list = args[1];
    Py_ssize_t n_blocks = PyList_Size(list);
    if (full > r->n_hashes || full > n_blocks) {
        PyErr_Format(PyExc_ValueError, "insert: %d blocks, but the request has %d hashes and "
                     "%zd block ids", (int)full, (int)r->n_hashes, n_blocks);
        return NULL;
    }
    int32_t from = r->n_path;
    if (full <= from) Py_RETURN_NONE;
    int32_t *blocks, *before;
    void *mem = scratch(SCRATCH(&blocks, full), SCRATCH(&before, full), NULL);
    if (mem == NULL) return NULL;
    for (int32_t k = from; k < full; k++) {
        if (as_i32(PyList_GetItem(list, k), "block id", &blocks[k]) < 0) {
            free(mem);
            return NULL;
        }
    }
    memcpy(before + from, blocks + from, sizeof(int32_t) * (size_t)(full - from));
    const char *err = NULL;
    int rc = core_insert(CORE(self), r, blocks, full, &err);
    /* dedups replace block ids in the engine's block table */
    for (int32_t k = from; k < full && rc >= -1; k++) {
        if (blocks[k] != before[k]) PyList_SetItem(list, k, PyLong_FromLong(blocks[k]));
    }
    free(mem);
    if (rc == -1) return PyErr_NoMemory();
    if (rc == -2) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Core_plan_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, min_uses = 0;
    request_t *r;
    if (parse_args(self, args, nargs, "plan_store(req, start, min_uses=0)", "Ri|i", &r, &start,
                   &min_uses) < 0)
        return NULL;
    if (path_range(r, start, 0) < 0) return NULL;
    int32_t room = r->n_path - start;
    int32_t *nodes, *cpus, *gpus;
    uint8_t *hashes;
    void *mem = scratch(SCRATCH(&nodes, room), SCRATCH(&cpus, room), SCRATCH(&gpus, room),
                        SCRATCH(&hashes, (size_t)room * HASH_LEN), NULL);
    PyObject *out = NULL;
    if (mem != NULL) {
        core_t *c = CORE(self);
        int32_t m = core_plan_store(c, r, start, min_uses, nodes, cpus);
        for (int32_t k = 0; k < m; k++) {
            gpus[k] = N(c, nodes[k])->gpu;
            memcpy(hashes + (size_t)k * HASH_LEN, N(c, nodes[k])->hash, HASH_LEN);
        }
        out = Py_BuildValue("NNNN", list_of(nodes, m), list_of(cpus, m), list_of(gpus, m),
                            hash_list(hashes, m));
    }
    free(mem);
    return out;
}

static PyObject *Core_finish_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int staged = !CORE(self)->external;
    if (parse_args(self, args, nargs,
                   "finish_store(nodes, stored: list[bool] | None, staged=not external)", "OO|p",
                   NULL, NULL, &staged) < 0)
        return NULL;
    Py_ssize_t n;
    int32_t *nodes = ints_of(args[0], "nodes", &n);
    if (nodes == NULL) return NULL;
    uint8_t *stored = NULL;
    int ok = args[1] != Py_None;
    if (scratch(SCRATCH(&stored, n), NULL) == NULL || check_nodes(CORE(self), nodes, n) < 0)
        goto fail;
    memset(stored, 0, (size_t)n);
    if (ok) {
        if (!PyList_Check(args[1])) {
            PyErr_SetString(PyExc_TypeError, "stored must be a list of bools or None");
            goto fail;
        }
        Py_ssize_t m = PyList_Size(args[1]);
        for (Py_ssize_t k = 0; k < n && k < m; k++) {
            int t = PyObject_IsTrue(PyList_GetItem(args[1], k));
            if (t < 0) goto fail;
            stored[k] = (uint8_t)t;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (CORE(self)->nodes[nodes[k]].busy <= 0) {
            PyErr_Format(PyExc_ValueError, "node %d has no store in flight", (int)nodes[k]);
            goto fail;
        }
    }
    core_finish_store(CORE(self), nodes, (int32_t)n, stored, ok, staged);
    free(nodes);
    free(stored);
    Py_RETURN_NONE;
fail:
    free(nodes);
    free(stored);
    return NULL;
}

#define VOID_METHOD(name, call)                                                \
    static PyObject *Core_##name(PyObject *self, PyObject *unused) {          \
        call(CORE(self));                                                     \
        Py_RETURN_NONE;                                                       \
    }
VOID_METHOD(drop_gpu_tier, core_drop_gpu_tier)
VOID_METHOD(drop_cpu_tier, core_drop_cpu_tier)
VOID_METHOD(forget_storage, core_forget_storage)

/* ------------------------------------------------- external GPU tier */

/* The engine's block hashes appended to r as this cache's keys: each key is
 * BLAKE2b-128(namespace || engine hash), so caches of different models or
 * weights never share a block even when the engine's hashes agree. */
static int append_hashes(core_t *c, request_t *r, PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list of bytes");
        return -1;
    }
    Py_ssize_t n = PyList_Size(list);
    if (request_reserve(r, r->n_hashes + (int32_t)n, c->memo) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const uint8_t *h;
        Py_ssize_t len;
        if (bytes_arg(PyList_GetItem(list, k), "hash", &h, &len) < 0) return -1;
        if (len < 1 || len > 256) {
            PyErr_Format(PyExc_ValueError, "hash %zd has %zd bytes, expected 1..256", k, len);
            return -1;
        }
        uint8_t input[HASH_LEN + 256];
        memcpy(input, r->ns, HASH_LEN);
        memcpy(input + HASH_LEN, h, (size_t)len);
        int32_t b = r->n_hashes;
        hash_bytes(input, HASH_LEN + (size_t)len, r->hashes + (size_t)b * HASH_LEN);
        r->walk[b] = NIL;
        if (r->records != NULL) r->records[b] = NULL;
        r->n_hashes = b + 1;
    }
    return 0;
}

static PyObject *Core_request_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *ns;
    Py_ssize_t ns_len;
    if (parse_args(self, args, nargs, "request_hashes(namespace, hashes)", "yO", &ns, &ns_len,
                   NULL) < 0)
        return NULL;
    if (ns_len != HASH_LEN) {
        PyErr_Format(PyExc_ValueError, "namespace must be %d bytes, got %zd", HASH_LEN, ns_len);
        return NULL;
    }
    PyObject *req = new_request(self, ns, (const uint8_t *)"", 0);
    if (req == NULL) return NULL;
    if (append_hashes(CORE(self), &((RequestObject *)req)->r, args[1]) < 0) {
        Py_DECREF(req);
        return NULL;
    }
    return req;
}

static PyObject *Core_add_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request_t *r;
    if (parse_args(self, args, nargs, "add_hashes(req, hashes)", "RO", &r, NULL) < 0) return NULL;
    if (append_hashes(CORE(self), r, args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The GPU or CPU block ids of the request's path nodes [start, stop). */
static PyObject *Core_path_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, stop;
    int tier;
    request_t *r;
    if (parse_args(self, args, nargs, "path_blocks(req, start, stop, tier)", "Riit", &r, &start,
                   &stop, &tier) < 0)
        return NULL;
    if (path_range(r, start, stop - start) < 0 || stop < start) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "path_blocks: stop < start");
        return NULL;
    }
    PyObject *out = PyList_New(stop - start);
    for (int32_t k = start; out != NULL && k < stop; k++) {
        const node_t *n = N(CORE(self), r->path[k]);
        PyList_SetItem(out, k - start, PyLong_FromLong(tier == T_GPU ? n->gpu : n->cpu));
    }
    return out;
}

static PyObject *Core_cpu_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t limit;
    request_t *r;
    if (parse_args(self, args, nargs, "cpu_prefix(req, limit)", "Ri", &r, &limit) < 0) return NULL;
    int moving;
    int32_t n = core_cpu_prefix(CORE(self), r, limit, &moving);
    return Py_BuildValue("(iO)", n, moving ? Py_True : Py_False);
}

static int need_external(PyObject *self) {
    if (!CORE(self)->external) {
        PyErr_SetString(PyExc_RuntimeError, "only a core with an external GPU tier saves this way");
        return -1;
    }
    return 0;
}

static PyObject *Core_ext_save(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t upto;
    request_t *r;
    if (parse_args(self, args, nargs, "ext_save(req, upto)", "Ri", &r, &upto) < 0) return NULL;
    if (need_external(self) < 0) return NULL;
    int32_t room = upto > r->n_path ? upto - r->n_path : 0;
    int32_t *nodes, *cpus, *blocks;
    void *mem = scratch(SCRATCH(&nodes, room), SCRATCH(&cpus, room), SCRATCH(&blocks, room), NULL);
    if (mem == NULL) return NULL;
    int32_t m = core_ext_save(CORE(self), r, upto, nodes, cpus, blocks);
    PyObject *out = Py_BuildValue("NNN", list_of(nodes, m), list_of(cpus, m), list_of(blocks, m));
    free(mem);
    return out;
}

static PyObject *Core_ext_finish_save(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request_t *r;
    int ok;
    if (parse_args(self, args, nargs, "ext_finish_save(req, nodes, blocks, ok)", "ROOp", &r,
                   NULL, NULL, &ok) < 0)
        return NULL;
    if (need_external(self) < 0) return NULL;
    Py_ssize_t n, nb;
    int32_t *nodes = ints_of(args[1], "nodes", &n);
    int32_t *blocks = nodes ? ints_of(args[2], "blocks", &nb) : NULL;
    PyObject *out = NULL;
    if (blocks != NULL && nb != n) {
        PyErr_SetString(PyExc_ValueError, "nodes and blocks differ in length");
    } else if (blocks != NULL && check_nodes(CORE(self), nodes, n) == 0) {
        for (Py_ssize_t k = 0; k < n; k++) {
            if (CORE(self)->nodes[nodes[k]].state != S_SWAP_OUT) {
                PyErr_Format(PyExc_ValueError, "node %d is not being saved", (int)nodes[k]);
                break;
            }
        }
        if (!PyErr_Occurred()) {
            core_ext_finish_save(CORE(self), r, nodes, blocks, (int32_t)n, ok);
            out = Py_NewRef(Py_None);
        }
    }
    free(nodes);
    free(blocks);
    return out;
}

static PyObject *Core_plan_store_host(PyObject *self, PyObject *const *args,
                                     Py_ssize_t nargs) {
    int32_t min_uses = 0;
    request_t *r;
    if (parse_args(self, args, nargs, "plan_store_host(req, min_uses=0)", "R|i", &r,
                   &min_uses) < 0)
        return NULL;
    int32_t room = r->n_path;
    int32_t *nodes, *cpus;
    uint8_t *hashes;
    void *mem = scratch(SCRATCH(&nodes, room), SCRATCH(&cpus, room),
                        SCRATCH(&hashes, (size_t)room * HASH_LEN), NULL);
    if (mem == NULL) return NULL;
    core_t *c = CORE(self);
    int32_t m = core_plan_store_host(c, r, min_uses, nodes, cpus);
    for (int32_t k = 0; k < m; k++)
        memcpy(hashes + (size_t)k * HASH_LEN, N(c, nodes[k])->hash, HASH_LEN);
    PyObject *out = Py_BuildValue("NNN", list_of(nodes, m), list_of(cpus, m), hash_list(hashes, m));
    free(mem);
    return out;
}

static PyObject *Core_counters(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *ev = PyDict_New();
    if (ev == NULL) return NULL;
    for (int k = 0; k < EV_COUNT; k++) {
        if (c->evictions[k] == 0) continue;
        PyObject *v = PyLong_FromLongLong(c->evictions[k]);
        if (v == NULL || PyDict_SetItemString(ev, EVICTION_NAMES[k], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(ev);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("{sNsLsLsL}", "evictions", ev, "dedup_blocks", (long long)c->dedup_blocks,
                         "memo_hits", (long long)c->memo_hits, "blocks_hashed",
                         (long long)c->blocks_hashed);
}
static PyObject *Core_policy_stats(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *out = Py_BuildValue("{ss}", "policy", POLICY_NAMES[c->policy]);
    if (out == NULL || c->policy == POLICY_LRU) return out;
    PyObject *prm = params_dict(&c->pol_params);
    if (prm == NULL || PyDict_SetItemString(out, "params", prm) < 0) goto fail;
    Py_CLEAR(prm);
    for (int t = 0; t < 2; t++) {
        if (c->pol[t] == NULL) continue;
        PyObject *d = policy_tier_stats(c->pol[t]);
        int bad = d == NULL || PyDict_SetItemString(out, TIER_NAMES[t], d) < 0;
        Py_XDECREF(d);
        if (bad) goto fail;
    }
    return out;
fail:
    Py_XDECREF(prm);
    Py_DECREF(out);
    return NULL;
}

/* A node's state in a tier's adaptive policy: (class, stamp, listed), or None
 * when the policy keeps none for it (tests). */
static PyObject *Core_policy_node(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    core_t *c = CORE(self);
    int tier;
    int32_t i;
    if (parse_args(self, args, nargs, "policy_node(tier, node)", "ti", &tier, &i) < 0) return NULL;
    if (i < 1 || i >= c->n_slots || !N(c, i)->live) {
        PyErr_Format(PyExc_ValueError, "no node %d", (int)i);
        return NULL;
    }
    const policy_t *p = c->pol[tier];
    if (p == NULL || !pol_tracked(p, i)) Py_RETURN_NONE;
    uint64_t meta = p->pnode[i].meta;
    return Py_BuildValue("iKO", (int)((meta >> 56) & 0xF),
                         (unsigned long long)(meta & ((1ULL << 56) - 1)),
                         pol_listed(p, i) ? Py_True : Py_False);
}

static PyObject *Core_set_policy_log(PyObject *self, PyObject *on) {
    int t = PyObject_IsTrue(on);
    if (t < 0) return NULL;
    CORE(self)->pol_log_on = t;
    Py_RETURN_NONE;
}

static const char *PL_NAMES[] = {"", "on_insert", "on_hit", "add_leaf", "remove_leaf", "victim",
                                 "on_evict"};

/* The policy calls since the last drain: [(tier, method, key)]; a victim()
 * that found none has key None. Tiers: 0 gpu, 1 cpu. */
static PyObject *Core_drain_policy_log(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *out = PyList_New(c->n_pol_log / 2);
    if (out == NULL) return NULL;
    for (int32_t k = 0; k < c->n_pol_log / 2; k++) {
        int64_t head = c->pol_log[2 * k];
        int op = (int)(head & 0xFF), none = (head & 0x10000) != 0;
        PyObject *key = none ? Py_NewRef(Py_None)
                             : PyLong_FromUnsignedLongLong((uint64_t)c->pol_log[2 * k + 1]);
        PyObject *t = key ? Py_BuildValue("isNK", (int)((head >> 8) & 0xFF), PL_NAMES[op], key,
                                          (unsigned long long)((uint64_t)head >> 24))
                          : NULL;
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, k, t);
    }
    c->n_pol_log = 0;
    return out;
}

/* The CPU-tier victims held for write-back since the last call (see ops.c
 * take_cpu_block): the caller stores them and calls finish_store(staged=False). */
static PyObject *Core_take_writebacks(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    int32_t nodes[WB_HOLD_MAX], cpus[WB_HOLD_MAX];
    uint8_t hashes[WB_HOLD_MAX * HASH_LEN];
    int32_t m = core_take_writebacks(c, nodes, cpus);
    for (int32_t k = 0; k < m; k++)
        memcpy(hashes + (size_t)k * HASH_LEN, N(c, nodes[k])->hash, HASH_LEN);
    return Py_BuildValue("NNN", list_of(nodes, m), list_of(cpus, m), hash_list(hashes, m));
}

static PyObject *Core_set_write_back(PyObject *self, PyObject *arg) {
    int32_t mode;
    if (as_i32(arg, "mode", &mode) < 0) return NULL;
    if (mode < WB_NONE || mode > WB_ALL) {
        PyErr_Format(PyExc_ValueError, "write-back mode must be 0 (none), 1 (reused) or 2 (all), "
                     "got %d", (int)mode);
        return NULL;
    }
    CORE(self)->wb_mode = mode;
    Py_RETURN_NONE;
}

static PyObject *Core_set_events(PyObject *self, PyObject *on) {
    int t = PyObject_IsTrue(on);
    if (t < 0) return NULL;
    CORE(self)->events_on = t;
    Py_RETURN_NONE;
}

/* The KV events since the last call: [(stored, tier, hash)], tier 0 gpu,
 * 1 cpu, 2 storage. */
static PyObject *Core_drain_events(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *out = PyList_New(c->n_events);
    if (out == NULL) return NULL;
    for (int32_t k = 0; k < c->n_events; k++) {
        event_t *e = &c->events[k];
        PyObject *t = Py_BuildValue("Niy#", PyBool_FromLong(e->stored), (int)e->tier,
                                    (const char *)e->hash, (Py_ssize_t)HASH_LEN);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, k, t);
    }
    c->n_events = 0;
    return out;
}

static PyObject *node_tuple(const node_t *n, int32_t i) {
    PyObject *rec = n->record ? PyBytes_FromStringAndSize((const char *)n->record, n->record_len)
                              : Py_NewRef(Py_None);
    if (rec == NULL) return NULL;
    return Py_BuildValue("iy#iiiiiKiiiiiiN", (int)i, (const char *)n->hash,
                         (Py_ssize_t)HASH_LEN, (int)n->parent, (int)n->state, (int)n->gpu,
                         (int)n->cpu, (int)n->ref, (unsigned long long)n->last_access,
                         (int)n->depth, (int)n->in_storage, (int)n->busy, (int)n->n_children,
                         (int)n->n_gpu_children, (int)n->n_cpu_children, rec);
}

static int by_key(const void *a, const void *b) {
    const heap_entry *x = a, *y = b;
    if (x->hi != y->hi) return x->hi < y->hi ? -1 : 1;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* A tier's leaves in the order eviction would take them. */
static PyObject *heap_order(const leafheap_t *h);
static PyObject *leaves_order(const core_t *c, int t) {
    const policy_t *p = c->pol[t];
    if (p == NULL) return heap_order(&c->lru[t]);
    int32_t *order;
    if (scratch(SCRATCH(&order, p->n_leaves), NULL) == NULL) return NULL;
    int64_t n = pol_order(p, order);
    PyObject *out = n == p->n_leaves ? list_of(order, (Py_ssize_t)n) : NULL;
    if (n != p->n_leaves) {
        PyErr_Format(PyExc_RuntimeError, "the policy counts %lld leaves but lists %lld",
                     (long long)p->n_leaves, (long long)n);
    }
    free(order);
    return out;
}

static PyObject *heap_order(const leafheap_t *h) {
    heap_entry *copy;
    if (scratch(SCRATCH(&copy, h->size), NULL) == NULL) return NULL;
    memcpy(copy, h->a, sizeof(heap_entry) * (size_t)h->size);
    qsort(copy, (size_t)h->size, sizeof(heap_entry), by_key);
    PyObject *out = PyList_New(h->size);
    for (int32_t k = 0; out != NULL && k < h->size; k++)
        PyList_SetItem(out, k, PyLong_FromLong(copy[k].node));
    free(copy);
    return out;
}

static PyObject *pool_ids(const pool_t *p) {
    PyObject *out = PyList_New(p->count);
    for (int32_t k = 0; out != NULL && k < p->count; k++) {
        int32_t pos = p->head + k;
        if (pos >= p->num_blocks) pos -= p->num_blocks;
        PyList_SetItem(out, k, PyLong_FromLong(p->ring[pos]));
    }
    return out;
}

/* The nodes a tier's adaptive policy tracks (holds state for), by slot:
 * the invariants check they are exactly the nodes holding the tier's copy.
 * Empty under LRU. */
static PyObject *tracked_nodes(const core_t *c, int t) {
    PyObject *out = PyList_New(0);
    const policy_t *p = c->pol[t];
    for (int32_t i = 1; out != NULL && p != NULL && i < c->n_slots; i++) {
        if (!pol_tracked(p, i)) continue;
        PyObject *v = PyLong_FromLong(i);
        if (v == NULL || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

/* Everything, as plain data, for the invariant checks and the tests (O(n)).
 * nodes: (id, hash, parent, state, gpu, cpu, ref, last_access, depth,
 * in_storage, busy, n_children, n_gpu_children, n_cpu_children, record),
 * root excluded, in a walk's order. */
static PyObject *Core_snapshot(PyObject *self, PyObject *unused) {
    core_t *c = CORE(self);
    PyObject *nodes = PyList_New(0);
    if (nodes == NULL) return NULL;
    int32_t *stack;
    if (scratch(SCRATCH(&stack, c->num_nodes + 1), NULL) == NULL) {
        Py_DECREF(nodes);
        return NULL;
    }
    int32_t sp = 0;
    kid_iter it;
    for (kid_first(c, ROOT, &it); it.node != NIL; kid_next(c, &it)) stack[sp++] = it.node;
    while (sp > 0) {
        int32_t i = stack[--sp];
        PyObject *t = node_tuple(N(c, i), i);
        if (t == NULL || PyList_Append(nodes, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(nodes);
            free(stack);
            return NULL;
        }
        Py_DECREF(t);
        for (kid_first(c, i, &it); it.node != NIL; kid_next(c, &it)) {
            if (sp > c->num_nodes) break; /* a corrupt tree: the check will say so */
            stack[sp++] = it.node;
        }
    }
    free(stack);
    return Py_BuildValue("{sNsNsNsNsNsNsisisisKsisisisssNsN}", "nodes", nodes, "gpu_lru",
                         leaves_order(c, T_GPU), "cpu_lru", leaves_order(c, T_CPU),
                         "gpu_free", pool_ids(&c->pools[T_GPU]), "cpu_free",
                         pool_ids(&c->pools[T_CPU]), "root_children",
                         Py_BuildValue("(ii)", (int)N(c, ROOT)->n_gpu_children,
                                       (int)N(c, ROOT)->n_cpu_children),
                         "num_nodes", (int)c->num_nodes, "gpu_idle", (int)c->n_gpu_idle,
                         "gpu_blocks", (int)c->pools[T_GPU].num_blocks, "clock",
                         (unsigned long long)c->clock, "cpu_blocks",
                         (int)c->pools[T_CPU].num_blocks, "block_size", (int)c->block_size,
                         "external", c->external, "policy", POLICY_NAMES[c->policy],
                         "gpu_tracked", tracked_nodes(c, T_GPU), "cpu_tracked",
                         tracked_nodes(c, T_CPU));
}

/* The node of hash h, or -1 (tests and checks). */
static PyObject *Core_find(PyObject *self, PyObject *h) {
    const uint8_t *p;
    Py_ssize_t n;
    if (bytes_arg(h, "hash", &p, &n) < 0) return NULL;
    if (n != HASH_LEN) return PyLong_FromLong(-1);
    return PyLong_FromLong(find_by_hash(CORE(self), p));
}

#define INT_GETTER(name, expr)                                                 \
    static PyObject *Core_get_##name(PyObject *self, void *closure) {         \
        const core_t *c = CORE(self);                                         \
        return PyLong_FromLongLong((long long)(expr));                        \
    }
INT_GETTER(gpu_free, c->pools[T_GPU].count)
INT_GETTER(cpu_free, c->pools[T_CPU].count)
INT_GETTER(gpu_idle, c->n_gpu_idle)
INT_GETTER(num_nodes, c->num_nodes)
INT_GETTER(clock, c->clock)
INT_GETTER(gpu_leaves, leaves_count(c, T_GPU))
INT_GETTER(cpu_leaves, leaves_count(c, T_CPU))
INT_GETTER(batch_size, c->n_batch)
INT_GETTER(block_size, c->block_size)
INT_GETTER(gpu_blocks, c->pools[T_GPU].num_blocks)
INT_GETTER(cpu_blocks, c->pools[T_CPU].num_blocks)
INT_GETTER(external, c->external)

static PyObject *Core_get_policy(PyObject *self, void *closure) {
    return PyUnicode_FromString(POLICY_NAMES[CORE(self)->policy]);
}

static PyGetSetDef core_getset[] = {
    {"policy", Core_get_policy, NULL, "the eviction policy: 'lru' or 'adaptive'", NULL},
    {"gpu_free", Core_get_gpu_free, NULL, "free GPU blocks", NULL},
    {"cpu_free", Core_get_cpu_free, NULL, "free CPU blocks", NULL},
    {"gpu_idle", Core_get_gpu_idle, NULL, "GPU nodes no request holds (what eviction can free)", NULL},
    {"num_nodes", Core_get_num_nodes, NULL, "cached nodes (the root excluded)", NULL},
    {"clock", Core_get_clock, NULL, "the logical clock last_access is stamped with", NULL},
    {"gpu_leaves", Core_get_gpu_leaves, NULL, "evictable GPU leaves", NULL},
    {"cpu_leaves", Core_get_cpu_leaves, NULL, "evictable CPU leaves", NULL},
    {"batch_size", Core_get_batch_size, NULL, "nodes in the swap-out batch in progress", NULL},
    {"block_size", Core_get_block_size, NULL, "tokens per block", NULL},
    {"gpu_blocks", Core_get_gpu_blocks, NULL, "GPU pool size", NULL},
    {"cpu_blocks", Core_get_cpu_blocks, NULL, "CPU pool size", NULL},
    {"external", Core_get_external, NULL, "1 when the engine owns the GPU tier", NULL},
    {NULL},
};

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Core_##name, METH_FASTCALL, doc}
static PyMethodDef core_methods[] = {
    FAST(request, "request(namespace, tokens, extra) -> Request: hash the full blocks (memo walk)"),
    FAST(extend_hashes, "extend_hashes(req, tokens, full): hash blocks up to full (no memo walk)"),
    FAST(match, "match(req, limit, with_cpu=True) -> (n_gpu, n_matched, gpu_ids): reference "
                "the cached prefix (GPU hits, then CPU hits unless with_cpu is false)"),
    {"undo_match", Core_undo_match, METH_O, "undo_match(req): exactly undo match()"},
    {"hit", Core_hit, METH_O,
     "hit(req): the matched path is taken (allocate goes ahead): the policy counts its hits "
     "(nothing under LRU)"},
    {"unref_path", Core_unref_path, METH_O, "unref_path(req): the request is done with its path"},
    {"tick", Core_tick, METH_NOARGS, "tick(): advance the logical clock"},
    FAST(alloc, "alloc(tier, n) -> list[int]: take n free blocks (ValueError if fewer)"),
    FAST(free, "free(tier, ids, front=False): return blocks (all checked first)"),
    FAST(evict, "evict(count, swap, freed) -> (status, freed): 0 done, 1 flush, 2 empty"),
    {"batch_copies", Core_batch_copies, METH_NOARGS,
     "batch_copies() -> (gpu_ids, cpu_ids): the copies the swap-out batch needs"},
    {"land_swap_out", Core_land_swap_out, METH_NOARGS, "land_swap_out(): the batch was copied"},
    {"rollback_swap_out", Core_rollback_swap_out, METH_NOARGS,
     "rollback_swap_out(): the batch's copy failed"},
    FAST(plan_swap_in, "plan_swap_in(req, start, gpu_ids) -> cpu_ids"),
    FAST(plan_load, "plan_load(req, start, n, gpu_ids) -> (nodes, cpu_ids, host blocks got)"),
    FAST(finish_fetch, "finish_fetch(req, start, nodes, ok, is_load, missing) -> cut or -1"),
    FAST(insert, "insert(req, blocks, full): cache the request's computed blocks"),
    FAST(plan_store, "plan_store(req, start, min_uses=0) -> (nodes, cpu_ids, gpu_ids, hashes): "
                     "stage GPU blocks used >= min_uses times into host blocks for a store"),
    FAST(finish_store, "finish_store(nodes, stored | None, staged=not external)"),
    FAST(plan_store_host, "plan_store_host(req, min_uses=0) -> (nodes, cpu_ids, hashes): "
                          "host copies used >= min_uses times to store from their host blocks"),
    {"take_writebacks", Core_take_writebacks, METH_NOARGS,
     "take_writebacks() -> (nodes, cpu_ids, hashes): CPU victims held for write-back"},
    {"set_write_back", Core_set_write_back, METH_O,
     "set_write_back(mode): CPU victims written back: 0 none, 1 reused ones, 2 all"},
    {"drop_gpu_tier", Core_drop_gpu_tier, METH_NOARGS, "forget every GPU copy"},
    {"drop_cpu_tier", Core_drop_cpu_tier, METH_NOARGS, "forget every CPU copy"},
    {"forget_storage", Core_forget_storage, METH_NOARGS, "forget what storage holds"},
    FAST(request_hashes, "request_hashes(namespace, engine_hashes) -> Request: a request whose "
                         "blocks the engine hashed (keys: BLAKE2b(namespace || hash))"),
    FAST(add_hashes, "add_hashes(req, engine_hashes): more blocks of the request"),
    FAST(cpu_prefix, "cpu_prefix(req, limit) -> (n, moving): leading blocks the CPU tier holds; "
                     "moving: the next one is being fetched or saved"),
    FAST(path_blocks, "path_blocks(req, start, stop, tier) -> block ids of path nodes"),
    FAST(ext_save, "ext_save(req, upto) -> (nodes, cpu_ids, block positions) to copy"),
    FAST(ext_finish_save, "ext_finish_save(req, nodes, blocks, ok)"),
    {"counters", Core_counters, METH_NOARGS,
     "counters() -> {evictions, dedup_blocks, memo_hits, blocks_hashed}"},
    {"set_events", Core_set_events, METH_O, "set_events(on): record KV events"},
    {"policy_stats", Core_policy_stats, METH_NOARGS,
     "policy_stats() -> {policy, params, gpu, cpu}: the eviction policy's state in numbers"},
    FAST(policy_node, "policy_node(tier, node) -> (class, stamp, listed) | None: tests"),
    {"set_policy_log", Core_set_policy_log, METH_O,
     "set_policy_log(on): tests: record every call the core makes on its policies"},
    {"drain_policy_log", Core_drain_policy_log, METH_NOARGS,
     "drain_policy_log() -> [(tier, method, key, clock)]: the calls recorded since the last drain"},
    {"drain_events", Core_drain_events, METH_NOARGS, "drain_events() -> [(stored, tier, hash)]"},
    {"snapshot", Core_snapshot, METH_NOARGS, "snapshot() -> dict: everything, as plain data"},
    {"find", Core_find, METH_O, "find(hash) -> node id or -1"},
    {NULL},
};

static PyType_Slot core_slots[] = {
    {Py_tp_new, core_new},
    {Py_tp_dealloc, core_dealloc},
    {Py_tp_methods, core_methods},
    {Py_tp_getset, core_getset},
    {Py_tp_doc, "The cache core: tree, pools and leaf heaps of one manager."},
    {0, NULL},
};

PyType_Spec core_spec = {"kvcached.core._core.Core", sizeof(CoreObject), 0,
                         Py_TPFLAGS_DEFAULT, core_slots};
