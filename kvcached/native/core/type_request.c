/* Request: one request's block hashes and path, made by Core.request or
 * Core.request_hashes and passed back to the Core's methods. Its memo
 * records are the Core's memory, so it keeps its Core alive. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

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

int request_reserve(request_t *r, int32_t n, int memo) {
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

request_t *request_arg(PyObject *core, PyObject *o) {
    module_state *st = state_of(core);
    if (!PyObject_TypeCheck(o, st->request_type)) {
        PyErr_SetString(PyExc_TypeError, "expected a Request made by Core.request");
        return NULL;
    }
    RequestObject *r = (RequestObject *)o;
    if (r->core != core) {
        PyErr_SetString(PyExc_ValueError, "the Request belongs to another Core");
        return NULL;
    }
    return &r->r;
}

PyObject *new_request(PyObject *core, const uint8_t *ns, const uint8_t *extra,
                      Py_ssize_t extra_len) {
    module_state *st = state_of(core);
    allocfunc alloc = (allocfunc)PyType_GetSlot(st->request_type, Py_tp_alloc);
    RequestObject *req = (RequestObject *)alloc(st->request_type, 0);
    if (req == NULL) return NULL;
    memset(&req->r, 0, sizeof req->r);
    req->core = Py_NewRef(core);
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

/* ---------------------------------------------------------------- the type */

static void request_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    RequestObject *r = (RequestObject *)self;
    if (r->core != NULL) request_clear(CORE(r->core), &r->r); /* its records are the core's */
    Py_XDECREF(r->core);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(self);
    Py_DECREF(tp);
}

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

PyType_Spec request_spec = {"kvcached.core._core.Request", sizeof(RequestObject), 0,
                            Py_TPFLAGS_DEFAULT, request_slots};

