/* kvcached.copy._cpu_copy: the CPU copy engine (cpu_copy.c) as a Python type.
 *
 *   Engine(plane_ptrs, plane_stride_bytes, plane_bytes, host_offsets,
 *          num_device_blocks, host, host_block_bytes, num_host_blocks,
 *          threads=1, keep=None)
 *     .copy(device_ids, host_ids, direction) -> bytes moved
 *     .unchecked_copy(device_ids, host_ids, direction) -> (code, err_index)
 *   strerror(code) -> str; TO_HOST, TO_DEVICE, ERR_*, STREAM_MIN_BYTES (cpu_copy.h's)
 *
 * kvcached/copy/cpu.py (CpuCopyEngine) checks the tensors and passes their
 * addresses. Ids come as lists or tuples of ints (read here, no numpy: a
 * one-block task is mostly call overhead) or as one-dimensional int64
 * buffers (numpy arrays, read in place). copy() checks every id and words
 * every error itself, then releases the GIL for the memcpy work, so a
 * worker's other threads keep running while blocks move.
 *
 * Public, documented C API only: a heap type, multi-phase init. An Engine
 * never changes after it is made, so threads may share one, and the module
 * needs no GIL on free-threaded builds. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "cpu_copy.h"

/* Ids read from a list or tuple go to a buffer on the stack up to this many;
 * longer lists take one allocation. */
#define STACK_IDS 64
/* Destinations are checked for duplicates pairwise up to this many ids, with
 * a bitmap of the destination pool beyond (O(n + pool / 64) instead of n^2). */
#define PAIRWISE_MAX 32

typedef struct {
    PyObject_HEAD
    kvc_cpu_engine e;     /* points into tables */
    int64_t *tables;      /* ptrs, strides, bytes, offsets: num_planes each */
    int64_t bytes_per_block;
    /* The object(s) owning the memory e's pointers address (the tensors).
     * The Engine holds it rather than trusting its caller to: an Engine then
     * stays safe to call however long it lives. */
    PyObject *keep;
} EngineObject;

/* ------------------------------------------------------------------ ids */

/* One side's ids as int64s: in a Python buffer (view) or in our own memory. */
typedef struct {
    const int64_t *p;
    Py_ssize_t n;
    Py_buffer view;
    int has_view;
    int64_t *heap;
    int64_t stack[STACK_IDS];
} ids_t;

static void ids_release(ids_t *ids) {
    if (ids->has_view) PyBuffer_Release(&ids->view);
    ids->has_view = 0;
    PyMem_Free(ids->heap);
    ids->heap = NULL;
}

/* One id from a list or tuple: an int (not a bool: True is not a block id)
 * or anything with __index__ (numpy integer scalars), that fits int64. */
static int read_id(PyObject *item, const char *side, Py_ssize_t i, int64_t *out) {
    PyObject *num;
    if (PyLong_CheckExact(item)) {
        num = Py_NewRef(item);
    } else if (PyBool_Check(item) || !PyIndex_Check(item)) {
        PyErr_Format(PyExc_ValueError, "%s ids must be integers, got %.100s at index %zd", side,
                     Py_TYPE(item)->tp_name, i);
        return -1;
    } else {
        num = PyNumber_Index(item);
        if (num == NULL) return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(num, &overflow);
    if (overflow) {
        PyErr_Format(PyExc_ValueError, "%s block id %R at index %zd does not fit in int64", side,
                     num, i);
        Py_DECREF(num);
        return -1;
    }
    Py_DECREF(num);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

static int read_sequence(PyObject *obj, const char *side, ids_t *ids) {
    int is_list = PyList_Check(obj);
    Py_ssize_t n = is_list ? PyList_GET_SIZE(obj) : PyTuple_GET_SIZE(obj);
    int64_t *buf = ids->stack;
    if (n > STACK_IDS) {
        buf = ids->heap = PyMem_Malloc(sizeof(int64_t) * (size_t)n);
        if (buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* An item's __index__ is Python code and may change the list under us. */
        if (is_list && PyList_GET_SIZE(obj) != n) {
            PyErr_Format(PyExc_ValueError, "%s ids changed size while being read", side);
            return -1;
        }
        PyObject *item = is_list ? PyList_GET_ITEM(obj, i) : PyTuple_GET_ITEM(obj, i);
        Py_INCREF(item);
        int rc = read_id(item, side, i, &buf[i]);
        Py_DECREF(item);
        if (rc < 0) return -1;
    }
    ids->p = buf;
    ids->n = n;
    return 0;
}

/* A one-dimensional, contiguous buffer of native int64s ('q', or 'l' where a
 * long is 8 bytes, as numpy's int64 is on Linux), read in place. */
static int read_buffer(PyObject *obj, const char *side, ids_t *ids) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s ids must be a list or tuple of ints or an int64 buffer, got %.100s",
                     side, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, &ids->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s ids must be a C-contiguous int64 buffer", side);
        return -1;
    }
    ids->has_view = 1;
    const Py_buffer *v = &ids->view;
    const char *fmt = v->format ? v->format : "B";
    if (*fmt == '@') fmt++;
    if (v->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s ids must be one-dimensional, got %d dimensions", side,
                     v->ndim);
        return -1;
    }
    if (v->itemsize != 8 || !((fmt[0] == 'q' || fmt[0] == 'l') && fmt[1] == '\0')) {
        PyErr_Format(PyExc_ValueError, "%s ids must be int64, got a buffer of format '%s' "
                     "(itemsize %zd)", side, v->format ? v->format : "B", v->itemsize);
        return -1;
    }
    ids->p = v->buf;
    ids->n = v->shape[0];
    return 0;
}

static int read_ids(PyObject *obj, const char *side, ids_t *ids) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) return read_sequence(obj, side, ids);
    return read_buffer(obj, side, ids);
}

static int read_direction(PyObject *obj, int64_t *out) {
    long long d = PyLong_AsLongLong(obj);
    if (d == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)d;
    return 0;
}

/* ------------------------------------------------------------- checks */

static int check_range(const ids_t *ids, int64_t limit, const char *side) {
    for (Py_ssize_t i = 0; i < ids->n; i++) {
        int64_t b = ids->p[i];
        if (b < 0 || b >= limit) {
            PyErr_Format(PyExc_ValueError, "%s block id %lld at index %zd is out of range: "
                         "allowed 0..%lld (%lld %s blocks)", side, (long long)b, i,
                         (long long)(limit - 1), (long long)limit, side);
            return -1;
        }
    }
    return 0;
}

static int duplicate_error(const ids_t *ids, Py_ssize_t second, const char *side) {
    Py_ssize_t first = 0;
    while (ids->p[first] != ids->p[second]) first++;
    PyErr_Format(PyExc_ValueError, "%s block id %lld is a destination twice (indices %zd and "
                 "%zd); destination ids must be distinct", side, (long long)ids->p[second],
                 first, second);
    return -1;
}

/* Two sources into one block is an upstream bug (two owners of one block),
 * and with threads a data race. The ids are in 0..limit-1 (checked first).
 * The error names the first id seen twice, and where it was seen first. */
static int check_unique(const ids_t *ids, int64_t limit, const char *side) {
    const int64_t *p = ids->p;
    Py_ssize_t n = ids->n;
    if (n <= PAIRWISE_MAX) {
        for (Py_ssize_t i = 1; i < n; i++) {
            for (Py_ssize_t j = 0; j < i; j++) {
                if (p[j] == p[i]) return duplicate_error(ids, i, side);
            }
        }
        return 0;
    }
    uint64_t *seen = PyMem_Calloc((size_t)(limit / 64 + 1), sizeof(uint64_t));
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t bit = (uint64_t)1 << (p[i] % 64);
        if (seen[p[i] / 64] & bit) {
            rc = duplicate_error(ids, i, side);
            break;
        }
        seen[p[i] / 64] |= bit;
    }
    PyMem_Free(seen);
    return rc;
}

/* The C side's refusal, as ValueError (copy() checks first, so not expected). */
static PyObject *native_error(const EngineObject *self, int rc, int64_t index, const ids_t *dev,
                              const ids_t *host) {
    const char *what = kvc_cpu_copy_strerror(rc);
    if (rc == KVC_ERR_DEVICE_ID && index >= 0 && index < dev->n) {
        PyErr_Format(PyExc_ValueError, "native CPU copy rejected the task (code %d: %s): device "
                     "block id %lld at index %lld, allowed 0..%lld", rc, what,
                     (long long)dev->p[index], (long long)index,
                     (long long)(self->e.num_device_blocks - 1));
    } else if (rc == KVC_ERR_HOST_ID && index >= 0 && index < host->n) {
        PyErr_Format(PyExc_ValueError, "native CPU copy rejected the task (code %d: %s): host "
                     "block id %lld at index %lld, allowed 0..%lld", rc, what,
                     (long long)host->p[index], (long long)index,
                     (long long)(self->e.num_host_blocks - 1));
    } else if (index >= 0) {
        PyErr_Format(PyExc_ValueError, "native CPU copy rejected the task (code %d: %s) at index "
                     "%lld", rc, what, (long long)index);
    } else {
        PyErr_Format(PyExc_ValueError, "native CPU copy rejected the task (code %d: %s)", rc,
                     what);
    }
    return NULL;
}

/* ------------------------------------------------------------- Engine */

/* Both sides' ids, read and paired up; direction as given. */
static int read_task(PyObject *const *args, Py_ssize_t nargs, const char *name, ids_t *dev,
                     ids_t *host, int64_t *direction) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s(device_ids, host_ids, direction) takes 3 arguments, "
                     "got %zd", name, nargs);
        return -1;
    }
    if (read_ids(args[0], "device", dev) < 0 || read_ids(args[1], "host", host) < 0
        || read_direction(args[2], direction) < 0) {
        return -1;
    }
    if (dev->n != host->n) {
        PyErr_Format(PyExc_ValueError, "got %zd device ids but %zd host ids; they pair up one "
                     "to one, so the lengths must match", dev->n, host->n);
        return -1;
    }
    return 0;
}

static PyObject *Engine_copy(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    EngineObject *self = (EngineObject *)op;
    ids_t dev = {0}, host = {0};
    int64_t direction, err = -1;
    PyObject *out = NULL;
    if (read_task(args, nargs, "copy", &dev, &host, &direction) < 0) goto done;
    if (direction != KVC_DIR_TO_HOST && direction != KVC_DIR_TO_DEVICE) {
        PyErr_Format(PyExc_ValueError, "direction must be %d (device to host) or %d (host to "
                     "device), got %lld", KVC_DIR_TO_HOST, KVC_DIR_TO_DEVICE,
                     (long long)direction);
        goto done;
    }
    if (dev.n == 0) {
        out = PyLong_FromLong(0);
        goto done;
    }
    if (check_range(&dev, self->e.num_device_blocks, "device") < 0
        || check_range(&host, self->e.num_host_blocks, "host") < 0)
        goto done;
    if (direction == KVC_DIR_TO_HOST ? check_unique(&host, self->e.num_host_blocks, "host")
                                     : check_unique(&dev, self->e.num_device_blocks, "device"))
        goto done;
    int rc;
    /* The ids stay valid without the GIL: our own memory, or a buffer we hold
     * an export of (numpy refuses to resize an exported array). */
    Py_BEGIN_ALLOW_THREADS
    rc = kvc_cpu_engine_copy(&self->e, dev.p, host.p, dev.n, direction, &err);
    Py_END_ALLOW_THREADS
    if (rc != KVC_OK) {
        native_error(self, rc, err, &dev, &host);
        goto done;
    }
    long long nbytes;
    if (__builtin_mul_overflow((long long)dev.n, (long long)self->bytes_per_block, &nbytes)) {
        PyErr_SetString(PyExc_OverflowError, "bytes moved do not fit in int64");
        goto done;
    }
    out = PyLong_FromLongLong(nbytes);
done:
    ids_release(&dev);
    ids_release(&host);
    return out;
}

static PyObject *Engine_unchecked_copy(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    EngineObject *self = (EngineObject *)op;
    ids_t dev = {0}, host = {0};
    int64_t direction, err = -1;
    PyObject *out = NULL;
    if (read_task(args, nargs, "unchecked_copy", &dev, &host, &direction) == 0) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = kvc_cpu_engine_copy(&self->e, dev.p, host.p, dev.n, direction, &err);
        Py_END_ALLOW_THREADS
        out = Py_BuildValue("(iL)", rc, (long long)err);
    }
    ids_release(&dev);
    ids_release(&host);
    return out;
}

/* One of the engine's four tables: a sequence of num ints, as int64s (addresses
 * as unsigned). */
static int read_table(PyObject *obj, const char *name, Py_ssize_t num, int64_t *out,
                      int is_address) {
    PyObject *seq = PySequence_Fast(obj, "the engine's tables must be sequences of ints");
    if (seq == NULL) return -1;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(seq) != num) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries for %zd planes", name,
                     PySequence_Fast_GET_SIZE(seq), num);
        goto done;
    }
    for (Py_ssize_t i = 0; i < num; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (is_address) {
            unsigned long long a = PyLong_AsUnsignedLongLong(item);
            if (a == (unsigned long long)-1 && PyErr_Occurred()) goto done;
            out[i] = (int64_t)a;
        } else {
            long long v = PyLong_AsLongLong(item);
            if (v == -1 && PyErr_Occurred()) goto done;
            out[i] = (int64_t)v;
        }
    }
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

/* The plane geometry (sizes, strides, offsets inside the host block) is not
 * checked here: kvc_cpu_copy checks it on every call and refuses with
 * KVC_ERR_PLANE, and CpuCopyEngine checks it first with clearer words. */
static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"plane_ptrs", "plane_stride_bytes", "plane_bytes", "host_offsets",
                         "num_device_blocks", "host", "host_block_bytes", "num_host_blocks",
                         "threads", "keep", NULL};
    PyObject *ptrs, *strides, *nbytes, *offsets, *keep = Py_None;
    long long ndev, hbb, nhost, threads = 1;
    unsigned long long host;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOLKLL|LO:Engine", kw, &ptrs, &strides,
                                     &nbytes, &offsets, &ndev, &host, &hbb, &nhost, &threads,
                                     &keep))
        return NULL;
    Py_ssize_t np = PyObject_Length(ptrs);
    if (np < 0) return NULL;
    if (np < 1 || np > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "an engine needs 1..%d planes, got %zd", INT32_MAX, np);
        return NULL;
    }
    if (threads < 1 || threads > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..%d, got %lld", INT32_MAX, threads);
        return NULL;
    }
    if (ndev < 0 || nhost < 0 || hbb < 0 || host == 0) {
        PyErr_Format(PyExc_ValueError, "block counts and host_block_bytes must be >= 0 and the "
                     "host address non-zero, got %lld, %lld, %lld, %#llx", ndev, nhost, hbb,
                     host);
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    EngineObject *self = (EngineObject *)alloc(type, 0);
    if (self == NULL) return NULL;
    self->tables = PyMem_Calloc(4 * (size_t)np, sizeof(int64_t));
    if (self->tables == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    int64_t *t = self->tables;
    if (read_table(ptrs, "plane_ptrs", np, t, 1) < 0
        || read_table(strides, "plane_stride_bytes", np, t + np, 0) < 0
        || read_table(nbytes, "plane_bytes", np, t + 2 * np, 0) < 0
        || read_table(offsets, "host_offsets", np, t + 3 * np, 0) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    int64_t bpb = 0;
    for (Py_ssize_t p = 0; p < np; p++) bpb += t[2 * np + p] > 0 ? t[2 * np + p] : 0;
    self->bytes_per_block = bpb;
    self->e = (kvc_cpu_engine){(const uint64_t *)t, t + np, t + 2 * np, t + 3 * np, np, ndev,
                               (uint8_t *)(uintptr_t)host, hbb, nhost, threads};
    self->keep = Py_NewRef(keep);
    return (PyObject *)self;
}

static int Engine_traverse(PyObject *op, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(((EngineObject *)op)->keep);
    return 0;
}

static int Engine_clear(PyObject *op) {
    Py_CLEAR(((EngineObject *)op)->keep);
    return 0;
}

static void Engine_dealloc(PyObject *op) {
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    Engine_clear(op);
    PyMem_Free(((EngineObject *)op)->tables);
    freefunc f = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    f(op);
    Py_DECREF(tp);
}

static PyObject *Engine_get_int(PyObject *op, void *which) {
    const EngineObject *self = (const EngineObject *)op;
    switch ((intptr_t)which) {
        case 0: return PyLong_FromLongLong(self->e.num_device_blocks);
        case 1: return PyLong_FromLongLong(self->e.num_host_blocks);
        case 2: return PyLong_FromLongLong(self->bytes_per_block);
        case 3: return PyLong_FromLongLong(self->e.num_planes);
        default: return PyLong_FromLongLong(self->e.num_threads);
    }
}

static PyGetSetDef Engine_getset[] = {
    {"num_device_blocks", Engine_get_int, NULL, "device blocks per plane", (void *)0},
    {"num_host_blocks", Engine_get_int, NULL, "host pool blocks", (void *)1},
    {"bytes_per_block", Engine_get_int, NULL, "payload bytes of one block, all planes",
     (void *)2},
    {"num_planes", Engine_get_int, NULL, "device planes", (void *)3},
    {"threads", Engine_get_int, NULL, "most threads one copy is split over", (void *)4},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Engine_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Engine_copy, METH_FASTCALL,
     "copy(device_ids, host_ids, direction) -> bytes moved\n\n"
     "Moves device block device_ids[i] to host block host_ids[i] (direction TO_HOST) or back "
     "(TO_DEVICE), every plane. Ids: a list or tuple of ints, or a one-dimensional int64 "
     "buffer. Every id is checked (in range, destinations distinct, as many of each) before "
     "any byte moves: ValueError, nothing touched. The GIL is released while blocks move."},
    {"unchecked_copy", (PyCFunction)(void (*)(void))Engine_unchecked_copy, METH_FASTCALL,
     "unchecked_copy(device_ids, host_ids, direction) -> (code, err_index)\n\n"
     "kvc_cpu_engine_copy without copy()'s checks: what the C side refuses by itself "
     "(cpu_copy.h's codes), for tests."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Engine_slots[] = {
    {Py_tp_new, Engine_new},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_traverse, Engine_traverse},
    {Py_tp_clear, Engine_clear},
    {Py_tp_methods, Engine_methods},
    {Py_tp_getset, Engine_getset},
    {Py_tp_doc, "Engine(plane_ptrs, plane_stride_bytes, plane_bytes, host_offsets, "
                "num_device_blocks, host, host_block_bytes, num_host_blocks, threads=1, "
                "keep=None)\n\nCopies blocks between device planes and a block-major host pool "
                "at the given addresses (cpu_copy.h's layout). keep: the object owning that "
                "memory, held as long as the engine."},
    {0, NULL},
};

static PyType_Spec Engine_spec = {"kvcached.copy._cpu_copy.Engine", sizeof(EngineObject), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Engine_slots};

/* ------------------------------------------------------------- module */

static PyObject *strerror_(PyObject *mod, PyObject *arg) {
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(kvc_cpu_copy_strerror(code < INT_MIN || code > INT_MAX
                                                      ? INT_MIN : (int)code));
}

static PyMethodDef module_methods[] = {
    {"strerror", strerror_, METH_O, "strerror(code) -> str: what a cpu_copy.h code means"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *mod) {
    PyObject *type = PyType_FromModuleAndSpec(mod, &Engine_spec, NULL);
    if (type == NULL) return -1;
    int rc = PyModule_AddObjectRef(mod, "Engine", type);
    Py_DECREF(type);
    if (rc < 0) return -1;
    static const struct {
        const char *name;
        int value;
    } constants[] = {
        {"TO_HOST", KVC_DIR_TO_HOST}, {"TO_DEVICE", KVC_DIR_TO_DEVICE},
        {"OK", KVC_OK}, {"ERR_NULL", KVC_ERR_NULL}, {"ERR_ARG", KVC_ERR_ARG},
        {"ERR_PLANE", KVC_ERR_PLANE}, {"ERR_DEVICE_ID", KVC_ERR_DEVICE_ID},
        {"ERR_HOST_ID", KVC_ERR_HOST_ID}, {"ERR_DIRECTION", KVC_ERR_DIRECTION},
        {"STREAM_MIN_BYTES", (int)KVC_STREAM_MIN_BYTES},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        if (PyModule_AddIntConstant(mod, constants[i].name, constants[i].value) < 0) return -1;
    }
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED}, /* an Engine never changes after it is made */
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_cpu_copy",
    "The CPU copy engine (kvcached/native/copy/): memcpy per block-plane, GIL released.",
    0, module_methods, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu_copy(void) { return PyModuleDef_Init(&module_def); }
