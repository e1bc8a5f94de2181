/* kvcached._tree_node.LeafLRU: one tier's evictable leaves, oldest first, in C.
 *
 * The same contract as kvcached.core.tree.PyLeafLRU (the reference, and the LRU of
 * the PyNode fallback): a binary heap of (key, node) with lazy deletion; a
 * node's live key sits in the node (Node.lru[which]: gpu_key / cpu_key), an
 * entry whose key is not the node's live key is stale and skipped on pop,
 * and the heap is rebuilt when stale entries outnumber live ones. Keys order
 * (last_access, -depth, insertion): `hi` is last_access, `lo` the inverted
 * depth over 40 bits of insertion order, exactly as kvcached.core.tree.lru_key.
 *
 * Why C: keys are 128-bit, so in Python every heap step compared big ints
 * inside tuples (~30 ns each, ~2 log n per pop), and eviction pops once per
 * evicted block. Here a comparison is two integer compares.
 */
#include "tree_node.h"
#include <structmember.h>

#define SEQ_BITS 40
#define SEQ_MASK ((UINT64_C(1) << SEQ_BITS) - 1)
#define DEPTH_MAX ((INT64_C(1) << 24) - 1)

static inline int before(uint64_t hi, uint64_t lo, const lru_entry *b) {
    return hi < b->hi || (hi == b->hi && lo < b->lo);
}

static inline int is_live(const LeafLRU *lru, const lru_entry *e) {
    const lru_slot *k = &e->node->lru[lru->which];
    return k->listed && k->lo == e->lo && k->hi == e->hi;
}

static void sift_up(lru_entry *h, Py_ssize_t i) {
    lru_entry x = h[i];
    while (i > 0) {
        Py_ssize_t up = (i - 1) >> 1;
        if (!before(x.hi, x.lo, &h[up]))
            break;
        h[i] = h[up];
        i = up;
    }
    h[i] = x;
}

static void sift_down(lru_entry *h, Py_ssize_t n, Py_ssize_t i) {
    lru_entry x = h[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && before(h[c + 1].hi, h[c + 1].lo, &h[c]))
            c++;
        if (!before(h[c].hi, h[c].lo, &x))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static int reserve_one(LeafLRU *lru) {
    if (lru->len < lru->cap)
        return 0;
    Py_ssize_t cap = lru->cap ? lru->cap * 2 : 64;
    lru_entry *h = PyMem_Realloc(lru->heap, sizeof(lru_entry) * (size_t)cap);
    if (h == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    lru->heap = h;
    lru->cap = cap;
    return 0;
}

/* A room was reserved: list node under (hi, lo) and push its entry. */
static void push(LeafLRU *lru, Node *node, uint64_t hi, uint64_t lo) {
    lru_slot *k = &node->lru[lru->which];
    k->hi = hi;
    k->lo = lo;
    k->listed = 1;
    lru->heap[lru->len] = (lru_entry){hi, lo, (Node *)Py_NewRef(node)};
    sift_up(lru->heap, lru->len++);
}

/* The node's last_access, and its key with the next insertion number. */
static int next_key(LeafLRU *lru, Node *node, uint64_t *hi, uint64_t *lo) {
    uint64_t last = node->last_access ? PyLong_AsUnsignedLongLong(node->last_access) : 0;
    long long depth = node->depth ? PyLong_AsLongLong(node->depth) : 0;
    if (((last == (uint64_t)-1 || depth == -1) && PyErr_Occurred()) || !node->last_access ||
        !node->depth) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "LeafLRU: a node's last_access was deleted");
        return -1;
    }
    uint64_t seq = ++lru->seq;
    uint64_t inv_depth = depth < DEPTH_MAX ? (uint64_t)(DEPTH_MAX - depth) : 0;
    *hi = last;
    *lo = (inv_depth << SEQ_BITS) | (seq & SEQ_MASK);
    return 0;
}

static void compact(LeafLRU *lru) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < lru->len; i++) {
        if (is_live(lru, &lru->heap[i]))
            lru->heap[kept++] = lru->heap[i];
        else
            Py_DECREF(lru->heap[i].node);
    }
    lru->len = kept;
    for (Py_ssize_t i = kept / 2 - 1; i >= 0; i--)
        sift_down(lru->heap, kept, i);
}

int kvc_lru_add(LeafLRU *lru, Node *node) {
    lru_slot *k = &node->lru[lru->which];
    if (k->listed) {
        uint64_t last = PyLong_AsUnsignedLongLong(node->last_access);
        if (last == (uint64_t)-1 && PyErr_Occurred())
            return -1;
        if (k->hi == last)
            return 0; /* same access time: its key stands */
    }
    uint64_t hi, lo;
    if (reserve_one(lru) < 0 || next_key(lru, node, &hi, &lo) < 0)
        return -1;
    lru->size += !k->listed;
    push(lru, node, hi, lo);
    if (lru->len > 2 * lru->size + 64)
        compact(lru);
    return 0;
}

void kvc_lru_discard(LeafLRU *lru, Node *node) {
    lru_slot *k = &node->lru[lru->which];
    if (k->listed) {
        k->listed = 0;
        lru->size--;
    }
}

Node *kvc_lru_pop(LeafLRU *lru) {
    lru_entry *h = lru->heap;
    while (lru->len > 0) {
        lru_entry e = h[0];
        h[0] = h[--lru->len];
        if (lru->len > 0)
            sift_down(h, lru->len, 0);
        if (is_live(lru, &e)) {
            e.node->lru[lru->which].listed = 0;
            lru->size--;
            return e.node; /* the entry's reference */
        }
        Py_DECREF(e.node);
    }
    return NULL;
}

/* add(node) then pop(); a node that would come straight back out never
 * touches the heap (eviction walking up a chain). */
Node *kvc_lru_push_pop(LeafLRU *lru, Node *node) {
    if (node == NULL)
        return kvc_lru_pop(lru);
    if (node->lru[lru->which].listed) {
        if (kvc_lru_add(lru, node) < 0)
            return NULL;
        return kvc_lru_pop(lru);
    }
    uint64_t last = PyLong_AsUnsignedLongLong(node->last_access), hi, lo;
    if (last == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (lru->len == 0 || last < lru->heap[0].hi)
        return (Node *)Py_NewRef(node); /* older than every entry, live or stale */
    if (reserve_one(lru) < 0 || next_key(lru, node, &hi, &lo) < 0)
        return NULL;
    if (before(hi, lo, &lru->heap[0]))
        return (Node *)Py_NewRef(node);
    lru->size++;
    push(lru, node, hi, lo);
    return kvc_lru_pop(lru);
}

/* ------------------------------------------------------------ Python API */

static int node_arg(PyObject *o, const char *what) {
    if (is_node(o))
        return 0;
    PyErr_Format(PyExc_TypeError, "LeafLRU.%s needs a native Node, got %.100s", what,
                 Py_TYPE(o)->tp_name);
    return -1;
}

static PyObject *lru_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"slot", NULL};
    PyObject *slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "U:LeafLRU", kwlist, &slot))
        return NULL;
    int which = PyUnicode_CompareWithASCIIString(slot, "gpu_key") == 0   ? LRU_GPU
                : PyUnicode_CompareWithASCIIString(slot, "cpu_key") == 0 ? LRU_CPU
                                                                         : -1;
    if (which < 0)
        return PyErr_Format(PyExc_ValueError,
                            "LeafLRU slot must be 'gpu_key' or 'cpu_key', got %R", slot);
    LeafLRU *lru = (LeafLRU *)type->tp_alloc(type, 0);
    if (lru != NULL) {
        lru->which = which;
        lru->slot = Py_NewRef(slot);
    }
    return (PyObject *)lru;
}

static void lru_dealloc(PyObject *op) {
    LeafLRU *lru = (LeafLRU *)op;
    for (Py_ssize_t i = 0; i < lru->len; i++)
        Py_DECREF(lru->heap[i].node);
    PyMem_Free(lru->heap);
    Py_CLEAR(lru->slot);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *lru_add(PyObject *op, PyObject *node) {
    if (node_arg(node, "add") < 0 || kvc_lru_add((LeafLRU *)op, (Node *)node) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *lru_discard(PyObject *op, PyObject *node) {
    if (node_arg(node, "discard") < 0)
        return NULL;
    kvc_lru_discard((LeafLRU *)op, (Node *)node);
    Py_RETURN_NONE;
}

static PyObject *or_none(Node *n) {
    if (n == NULL && PyErr_Occurred())
        return NULL;
    return n != NULL ? (PyObject *)n : Py_NewRef(Py_None);
}

static PyObject *lru_pop(PyObject *op, PyObject *unused) { return or_none(kvc_lru_pop((LeafLRU *)op)); }

static PyObject *lru_push_pop(PyObject *op, PyObject *node) {
    if (node != Py_None && node_arg(node, "push_pop") < 0)
        return NULL;
    return or_none(kvc_lru_push_pop((LeafLRU *)op, node == Py_None ? NULL : (Node *)node));
}

static PyObject *lru_nodes(PyObject *op, PyObject *unused) {
    LeafLRU *lru = (LeafLRU *)op;
    PyObject *out = PySet_New(NULL);
    for (Py_ssize_t i = 0; out != NULL && i < lru->len; i++)
        if (is_live(lru, &lru->heap[i]) && PySet_Add(out, (PyObject *)lru->heap[i].node) < 0)
            Py_CLEAR(out);
    return out;
}

static PyObject *lru_heap_len(PyObject *op, PyObject *unused) {
    return PyLong_FromSsize_t(((LeafLRU *)op)->len);
}

static Py_ssize_t lru_len(PyObject *op) { return ((LeafLRU *)op)->size; }

static int lru_contains(PyObject *op, PyObject *node) {
    return is_node(node) && ((Node *)node)->lru[((LeafLRU *)op)->which].listed;
}

static PyObject *lru_get_seq(PyObject *op, void *c) {
    return PyLong_FromUnsignedLongLong(((LeafLRU *)op)->seq);
}

static int lru_set_seq(PyObject *op, PyObject *v, void *c) {
    uint64_t seq = v == NULL ? (uint64_t)-1 : PyLong_AsUnsignedLongLong(v);
    if (seq == (uint64_t)-1 && (v == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "_seq cannot be deleted");
        return -1;
    }
    ((LeafLRU *)op)->seq = seq;
    return 0;
}

static PyMethodDef lru_methods[] = {
    {"add", lru_add, METH_O, "Insert, or re-key if the node's last_access changed."},
    {"discard", lru_discard, METH_O, "Take the node out (a no-op when it is not in)."},
    {"pop", lru_pop, METH_NOARGS, "Remove and return the oldest evictable leaf, or None."},
    {"push_pop", lru_push_pop, METH_O, "add(node) then pop() (just pop() for None)."},
    {"nodes", lru_nodes, METH_NOARGS, "The live nodes, as a set."},
    {"heap_len", lru_heap_len, METH_NOARGS, "Heap entries, stale ones included."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef lru_members[] = {
    {"slot", T_OBJECT_EX, offsetof(LeafLRU, slot), READONLY, "the node attribute it keys"},
    {"size", T_PYSSIZET, offsetof(LeafLRU, size), 0, "live nodes"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef lru_getset[] = {
    {"_seq", lru_get_seq, lru_set_seq, "the last insertion number", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods lru_as_sequence = {.sq_length = lru_len, .sq_contains = lru_contains};

PyTypeObject LeafLRUType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached._tree_node.LeafLRU",
    .tp_basicsize = sizeof(LeafLRU),
    .tp_flags = Py_TPFLAGS_DEFAULT, /* holds only Nodes, which cannot refer back to it */
    .tp_doc = "Evictable leaves of one tier, oldest first (kvcached.core.tree.PyLeafLRU, in C).",
    .tp_new = lru_new,
    .tp_dealloc = lru_dealloc,
    .tp_as_sequence = &lru_as_sequence,
    .tp_methods = lru_methods,
    .tp_members = lru_members,
    .tp_getset = lru_getset,
};

int kvc_add_lru_types(PyObject *m) {
    if (PyType_Ready(&LeafLRUType) < 0 || PyType_Ready(&BlockPoolType) < 0)
        return -1;
    if (PyModule_AddObjectRef(m, "LeafLRU", (PyObject *)&LeafLRUType) < 0 ||
        PyModule_AddObjectRef(m, "BlockPool", (PyObject *)&BlockPoolType) < 0)
        return -1;
    return 0;
}
