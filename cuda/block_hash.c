/*
 * kvcached chained block hashes, native: the hot path of kvcached.hashing.
 *
 *   h_i = BLAKE2b-128(h_{i-1} || extra || tokens_i as little-endian int64)
 *
 * for every full block i in [start, stop), h_{start-1} = parent. Results are
 * byte-identical to hashlib.blake2b(..., digest_size=16) over the same bytes
 * (kvcached.hashing._block_hashes_py is the reference; the tests compare).
 *
 * BLAKE2b (RFC 7693) is implemented here: unkeyed, 16-byte digest, the
 * message fed incrementally through one 128-byte block buffer, so no copy of
 * the prompt is ever made. Tokens are read straight from the list/tuple
 * (PyList_GET_ITEM + PyLong_AsLongLongAndOverflow) or from a C-contiguous
 * int64 buffer (a numpy array).
 *
 * Module: kvcached._block_hash (loaded from the build cache by
 * kvcached/hashing.py with ExtensionFileLoader; PyInit__block_hash).
 *
 *   chain(parent: bytes, tokens, block_size: int, extra: bytes,
 *         start: int, stop: int) -> list[bytes]
 *
 * Errors: OverflowError for an int outside int64, TypeError for an item that
 * is not an int (a float, a numpy scalar, None) or a buffer that is not
 * C-contiguous int64, ValueError when [start, stop) is not within the full
 * blocks of tokens. The Python wrapper clips stop and reruns the reference
 * path on TypeError, so odd items keep the reference's numpy conversion
 * semantics exactly (floats truncate, None raises numpy's TypeError).
 *
 * Build: cc -O3 -shared -fPIC -Wall -Werror -I<python include> block_hash.c
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define DIGEST 16
#define BLOCKBYTES 128

/* ------------------------------------------------------------------ BLAKE2b */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
#endif
}

static inline void store64_le(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, 8);
#else
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

#define G(r, i, a, b, c, d)                        \
    do {                                           \
        a = a + b + m[SIGMA[r][2 * (i)]];          \
        d = rotr64(d ^ a, 32);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 24);                     \
        a = a + b + m[SIGMA[r][2 * (i) + 1]];      \
        d = rotr64(d ^ a, 16);                     \
        c = c + d;                                 \
        b = rotr64(b ^ c, 63);                     \
    } while (0)

#define ROUND(r)                                   \
    do {                                           \
        G(r, 0, v[0], v[4], v[8], v[12]);          \
        G(r, 1, v[1], v[5], v[9], v[13]);          \
        G(r, 2, v[2], v[6], v[10], v[14]);         \
        G(r, 3, v[3], v[7], v[11], v[15]);         \
        G(r, 4, v[0], v[5], v[10], v[15]);         \
        G(r, 5, v[1], v[6], v[11], v[12]);         \
        G(r, 6, v[2], v[7], v[8], v[13]);          \
        G(r, 7, v[3], v[4], v[9], v[14]);          \
    } while (0)

/* F: compress one 128-byte block into h; t = bytes hashed so far including
 * this block (messages here are far below 2^64 bytes, so t's high word is 0). */
static void compress(uint64_t h[8], const uint8_t block[BLOCKBYTES], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

typedef struct {
    uint64_t h[8];
    uint64_t t;    /* bytes compressed so far */
    size_t len;    /* bytes waiting in buf, 0..128 */
    uint8_t buf[BLOCKBYTES];
} b2b_state;

static inline void b2b_init(b2b_state *s) {
    memcpy(s->h, IV, sizeof s->h);
    /* parameter block: digest length 16, key length 0, fanout 1, depth 1 */
    s->h[0] ^= 0x01010000ULL ^ DIGEST;
    s->t = 0;
    s->len = 0;
}

/* The buffer is compressed only once more input arrives: the last block must
 * go through b2b_final with the final flag, even when it is full. */
static inline void b2b_update(b2b_state *s, const uint8_t *in, size_t n) {
    while (n > 0) {
        if (s->len == BLOCKBYTES) {
            s->t += BLOCKBYTES;
            compress(s->h, s->buf, s->t, 0);
            s->len = 0;
        }
        size_t take = BLOCKBYTES - s->len;
        if (take > n) take = n;
        memcpy(s->buf + s->len, in, take);
        s->len += take;
        in += take;
        n -= take;
    }
}

static inline void b2b_final(b2b_state *s, uint8_t out[DIGEST]) {
    s->t += s->len;
    memset(s->buf + s->len, 0, BLOCKBYTES - s->len);
    compress(s->h, s->buf, s->t, 1);
    store64_le(out, s->h[0]);
    store64_le(out + 8, s->h[1]);
}

/* ---------------------------------------------------------------- tokens */

/* Fast read of an int that fits in two digits (every realistic token id):
 * 1 if *out was set, 0 to take the general path. */
static inline int small_long(PyObject *o, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
    return 0;
#else
    const digit *d = ((PyLongObject *)o)->ob_digit;
    switch (Py_SIZE(o)) {
    case 0: *out = 0; return 1;
    case 1: *out = (int64_t)d[0]; return 1;
    case -1: *out = -(int64_t)d[0]; return 1;
    case 2: *out = (int64_t)d[0] | (int64_t)d[1] << PyLong_SHIFT; return 1;
    case -2: *out = -((int64_t)d[0] | (int64_t)d[1] << PyLong_SHIFT); return 1;
    default: return 0;
    }
#endif
}

/* Token i of a list/tuple as int64, general case; -1 with an exception set.
 * A big int is range-checked (OverflowError outside int64, as numpy raises);
 * anything that is not an int is a TypeError. No Python code runs here, so
 * the sequence cannot change under the loop; the size check is belt and braces. */
static int token_slow(PyObject *seq, int is_list, Py_ssize_t i, int64_t *out) {
    Py_ssize_t size = is_list ? PyList_GET_SIZE(seq) : PyTuple_GET_SIZE(seq);
    if (i >= size) {
        PyErr_SetString(PyExc_RuntimeError, "token list changed size while being hashed");
        return -1;
    }
    PyObject *item = is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "token %zd is a %.100s, not an int", i,
                     Py_TYPE(item)->tp_name);
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow) {
        PyErr_Format(PyExc_OverflowError,
                     "Python int too large to convert to C long (token %zd is outside int64)", i);
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* Token i of a list/tuple: the common small int inline, the rest in token_slow. */
static inline int token_from_item(PyObject *seq, int is_list, Py_ssize_t i, int64_t *out) {
    if (i < Py_SIZE(seq)) {
        PyObject *item = is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i);
        if (PyLong_Check(item) && small_long(item, out)) return 0;
    }
    return token_slow(seq, is_list, i, out);
}

/* Tokens are staged 16 at a time (one BLAKE2b block's worth). */
#define STAGE 16

static PyObject *chain_impl(const uint8_t *parent, Py_ssize_t parent_len, PyObject *seq,
                            const int64_t *arr, Py_ssize_t block_size, const uint8_t *extra,
                            Py_ssize_t extra_len, Py_ssize_t start, Py_ssize_t stop) {
    int is_list = seq != NULL && PyList_Check(seq);
    PyObject *out = PyList_New(stop - start);
    if (out == NULL) return NULL;
    uint8_t digest[DIGEST];
    uint8_t stage[STAGE * 8];
    b2b_state s;
    for (Py_ssize_t b = start; b < stop; b++) {
        b2b_init(&s);
        if (b == start) {
            b2b_update(&s, parent, (size_t)parent_len);
        } else {
            b2b_update(&s, digest, DIGEST);
        }
        b2b_update(&s, extra, (size_t)extra_len);
        Py_ssize_t lo = b * block_size, hi = lo + block_size;
        if (arr != NULL) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
            b2b_update(&s, (const uint8_t *)(arr + lo), (size_t)block_size * 8);
#else
            for (Py_ssize_t i = lo; i < hi;) {
                int n = 0;
                for (; n < STAGE && i < hi; n++, i++) store64_le(stage + 8 * n, (uint64_t)arr[i]);
                b2b_update(&s, stage, (size_t)n * 8);
            }
#endif
        } else {
            for (Py_ssize_t i = lo; i < hi;) {
                int n = 0;
                for (; n < STAGE && i < hi; n++, i++) {
                    int64_t v;
                    if (token_from_item(seq, is_list, i, &v) < 0) {
                        Py_DECREF(out);
                        return NULL;
                    }
                    store64_le(stage + 8 * n, (uint64_t)v);
                }
                b2b_update(&s, stage, (size_t)n * 8);
            }
        }
        b2b_final(&s, digest);
        PyObject *h = PyBytes_FromStringAndSize((const char *)digest, DIGEST);
        if (h == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b - start, h);
    }
    return out;
}

/* Accept int64 buffers: itemsize 8 and a signed 64-bit integer format. */
static int is_int64_format(const Py_buffer *view) {
    if (view->itemsize != 8) return 0;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=') f++;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*f == '<') f++;
#endif
    return (f[0] == 'q' || f[0] == 'l') && f[1] == '\0';
}

static Py_ssize_t index_arg(PyObject *o, const char *name) {
    Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", name, Py_TYPE(o)->tp_name);
    }
    return v;
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "chain(parent, tokens, block_size, extra, start, stop) takes 6 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    PyObject *parent = args[0], *tokens = args[1], *extra = args[3];
    if (!PyBytes_Check(parent)) {
        PyErr_Format(PyExc_TypeError, "parent must be bytes, got %.100s", Py_TYPE(parent)->tp_name);
        return NULL;
    }
    if (!PyBytes_Check(extra)) {
        PyErr_Format(PyExc_TypeError, "extra must be bytes, got %.100s", Py_TYPE(extra)->tp_name);
        return NULL;
    }
    Py_ssize_t block_size = index_arg(args[2], "block_size");
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = index_arg(args[4], "start");
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t stop = index_arg(args[5], "stop");
    if (stop == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }

    int is_seq = PyList_Check(tokens) || PyTuple_Check(tokens);
    Py_buffer view;
    Py_ssize_t n_tokens;
    if (is_seq) {
        n_tokens = PyList_Check(tokens) ? PyList_GET_SIZE(tokens) : PyTuple_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Format(PyExc_TypeError,
                         "tokens must be a list, a tuple or a C-contiguous int64 buffer, "
                         "got %.100s", Py_TYPE(tokens)->tp_name);
            return NULL;
        }
        if (!is_int64_format(&view)) {
            PyErr_Format(PyExc_TypeError, "token buffer must hold int64 items, got format '%s' "
                         "with itemsize %zd", view.format ? view.format : "B", view.itemsize);
            PyBuffer_Release(&view);
            return NULL;
        }
        n_tokens = view.len / 8;
    }
    PyObject *result;
    Py_ssize_t full = n_tokens / block_size;
    if (start < 0 || stop > full) {
        PyErr_Format(PyExc_ValueError,
                     "blocks [%zd, %zd) are not within the %zd full blocks of %zd tokens",
                     start, stop, full, n_tokens);
        result = NULL;
    } else if (stop <= start) {
        result = PyList_New(0);
    } else {
        result = chain_impl((const uint8_t *)PyBytes_AS_STRING(parent), PyBytes_GET_SIZE(parent),
                            is_seq ? tokens : NULL, is_seq ? NULL : (const int64_t *)view.buf,
                            block_size, (const uint8_t *)PyBytes_AS_STRING(extra),
                            PyBytes_GET_SIZE(extra), start, stop);
    }
    if (!is_seq) PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(parent, tokens, block_size, extra, start, stop) -> list[bytes]\n\n"
     "BLAKE2b-128 chained hashes of full blocks start..stop-1 of tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block_hash", "Native chained block hashes for kvcached.hashing.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&module); }
