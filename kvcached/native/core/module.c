/* kvcached.core._core: the cache core as two Python types.
 *
 *   Core     the tree, pools and leaf heaps of one manager; every method is
 *            one transition of ops.c, taking and returning plain ints,
 *            lists and bytes (plans the manager turns into transfer tasks)
 *   Request  one request's block hashes and path (made by Core.request)
 *
 * Public, documented C API only (no object internals, no _Py or PyUnstable
 * calls): heap types, multi-phase init, per-module state. Built per
 * interpreter rather than as abi3 for one reason, the token read below
 * (setup.py says why). The caller (the manager) holds one lock around every
 * call, which is also what lets the module run without the GIL on
 * free-threaded builds.
 *
 * Tokens are read once per call, as the engine gives them: a list or tuple
 * of ints (PyLong_AsLongLong per item), or any C-contiguous integer buffer
 * (numpy, array: copied at memcpy speed). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "hashing.h"

typedef struct {
    PyTypeObject *core_type, *request_type, *policy_type;
} module_state;

typedef struct {
    PyObject_HEAD
    core_t c;
} CoreObject;

typedef struct {
    PyObject_HEAD
    PyObject *core; /* the Core whose nodes the path names (kept alive) */
    request_t r;
} RequestObject;

static const char *EVICTION_NAMES[EV_COUNT] = {"gpu_dropped", "cpu_dropped", "gpu_to_cpu",
                                               "gpu_to_cpu_backup"};
static const char *TIER_NAMES[2] = {"gpu", "cpu"};

static module_state *state_of(PyObject *self) {
    return (module_state *)PyType_GetModuleState(Py_TYPE(self));
}

/* ---------------------------------------------------------------- helpers */

static int as_i32(PyObject *o, const char *what, int32_t *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s %ld is out of range", what, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* A list of ints as a malloc'd int32 array (*n set); NULL with an exception. */
static int32_t *ints_of(PyObject *list, const char *what, Py_ssize_t *n) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of ints", what);
        return NULL;
    }
    *n = PyList_Size(list);
    int32_t *out = malloc(sizeof(int32_t) * (size_t)(*n ? *n : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t k = 0; k < *n; k++) {
        if (as_i32(PyList_GetItem(list, k), what, &out[k]) < 0) {
            free(out);
            return NULL;
        }
    }
    return out;
}

static PyObject *list_of(const int32_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *x = PyLong_FromLong(v[k]);
        if (x == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, k, x);
    }
    return out;
}

static PyObject *hash_list(const uint8_t *hashes, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *h = PyBytes_FromStringAndSize((const char *)hashes + k * HASH_LEN, HASH_LEN);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, k, h);
    }
    return out;
}

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

static int bytes_arg(PyObject *o, const char *what, const uint8_t **p, Py_ssize_t *n) {
    char *s;
    if (!PyBytes_Check(o) || PyBytes_AsStringAndSize(o, &s, n) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s must be bytes", what);
        return -1;
    }
    *p = (const uint8_t *)s;
    return 0;
}

/* ----------------------------------------------------------------- tokens */

static int token_error(PyObject *item, Py_ssize_t i) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyObject *name = PyType_GetName(Py_TYPE(item));
        PyErr_Format(PyExc_TypeError, "token %zd is a %S, not an int", i, name);
        Py_XDECREF(name);
    } else if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "token %zd is outside int64", i);
    }
    return -1;
}

static inline PyObject *item_at(PyObject *seq, int is_list, Py_ssize_t i) {
    return is_list ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

/* Tokens [lo, hi) of a list or tuple as int64, at out. The int objects lie
 * all over the heap, and reading them is most of a resident hit's cost: the
 * item pointers are collected first (into out itself) so that each object
 * can be prefetched well before it is read. Only exact ints are read that
 * way (converting them runs no Python code, so the sequence cannot change
 * meanwhile); from the first other item on, each item is fetched as it is
 * converted (its __index__ may run anything). */
static int read_items(PyObject *seq, int is_list, Py_ssize_t lo, Py_ssize_t hi, int64_t *out) {
    enum { AHEAD = 16 };
    Py_ssize_t n = hi - lo;
#if !defined(Py_LIMITED_API) && !defined(Py_GIL_DISABLED)
    /* PyList_GET_ITEM is public API, but not limited API: reading the item
     * array in place instead of a PyList_GetItem call per token is ~20% of
     * a resident request (docs/benchmarks.md), hence the per-interpreter build. */
    PyObject **items = is_list ? &PyList_GET_ITEM(seq, 0) : &PyTuple_GET_ITEM(seq, 0);
    for (Py_ssize_t k = 0; k < n; k++) out[k] = (int64_t)(intptr_t)items[lo + k];
#else
    for (Py_ssize_t k = 0; k < n; k++) out[k] = (int64_t)(intptr_t)item_at(seq, is_list, lo + k);
#endif
    Py_ssize_t k = 0, exact = n;
    for (; k < n; k++) {
        if (k + AHEAD < n) {
            __builtin_prefetch((const void *)(intptr_t)out[k + AHEAD]);
        }
        PyObject *item = (PyObject *)(intptr_t)out[k];
        if (!PyLong_CheckExact(item)) {
            exact = k;
            break;
        }
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) return token_error(item, lo + k);
        out[k] = (int64_t)v;
    }
    k = exact;
    for (; k < n; k++) {
        Py_ssize_t size = is_list ? PyList_Size(seq) : PyTuple_Size(seq);
        if (lo + k >= size) {
            PyErr_SetString(PyExc_ValueError, "tokens changed size while being read");
            return -1;
        }
        PyObject *item = item_at(seq, is_list, lo + k);
        Py_INCREF(item); /* its __index__ may drop the sequence's reference */
        long long v = PyLong_AsLongLong(item);
        int failed = v == -1 && PyErr_Occurred();
        if (failed) token_error(item, lo + k);
        Py_DECREF(item);
        if (failed) return -1;
        out[k] = (int64_t)v;
    }
    return 0;
}

/* Tokens [lo, hi) of a list, tuple or integer buffer as int64, at out. */
static int read_tokens(PyObject *tokens, Py_ssize_t lo, Py_ssize_t hi, int64_t *out) {
    int is_list = PyList_Check(tokens);
    if (is_list || PyTuple_Check(tokens)) {
        Py_ssize_t size = is_list ? PyList_Size(tokens) : PyTuple_Size(tokens);
        if (hi > size) {
            PyErr_SetString(PyExc_ValueError, "tokens changed size while being read");
            return -1;
        }
        return read_items(tokens, is_list, lo, hi, out);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a list or tuple of ints or an integer array, not %S",
                     (PyObject *)Py_TYPE(tokens));
        return -1;
    }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '@' || *f == '=') f++;
    char kind = f[0] != '\0' && f[1] == '\0' ? f[0] : '?';
    Py_ssize_t size = view.itemsize, n = view.len / (size ? size : 1);
    int ok = strchr("bhilqBHI", kind) != NULL || (kind == 'L' && size == 4);
    if (!ok || view.ndim > 1) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_TypeError, "tokens must be a 1-d buffer of signed ints (or unsigned of "
                                      "at most 32 bits), got format %s", view.format ? view.format : "B");
        return -1;
    }
    if (hi > n) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "tokens changed size while being read");
        return -1;
    }
    const char *p = (const char *)view.buf;
    int is_signed = kind >= 'a';
    for (Py_ssize_t i = lo; i < hi; i++) {
        const char *x = p + i * size;
        int64_t v;
        if (size == 8) {
            memcpy(&v, x, 8);
        } else if (size == 4) {
            int32_t s;
            memcpy(&s, x, 4);
            v = is_signed ? s : (int64_t)(uint32_t)s;
        } else if (size == 2) {
            int16_t s;
            memcpy(&s, x, 2);
            v = is_signed ? s : (int64_t)(uint16_t)s;
        } else {
            v = is_signed ? (int64_t)(signed char)*x : (int64_t)(unsigned char)*x;
        }
        out[i - lo] = v;
    }
    PyBuffer_Release(&view);
    return 0;
}

/* How many tokens; for a buffer, also that it is 1-d and of integers. */
static Py_ssize_t token_count(PyObject *tokens) {
    if (PyList_Check(tokens)) return PyList_Size(tokens);
    if (PyTuple_Check(tokens)) return PyTuple_Size(tokens);
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a list or tuple of ints or an integer array, not %S",
                     (PyObject *)Py_TYPE(tokens));
        return -1;
    }
    Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    int ndim = view.ndim;
    PyBuffer_Release(&view);
    if (ndim > 1) {
        PyErr_Format(PyExc_TypeError, "tokens must be a 1-d array, got %d dimensions", ndim);
        return -1;
    }
    return n;
}

/* ------------------------------------------------------------- requests */

static void request_clear(core_t *c, request_t *r) {
    if (r->records != NULL) {
        for (int32_t k = 0; k < r->n_hashes; k++) rec_free(c, r->records[k], r->record_lens[k]);
    }
    free(r->records);
    free(r->record_lens);
    free(r->walk);
    free(r->hashes);
    free(r->path);
    free(r->extra);
    memset(r, 0, sizeof *r);
}

static int request_reserve(request_t *r, int32_t n, int memo) {
    if (r->hash_cap >= n) return 0;
    int32_t cap = r->hash_cap ? r->hash_cap : 8;
    while (cap < n) cap *= 2;
    uint8_t *h = realloc(r->hashes, (size_t)cap * HASH_LEN);
    if (h == NULL) return -1;
    r->hashes = h;
    int32_t *w = realloc(r->walk, sizeof(int32_t) * (size_t)cap);
    if (w == NULL) return -1;
    r->walk = w;
    if (memo) {
        uint8_t **rec = realloc(r->records, sizeof(uint8_t *) * (size_t)cap);
        if (rec == NULL) return -1;
        r->records = rec;
        uint32_t *len = realloc(r->record_lens, sizeof(uint32_t) * (size_t)cap);
        if (len == NULL) return -1;
        r->record_lens = len;
        for (int32_t k = r->hash_cap; k < cap; k++) r->records[k] = NULL;
    }
    r->hash_cap = cap;
    return 0;
}

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
 * record for the node commit makes. */
static int hash_blocks(core_t *c, request_t *r, const int64_t *ids, int32_t stop, int walk) {
    int32_t bs = c->block_size, first = r->n_hashes;
    if (request_reserve(r, stop, c->memo) < 0) return -1;
    uint8_t *rec = c->memo ? malloc(record_room(r->extra_len, bs)) : NULL;
    if (c->memo && rec == NULL) return -1;
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
    free(rec);
    return 0;
}

/* -------------------------------------------------------- policy params */

static const char *POLICY_NAMES[] = {"lru", "adaptive"};
static const char *PARAM_NAMES[] = {"classes", "bins", "windows_per_capacity", "ghost_factor",
                                    "ways", "decay_shift", "ghost_bits", "ghost_win_bits",
                                    "min_window"};
static const size_t PARAM_OFFSETS[] = {
    offsetof(pol_params_t, classes), offsetof(pol_params_t, bins),
    offsetof(pol_params_t, windows_per_capacity), offsetof(pol_params_t, ghost_factor),
    offsetof(pol_params_t, ways), offsetof(pol_params_t, decay_shift),
    offsetof(pol_params_t, ghost_bits), offsetof(pol_params_t, ghost_win_bits),
    offsetof(pol_params_t, min_window)};
#define N_PARAMS ((int)(sizeof PARAM_OFFSETS / sizeof PARAM_OFFSETS[0]))

static int32_t *param_at(pol_params_t *p, int k) {
    return (int32_t *)((char *)p + PARAM_OFFSETS[k]);
}

/* The adaptive policy's constants: the defaults, overridden by a dict's
 * (tests/reference/policy.py AdaptiveParams has the same names). */
static int params_arg(PyObject *d, pol_params_t *out) {
    pol_default_params(out);
    if (d != NULL && d != Py_None) {
        if (!PyDict_Check(d)) {
            PyErr_SetString(PyExc_TypeError, "policy_params must be a dict");
            return -1;
        }
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(d, &pos, &key, &value)) {
            const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
            if (name == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "policy_params keys are names");
                return -1;
            }
            int k = 0;
            while (k < N_PARAMS && strcmp(name, PARAM_NAMES[k]) != 0) k++;
            if (k == N_PARAMS) {
                PyErr_Format(PyExc_ValueError, "unknown policy parameter %R", key);
                return -1;
            }
            if (as_i32(value, name, param_at(out, k)) < 0) return -1;
        }
    }
    const char *bad = pol_check_params(out);
    if (bad != NULL) {
        PyErr_SetString(PyExc_ValueError, bad);
        return -1;
    }
    return 0;
}

static PyObject *params_dict(const pol_params_t *p) {
    PyObject *d = PyDict_New();
    for (int k = 0; d != NULL && k < N_PARAMS; k++) {
        PyObject *v = PyLong_FromLong(*param_at((pol_params_t *)p, k));
        if (v == NULL || PyDict_SetItemString(d, PARAM_NAMES[k], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
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

#define CORE(self) (&((CoreObject *)(self))->c)

static request_t *request_arg(PyObject *self, PyObject *o) {
    module_state *st = state_of(self);
    if (!PyObject_TypeCheck(o, st->request_type)) {
        PyErr_SetString(PyExc_TypeError, "expected a Request made by Core.request");
        return NULL;
    }
    RequestObject *r = (RequestObject *)o;
    if (r->core != self) {
        PyErr_SetString(PyExc_ValueError, "the Request belongs to another Core");
        return NULL;
    }
    return &r->r;
}

static PyObject *new_request(PyObject *self, const uint8_t *ns, const uint8_t *extra,
                             Py_ssize_t extra_len) {
    module_state *st = state_of(self);
    allocfunc alloc = (allocfunc)PyType_GetSlot(st->request_type, Py_tp_alloc);
    RequestObject *req = (RequestObject *)alloc(st->request_type, 0);
    if (req == NULL) return NULL;
    memset(&req->r, 0, sizeof req->r);
    req->core = Py_NewRef(self);
    req->r.chain_open = 1;
    req->r.unlisted[0].node = req->r.unlisted[1].node = NIL;
    if (ns != NULL) memcpy(req->r.ns, ns, HASH_LEN);
    req->r.extra = malloc(extra_len ? (size_t)extra_len : 1);
    if (req->r.extra == NULL) {
        Py_DECREF(req);
        return PyErr_NoMemory();
    }
    memcpy(req->r.extra, extra, (size_t)extra_len);
    req->r.extra_len = (size_t)extra_len;
    return (PyObject *)req;
}

/* Hash tokens' blocks [r->n_hashes, stop) into r (walk: the memo walk). */
static int hash_tokens(core_t *c, request_t *r, PyObject *tokens, int32_t stop, int walk) {
    int32_t bs = c->block_size, first = r->n_hashes;
    if (stop <= first) return 0;
    Py_ssize_t n = (Py_ssize_t)(stop - first) * bs;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (read_tokens(tokens, (Py_ssize_t)first * bs, (Py_ssize_t)stop * bs, ids) < 0) {
        free(ids);
        return -1;
    }
    int rc = hash_blocks(c, r, ids, stop, walk);
    free(ids);
    if (rc < 0) PyErr_NoMemory();
    return rc;
}

static PyObject *Core_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "request(namespace, tokens, extra)");
        return NULL;
    }
    const uint8_t *ns, *extra;
    Py_ssize_t ns_len, extra_len;
    if (bytes_arg(args[0], "namespace", &ns, &ns_len) < 0 ||
        bytes_arg(args[2], "extra", &extra, &extra_len) < 0)
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
    if (nargs != 3 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[2], "full", &full) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "extend_hashes(req, tokens, full)");
        return NULL;
    }
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
    if (nargs < 2 || nargs > 3 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "limit", &limit) < 0 ||
        (nargs == 3 && (with_cpu = PyObject_IsTrue(args[2])) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "match(req, limit, with_cpu=True)");
        return NULL;
    }
    if (r->n_path) {
        PyErr_SetString(PyExc_RuntimeError, "the request already holds its path");
        return NULL;
    }
    int32_t room = limit < r->n_hashes ? limit : r->n_hashes;
    int32_t *gpu_ids = malloc(sizeof(int32_t) * (size_t)(room > 0 ? room : 1));
    if (gpu_ids == NULL || core_match(CORE(self), r, limit < 0 ? 0 : limit, with_cpu, &n_gpu, gpu_ids) < 0) {
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

static int tier_arg(PyObject *o, int *tier) {
    long t = PyLong_AsLong(o);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (t != T_GPU && t != T_CPU) {
        PyErr_Format(PyExc_ValueError, "tier must be 0 (gpu) or 1 (cpu), got %ld", t);
        return -1;
    }
    *tier = (int)t;
    return 0;
}

static PyObject *Core_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int tier;
    int32_t n;
    if (nargs != 2 || tier_arg(args[0], &tier) < 0 || as_i32(args[1], "n", &n) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "alloc(tier, n)");
        return NULL;
    }
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
    if (nargs < 2 || nargs > 3 || tier_arg(args[0], &tier) < 0 ||
        (nargs == 3 && (front = PyObject_IsTrue(args[2])) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "free(tier, ids, front=False)");
        return NULL;
    }
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
    if (nargs != 3 || as_i32(args[0], "count", &count) < 0 ||
        (swap = PyObject_IsTrue(args[1])) < 0 || as_i32(args[2], "freed", &freed) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "evict(count, swap, freed)");
        return NULL;
    }
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
    if (nargs != 3 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "start", &start) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "plan_swap_in(req, start, gpu_ids)");
        return NULL;
    }
    Py_ssize_t n;
    int32_t *gpu = ints_of(args[2], "gpu_ids", &n);
    if (gpu == NULL) return NULL;
    int32_t *cpu = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    PyObject *out = NULL;
    if (cpu == NULL) {
        PyErr_NoMemory();
    } else if (path_range(r, start, n) == 0) {
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
    if (nargs != 4 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "start", &start) < 0 || as_i32(args[2], "n", &want) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "plan_load(req, start, n, gpu_ids)");
        return NULL;
    }
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
    int32_t *nodes = malloc(sizeof(int32_t) * (size_t)(want ? want : 1));
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)(want ? want : 1));
    PyObject *out = NULL;
    if (nodes == NULL || cpus == NULL) {
        PyErr_NoMemory();
    } else {
        int32_t got;
        int32_t m = core_plan_load(CORE(self), r, start, want, gpu, nodes, cpus, &got);
        out = Py_BuildValue("NNi", list_of(nodes, m), list_of(cpus, m), (int)got);
    }
    free(gpu);
    free(nodes);
    free(cpus);
    return out;
}

static PyObject *Core_finish_fetch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, ok;
    int is_load, missing;
    request_t *r;
    if (nargs != 6 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "start", &start) < 0 || as_i32(args[3], "ok", &ok) < 0 ||
        (is_load = PyObject_IsTrue(args[4])) < 0 || (missing = PyObject_IsTrue(args[5])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "finish_fetch(req, start, nodes, ok, is_load, missing)");
        return NULL;
    }
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
    if (nargs != 3 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[2], "full", &full) < 0 || !PyList_Check(args[1])) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "insert(req, blocks: list, full)");
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
    int32_t *blocks = malloc(sizeof(int32_t) * (size_t)full);
    if (blocks == NULL) return PyErr_NoMemory();
    for (int32_t k = from; k < full; k++) {
        if (as_i32(PyList_GetItem(list, k), "block id", &blocks[k]) < 0) {
            free(blocks);
            return NULL;
        }
    }
    int32_t *before = malloc(sizeof(int32_t) * (size_t)full);
    if (before == NULL) {
        free(blocks);
        return PyErr_NoMemory();
    }
    memcpy(before + from, blocks + from, sizeof(int32_t) * (size_t)(full - from));
    const char *err = NULL;
    int rc = core_insert(CORE(self), r, blocks, full, &err);
    /* dedups replace block ids in the engine's block table */
    for (int32_t k = from; k < full && rc >= -1; k++) {
        if (blocks[k] != before[k]) PyList_SetItem(list, k, PyLong_FromLong(blocks[k]));
    }
    free(blocks);
    free(before);
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
    if (nargs < 2 || nargs > 3 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "start", &start) < 0 ||
        (nargs == 3 && as_i32(args[2], "min_uses", &min_uses) < 0)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "plan_store(req, start, min_uses=0)");
        return NULL;
    }
    if (path_range(r, start, 0) < 0) return NULL;
    int32_t room = r->n_path - start;
    int32_t *nodes = malloc(sizeof(int32_t) * (size_t)(room ? room : 1));
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)(room ? room : 1));
    int32_t *gpus = malloc(sizeof(int32_t) * (size_t)(room ? room : 1));
    uint8_t *hashes = malloc((size_t)HASH_LEN * (size_t)(room ? room : 1));
    PyObject *out = NULL;
    if (nodes == NULL || cpus == NULL || gpus == NULL || hashes == NULL) {
        PyErr_NoMemory();
    } else {
        core_t *c = CORE(self);
        int32_t m = core_plan_store(c, r, start, min_uses, nodes, cpus);
        for (int32_t k = 0; k < m; k++) {
            gpus[k] = N(c, nodes[k])->gpu;
            memcpy(hashes + (size_t)k * HASH_LEN, N(c, nodes[k])->hash, HASH_LEN);
        }
        out = Py_BuildValue("NNNN", list_of(nodes, m), list_of(cpus, m), list_of(gpus, m),
                            hash_list(hashes, m));
    }
    free(nodes);
    free(cpus);
    free(gpus);
    free(hashes);
    return out;
}

static PyObject *Core_finish_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError,
                        "finish_store(nodes, stored: list[bool] | None, staged=not external)");
        return NULL;
    }
    int staged = nargs == 3 ? PyObject_IsTrue(args[2]) : !CORE(self)->external;
    if (staged < 0) return NULL;
    Py_ssize_t n;
    int32_t *nodes = ints_of(args[0], "nodes", &n);
    if (nodes == NULL) return NULL;
    uint8_t *stored = calloc((size_t)(n ? n : 1), 1);
    int ok = args[1] != Py_None;
    if (stored == NULL || check_nodes(CORE(self), nodes, n) < 0) goto fail;
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
    if (stored == NULL && !PyErr_Occurred()) PyErr_NoMemory();
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
    if (nargs != 2 || bytes_arg(args[0], "namespace", &ns, &ns_len) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "request_hashes(namespace, hashes)");
        return NULL;
    }
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
    if (nargs != 2 || (r = request_arg(self, args[0])) == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "add_hashes(req, hashes)");
        return NULL;
    }
    if (append_hashes(CORE(self), r, args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The GPU or CPU block ids of the request's path nodes [start, stop). */
static PyObject *Core_path_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int32_t start, stop;
    int tier;
    request_t *r;
    if (nargs != 4 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "start", &start) < 0 || as_i32(args[2], "stop", &stop) < 0 ||
        tier_arg(args[3], &tier) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "path_blocks(req, start, stop, tier)");
        return NULL;
    }
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
    if (nargs != 2 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "limit", &limit) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "cpu_prefix(req, limit)");
        return NULL;
    }
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
    if (nargs != 2 || (r = request_arg(self, args[0])) == NULL ||
        as_i32(args[1], "upto", &upto) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ext_save(req, upto)");
        return NULL;
    }
    if (need_external(self) < 0) return NULL;
    int32_t room = upto > r->n_path ? upto - r->n_path : 1;
    int32_t *nodes = malloc(sizeof(int32_t) * (size_t)room);
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)room);
    int32_t *blocks = malloc(sizeof(int32_t) * (size_t)room);
    PyObject *out = NULL;
    if (nodes == NULL || cpus == NULL || blocks == NULL) {
        PyErr_NoMemory();
    } else {
        int32_t m = core_ext_save(CORE(self), r, upto, nodes, cpus, blocks);
        out = Py_BuildValue("NNN", list_of(nodes, m), list_of(cpus, m), list_of(blocks, m));
    }
    free(nodes);
    free(cpus);
    free(blocks);
    return out;
}

static PyObject *Core_ext_finish_save(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request_t *r;
    int ok;
    if (nargs != 4 || (r = request_arg(self, args[0])) == NULL ||
        (ok = PyObject_IsTrue(args[3])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "ext_finish_save(req, nodes, blocks, ok)");
        return NULL;
    }
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
    if (nargs < 1 || nargs > 2 || (r = request_arg(self, args[0])) == NULL ||
        (nargs == 2 && as_i32(args[1], "min_uses", &min_uses) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "plan_store_host(req, min_uses=0)");
        return NULL;
    }
    int32_t room = r->n_path ? r->n_path : 1;
    int32_t *nodes = malloc(sizeof(int32_t) * (size_t)room);
    int32_t *cpus = malloc(sizeof(int32_t) * (size_t)room);
    uint8_t *hashes = malloc((size_t)HASH_LEN * (size_t)room);
    PyObject *out = NULL;
    if (nodes == NULL || cpus == NULL || hashes == NULL) {
        PyErr_NoMemory();
    } else {
        core_t *c = CORE(self);
        int32_t m = core_plan_store_host(c, r, min_uses, nodes, cpus);
        for (int32_t k = 0; k < m; k++)
            memcpy(hashes + (size_t)k * HASH_LEN, N(c, nodes[k])->hash, HASH_LEN);
        out = Py_BuildValue("NNN", list_of(nodes, m), list_of(cpus, m), hash_list(hashes, m));
    }
    free(nodes);
    free(cpus);
    free(hashes);
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

/* One tier's adaptive policy, as numbers (status, metrics, tests). */
static PyObject *policy_tier_stats(const policy_t *p) {
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsKsKsL}", "ghost_entries", (long long)p->ghost_size, "ghost_slots",
        (long long)pol_ghost_slots(p), "ghost_bytes", (long long)pol_ghost_bytes(p), "ghost_hits",
        (long long)p->ghost_hits, "inserts", (long long)p->tick, "hits", (long long)p->hits_seen,
        "leaves", (long long)p->n_leaves, "node_bytes", (long long)(sizeof(pnode_t) * (size_t)p->cap),
        "window", (unsigned long long)p->window, "cur_win", (unsigned long long)p->cur_win,
        "table_bytes",
        (long long)((sizeof(uint64_t) * 3 + sizeof(uint16_t) * 2 + sizeof(plist_t)) *
                    (size_t)p->n_ranks));
}

/* {"policy": name, "params": {...} (adaptive), "gpu"/"cpu": per tier (adaptive)}. */
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
    if (nargs != 2 || tier_arg(args[0], &tier) < 0 || as_i32(args[1], "node", &i) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "policy_node(tier, node)");
        return NULL;
    }
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
        PyObject *t = key ? Py_BuildValue("isN", (int)((head >> 8) & 0xFF), PL_NAMES[op], key)
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
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(p->n_leaves ? p->n_leaves : 1));
    if (order == NULL) return PyErr_NoMemory();
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
    heap_entry *copy = malloc(sizeof(heap_entry) * (size_t)(h->size ? h->size : 1));
    if (copy == NULL) return PyErr_NoMemory();
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
    int32_t *stack = malloc(sizeof(int32_t) * (size_t)(c->num_nodes + 1));
    if (stack == NULL) {
        Py_DECREF(nodes);
        return PyErr_NoMemory();
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
     "drain_policy_log() -> [(tier, method, key)]: the calls recorded since the last drain"},
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

static PyType_Spec core_spec = {"kvcached.core._core.Core", sizeof(CoreObject), 0,
                                Py_TPFLAGS_DEFAULT, core_slots};

/* ---------------------------------------------------------------- Request */

static void request_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    RequestObject *r = (RequestObject *)self;
    if (r->core != NULL) request_clear(CORE(r->core), &r->r); /* its records are the core's */
    Py_XDECREF(r->core);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(self);
    Py_DECREF(tp);
}

#define R(self) (&((RequestObject *)(self))->r)

static PyObject *Request_hashes(PyObject *self, PyObject *args) {
    Py_ssize_t n = R(self)->n_hashes, start = 0, stop = n;
    if (!PyArg_ParseTuple(args, "|nn", &start, &stop)) return NULL;
    if (start < 0) start = 0;
    if (stop > n) stop = n;
    if (stop < start) stop = start;
    return hash_list(R(self)->hashes + start * HASH_LEN, stop - start);
}

static PyObject *Request_path(PyObject *self, PyObject *unused) {
    return list_of(R(self)->path, R(self)->n_path);
}

static PyObject *Request_get_n_hashes(PyObject *self, void *c) {
    return PyLong_FromLong(R(self)->n_hashes);
}
static PyObject *Request_get_n_path(PyObject *self, void *c) {
    return PyLong_FromLong(R(self)->n_path);
}
static PyObject *Request_get_chain_open(PyObject *self, void *c) {
    return PyBool_FromLong(R(self)->chain_open);
}

static PyMethodDef request_methods[] = {
    {"hashes", Request_hashes, METH_VARARGS,
     "hashes(start=0, stop=n) -> list[bytes]: the block hashes"},
    {"path", Request_path, METH_NOARGS, "path() -> list[int]: the nodes the request holds"},
    {NULL},
};

static PyGetSetDef request_getset[] = {
    {"n_hashes", Request_get_n_hashes, NULL, "blocks hashed", NULL},
    {"n_path", Request_get_n_path, NULL, "nodes the request holds", NULL},
    {"chain_open", Request_get_chain_open, NULL,
     "False once a computed block could not join the tree", NULL},
    {NULL},
};

static PyType_Slot request_slots[] = {
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_methods, request_methods},
    {Py_tp_getset, request_getset},
    {Py_tp_doc, "One request's block hashes and path (made by Core.request)."},
    {0, NULL},
};

static PyType_Spec request_spec = {"kvcached.core._core.Request", sizeof(RequestObject), 0,
                                   Py_TPFLAGS_DEFAULT, request_slots};

/* ---------------------------------------------------------------- module */

/* ----------------------------------------------------------------- Policy */

/* The adaptive policy alone, keyed by 64-bit block keys as the reference
 * (tests/reference/policy.py AdaptivePolicy) is: the differential tests replay
 * the reference's calls into it and compare every victim, and the policy
 * benchmark's simulator can run it. Entries are slots of the policy; a dict
 * maps keys to them. */
typedef struct {
    PyObject_HEAD
    policy_t p;
    int ready;
    PyObject *slots;   /* key -> slot */
    uint64_t *keys;    /* slot -> key */
    int32_t *free_slots;
    int32_t n_free, n_used, cap;
} PolicyObject;

#define POL(self) ((PolicyObject *)(self))

static void policy_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PolicyObject *o = POL(self);
    if (o->ready) pol_free(&o->p);
    Py_XDECREF(o->slots);
    free(o->keys);
    free(o->free_slots);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(self);
    Py_DECREF(tp);
}

static PyObject *policy_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"capacity", "params", NULL};
    long long capacity;
    PyObject *params_obj = NULL;
    pol_params_t params;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|O", kw, &capacity, &params_obj)) return NULL;
    if (capacity < 1 || capacity > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "capacity must be >= 1 block, got %lld", capacity);
        return NULL;
    }
    if (params_arg(params_obj, &params) < 0) return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    PolicyObject *o = (PolicyObject *)alloc(type, 0);
    if (o == NULL) return NULL;
    o->slots = PyDict_New();
    if (o->slots == NULL) {
        Py_DECREF(o);
        return NULL;
    }
    if (pol_init(&o->p, capacity, &params) < 0) {
        Py_DECREF(o);
        return PyErr_NoMemory();
    }
    o->ready = 1;
    return (PyObject *)o;
}

/* The slot of a key the policy holds (-1 with KeyError when it holds none). */
static int32_t slot_of(PolicyObject *o, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(o->slots, key);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "%R is not in the policy", key);
        return -1;
    }
    return (int32_t)PyLong_AsLong(v);
}

static int key_arg(PyObject *key, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(key);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *Policy_on_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PolicyObject *o = POL(self);
    uint64_t key;
    if (nargs < 1 || nargs > 3 || key_arg(args[0], &key) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "on_insert(key, depth, now)");
        return NULL;
    }
    int has = PyDict_Contains(o->slots, args[0]);
    if (has != 0) {
        if (has > 0) PyErr_Format(PyExc_ValueError, "%R is in the policy already", args[0]);
        return NULL;
    }
    int32_t i;
    if (o->n_free) {
        i = o->free_slots[--o->n_free];
    } else {
        if (o->n_used == o->cap) {
            int32_t cap = o->cap ? o->cap * 2 : 1024;
            uint64_t *k = realloc(o->keys, sizeof(uint64_t) * (size_t)cap);
            if (k == NULL) return PyErr_NoMemory();
            o->keys = k;
            int32_t *f = realloc(o->free_slots, sizeof(int32_t) * (size_t)cap);
            if (f == NULL) return PyErr_NoMemory();
            o->free_slots = f;
            o->cap = cap;
        }
        if (pol_reserve(&o->p, o->n_used + 1) < 0) return PyErr_NoMemory();
        i = o->n_used++;
    }
    PyObject *v = PyLong_FromLong(i);
    if (v == NULL || PyDict_SetItem(o->slots, args[0], v) < 0) {
        Py_XDECREF(v);
        o->free_slots[o->n_free++] = i;
        return NULL;
    }
    Py_DECREF(v);
    o->keys[i] = key;
    pol_on_insert(&o->p, i, key);
    Py_RETURN_NONE;
}

static PyObject *Policy_on_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "on_hit(key, now)");
        return NULL;
    }
    int32_t i = slot_of(POL(self), args[0]);
    if (i < 0) return NULL;
    pol_on_hit(&POL(self)->p, i);
    Py_RETURN_NONE;
}

static PyObject *Policy_add_leaf(PyObject *self, PyObject *key) {
    int32_t i = slot_of(POL(self), key);
    if (i < 0) return NULL;
    if (pol_listed(&POL(self)->p, i)) {
        PyErr_Format(PyExc_ValueError, "%R is a leaf already", key);
        return NULL;
    }
    pol_add_leaf(&POL(self)->p, i);
    Py_RETURN_NONE;
}

static PyObject *Policy_remove_leaf(PyObject *self, PyObject *key) {
    int32_t i = slot_of(POL(self), key);
    if (i < 0) return NULL;
    if (!pol_listed(&POL(self)->p, i)) {
        PyErr_Format(PyExc_KeyError, "%R is not a leaf", key);
        return NULL;
    }
    pol_remove_leaf(&POL(self)->p, i);
    Py_RETURN_NONE;
}

static PyObject *Policy_victim(PyObject *self, PyObject *unused) {
    int32_t i = pol_victim(&POL(self)->p);
    if (i == NIL) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(POL(self)->keys[i]);
}

static PyObject *Policy_on_evict(PyObject *self, PyObject *key) {
    PolicyObject *o = POL(self);
    int32_t i = slot_of(o, key);
    if (i < 0) return NULL;
    if (pol_listed(&o->p, i)) {
        PyErr_Format(PyExc_ValueError, "%R evicted while listed as a leaf", key);
        return NULL;
    }
    if (PyDict_DelItem(o->slots, key) < 0) return NULL;
    pol_on_evict(&o->p, i, o->keys[i]);
    o->free_slots[o->n_free++] = i;
    Py_RETURN_NONE;
}

static PyObject *Policy_leaves(PyObject *self, PyObject *unused) {
    PolicyObject *o = POL(self);
    PyObject *out = PySet_New(NULL);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(o->p.n_leaves ? o->p.n_leaves : 1));
    if (out == NULL || order == NULL) {
        Py_XDECREF(out);
        free(order);
        return PyErr_NoMemory();
    }
    int64_t n = pol_order(&o->p, order);
    for (int64_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromUnsignedLongLong(o->keys[order[k]]);
        if (v == NULL || PySet_Add(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            free(order);
            return NULL;
        }
        Py_DECREF(v);
    }
    free(order);
    return out;
}

/* The leaves in the order victim() would take them (nothing changes). */
static PyObject *Policy_order(PyObject *self, PyObject *unused) {
    PolicyObject *o = POL(self);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)(o->p.n_leaves ? o->p.n_leaves : 1));
    if (order == NULL) return PyErr_NoMemory();
    int64_t n = pol_order(&o->p, order);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (int64_t k = 0; out != NULL && k < n; k++)
        PyList_SetItem(out, (Py_ssize_t)k, PyLong_FromUnsignedLongLong(o->keys[order[k]]));
    free(order);
    return out;
}

static PyObject *table_list(const policy_t *p, const uint64_t *t) {
    PyObject *out = PyList_New(p->prm.classes);
    for (int32_t c = 0; out != NULL && c < p->prm.classes; c++) {
        PyObject *row = PyList_New(p->prm.bins);
        for (int32_t b = 0; row != NULL && b < p->prm.bins; b++)
            PyList_SetItem(row, b, PyLong_FromUnsignedLongLong(t[c * p->prm.bins + b]));
        if (row == NULL) Py_CLEAR(out);
        else PyList_SetItem(out, c, row);
    }
    return out;
}

/* (cls, stamp) of a key (tests). */
static PyObject *Policy_entry(PyObject *self, PyObject *key) {
    int32_t i = slot_of(POL(self), key);
    if (i < 0) return NULL;
    const pnode_t *n = &POL(self)->p.pnode[i];
    return Py_BuildValue("iK", (int)((n->meta >> 56) & 0xF),
                         (unsigned long long)(n->meta & ((1ULL << 56) - 1)));
}

static PyObject *Policy_tables(PyObject *self, PyObject *unused) {
    const policy_t *p = &POL(self)->p;
    PyObject *expire = PyList_New(p->prm.classes);
    if (expire == NULL) return NULL;
    for (int32_t c = 0; c < p->prm.classes; c++) {
        PyObject *v = PyLong_FromUnsignedLongLong(p->expire_after[c]);
        if (v == NULL) {
            Py_DECREF(expire);
            return NULL;
        }
        PyList_SET_ITEM(expire, c, v);
    }
    return Py_BuildValue("{sNsNsNsN}", "hits", table_list(p, p->hits), "ends",
                         table_list(p, p->ends), "density", table_list(p, p->density),
                         "expire_after", expire);
}

static PyObject *Policy_stats(PyObject *self, PyObject *unused) {
    return policy_tier_stats(&POL(self)->p);
}

static PyMethodDef policy_methods[] = {
    {"on_insert", (PyCFunction)(void (*)(void))Policy_on_insert, METH_FASTCALL,
     "on_insert(key, depth=0, now=0): the block entered the tier"},
    {"on_hit", (PyCFunction)(void (*)(void))Policy_on_hit, METH_FASTCALL,
     "on_hit(key, now=0): a request used the block"},
    {"add_leaf", Policy_add_leaf, METH_O, "add_leaf(key): the block became an evictable leaf"},
    {"remove_leaf", Policy_remove_leaf, METH_O, "remove_leaf(key): it stopped being one"},
    {"victim", Policy_victim, METH_NOARGS, "victim() -> key | None: the next leaf to evict, unlisted"},
    {"on_evict", Policy_on_evict, METH_O, "on_evict(key): the block left the tier"},
    {"leaves", Policy_leaves, METH_NOARGS, "leaves() -> set[int]"},
    {"order", Policy_order, METH_NOARGS, "order() -> list[int]: the leaves in eviction order"},
    {"entry", Policy_entry, METH_O, "entry(key) -> (cls, stamp)"},
    {"tables", Policy_tables, METH_NOARGS, "tables() -> {hits, ends, density}: [class][bin]; expire_after: [class]"},
    {"stats", Policy_stats, METH_NOARGS, "stats() -> dict: ghost size and hits, inserts, ..."},
    {NULL},
};

static PyObject *Policy_get_ghost_size(PyObject *self, void *c) {
    return PyLong_FromLongLong(POL(self)->p.ghost_size);
}
static PyObject *Policy_get_ghost_hits(PyObject *self, void *c) {
    return PyLong_FromLongLong(POL(self)->p.ghost_hits);
}
static PyObject *Policy_get_tick(PyObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(POL(self)->p.tick);
}
static PyObject *Policy_get_cur_win(PyObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(POL(self)->p.cur_win);
}
static PyObject *Policy_get_window(PyObject *self, void *c) {
    return PyLong_FromUnsignedLongLong(POL(self)->p.window);
}

static PyGetSetDef policy_getset[] = {
    {"ghost_size", Policy_get_ghost_size, NULL, "entries the ghost holds", NULL},
    {"ghost_hits", Policy_get_ghost_hits, NULL, "inserts the ghost remembered", NULL},
    {"tick", Policy_get_tick, NULL, "on_insert calls", NULL},
    {"cur_win", Policy_get_cur_win, NULL, "the current window (tick // window)", NULL},
    {"window", Policy_get_window, NULL, "ticks per age bin", NULL},
    {NULL},
};

static PyType_Slot policy_slots[] = {
    {Py_tp_new, policy_new},
    {Py_tp_dealloc, policy_dealloc},
    {Py_tp_methods, policy_methods},
    {Py_tp_getset, policy_getset},
    {Py_tp_doc, "Policy(capacity, params=None): the adaptive eviction policy alone, by block key "
                "(tests and the policy benchmark)."},
    {0, NULL},
};

static PyType_Spec policy_spec = {"kvcached.core._core.Policy", sizeof(PolicyObject), 0,
                                  Py_TPFLAGS_DEFAULT, policy_slots};


/* chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]: the
 * chained hashes of blocks [start, stop), block start-1's hash being parent. */
static PyObject *mod_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *parent, *extra;
    Py_ssize_t parent_len, extra_len;
    int32_t bs, start, stop;
    if (nargs != 6 || bytes_arg(args[0], "parent", &parent, &parent_len) < 0 ||
        as_i32(args[2], "block_size", &bs) < 0 || bytes_arg(args[3], "extra", &extra, &extra_len) < 0 ||
        as_i32(args[4], "start", &start) < 0 || as_i32(args[5], "stop", &stop) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "chain(parent, tokens, block_size, extra, start, stop)");
        return NULL;
    }
    if (parent_len != HASH_LEN || bs <= 0 || start < 0 || stop < start) {
        PyErr_Format(PyExc_ValueError, "chain: parent of %d bytes, block_size > 0 and "
                     "0 <= start <= stop needed", HASH_LEN);
        return NULL;
    }
    Py_ssize_t n = token_count(args[1]);
    if (n < 0) return NULL;
    if ((Py_ssize_t)stop * bs > n) {
        PyErr_Format(PyExc_ValueError, "chain: block %d ends past the %zd tokens", (int)stop, n);
        return NULL;
    }
    Py_ssize_t count = (Py_ssize_t)(stop - start) * bs;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    uint8_t *hashes = malloc((size_t)HASH_LEN * (size_t)(stop - start ? stop - start : 1));
    PyObject *out = NULL;
    if (ids == NULL || hashes == NULL) {
        PyErr_NoMemory();
    } else if (read_tokens(args[1], (Py_ssize_t)start * bs, (Py_ssize_t)stop * bs, ids) == 0) {
        const uint8_t *prev = parent;
        for (int32_t b = 0; b < stop - start; b++) {
            hash_block(prev, extra, (size_t)extra_len, ids + (size_t)b * bs, bs,
                       hashes + (size_t)b * HASH_LEN);
            prev = hashes + (size_t)b * HASH_LEN;
        }
        out = hash_list(hashes, stop - start);
    }
    free(ids);
    free(hashes);
    return out;
}

/* record_input(record, parent, block_size, has_ns) -> bytes: the hash input a
 * memo record stands for (the invariant check rehashes it). */
static PyObject *mod_record_input(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *rec, *parent;
    Py_ssize_t len, plen;
    int32_t bs;
    int has_ns;
    if (nargs != 4 || bytes_arg(args[0], "record", &rec, &len) < 0 ||
        bytes_arg(args[1], "parent", &parent, &plen) < 0 || as_i32(args[2], "block_size", &bs) < 0 ||
        (has_ns = PyObject_IsTrue(args[3])) < 0)
        return NULL;
    int width = len ? rec[len - 1] : 0;
    Py_ssize_t head = len - 1 - (Py_ssize_t)width * bs;
    if ((width != 2 && width != 4 && width != 8) || bs <= 0 || head < (has_ns ? HASH_LEN : 0) ||
        (!has_ns && plen != HASH_LEN)) {
        PyErr_Format(PyExc_ValueError, "not a memo record of %d-token blocks (%zd bytes, width %d)",
                     (int)bs, len, width);
        return NULL;
    }
    size_t room = HASH_LEN + (size_t)len + 8 * (size_t)bs;
    uint8_t *out = malloc(room);
    if (out == NULL) return PyErr_NoMemory();
    size_t n = record_input(out, parent, rec, (uint32_t)len, bs, has_ns);
    PyObject *res = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)n);
    free(out);
    return res;
}

static PyObject *mod_impl(PyObject *mod, PyObject *unused) {
    return PyUnicode_FromString(hash_impl_name());
}

static PyObject *mod_impls(PyObject *mod, PyObject *unused) {
    const char *names[8];
    int n = hash_impl_list(names, 8);
    PyObject *out = PyTuple_New(n);
    for (int k = 0; out != NULL && k < n; k++) PyTuple_SetItem(out, k, PyUnicode_FromString(names[k]));
    return out;
}

static PyObject *mod_set_impl(PyObject *mod, PyObject *name) {
    const char *s = PyUnicode_AsUTF8AndSize(name, NULL);
    if (s == NULL) return NULL;
    PyObject *prev = PyUnicode_FromString(hash_impl_name());
    if (prev == NULL) return NULL;
    if (hash_impl_set(s) < 0) {
        Py_DECREF(prev);
        PyErr_Format(PyExc_ValueError, "BLAKE2b implementation %R is unknown or not supported "
                     "by this CPU", name);
        return NULL;
    }
    return prev;
}

static PyMethodDef module_methods[] = {
    {"chain", (PyCFunction)(void (*)(void))mod_chain, METH_FASTCALL,
     "chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]"},
    {"record_input", (PyCFunction)(void (*)(void))mod_record_input, METH_FASTCALL,
     "record_input(record, parent, block_size, has_ns) -> bytes"},
    {"impl", mod_impl, METH_NOARGS, "impl() -> str: the BLAKE2b compress in use"},
    {"impls", mod_impls, METH_NOARGS, "impls() -> tuple[str]: those this CPU runs, best first"},
    {"set_impl", mod_set_impl, METH_O, "set_impl(name) -> str: switch; returns the previous"},
    {NULL},
};

static int module_exec(PyObject *mod) {
    module_state *st = PyModule_GetState(mod);
    hash_impl_select();
    st->core_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &core_spec, NULL);
    if (st->core_type == NULL) return -1;
    st->request_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &request_spec, NULL);
    if (st->request_type == NULL) return -1;
    if (PyModule_AddObjectRef(mod, "Core", (PyObject *)st->core_type) < 0) return -1;
    if (PyModule_AddObjectRef(mod, "Request", (PyObject *)st->request_type) < 0) return -1;
    st->policy_type = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &policy_spec, NULL);
    if (st->policy_type == NULL) return -1;
    if (PyModule_AddObjectRef(mod, "Policy", (PyObject *)st->policy_type) < 0) return -1;
    if (PyModule_AddIntConstant(mod, "HASH_LEN", HASH_LEN) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *mod, visitproc visit, void *arg) {
    module_state *st = PyModule_GetState(mod);
    Py_VISIT(st->core_type);
    Py_VISIT(st->request_type);
    Py_VISIT(st->policy_type);
    return 0;
}

static int module_clear(PyObject *mod) {
    module_state *st = PyModule_GetState(mod);
    Py_CLEAR(st->core_type);
    Py_CLEAR(st->request_type);
    Py_CLEAR(st->policy_type);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_core", "The kvcached cache core (see kvcached/native/core/core.h).",
    sizeof(module_state),  module_methods, module_slots, module_traverse, module_clear, NULL,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&module_def); }
