/*
 * kvcached wire fast paths, native: the two messages of every swap task.
 *
 * Worker side: a small swap task off the wire, copied, and its Done packed,
 * in one call with no Python objects in between. A worker's hot loop is
 * recv -> decode Task -> copy -> encode Done -> send; in Python that is ~10
 * us warm but ~35 us per task in a running system (every worker wakes on
 * cold caches, and TP workers share the cores), most of what a task cost
 * above a raw ZeroMQ round trip. Coordinator side: the fields of a Done
 * without msgpack-python's generic unpack and the Python checks after it.
 *
 * The Python path stays the reference (kvcached/transfer/protocol.py,
 * worker.py, coordinator.py): it accepts a superset of these frames and words
 * every error. A frame is taken here only if protocol.quick_wire takes it,
 * with the same fields; anything else returns None, having touched nothing,
 * and the Python path decides. The tests check this on canonical, crafted
 * and mutated frames.
 *
 * Task frames taken: a msgpack map of the seven Task keys, each once, in any
 * order; v == version; kind "task"; task_kind swap_out, swap_in or noop;
 * task_id an int64 >= 0; src and dst equal-length arrays of at most FAST_MAX_IDS
 * ints in [0, bound); args an empty map; nothing after the map; every size
 * within the limits (frame, strings, maps, arrays) as msgpack-python checks
 * them. The Done sent back is byte-identical to protocol.encode_done(task_id,
 * rank, n, elapsed_s, {"bytes": n * bytes_per_block, "finished": monotonic}).
 *
 * Done frames taken: the nine Done keys, each once; task_id and blocks_done
 * int64s >= 0, rank in 0..MAX_RANK, a bool ok, a float elapsed_s in
 * [0, MAX_SECONDS], an error string and result keys that are ASCII and at
 * most max_str / 4 long, result values int64s, finite floats or bools.
 *
 * The copy is the CPU copy engine's kvc_cpu_engine_copy (kvcached/copy/native/cpu_copy.c),
 * reached through the engine struct and function pointer that
 * kvcached.copy.cpu.CpuCopyEngine owns; the server holds a reference to that
 * engine (owner), so its memory outlives every call. The GIL is held during
 * the copy: only tasks of up to max_blocks blocks come here (microseconds).
 *
 * Module: kvcached.transfer._swap_wire (imported by kvcached/transfer/fastpath.py).
 * limits: (version, max_frame_bytes, max_ids, max_str, max_map, device_bound,
 * host_bound), from protocol.Limits (bounds exclusive).
 *
 *   server(owner, engine, copy_fn, rank, bytes_per_block, max_blocks, limits)
 *       -> serve(raw: bytes) -> bytes | None
 *   done_parser(limits)
 *       -> parse(raw: bytes) -> (task_id, rank, ok, error, result, elapsed_s) | None
 *   parse_task(raw, limits) -> (task_id, kind, src, dst) | None   (for tests)
 *   pack_done(version, task_id, rank, blocks_done, elapsed_s, nbytes, finished)
 *       -> bytes                                                  (for tests)
 *
 * Built at install by setup.py (-O3 -std=c11 -Wall -Wextra -Werror).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define FAST_MAX_IDS 64 /* longer id lists take the Python path */
#define DONE_MAX_BYTES 192
/* protocol.MAX_RANK and protocol.MAX_SECONDS: the ranges of a Done's rank and
 * elapsed_s (the tests compare this reader with protocol.done_fields). */
#define MAX_RANK 65535
#define MAX_SECONDS 1e6

enum { KIND_SWAP_OUT, KIND_SWAP_IN, KIND_NOOP };

/* kvc_cpu_engine_copy's signature (kvcached/copy/native/cpu_copy.c). */
typedef int (*copy_fn_t)(const void *engine, const int64_t *device_ids, const int64_t *host_ids,
                         int64_t n, int64_t direction, int64_t *err_index);

typedef struct {
    int64_t version, max_frame_bytes, max_ids, max_str, max_map, device_bound, host_bound;
} limits_t;

typedef struct {
    int64_t task_id;
    int kind;
    int64_t n;
    int64_t src[FAST_MAX_IDS];
    int64_t dst[FAST_MAX_IDS];
} task_t;

/* ------------------------------------------------------------ msgpack read */

/* A cursor over one frame; every read checks the bytes left and the sizes
 * msgpack-python's unpackb is given (max_str_len, max_map_len, ...). */
typedef struct {
    const uint8_t *p, *end;
    const limits_t *lim;
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

/* A msgpack float (32 or 64 bit): msgpack-python gives a Python float for both. */
static int read_float(reader *r, double *out) {
    const uint8_t *t, *b;
    if (!take(r, 1, &t) || (t[0] != 0xca && t[0] != 0xcb)) return 0;
    int n = t[0] == 0xca ? 4 : 8;
    if (!take(r, (size_t)n, &b)) return 0;
    uint64_t u = be(b, n);
    if (n == 4) {
        uint32_t u32 = (uint32_t)u;
        float f;
        memcpy(&f, &u32, sizeof f);
        *out = f;
    } else {
        memcpy(out, &u, sizeof *out);
    }
    return 1;
}

static int read_bool(reader *r, int *out) {
    const uint8_t *t;
    if (!take(r, 1, &t) || (t[0] != 0xc2 && t[0] != 0xc3)) return 0;
    *out = t[0] == 0xc3;
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
    if (n > (size_t)r->lim->max_str) return 0;
    return take(r, n, s) && (*len = n, 1);
}

/* A str of at most max_str / 4 bytes, all ASCII (so as long in characters as
 * in bytes, which is what the quick check measures, and valid UTF-8). */
static int read_ascii(reader *r, const uint8_t **s, size_t *len) {
    if (!read_str(r, s, len) || *len > (size_t)(r->lim->max_str >> 2)) return 0;
    for (size_t i = 0; i < *len; i++) {
        if ((*s)[i] & 0x80) return 0;
    }
    return 1;
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

static int read_map(reader *r, int64_t *n) {
    return read_len(r, 0x80, 0xf0, 0xde, 0xdf, n) && *n <= r->lim->max_map;
}

/* A map key: which of keys[0..n) it is, once each (seen); -1 for anything else. */
static int read_key(reader *r, const char *const *keys, int n, int *seen) {
    const uint8_t *s;
    size_t len;
    if (!read_str(r, &s, &len)) return -1;
    for (int k = 0; k < n; k++) {
        if (str_is(s, len, keys[k])) {
            if (*seen & (1 << k)) return -1; /* repeated: a dict would keep one */
            *seen |= 1 << k;
            return k;
        }
    }
    return -1;
}

/* An array of ids >= 0; their upper bounds depend on the task kind, which may
 * come later in the map, so parse_task_frame checks those at the end. */
static int read_ids(reader *r, int64_t *ids, int64_t *n) {
    if (!read_len(r, 0x90, 0xf0, 0xdc, 0xdd, n) || *n > r->lim->max_ids || *n > FAST_MAX_IDS) {
        return 0;
    }
    for (int64_t i = 0; i < *n; i++) {
        if (!read_int(r, &ids[i]) || ids[i] < 0) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ Task */

/* 1 when raw is a quick-shape Task (see the header); its fields go to *t. */
static int parse_task_frame(PyObject *raw, const limits_t *lim, task_t *t) {
    static const char *const keys[] = {"v", "kind", "task_id", "task_kind", "src", "dst",
                                       "args"};
    enum { K_V, K_KIND, K_ID, K_TASK_KIND, K_SRC, K_DST, K_ARGS, N_KEYS };
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) > lim->max_frame_bytes) return 0;
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(raw);
    reader r = {buf, buf + PyBytes_GET_SIZE(raw), lim};
    int64_t entries, v, n_src = -1, n_dst = -1, n_args;
    const uint8_t *s;
    size_t len;
    int seen = 0;
    if (!read_map(&r, &entries) || entries != N_KEYS) return 0;
    for (int e = 0; e < N_KEYS; e++) {
        int good = 0;
        switch (read_key(&r, keys, N_KEYS, &seen)) {
        case K_V: good = read_int(&r, &v) && v == lim->version; break;
        case K_KIND: good = read_str(&r, &s, &len) && str_is(s, len, "task"); break;
        case K_ID: good = read_int(&r, &t->task_id) && t->task_id >= 0; break;
        case K_TASK_KIND:
            good = read_str(&r, &s, &len);
            t->kind = !good ? -1
                      : str_is(s, len, "swap_out") ? KIND_SWAP_OUT
                      : str_is(s, len, "swap_in")  ? KIND_SWAP_IN
                      : str_is(s, len, "noop")     ? KIND_NOOP
                                                   : -1;
            good = t->kind >= 0;
            break;
        case K_SRC: good = read_ids(&r, t->src, &n_src); break;
        case K_DST: good = read_ids(&r, t->dst, &n_dst); break;
        case K_ARGS: good = read_map(&r, &n_args) && n_args == 0; break;
        }
        if (!good) return 0;
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

/* ------------------------------------------------------------------ Done */

typedef struct {
    uint8_t buf[DONE_MAX_BYTES];
    size_t n;
} writer;

static void put_be(writer *w, uint8_t code, uint64_t v, int bytes) {
    w->buf[w->n++] = code;
    for (int i = bytes - 1; i >= 0; i--) w->buf[w->n++] = (uint8_t)(v >> (8 * i));
}

static void put_str(writer *w, const char *s) { /* short literals: fixstr */
    size_t n = strlen(s);
    w->buf[w->n++] = (uint8_t)(0xa0 | n);
    memcpy(w->buf + w->n, s, n);
    w->n += n;
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

/* One value of a Done's result map: an int64, a float or a bool (what the
 * quick check allows); a new reference, or NULL (not a quick value). */
static PyObject *read_plain(reader *r) {
    if (r->p >= r->end) return NULL;
    uint8_t c = *r->p;
    if (c == 0xc2 || c == 0xc3) {
        r->p++;
        return Py_NewRef(c == 0xc3 ? Py_True : Py_False);
    }
    double x;
    if (c == 0xca || c == 0xcb)
        return read_float(r, &x) && isfinite(x) ? PyFloat_FromDouble(x) : NULL;
    int64_t v;
    return read_int(r, &v) ? PyLong_FromLongLong(v) : NULL;
}

/* The result map: short ASCII keys, plain values; a later key wins, as in a dict. */
static PyObject *read_result(reader *r) {
    int64_t n;
    if (!read_map(r, &n)) return NULL;
    PyObject *out = PyDict_New();
    for (int64_t i = 0; out != NULL && i < n; i++) {
        const uint8_t *k;
        size_t len;
        PyObject *key = NULL, *value = NULL;
        if (read_ascii(r, &k, &len)
            && (key = PyUnicode_DecodeASCII((const char *)k, (Py_ssize_t)len, NULL)) != NULL
            && (value = read_plain(r)) != NULL && PyDict_SetItem(out, key, value) == 0) {
            Py_DECREF(key);
            Py_DECREF(value);
            continue;
        }
        Py_XDECREF(key);
        Py_XDECREF(value);
        Py_CLEAR(out);
    }
    return out;
}

/* The fields of a quick-shape Done, or None. A memory error also gives None:
 * the Python path then meets it with its own error. */
static PyObject *parse_done_frame(PyObject *raw, const limits_t *lim) {
    static const char *const keys[] = {"v", "kind", "task_id", "rank", "ok", "error",
                                       "blocks_done", "elapsed_s", "result"};
    enum { K_V, K_KIND, K_ID, K_RANK, K_OK, K_ERROR, K_BLOCKS, K_ELAPSED, K_RESULT, N_KEYS };
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) > lim->max_frame_bytes) Py_RETURN_NONE;
    const uint8_t *buf = (const uint8_t *)PyBytes_AS_STRING(raw);
    reader r = {buf, buf + PyBytes_GET_SIZE(raw), lim};
    int64_t entries, v, task_id = 0, rank = 0, blocks;
    int ok = 0, seen = 0, good = 1;
    double elapsed = 0;
    const uint8_t *error = NULL, *s;
    size_t error_len = 0, len;
    PyObject *result = NULL, *out = NULL;
    if (!read_map(&r, &entries) || entries != N_KEYS) Py_RETURN_NONE;
    for (int e = 0; good && e < N_KEYS; e++) {
        switch (read_key(&r, keys, N_KEYS, &seen)) {
        case K_V: good = read_int(&r, &v) && v == lim->version; break;
        case K_KIND: good = read_str(&r, &s, &len) && str_is(s, len, "done"); break;
        case K_ID: good = read_int(&r, &task_id) && task_id >= 0; break;
        case K_RANK: good = read_int(&r, &rank) && rank >= 0 && rank <= MAX_RANK; break;
        case K_OK: good = read_bool(&r, &ok); break;
        case K_ERROR: good = read_ascii(&r, &error, &error_len); break;
        case K_BLOCKS: good = read_int(&r, &blocks) && blocks >= 0; break;
        case K_ELAPSED: /* NaN fails both comparisons */
            good = read_float(&r, &elapsed) && elapsed >= 0 && elapsed <= MAX_SECONDS;
            break;
        case K_RESULT: good = (result = read_result(&r)) != NULL; break;
        default: good = 0;
        }
    }
    if (good && r.p == r.end) {
        out = Py_BuildValue("(LLOs#Od)", (long long)task_id, (long long)rank,
                            ok ? Py_True : Py_False, (const char *)error,
                            (Py_ssize_t)error_len, result, elapsed);
    }
    Py_XDECREF(result);
    PyErr_Clear();
    return out != NULL ? out : Py_NewRef(Py_None);
}

/* ----------------------------------------------------------- Python API */

/* time.monotonic() (and time.perf_counter()) on Linux, rounded as CPython does. */
static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)((int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9;
}

typedef struct {
    PyObject *owner; /* keeps the engine's memory alive (a strong reference) */
    const void *engine;
    copy_fn_t copy;
    int64_t rank, bytes_per_block, max_blocks;
    limits_t lim;
} server_t;

#define SERVER "kvcached.transfer._swap_wire.server"
#define LIMITS "kvcached.transfer._swap_wire.limits"

static int distinct(const int64_t *ids, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = 0; j < i; j++)
            if (ids[i] == ids[j]) return 0;
    return 1;
}

/* serve(raw) -> bytes | None: the Done of a served task, or None for the Python path. */
static PyObject *serve(PyObject *capsule, PyObject *raw) {
    server_t *s = PyCapsule_GetPointer(capsule, SERVER);
    if (s == NULL) return NULL;
    task_t t;
    double t0 = monotonic();
    if (!parse_task_frame(raw, &s->lim, &t)) Py_RETURN_NONE;
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

/* parse(raw) -> tuple | None, bound to a limits capsule by done_parser. */
static PyObject *parse_done(PyObject *capsule, PyObject *raw) {
    const limits_t *lim = PyCapsule_GetPointer(capsule, LIMITS);
    return lim == NULL ? NULL : parse_done_frame(raw, lim);
}

static PyMethodDef serve_def = {
    "serve", (PyCFunction)serve, METH_O,
    "serve(raw: bytes) -> bytes | None: run a quick-shape swap/noop Task frame and return its "
    "Done frame; None leaves the frame to the Python path (nothing was copied)."};

static PyMethodDef parse_done_def = {
    "parse", (PyCFunction)parse_done, METH_O,
    "parse(raw: bytes) -> (task_id, rank, ok, error, result, elapsed_s) | None: the fields "
    "of a quick-shape Done frame; None leaves the frame to the Python path."};

static int as_i64(PyObject *obj, int64_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return 0;
    *out = v;
    return 1;
}

static int read_limits(PyObject *tuple, limits_t *lim) {
    int64_t *f[] = {&lim->version, &lim->max_frame_bytes, &lim->max_ids, &lim->max_str,
                    &lim->max_map, &lim->device_bound, &lim->host_bound};
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != 7) {
        PyErr_SetString(PyExc_TypeError, "limits must be a tuple (version, max_frame_bytes, "
                                         "max_ids, max_str, max_map, device_bound, host_bound)");
        return 0;
    }
    for (int i = 0; i < 7; i++) {
        if (!as_i64(PyTuple_GET_ITEM(tuple, i), f[i])) return 0;
    }
    return 1;
}

static void free_server(PyObject *capsule) {
    server_t *s = PyCapsule_GetPointer(capsule, SERVER);
    Py_XDECREF(s->owner);
    PyMem_Free(s);
}

static void free_limits(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, LIMITS)); }

/* A C function bound to a heap copy of data (size bytes) in a capsule. */
static PyObject *bind(PyMethodDef *def, const void *data, size_t size, const char *name,
                      PyCapsule_Destructor destructor) {
    void *heap = PyMem_Malloc(size);
    if (heap == NULL) return PyErr_NoMemory();
    memcpy(heap, data, size);
    PyObject *capsule = PyCapsule_New(heap, name, destructor);
    if (capsule == NULL) {
        PyMem_Free(heap);
        return NULL;
    }
    PyObject *fn = PyCFunction_New(def, capsule); /* the capsule is its self */
    Py_DECREF(capsule); /* on failure this runs the destructor */
    return fn;
}

static PyObject *server(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "server() takes 7 arguments");
        return NULL;
    }
    server_t s;
    int64_t engine, copy;
    if (!as_i64(args[1], &engine) || !as_i64(args[2], &copy) || !as_i64(args[3], &s.rank)
        || !as_i64(args[4], &s.bytes_per_block) || !as_i64(args[5], &s.max_blocks)
        || !read_limits(args[6], &s.lim)) {
        return NULL;
    }
    if (engine == 0 || copy == 0) {
        PyErr_SetString(PyExc_ValueError, "server() needs a copy engine and its copy function");
        return NULL;
    }
    s.owner = NULL;
    s.engine = (const void *)(intptr_t)engine;
    s.copy = (copy_fn_t)(intptr_t)copy;
    PyObject *fn = bind(&serve_def, &s, sizeof s, SERVER, free_server);
    if (fn != NULL) { /* only now: free_server releases it with the capsule */
        server_t *bound = PyCapsule_GetPointer(PyCFunction_GET_SELF(fn), SERVER);
        bound->owner = Py_NewRef(args[0]);
    }
    return fn;
}

static PyObject *done_parser(PyObject *self, PyObject *limits) {
    limits_t lim;
    return read_limits(limits, &lim) ? bind(&parse_done_def, &lim, sizeof lim, LIMITS,
                                            free_limits)
                                     : NULL;
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
    task_t t;
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "parse_task(raw: bytes, limits)");
        return NULL;
    }
    if (!read_limits(args[1], &lim)) return NULL;
    if (!parse_task_frame(args[0], &lim, &t)) Py_RETURN_NONE;
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
    if (PyErr_Occurred() || !as_i64(args[0], &version) || !as_i64(args[1], &task_id)
        || !as_i64(args[2], &rank) || !as_i64(args[3], &blocks) || !as_i64(args[5], &nbytes)) {
        return NULL;
    }
    return done_bytes(version, task_id, rank, blocks, elapsed, nbytes, finished);
}

static PyMethodDef methods[] = {
    {"server", (PyCFunction)(void (*)(void))server, METH_FASTCALL,
     "server(owner, engine, copy_fn, rank, bytes_per_block, max_blocks, limits) -> "
     "serve(raw) -> bytes | None\n\nengine/copy_fn: addresses of a kvc_cpu_engine and of "
     "kvc_cpu_engine_copy; owner (the object whose memory they are) is kept alive as long "
     "as serve."},
    {"done_parser", done_parser, METH_O,
     "done_parser(limits) -> parse(raw) -> (task_id, rank, ok, error, result, elapsed_s) | "
     "None"},
    {"parse_task", (PyCFunction)(void (*)(void))parse_task, METH_FASTCALL,
     "parse_task(raw, limits) -> (task_id, kind, src, dst) | None: the Task serve() would "
     "run (for tests)."},
    {"pack_done", (PyCFunction)(void (*)(void))pack_done, METH_FASTCALL,
     "pack_done(version, task_id, rank, blocks_done, elapsed_s, nbytes, finished) -> bytes: "
     "the Done serve() sends (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_swap_wire", "Native fast paths of the task/done wire.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__swap_wire(void) { return PyModule_Create(&module); }
