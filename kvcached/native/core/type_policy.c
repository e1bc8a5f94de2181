/* Policy: the adaptive eviction policy alone, keyed by 64-bit block keys as
 * the reference (tests/reference/policy.py AdaptivePolicy) is: the
 * differential tests replay the reference's calls into it and compare every
 * victim, and the policy benchmark's simulator can run it. Entries are slots
 * of the policy; a dict maps keys to them.
 *
 * Also the policy's parameters and numbers, which Core takes and reports
 * the same way. */
#include "module.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* -------------------------------------------------------- policy params */

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
int params_arg(PyObject *d, pol_params_t *out) {
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

PyObject *params_dict(const pol_params_t *p) {
    PyObject *d = PyDict_New();
    for (int k = 0; d != NULL && k < N_PARAMS; k++) {
        PyObject *v = PyLong_FromLong(*param_at((pol_params_t *)p, k));
        if (v == NULL || PyDict_SetItemString(d, PARAM_NAMES[k], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}


/* One tier's adaptive policy, as numbers (status, metrics, tests). */
PyObject *policy_tier_stats(const policy_t *p) {
    return Py_BuildValue(
        "{sLsLsLsLsLsLsLsKsKsL}", "ghost_entries", (long long)p->ghost_size, "ghost_slots",
        (long long)pol_ghost_slots(p), "ghost_bytes", (long long)pol_ghost_bytes(p), "ghost_hits",
        (long long)p->ghost_hits, "inserts", (long long)p->inserts, "hits", (long long)p->hits_seen,
        "leaves", (long long)p->n_leaves, "node_bytes", (long long)(sizeof(pnode_t) * (size_t)p->cap),
        "window", (unsigned long long)p->window, "cur_win", (unsigned long long)p->cur_win,
        "table_bytes",
        (long long)((sizeof(uint64_t) * 3 + sizeof(uint16_t) * 2 + sizeof(plist_t)) *
                    (size_t)p->n_ranks));
}

/* ----------------------------------------------------------------- Policy */

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

static PyObject *Policy_on_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PolicyObject *o = POL(self);
    uint64_t key, now = o->p.tick;
    if (parse_args(self, args, nargs, "on_insert(key, depth, now)", "K|OK", &key, NULL, &now) < 0)
        return NULL;
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
    pol_on_insert(&o->p, i, key, now);
    Py_RETURN_NONE;
}

static PyObject *Policy_on_hit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t now = POL(self)->p.tick;
    if (parse_args(self, args, nargs, "on_hit(key, now)", "O|K", NULL, &now) < 0) return NULL;
    int32_t i = slot_of(POL(self), args[0]);
    if (i < 0) return NULL;
    pol_on_hit(&POL(self)->p, i, now);
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
    int32_t *order;
    if (scratch(SCRATCH(&order, o->p.n_leaves), NULL) == NULL) return NULL;
    PyObject *out = PySet_New(NULL);
    if (out == NULL) {
        free(order);
        return NULL;
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
    int32_t *order;
    if (scratch(SCRATCH(&order, o->p.n_leaves), NULL) == NULL) return NULL;
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
    return Py_BuildValue("{sNsNsN}", "hits", table_list(p, p->hits), "ends",
                         table_list(p, p->ends), "density", table_list(p, p->density));
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

PyType_Spec policy_spec = {"kvcached.core._core.Policy", sizeof(PolicyObject), 0,
                           Py_TPFLAGS_DEFAULT, policy_slots};
