/* Arguments in, results out, scratch memory: what every method of the
 * binding does around its call into the core (module.h documents each). */
#include "module.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* 0; -1 with an exception; 1 when the int is outside int32 (its value in *v,
 * no exception yet: the caller names the argument). */
static int i32_of(PyObject *o, int32_t *out, long *v) {
    *v = PyLong_AsLong(o);
    if (*v == -1 && PyErr_Occurred()) return -1;
    if (*v < INT32_MIN || *v > INT32_MAX) return 1;
    *out = (int32_t)*v;
    return 0;
}

static int out_of_range(const char *what, long v) {
    PyErr_Format(PyExc_OverflowError, "%s %ld is out of range", what, v);
    return -1;
}

static int not_bytes(const char *what) {
    PyErr_Format(PyExc_TypeError, "%s must be bytes", what);
    return -1;
}

int as_i32(PyObject *o, const char *what, int32_t *out) {
    long v;
    int rc = i32_of(o, out, &v);
    return rc > 0 ? out_of_range(what, v) : rc;
}

int tier_arg(PyObject *o, int *tier) {
    long t = PyLong_AsLong(o);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (t != T_GPU && t != T_CPU) {
        PyErr_Format(PyExc_ValueError, "tier must be 0 (gpu) or 1 (cpu), got %ld", t);
        return -1;
    }
    *tier = (int)t;
    return 0;
}

int bytes_arg(PyObject *o, const char *what, const uint8_t **p, Py_ssize_t *n) {
    char *s;
    if (!PyBytes_Check(o) || PyBytes_AsStringAndSize(o, &s, n) < 0)
        return PyErr_Occurred() ? -1 : not_bytes(what);
    *p = (const uint8_t *)s;
    return 0;
}

/* The name of argument k in usage, "name(a, b: list, c=0)", into buf (only
 * an error message needs it). */
static const char *arg_name(const char *usage, Py_ssize_t k, char *buf, size_t cap) {
    const char *s = strchr(usage, '(');
    s = s ? s + 1 : usage;
    for (; k > 0 && *s; s++) {
        if (*s == ',') k--;
    }
    while (*s == ' ') s++;
    size_t n = strcspn(s, ",:=) ");
    if (n >= cap) n = cap - 1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    return buf;
}

int parse_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs, const char *usage,
               const char *fmt, ...) {
    Py_ssize_t min = -1, max = 0;
    for (const char *f = fmt; *f; f++) {
        if (*f == '|') min = max;
        else max++;
    }
    if (min < 0) min = max;
    if (nargs < min || nargs > max) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    char name[64];
    int rc = 0;
    va_list ap;
    va_start(ap, fmt);
    Py_ssize_t k = 0;
    for (const char *f = fmt; rc == 0 && *f && k < nargs; f++) {
        if (*f == '|') continue;
        PyObject *o = args[k];
        switch (*f) {
        case 'O': {
            PyObject **out = va_arg(ap, PyObject **);
            if (out != NULL) *out = o;
            break;
        }
        case 'i': {
            int32_t *out = va_arg(ap, int32_t *);
            long v;
            rc = i32_of(o, out, &v);
            if (rc > 0) rc = out_of_range(arg_name(usage, k, name, sizeof name), v);
            break;
        }
        case 'K': {
            uint64_t *out = va_arg(ap, uint64_t *);
            *out = PyLong_AsUnsignedLongLong(o);
            if (*out == (uint64_t)-1 && PyErr_Occurred()) rc = -1;
            break;
        }
        case 'p': {
            int *out = va_arg(ap, int *), t = PyObject_IsTrue(o);
            if (t < 0) rc = -1;
            else *out = t;
            break;
        }
        case 't':
            rc = tier_arg(o, va_arg(ap, int *));
            break;
        case 'y': {
            const uint8_t **p = va_arg(ap, const uint8_t **);
            Py_ssize_t *n = va_arg(ap, Py_ssize_t *);
            char *s;
            if (!PyBytes_Check(o)) rc = not_bytes(arg_name(usage, k, name, sizeof name));
            else if (PyBytes_AsStringAndSize(o, &s, n) < 0) rc = -1;
            else *p = (const uint8_t *)s;
            break;
        }
        case 'R': {
            request_t **out = va_arg(ap, request_t **);
            *out = request_arg(self, o);
            if (*out == NULL) rc = -1;
            break;
        }
        default:
            PyErr_Format(PyExc_SystemError, "parse_args: no conversion '%c' (%s)", *f, usage);
            rc = -1;
        }
        k++;
    }
    va_end(ap);
    if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, usage);
    return rc < 0 ? -1 : 0;
}

void *scratch(void *array, ...) {
    enum { ALIGN = _Alignof(max_align_t) };
    va_list ap, again;
    va_start(ap, array);
    va_copy(again, ap);
    size_t total = 0;
    for (void *a = array; a != NULL; a = va_arg(ap, void *)) {
        size_t bytes = va_arg(ap, size_t);
        total += (bytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    va_end(ap);
    char *mem = malloc(total ? total : 1);
    if (mem == NULL) {
        va_end(again);
        PyErr_NoMemory();
        return NULL;
    }
    size_t at = 0;
    for (void *a = array; a != NULL; a = va_arg(again, void *)) {
        size_t bytes = va_arg(again, size_t);
        void *p = mem + at;
        memcpy(a, &p, sizeof p); /* a points at a T *: object pointers share one representation */
        at += (bytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    va_end(again);
    return mem;
}

int32_t *ints_of(PyObject *list, const char *what, Py_ssize_t *n) {
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of ints", what);
        return NULL;
    }
    *n = PyList_Size(list);
    int32_t *out;
    if (scratch(SCRATCH(&out, *n), NULL) == NULL) return NULL;
    for (Py_ssize_t k = 0; k < *n; k++) {
        if (as_i32(PyList_GetItem(list, k), what, &out[k]) < 0) {
            free(out);
            return NULL;
        }
    }
    return out;
}

PyObject *list_of(const int32_t *v, Py_ssize_t n) {
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

PyObject *hash_list(const uint8_t *hashes, Py_ssize_t n) {
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
