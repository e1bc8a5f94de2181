/* Eviction's per-block loops over native nodes, pools and LRUs.
 *
 * kvcached/eviction.py holds the reference of each (EvictionMixin._evict_gpu's
 * loop, _take_cpu_block, _drop_cpu_leaf, _drop_gpu_leaf, _begin_swap_out,
 * _land_swap_out, _refresh) and runs it for PyNode and whenever KV events are
 * published; these are the same steps, in the same order, for the common
 * case. What is rare calls back into the manager (removing a node that has
 * children, dropping a GPU node's CPU backup) or returns to the Python loop
 * (flushing a swap-out batch, an empty LRU).
 *
 * Why: under churn every request evicts dozens of blocks, and in Python each
 * eviction cost ~2 us of attribute traffic and calls.
 */
#include "tree_node.h"

static PyObject *S_GPU, *S_SWAP_OUT, *S_CPU, *S_STORAGE; /* kvcached.core.tree.Tier */

static PyObject *set_states(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "set_states(gpu, swap_out, cpu, storage)");
        return NULL;
    }
    Py_XSETREF(S_GPU, Py_NewRef(args[0]));
    Py_XSETREF(S_SWAP_OUT, Py_NewRef(args[1]));
    Py_XSETREF(S_CPU, Py_NewRef(args[2]));
    Py_XSETREF(S_STORAGE, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* An int attribute as a C long; -1 with an error set where it is not one. */
static int get(PyObject *v, long *out) {
    *out = 0;
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "a node's attribute was deleted");
        return -1;
    }
    return kvc_get(v, out);
}

static int set(PyObject **slot, long v) {
    PyObject *o = PyLong_FromLong(v);
    if (o == NULL)
        return -1;
    Py_XSETREF(*slot, o);
    return 0;
}

static inline void set_state(Node *n, PyObject *state) { Py_XSETREF(n->state, Py_NewRef(state)); }

static inline int is_root(Node *n) { return n->parent == NULL || n->parent == Py_None; }

static inline int truthy(PyObject *o) {
    return o == Py_True ? 1 : o == Py_False ? 0 : o == NULL ? -1 : PyObject_IsTrue(o);
}

/* The context of one call: what the loops read and count. */
typedef struct {
    PyObject *mgr; /* for the rare steps: mgr._remove(node), mgr._drop_cpu(node) */
    LeafLRU *gpu_lru, *cpu_lru;
    BlockPool *gpu_pool, *cpu_pool;
    long idle, gpu_dropped, cpu_dropped, removed; /* deltas for the manager's counters */
} ctx;

/* EvictionMixin._refresh: put n in exactly the LRU sets it is evictable from. */
static int refresh(ctx *c, Node *n) {
    if (is_root(n))
        return 0;
    long ref, gk, ck, busy, cpu;
    if (get(n->ref, &ref) < 0 || get(n->n_gpu_children, &gk) < 0 ||
        get(n->n_cpu_children, &ck) < 0 || get(n->busy, &busy) < 0 || get(n->cpu, &cpu) < 0)
        return -1;
    PyObject *state = n->state;
    if (state == S_GPU && !(ref || gk || busy)) {
        if (kvc_lru_add(c->gpu_lru, n) < 0)
            return -1;
    } else {
        kvc_lru_discard(c->gpu_lru, n);
    }
    if (cpu >= 0 && !(ck || busy) && (state == S_GPU || (state == S_CPU && !(ref || gk))))
        return kvc_lru_add(c->cpu_lru, n);
    kvc_lru_discard(c->cpu_lru, n);
    return 0;
}

/* _new_gpu_leaf: whether parent, which just lost a GPU child, is an evictable
 * GPU leaf now. 1, 0, or -1 on error. */
static int new_gpu_leaf(Node *p) {
    long gk, ref, busy;
    if (get(p->n_gpu_children, &gk) < 0 || get(p->ref, &ref) < 0 || get(p->busy, &busy) < 0)
        return -1;
    return !(gk || ref || busy) && p->state == S_GPU && !is_root(p);
}

static int call_mgr(ctx *c, const char *method, Node *n) {
    PyObject *r = PyObject_CallMethod(c->mgr, method, "O", (PyObject *)n);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* `if not node.in_storage: _remove(node)` for a node that holds no copy: a
 * leaf is unlinked here, a node with children goes through the manager. */
static int remove_node(ctx *c, Node *n) {
    int stored = truthy(n->in_storage);
    if (stored)
        return stored < 0 ? -1 : 0; /* storage still has it: the node stays */
    if (n->children != NULL)
        return call_mgr(c, "_remove", n);
    if (kvc_unlink_child((Node *)n->parent, n->hash) < 0)
        return -1;
    kvc_lru_discard(c->gpu_lru, n);
    kvc_lru_discard(c->cpu_lru, n);
    c->removed++;
    return 0;
}

/* A node that lost its last local copy but stays for storage: the CPU copies
 * below it go too (_drop_cpu_below; rare: a GPU leaf with CPU children). */
static int drop_cpu_below(ctx *c, Node *n) {
    long ck;
    int stored = truthy(n->in_storage);
    if (stored <= 0 || get(n->n_cpu_children, &ck) < 0)
        return stored < 0 || PyErr_Occurred() ? -1 : 0;
    return ck ? call_mgr(c, "_drop_cpu_below", n) : 0;
}

/* _drop_cpu_leaf: a CPU-only leaf just popped off the CPU LRU; returns its
 * host block (freed, the caller takes it straight back), or -1 on error. */
static long drop_cpu_leaf(ctx *c, Node *n) {
    long cpu, pk, pcpu;
    if (get(n->cpu, &cpu) < 0 || set(&n->cpu, -1) < 0)
        return -1;
    set_state(n, S_STORAGE);
    Node *parent = (Node *)n->parent;
    if (kvc_add_to(&parent->n_cpu_children, -1) < 0 || get(parent->n_cpu_children, &pk) < 0 ||
        get(parent->cpu, &pcpu) < 0 || (!pk && pcpu >= 0 && refresh(c, parent) < 0))
        return -1;
    if (remove_node(c, n) < 0)
        return -1;
    if (kvc_pool_free_one(c->cpu_pool, cpu) < 0)
        return -1;
    c->cpu_dropped++;
    return cpu;
}

/* _take_cpu_block: a free host block, making one from the LRU CPU leaf when
 * none is free. Returns the block, -2 when there is none, -1 on error. */
static long take_cpu_block(ctx *c) {
    if (c->cpu_pool->count == 0) {
        Node *v = kvc_lru_pop(c->cpu_lru);
        if (v == NULL)
            return PyErr_Occurred() ? -1 : -2;
        long rc = v->state == S_CPU ? drop_cpu_leaf(c, v) : call_mgr(c, "_drop_cpu", v);
        Py_DECREF(v);
        if (rc == -1)
            return -1;
    }
    Py_ssize_t b = kvc_pool_take_one(c->cpu_pool);
    if (b < 0)
        PyErr_SetString(PyExc_RuntimeError, "evict_gpu: no host block after dropping a CPU leaf");
    return b < 0 ? -1 : b;
}

/* The victim's parent, lost a GPU child: a new reference where it just became
 * a GPU leaf (the caller lists it), else NULL; *err on error. */
static Node *leaf_parent(Node *parent, int *err) {
    int leaf = new_gpu_leaf(parent);
    *err = leaf < 0;
    return leaf > 0 ? (Node *)Py_NewRef(parent) : NULL;
}

/* _drop_gpu_leaf: a GPU leaf with no CPU copy just popped off the GPU LRU. */
static Node *drop_gpu_leaf(ctx *c, Node *n, int *err) {
    long gpu;
    *err = 1;
    kvc_lru_discard(c->gpu_lru, n);
    if (get(n->gpu, &gpu) < 0 || kvc_pool_free_one(c->gpu_pool, gpu) < 0 || set(&n->gpu, -1) < 0)
        return NULL;
    set_state(n, S_STORAGE);
    c->idle--;
    c->gpu_dropped++;
    Node *parent = (Node *)Py_NewRef(n->parent);
    if (kvc_add_to(&parent->n_gpu_children, -1) < 0 || remove_node(c, n) < 0 ||
        drop_cpu_below(c, n) < 0) {
        Py_DECREF(parent);
        return NULL;
    }
    Node *leaf = leaf_parent(parent, err);
    Py_DECREF(parent);
    return leaf;
}

/* _begin_swap_out: the victim leaves for host block `cpu` (-2: a backup
 * already holds its bytes). */
static Node *begin_swap_out(ctx *c, Node *n, long cpu, int *err) {
    *err = 1;
    kvc_lru_discard(c->gpu_lru, n);
    if (cpu == -2)
        kvc_lru_discard(c->cpu_lru, n); /* a backup in flight is not evictable */
    else
        Py_XSETREF(n->cpu, Py_NewRef(kvc_pool_id(c->cpu_pool, cpu)));
    set_state(n, S_SWAP_OUT);
    c->idle--;
    Node *parent = (Node *)n->parent;
    if (kvc_add_to(&parent->n_gpu_children, -1) < 0 ||
        (cpu != -2 && kvc_add_to(&parent->n_cpu_children, 1) < 0))
        return NULL;
    if (cpu != -2)
        kvc_lru_discard(c->cpu_lru, parent); /* no longer a CPU leaf */
    return leaf_parent(parent, err);
}

enum { DONE = 0, FLUSH = 1, EMPTY = 2 };

/* EvictionMixin._evict_gpu's loop, from its state (freed, leaf) to `count`
 * freed blocks, or until the Python loop must act: FLUSH (no host block
 * while this batch's own victims hold them: the victim went back to the LRU)
 * or EMPTY (the LRU is empty). Victims are appended to batch (and copies). */
static int evict_loop(ctx *c, PyObject *batch, PyObject *copies, Py_ssize_t *freed,
                      Py_ssize_t count, Node **leaf, int swap) {
    while (*freed < count) {
        Node *n = kvc_lru_push_pop(c->gpu_lru, *leaf);
        Py_CLEAR(*leaf);
        if (n == NULL)
            return PyErr_Occurred() ? -1 : EMPTY;
        long own_cpu, cpu = -2;
        int err = 0;
        if (get(n->cpu, &own_cpu) < 0)
            goto fail;
        if (own_cpu < 0) {
            cpu = swap ? take_cpu_block(c) : -2;
            if (cpu == -1)
                goto fail;
            if (cpu == -2 && PyList_GET_SIZE(batch) > 0) {
                int rc = refresh(c, n);
                Py_DECREF(n);
                return rc < 0 ? -1 : FLUSH;
            }
            if (cpu == -2) {
                *leaf = drop_gpu_leaf(c, n, &err);
                Py_DECREF(n);
                if (err)
                    return -1;
                (*freed)++;
                continue;
            }
            if (PyList_Append(copies, (PyObject *)n) < 0)
                goto fail;
        }
        *leaf = begin_swap_out(c, n, cpu, &err);
        if (err || PyList_Append(batch, (PyObject *)n) < 0)
            goto fail;
        Py_DECREF(n);
        (*freed)++;
        continue;
    fail:
        Py_DECREF(n);
        return -1;
    }
    return DONE;
}

static int parse_ctx(ctx *c, PyObject *const *args) {
    if (!Py_IS_TYPE(args[1], &LeafLRUType) || !Py_IS_TYPE(args[2], &LeafLRUType) ||
        !Py_IS_TYPE(args[3], &BlockPoolType) || !Py_IS_TYPE(args[4], &BlockPoolType) ||
        !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "native eviction needs native LRUs and pools");
        return -1;
    }
    if (S_GPU == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvcached._tree_node: set_states() not called");
        return -1;
    }
    *c = (ctx){args[0], (LeafLRU *)args[1], (LeafLRU *)args[2], (BlockPool *)args[3],
               (BlockPool *)args[4], 0, 0, 0, 0};
    return 0;
}

/* Add the call's deltas to counts = [idle, gpu_dropped, cpu_dropped, removed],
 * on success and on error alike: what was done is counted. */
static int report(ctx *c, PyObject *counts) {
    long d[4] = {c->idle, c->gpu_dropped, c->cpu_dropped, c->removed};
    for (Py_ssize_t i = 0; i < 4; i++) {
        PyObject **slot = &PyList_GET_ITEM(counts, i);
        if (d[i] && kvc_add_to(slot, d[i]) < 0)
            return -1;
    }
    return 0;
}

/* evict_gpu(mgr, gpu_lru, cpu_lru, gpu_pool, cpu_pool, counts, batch, copies,
 *           freed, count, leaf, swap) -> (freed, leaf, status) */
static PyObject *evict_gpu(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    ctx c;
    if (nargs != 12 || parse_ctx(&c, args) < 0 || PyList_GET_SIZE(args[5]) != 4 ||
        !PyList_Check(args[6]) || !PyList_Check(args[7]) ||
        (args[10] != Py_None && !is_node(args[10]))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError,
                            "evict_gpu(mgr, gpu_lru, cpu_lru, gpu_pool, cpu_pool, counts: list, "
                            "batch: list, copies: list, freed, count, leaf: Node | None, swap)");
        return NULL;
    }
    Py_ssize_t freed = PyLong_AsSsize_t(args[8]), count = PyLong_AsSsize_t(args[9]);
    int swap = PyObject_IsTrue(args[11]);
    if (((freed == -1 || count == -1) && PyErr_Occurred()) || swap < 0)
        return NULL;
    Node *leaf = args[10] == Py_None ? NULL : (Node *)Py_NewRef(args[10]);
    int status = evict_loop(&c, args[6], args[7], &freed, count, &leaf, swap);
    if (report(&c, args[5]) < 0 || status < 0) {
        Py_XDECREF(leaf);
        return NULL;
    }
    return Py_BuildValue("(nNi)", freed, leaf ? (PyObject *)leaf : Py_NewRef(Py_None), status);
}

/* _land_swap_out: every rank holds batch in host blocks; SWAP_OUT -> CPU,
 * GPU blocks freed, a node that is a CPU leaf now joins the CPU LRU.
 * land_swap_out(mgr, gpu_lru, cpu_lru, gpu_pool, cpu_pool, batch) */
static PyObject *land_swap_out(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    ctx c;
    if (nargs != 6 || parse_ctx(&c, args) < 0)
        return NULL;
    PyObject *batch = args[5];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
        Node *n = (Node *)PyList_GET_ITEM(batch, i);
        long gpu, ck, busy, ref, gk;
        if (!is_node((PyObject *)n)) {
            PyErr_SetString(PyExc_TypeError, "land_swap_out: batch must hold native Nodes");
            return NULL;
        }
        if (get(n->gpu, &gpu) < 0 || kvc_pool_free_one(c.gpu_pool, gpu) < 0 ||
            set(&n->gpu, -1) < 0)
            return NULL;
        set_state(n, S_CPU);
        if (get(n->n_cpu_children, &ck) < 0 || get(n->busy, &busy) < 0 || get(n->ref, &ref) < 0 ||
            get(n->n_gpu_children, &gk) < 0)
            return NULL;
        if (!(ck || busy || ref || gk) && kvc_lru_add(c.cpu_lru, n) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef evict_methods[] = {
    {"set_states", (PyCFunction)(void (*)(void))set_states, METH_FASTCALL,
     "The Tier members GPU, SWAP_OUT, CPU, STORAGE (kvcached.core.tree sets them)."},
    {"evict_gpu", (PyCFunction)(void (*)(void))evict_gpu, METH_FASTCALL,
     "EvictionMixin._evict_gpu's loop over native nodes (see the C comment)."},
    {"land_swap_out", (PyCFunction)(void (*)(void))land_swap_out, METH_FASTCALL,
     "EvictionMixin._land_swap_out over native nodes."},
    {NULL, NULL, 0, NULL},
};

int kvc_add_evict_functions(PyObject *m) { return PyModule_AddFunctions(m, evict_methods); }
