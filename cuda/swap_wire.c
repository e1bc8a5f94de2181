/*
 * kvcached worker fast path, native: a small swap task off the wire, copied,
 * and its Done packed, in one call with no Python objects in between.
 *
 * A worker's hot loop is recv -> decode Task -> copy -> encode Done -> send.
 * In Python that is ~10 us warm but ~35 us per task in a running system
 * (every worker wakes on cold caches, and TP workers share the cores), which
 * was most of a task's latency above a raw ZeroMQ round trip. This module
 * does the middle three steps for the common frame and leaves everything
 * else to the Python path (kvcached/transfer/worker.py), which stays the
 * reference: it accepts a superset of these frames and words every error.
 *
 * The frames taken here are exactly those protocol.quick_wire takes as a
 * Task (same checks, same limits) with at most FAST_MAX_IDS ids per list:
 * a msgpack map of the seven Task keys, each once, in any order;
 * v == PROTOCOL_VERSION; kind "task"; task_kind swap_out, swap_in or noop;
 * task_id an int64; src and dst equal-length arrays of ints in [0, bound);
 * args an empty map; nothing after the map. Any other frame returns None.
 * The Done is byte-identical to protocol.encode_done(task_id, rank, n,
 * elapsed_s, {"bytes": n * bytes_per_block, "finished": monotonic}) as
 * msgpack-python packs it (the tests compare both, byte for byte).
 *
 * The copy is the CPU copy engine's kvc_cpu_engine_copy (cuda/cpu_copy.c),
 * reached through the engine struct and function pointer that
 * kvcached.copy.cpu.CpuCopyEngine owns; the server holds a reference to that
 * engine (owner), so its memory outlives every call. The GIL is held during
 * the copy: only tasks of up to max_blocks blocks come here (microseconds).
 *
 * Module: kvcached._swap_wire (loaded by kvcached/transfer/fastpath.py).
 *
 *   server(owner, engine, copy_fn, rank, version, max_frame_bytes, max_ids,
 *          device_bound, host_bound, bytes_per_block, max_blocks)
 *       -> serve(raw: bytes) -> bytes | None
 *   parse_task(raw, version, max_frame_bytes, max_ids, device_bound,
 *              host_bound) -> (task_id, kind, src, dst) | None
 *   pack_done(version, task_id, rank, blocks_done, elapsed_s, nbytes, finished)
 *       -> bytes
 *
 * Build: cc -O3 -shared -fPIC -Wall -Werror -I<python include> swap_wire.c
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#define FAST_MAX_IDS 64 /* longer id lists take the Python path */
#define DONE_MAX_BYTES 192

enum { KIND_SWAP_OUT, KIND_SWAP_IN, KIND_NOOP };

/* kvc_cpu_engine_copy's signature (cuda/cpu_copy.c). */
typedef int (*copy_fn_t)(const void *engine, const int64_t *device_ids, const int64_t *host_ids,
                         int64_t n, int64_t direction, int64_t *err_index);

typedef struct {
    int64_t task_id;
    int kind;
    int64_t n;
    int64_t src[FAST_MAX_IDS];
    int64_t dst[FAST_MAX_IDS];
} task_t;

typedef struct {
    int64_t version, max_frame_bytes, max_ids, device_bound, host_bound;
} limits_t;

/* ------------------------------------------------------------ msgpack read */

typedef struct {
    const uint8_t *p, *end;
} reader;

static int take(reader *r, size_t n, const uint8_t **out) {
    if ((size_t)(r->end - r->p) < n) return 0;
    *out = r->p;
    r->p += n;
    return 1;
}

static uint64_t be(const uint8_t *b, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | b[i];
    return v;
}

/* Any msgpack int that fits int64 (msgpack-python gives a Python int for each
 * encoding; a uint64 above INT64_MAX fails the protocol's int64 check). */
static int read_int(reader *r, int64_t *out) {
    const uint8_t *t, *b;
    if (!take(r, 1, &t)) return 0;
    uint8_t c = t[0];
    if (c <= 0x7f || c >= 0xe0) {
        *out = (int8_t)c;
        return 1;
    }
    int n;
    switch (c) {
    case 0xcc: case 0xd0: n = 1; break;
    case 0xcd: case 0xd1: n = 2; break;
    case 0xce: case 0xd2: n = 4; break;
    case 0xcf: case 0xd3: n = 8; break;
    default: return 0;
    }
    if (!take(r, (size_t)n, &b)) return 0;
    uint64_t u = be(b, n);
    if (c >= 0xd0) { /* signed: sign-extend from n bytes */
        int shift = 64 - 8 * n;
        *out = (int64_t)(u << shift) >> shift;
        return 1;
    }
    if (u > (uint64_t)INT64_MAX) return 0;
    *out = (int64_t)u;
    return 1;
}

static int read_str(reader *r, const uint8_t **s, size_t *len) {
    const uint8_t *t, *b;
    if (!take(r, 1, &t)) return 0;
    uint8_t c = t[0];
    size_t n;
    if ((c & 0xe0) == 0xa0) {
        n = c & 0x1f;
    } else if (c == 0xd9 || c == 0xda || c == 0xdb) {
        int w = c == 0xd9 ? 1 : c == 0xda ? 2 : 4;
        if (!take(r, (size_t)w, &b)) return 0;
        n = (size_t)be(b, w);
    } else {
        return 0;
    }
    return take(r, n, s) && (*len = n, 1);
}

static int str_is(const uint8_t *s, size_t len, const char *lit) {
    return len == strlen(lit) && memcmp(s, lit, len) == 0;
}

/* A container header: fix (mask/low bits) or 16/32-bit length. */
static int read_len(reader *r, uint8_t fix, uint8_t fixmask, uint8_t c16, uint8_t c32,
                    int64_t *n) {
    const uint8_t *t, *b;
    if (!take(r, 1, &t)) return 0;
    uint8_t c = t[0];
    if ((c & fixmask) == fix) {
        *n = c & (uint8_t)~fixmask;
        return 1;
    }
    if (c != c16 && c != c32) return 0;
    int w = c == c16 ? 2 : 4;
    if (!take(r, (size_t)w, &b)) return 0;
    *n = (int64_t)be(b, w);
    return 1;
}

/* An array of ids >= 0; their upper bounds depend on the task kind, which may
 * come later in the map, so parse_task_frame checks those at the end. */
static int read_ids(reader *r, int64_t max_ids, int64_t *ids, int64_t *n) {
    if (!read_len(r, 0x90, 0xf0, 0xdc, 0xdd, n) || *n > max_ids || *n > FAST_MAX_IDS) return 0;
    for (int64_t i = 0; i < *n; i++) {
        if (!read_int(r, &ids[i]) || ids[i] < 0) return 0;
    }
    return 1;
}

/* 1 when raw is a quick-shape Task (see the header); its fields go to *t. */
static int parse_task_frame(const uint8_t *buf, Py_ssize_t size, const limits_t *lim,
                            task_t *t) {
    static const char *const keys[] = {"v", "kind", "task_id", "task_kind", "src", "dst",
                                       "args"};
    enum { K_V, K_KIND, K_ID, K_TASK_KIND, K_SRC, K_DST, K_ARGS, N_KEYS };
    if (size > lim->max_frame_bytes) return 0;
    reader r = {buf, buf + size};
    int64_t entries, v, n_src = -1, n_dst = -1, n_args;
    if (!read_len(&r, 0x80, 0xf0, 0xde, 0xdf, &entries) || entries != N_KEYS) return 0;
    int seen = 0;
    for (int e = 0; e < N_KEYS; e++) {
        const uint8_t *s, *vs;
        size_t len, vlen;
        int k = 0;
        if (!read_str(&r, &s, &len)) return 0;
        while (k < N_KEYS && !str_is(s, len, keys[k])) k++;
        if (k == N_KEYS || (seen & (1 << k))) return 0; /* unknown or repeated key */
        seen |= 1 << k;
        switch (k) {
        case K_V:
            if (!read_int(&r, &v) || v != lim->version) return 0;
            break;
        case K_KIND:
            if (!read_str(&r, &vs, &vlen) || !str_is(vs, vlen, "task")) return 0;
            break;
        case K_ID:
            if (!read_int(&r, &t->task_id)) return 0;
            break;
        case K_TASK_KIND:
            if (!read_str(&r, &vs, &vlen)) return 0;
            if (str_is(vs, vlen, "swap_out")) t->kind = KIND_SWAP_OUT;
            else if (str_is(vs, vlen, "swap_in")) t->kind = KIND_SWAP_IN;
            else if (str_is(vs, vlen, "noop")) t->kind = KIND_NOOP;
            else return 0;
            break;
        case K_SRC:
            if (!read_ids(&r, lim->max_ids, t->src, &n_src)) return 0;
            break;
        case K_DST:
            if (!read_ids(&r, lim->max_ids, t->dst, &n_dst)) return 0;
            break;
        case K_ARGS:
            if (!read_len(&r, 0x80, 0xf0, 0xde, 0xdf, &n_args) || n_args != 0) return 0;
            break;
        }
    }
    if (r.p != r.end || n_src != n_dst) return 0;
    t->n = n_src;
    if (t->kind == KIND_NOOP) return 1; /* noop ids: any int64 >= 0 */
    int64_t src_bound = t->kind == KIND_SWAP_OUT ? lim->device_bound : lim->host_bound;
    int64_t dst_bound = t->kind == KIND_SWAP_OUT ? lim->host_bound : lim->device_bound;
    for (int64_t i = 0; i < t->n; i++) {
        if (t->src[i] >= src_bound || t->dst[i] >= dst_bound) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------ msgpack write */

typedef struct {
    uint8_t buf[DONE_MAX_BYTES];
    size_t n;
} writer;

static void put(writer *w, const void *src, size_t n) {
    memcpy(w->buf + w->n, src, n);
    w->n += n;
}

static void put_be(writer *w, uint8_t code, uint64_t v, int bytes) {
    w->buf[w->n++] = code;
    for (int i = bytes - 1; i >= 0; i--) w->buf[w->n++] = (uint8_t)(v >> (8 * i));
}

static void put_str(writer *w, const char *s) { /* short literals: fixstr */
    size_t n = strlen(s);
    w->buf[w->n++] = (uint8_t)(0xa0 | n);
    put(w, s, n);
}

/* The smallest encoding, as msgpack-python's packer picks it. */
static void put_int(writer *w, int64_t d) {
    if (d < -(1LL << 5)) {
        if (d < -(1LL << 15)) {
            if (d < -(1LL << 31)) put_be(w, 0xd3, (uint64_t)d, 8);
            else put_be(w, 0xd2, (uint64_t)d, 4);
        } else if (d < -(1LL << 7)) {
            put_be(w, 0xd1, (uint64_t)d, 2);
        } else {
            put_be(w, 0xd0, (uint64_t)d, 1);
        }
    } else if (d < (1LL << 7)) {
        w->buf[w->n++] = (uint8_t)d;
    } else if (d < (1LL << 8)) {
        put_be(w, 0xcc, (uint64_t)d, 1);
    } else if (d < (1LL << 16)) {
        put_be(w, 0xcd, (uint64_t)d, 2);
    } else if (d < (1LL << 32)) {
        put_be(w, 0xce, (uint64_t)d, 4);
    } else {
        put_be(w, 0xcf, (uint64_t)d, 8);
    }
}

static void put_double(writer *w, double x) {
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    put_be(w, 0xcb, u, 8);
}

/* protocol.encode_done's bytes for an ok Done with result {bytes, finished}. */
static PyObject *done_bytes(int64_t version, int64_t task_id, int64_t rank, int64_t blocks,
                            double elapsed, int64_t nbytes, double finished) {
    writer w = {.n = 0};
    w.buf[w.n++] = 0x89; /* 9 keys, in encode_done's order */
    put_str(&w, "v"), put_int(&w, version);
    put_str(&w, "kind"), put_str(&w, "done");
    put_str(&w, "task_id"), put_int(&w, task_id);
    put_str(&w, "rank"), put_int(&w, rank);
    put_str(&w, "ok"), w.buf[w.n++] = 0xc3;
    put_str(&w, "error"), put_str(&w, "");
    put_str(&w, "blocks_done"), put_int(&w, blocks);
    put_str(&w, "elapsed_s"), put_double(&w, elapsed);
    put_str(&w, "result"), w.buf[w.n++] = 0x82;
    put_str(&w, "bytes"), put_int(&w, nbytes);
    put_str(&w, "finished"), put_double(&w, finished);
    return PyBytes_FromStringAndSize((const char *)w.buf, (Py_ssize_t)w.n);
}

/* time.monotonic() (and time.perf_counter()) on Linux, rounded as CPython does. */
static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9;
}

/* ------------------------------------------------------------------ server */

typedef struct {
    PyObject *owner; /* keeps the engine's memory alive (a strong reference) */
    const void *engine;
    copy_fn_t copy;
    int64_t rank, bytes_per_block, max_blocks;
    limits_t lim;
} server_t;

#define CAPSULE "kvcached._swap_wire.server"

static int distinct(const int64_t *ids, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < i; j++)
            if (ids[i] == ids[j]) return 0;
    return 1;
}

/* serve(raw) -> bytes | None: the Done of a served task, or None for the Python path. */
static PyObject *serve(PyObject *capsule, PyObject *raw) {
    server_t *s = PyCapsule_GetPointer(capsule, CAPSULE);
    if (s == NULL) return NULL;
    if (!PyBytes_Check(raw)) Py_RETURN_NONE;
    task_t t;
    double t0 = monotonic();
    if (!parse_task_frame((const uint8_t *)PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw),
                          &s->lim, &t)) {
        Py_RETURN_NONE;
    }
    int64_t nbytes = 0;
    if (t.kind != KIND_NOOP) {
        /* The copy engine requires distinct destinations (else: Python's error). */
        if (t.n > s->max_blocks || !distinct(t.dst, t.n)) Py_RETURN_NONE;
        int out = t.kind == KIND_SWAP_OUT;
        int64_t err = -1;
        if (t.n > 0 && s->copy(s->engine, out ? t.src : t.dst, out ? t.dst : t.src, t.n,
                               out ? 0 : 1, &err) != 0) {
            Py_RETURN_NONE; /* not expected (ids checked): Python reruns and reports it */
        }
        nbytes = t.n * s->bytes_per_block;
    }
    double finished = monotonic();
    return done_bytes(s->lim.version, t.task_id, s->rank, t.n, finished - t0, nbytes, finished);
}

static PyMethodDef serve_def = {
    "serve", (PyCFunction)serve, METH_O,
    "serve(raw: bytes) -> bytes | None: run a quick-shape swap/noop Task frame and return its "
    "Done frame; None leaves the frame to the Python path (nothing was copied)."};

static void free_server(PyObject *capsule) {
    server_t *s = PyCapsule_GetPointer(capsule, CAPSULE);
    Py_XDECREF(s->owner);
    PyMem_Free(s);
}

static int as_i64(PyObject *const *args, Py_ssize_t i, int64_t *out) {
    long long v = PyLong_AsLongLong(args[i]);
    if (v == -1 && PyErr_Occurred()) return 0;
    *out = v;
    return 1;
}

static int read_limits(PyObject *const *args, Py_ssize_t first, limits_t *lim) {
    return as_i64(args, first, &lim->version) && as_i64(args, first + 1, &lim->max_frame_bytes)
           && as_i64(args, first + 2, &lim->max_ids)
           && as_i64(args, first + 3, &lim->device_bound)
           && as_i64(args, first + 4, &lim->host_bound);
}

static PyObject *server(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "server() takes 11 arguments");
        return NULL;
    }
    server_t s;
    int64_t engine, copy;
    if (!as_i64(args, 1, &engine) || !as_i64(args, 2, &copy) || !as_i64(args, 3, &s.rank)
        || !read_limits(args, 4, &s.lim) || !as_i64(args, 9, &s.bytes_per_block)
        || !as_i64(args, 10, &s.max_blocks)) {
        return NULL;
    }
    if (engine == 0 || copy == 0) {
        PyErr_SetString(PyExc_ValueError, "server() needs a copy engine and its copy function");
        return NULL;
    }
    s.owner = Py_NewRef(args[0]);
    s.engine = (const void *)(intptr_t)engine;
    s.copy = (copy_fn_t)(intptr_t)copy;
    server_t *heap = PyMem_Malloc(sizeof s);
    if (heap == NULL) {
        Py_DECREF(s.owner);
        return PyErr_NoMemory();
    }
    *heap = s;
    PyObject *capsule = PyCapsule_New(heap, CAPSULE, free_server);
    if (capsule == NULL) {
        Py_DECREF(heap->owner);
        PyMem_Free(heap);
        return NULL;
    }
    PyObject *fn = PyCFunction_New(&serve_def, capsule); /* serve, bound to the capsule */
    Py_DECREF(capsule);
    return fn;
}

static PyObject *id_list(const int64_t *ids, int64_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(ids[i]);
        if (x == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, x);
    }
    return list;
}

static PyObject *parse_task(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char *const kinds[] = {"swap_out", "swap_in", "noop"};
    limits_t lim;
    if (nargs != 6 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "parse_task(raw: bytes, version, max_frame_bytes, "
                                         "max_ids, device_bound, host_bound)");
        return NULL;
    }
    if (!read_limits(args, 1, &lim)) return NULL;
    task_t t;
    if (!parse_task_frame((const uint8_t *)PyBytes_AS_STRING(args[0]),
                          PyBytes_GET_SIZE(args[0]), &lim, &t)) {
        Py_RETURN_NONE;
    }
    PyObject *src = id_list(t.src, t.n), *dst = id_list(t.dst, t.n);
    PyObject *out = src && dst ? Py_BuildValue("(LsOO)", (long long)t.task_id, kinds[t.kind],
                                               src, dst)
                               : NULL;
    Py_XDECREF(src);
    Py_XDECREF(dst);
    return out;
}

static PyObject *pack_done(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t version, task_id, rank, blocks, nbytes;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "pack_done() takes 7 arguments");
        return NULL;
    }
    double elapsed = PyFloat_AsDouble(args[4]), finished = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred() || !as_i64(args, 0, &version) || !as_i64(args, 1, &task_id)
        || !as_i64(args, 2, &rank) || !as_i64(args, 3, &blocks) || !as_i64(args, 5, &nbytes)) {
        return NULL;
    }
    return done_bytes(version, task_id, rank, blocks, elapsed, nbytes, finished);
}

static PyMethodDef methods[] = {
    {"server", (PyCFunction)(void (*)(void))server, METH_FASTCALL,
     "server(owner, engine, copy_fn, rank, version, max_frame_bytes, max_ids, device_bound, "
     "host_bound, bytes_per_block, max_blocks) -> serve(raw) -> bytes | None\n\n"
     "engine/copy_fn: addresses of a kvc_cpu_engine and of kvc_cpu_engine_copy; owner (the "
     "object whose memory they are) is kept alive as long as serve."},
    {"parse_task", (PyCFunction)(void (*)(void))parse_task, METH_FASTCALL,
     "parse_task(raw, version, max_frame_bytes, max_ids, device_bound, host_bound) -> "
     "(task_id, kind, src, dst) | None: the Task serve() would run (for tests)."},
    {"pack_done", (PyCFunction)(void (*)(void))pack_done, METH_FASTCALL,
     "pack_done(version, task_id, rank, blocks_done, elapsed_s, nbytes, finished) -> bytes: "
     "the Done "
     "serve() sends (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_swap_wire", "Native fast path of a worker's small swap tasks.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__swap_wire(void) { return PyModule_Create(&module); }
