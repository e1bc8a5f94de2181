/* The engine's tokens, read once per call as the engine gives them: a list
 * or tuple of ints (PyLong_AsLongLong per item), or any C-contiguous integer
 * buffer (numpy, array: copied at memcpy speed). */
#include "module.h"

#include <stdint.h>
#include <string.h>

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
int read_tokens(PyObject *tokens, Py_ssize_t lo, Py_ssize_t hi, int64_t *out) {
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
Py_ssize_t token_count(PyObject *tokens) {
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
