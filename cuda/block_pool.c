/* kvcached._tree_node.BlockPool: one tier's free block ids, in C.
 *
 * The same contract as kvcached.core.pool.PyBlockPool (the reference, and the
 * pool of the PyNode fallback): ids 0..num_blocks-1, allocation takes the
 * oldest freed id first, a double free or an id out of range raises with
 * nothing freed. In C so that the eviction loop (tree_evict.c) frees and
 * takes one block without a Python call. The free ids are a FIFO ring: it
 * never holds more than num_blocks ids, since every id is free at most once.
 *
 * Every id is handed out as the same int object, made once (`objs`): the
 * block table and the tree's nodes then share a compact array of ints that
 * stays in cache, instead of ints scattered wherever each was allocated
 * (matching a prompt touched each hit block's id: a cache miss per block).
 */
#include "tree_node.h"
#include <structmember.h>

static inline Py_ssize_t at(BlockPool *p, Py_ssize_t i) {
    Py_ssize_t j = p->head + i;
    return j >= p->num_blocks ? j - p->num_blocks : j;
}

Py_ssize_t kvc_pool_take_one(BlockPool *p) {
    if (p->count == 0)
        return -1;
    Py_ssize_t b = p->ring[p->head];
    p->head = at(p, 1);
    p->count--;
    p->is_free[b] = 0;
    return b;
}

static int bad_id(BlockPool *p, Py_ssize_t b) {
    if (b < 0 || b >= p->num_blocks)
        PyErr_Format(PyExc_ValueError, "%U pool: block id %zd out of range 0..%zd", p->name, b,
                     p->num_blocks - 1);
    else
        PyErr_Format(PyExc_ValueError, "%U pool: double free of block %zd", p->name, b);
    return -1;
}

PyObject *kvc_pool_id(BlockPool *p, Py_ssize_t b) { return p->objs[b]; }

int kvc_pool_free_one(BlockPool *p, Py_ssize_t b) {
    if (b < 0 || b >= p->num_blocks || p->is_free[b])
        return bad_id(p, b);
    p->is_free[b] = 1;
    p->ring[at(p, p->count)] = (int32_t)b;
    p->count++;
    return 0;
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "num_blocks", NULL};
    PyObject *name;
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Un:BlockPool", kwlist, &name, &n))
        return NULL;
    if (n < 0 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%U pool: num_blocks must be in 0..%d, got %zd", name,
                     INT32_MAX, n);
        return NULL;
    }
    BlockPool *p = (BlockPool *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->name = Py_NewRef(name);
    p->num_blocks = p->count = n;
    p->ring = PyMem_Malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    p->is_free = PyMem_Malloc((size_t)(n ? n : 1));
    p->objs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(PyObject *));
    if (p->ring == NULL || p->is_free == NULL || p->objs == NULL) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        p->ring[i] = (int32_t)i;
        p->is_free[i] = 1;
        if ((p->objs[i] = PyLong_FromSsize_t(i)) == NULL) {
            Py_DECREF(p);
            return NULL;
        }
    }
    return (PyObject *)p;
}

static void pool_dealloc(PyObject *op) {
    BlockPool *p = (BlockPool *)op;
    Py_CLEAR(p->name);
    for (Py_ssize_t i = 0; p->objs != NULL && i < p->num_blocks; i++)
        Py_XDECREF(p->objs[i]);
    PyMem_Free(p->objs);
    PyMem_Free(p->ring);
    PyMem_Free(p->is_free);
    Py_TYPE(op)->tp_free(op);
}

static PyObject *pool_allocate(PyObject *op, PyObject *arg) {
    BlockPool *p = (BlockPool *)op;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n > p->count) {
        PyErr_Format(PyExc_ValueError, "%U pool: asked for %zd blocks, %zd free", p->name, n,
                     p->count);
        return NULL;
    }
    PyObject *out = PyList_New(n > 0 ? n : 0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(out, i, Py_NewRef(p->objs[kvc_pool_take_one(p)]));
    return out;
}

static PyObject *pool_allocate_one(PyObject *op, PyObject *unused) {
    BlockPool *p = (BlockPool *)op;
    Py_ssize_t b = kvc_pool_take_one(p);
    if (b < 0)
        return PyErr_Format(PyExc_ValueError, "%U pool: asked for 1 block, 0 free", p->name);
    return Py_NewRef(p->objs[b]);
}

/* free(ids, front=False): every id is checked before any is freed (ids seen in
 * this batch are marked 2 meanwhile, so a repeat is a double free too). */
static PyObject *pool_free(PyObject *op, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ids", "front", NULL};
    BlockPool *p = (BlockPool *)op;
    PyObject *ids;
    int front = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:free", kwlist, &ids, &front))
        return NULL;
    PyObject *seq = PySequence_Fast(ids, "free() needs a list or tuple of block ids");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; i < n; i++) {
        Py_ssize_t b = PyLong_AsSsize_t(items[i]);
        if (b == -1 && PyErr_Occurred())
            break;
        if (b < 0 || b >= p->num_blocks || p->is_free[b]) {
            bad_id(p, b);
            break;
        }
        p->is_free[b] = 2;
    }
    if (i < n) { /* unmark what was marked: nothing is freed */
        for (Py_ssize_t j = 0; j < i; j++)
            p->is_free[PyLong_AsSsize_t(items[j])] = 0;
        Py_DECREF(seq);
        return NULL;
    }
    if (front) { /* undo an allocate exactly: back to the head, in order */
        p->head = at(p, p->num_blocks - n);
        for (i = 0; i < n; i++)
            p->ring[at(p, i)] = (int32_t)PyLong_AsSsize_t(items[i]);
    } else {
        for (i = 0; i < n; i++)
            p->ring[at(p, p->count + i)] = (int32_t)PyLong_AsSsize_t(items[i]);
    }
    for (i = 0; i < n; i++)
        p->is_free[PyLong_AsSsize_t(items[i])] = 1;
    p->count += n;
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *pool_free_one(PyObject *op, PyObject *arg) {
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if ((b == -1 && PyErr_Occurred()) || kvc_pool_free_one((BlockPool *)op, b) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *pool_is_free(PyObject *op, PyObject *arg) {
    BlockPool *p = (BlockPool *)op;
    Py_ssize_t b = PyLong_AsSsize_t(arg);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (b < 0 || b >= p->num_blocks) {
        PyErr_Format(PyExc_IndexError, "%U pool: block id %zd out of range", p->name, b);
        return NULL;
    }
    return PyBool_FromLong(p->is_free[b]);
}

static PyObject *pool_free_ids(PyObject *op, PyObject *unused) {
    BlockPool *p = (BlockPool *)op;
    PyObject *out = PyList_New(p->count);
    for (Py_ssize_t i = 0; out != NULL && i < p->count; i++)
        PyList_SET_ITEM(out, i, Py_NewRef(p->objs[p->ring[at(p, i)]]));
    return out;
}

static PyObject *pool_num_free(PyObject *op, void *c) {
    return PyLong_FromSsize_t(((BlockPool *)op)->count);
}

static PyObject *pool_num_used(PyObject *op, void *c) {
    return PyLong_FromSsize_t(((BlockPool *)op)->num_blocks - ((BlockPool *)op)->count);
}

static PyMethodDef pool_methods[] = {
    {"allocate", pool_allocate, METH_O,
     "Take n ids; ValueError (state unchanged) if fewer are free."},
    {"allocate_one", pool_allocate_one, METH_NOARGS, "allocate(1)[0] without the list."},
    {"free", (PyCFunction)(void (*)(void))pool_free, METH_VARARGS | METH_KEYWORDS,
     "Return ids (all checked before any is freed); front=True undoes an allocate."},
    {"free_one", pool_free_one, METH_O, "free([b]) without the batch bookkeeping."},
    {"is_free", pool_is_free, METH_O, "Whether block_id is free."},
    {"free_ids", pool_free_ids, METH_NOARGS, "The free ids, oldest freed first."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef pool_members[] = {
    {"name", T_OBJECT_EX, offsetof(BlockPool, name), READONLY, "tier name"},
    {"num_blocks", T_PYSSIZET, offsetof(BlockPool, num_blocks), READONLY, "pool size"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"num_free", pool_num_free, NULL, "free ids", NULL},
    {"num_used", pool_num_used, NULL, "ids in use", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject BlockPoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached._tree_node.BlockPool",
    .tp_basicsize = sizeof(BlockPool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Free list of one tier's block ids (kvcached.core.pool.PyBlockPool, in C).",
    .tp_new = pool_new,
    .tp_dealloc = pool_dealloc,
    .tp_methods = pool_methods,
    .tp_members = pool_members,
    .tp_getset = pool_getset,
};
