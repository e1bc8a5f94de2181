/* The module's functions: the chained block hash the core computes, for
 * callers outside a Core (kvcached.core.hashing), the input a memo record
 * stands for (the invariant check rehashes it), and the choice of BLAKE2b
 * compress. */
#include "module.h"

#include <stdlib.h>
#include <string.h>

#include "hashing.h"

/* chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]: the
 * chained hashes of blocks [start, stop), block start-1's hash being parent. */
static PyObject *mod_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *parent, *extra;
    Py_ssize_t parent_len, extra_len;
    int32_t bs, start, stop;
    if (parse_args(mod, args, nargs, "chain(parent, tokens, block_size, extra, start, stop)",
                   "yOiyii", &parent, &parent_len, NULL, &bs, &extra, &extra_len, &start, &stop) < 0)
        return NULL;
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
    int64_t *ids;
    uint8_t *hashes;
    void *mem = scratch(SCRATCH(&ids, count), SCRATCH(&hashes, (size_t)(stop - start) * HASH_LEN),
                        NULL);
    if (mem == NULL) return NULL;
    PyObject *out = NULL;
    if (read_tokens(args[1], (Py_ssize_t)start * bs, (Py_ssize_t)stop * bs, ids) == 0) {
        const uint8_t *prev = parent;
        for (int32_t b = 0; b < stop - start; b++) {
            hash_block(prev, extra, (size_t)extra_len, ids + (size_t)b * bs, bs,
                       hashes + (size_t)b * HASH_LEN);
            prev = hashes + (size_t)b * HASH_LEN;
        }
        out = hash_list(hashes, stop - start);
    }
    free(mem);
    return out;
}

/* record_input(record, parent, block_size, has_ns) -> bytes: the hash input a
 * memo record stands for (the invariant check rehashes it). */
static PyObject *mod_record_input(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    const uint8_t *rec, *parent;
    Py_ssize_t len, plen;
    int32_t bs;
    int has_ns;
    if (parse_args(mod, args, nargs, "record_input(record, parent, block_size, has_ns)", "yyip",
                   &rec, &len, &parent, &plen, &bs, &has_ns) < 0)
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
    uint8_t *out;
    if (scratch(SCRATCH(&out, room), NULL) == NULL) return NULL;
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

PyMethodDef hashing_methods[] = {
    {"chain", (PyCFunction)(void (*)(void))mod_chain, METH_FASTCALL,
     "chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]"},
    {"record_input", (PyCFunction)(void (*)(void))mod_record_input, METH_FASTCALL,
     "record_input(record, parent, block_size, has_ns) -> bytes"},
    {"impl", mod_impl, METH_NOARGS, "impl() -> str: the BLAKE2b compress in use"},
    {"impls", mod_impls, METH_NOARGS, "impls() -> tuple[str]: those this CPU runs, best first"},
    {"set_impl", mod_set_impl, METH_O, "set_impl(name) -> str: switch; returns the previous"},
    {NULL},
};
