/* What the files of the Python binding (kvcached.core._core) share: the
 * module state, the object layouts, argument conversion, scratch memory and
 * the token reader. The cache itself (core.h) knows nothing of Python.
 *
 * Files: module.c (module init), type_core.c (Core), type_request.c
 * (Request), type_policy.c (Policy, and the policy parameters Core takes
 * too), hashing_module.c (the module's hashing functions), convert.c
 * (arguments in, results out, scratch memory), tokens.c (the engine's
 * tokens). */
#ifndef KVC_MODULE_H
#define KVC_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"

typedef struct {
    PyTypeObject *core_type, *request_type, *policy_type;
} module_state;

typedef struct {
    PyObject_HEAD
    core_t c;
} CoreObject;

typedef struct {
    PyObject_HEAD
    PyObject *core; /* the Core whose nodes the path names (kept alive) */
    request_t r;
} RequestObject;

/* The adaptive policy alone, keyed by 64-bit block keys (type_policy.c). */
typedef struct {
    PyObject_HEAD
    policy_t p;
    int ready;
    PyObject *slots;   /* key -> slot */
    uint64_t *keys;    /* slot -> key */
    int32_t *free_slots;
    int32_t n_free, n_used, cap;
} PolicyObject;

#define CORE(self) (&((CoreObject *)(self))->c)
#define R(self) (&((RequestObject *)(self))->r)
#define POL(self) ((PolicyObject *)(self))

/* The state of the module that defined self's type. */
static inline module_state *state_of(PyObject *self) {
    return (module_state *)PyType_GetModuleState(Py_TYPE(self));
}

extern PyType_Spec core_spec, request_spec, policy_spec;
extern PyMethodDef hashing_methods[];

/* ---------------------------------------------------------- convert.c */

/* Converts a METH_FASTCALL call's arguments by fmt, one letter per
 * argument, '|' before the optional ones (which keep their values when not
 * given), each letter followed in the varargs by where it goes:
 *
 *   O  PyObject **                      the object itself (NULL: ignore it)
 *   i  int32_t *                        an int in int32 range
 *   K  uint64_t *                       an int in uint64 range
 *   p  int *                            a truth value (PyObject_IsTrue)
 *   t  int *                            a tier: 0 (gpu) or 1 (cpu)
 *   y  const uint8_t **, Py_ssize_t *   bytes, read in place
 *   R  request_t **                     a Request of self (a Core)
 *
 * usage is the call's signature, "name(arg, ...)": a wrong argument count
 * raises TypeError(usage), and a conversion error names the argument as
 * usage does, so the signature is written once. Arguments are converted in
 * order; -1 with an exception at the first that fails. */
int parse_args(PyObject *self, PyObject *const *args, Py_ssize_t nargs, const char *usage,
               const char *fmt, ...);

/* Temporary arrays of one call in one allocation, freed once with free():
 * (array, bytes) pairs written with SCRATCH(&array, count), then NULL. Each
 * array is aligned for any type; an empty one still gets a valid pointer.
 * NULL with MemoryError (the arrays are then left as they were). */
void *scratch(void *array, ...);
#define SCRATCH(pp, count) (void *)(pp), sizeof **(pp) * (size_t)(count)

int as_i32(PyObject *o, const char *what, int32_t *out);
int tier_arg(PyObject *o, int *tier);
int bytes_arg(PyObject *o, const char *what, const uint8_t **p, Py_ssize_t *n);
/* A list of ints as an int32 array to free() (*n set); NULL with an exception. */
int32_t *ints_of(PyObject *list, const char *what, Py_ssize_t *n);
PyObject *list_of(const int32_t *v, Py_ssize_t n);
PyObject *hash_list(const uint8_t *hashes, Py_ssize_t n);

/* ----------------------------------------------------------- tokens.c */

/* Tokens [lo, hi) of a list, tuple or integer buffer as int64, at out. */
int read_tokens(PyObject *tokens, Py_ssize_t lo, Py_ssize_t hi, int64_t *out);
/* How many tokens; for a buffer, also that it is 1-d and of integers. */
Py_ssize_t token_count(PyObject *tokens);

/* ----------------------------------------------------- type_request.c */

/* o as a Request of the Core core, or NULL with TypeError / ValueError. */
request_t *request_arg(PyObject *core, PyObject *o);
PyObject *new_request(PyObject *core, const uint8_t *ns, const uint8_t *extra,
                      Py_ssize_t extra_len);
int request_reserve(request_t *r, int32_t n, int memo); /* -1: no memory (no exception) */

/* ------------------------------------------------------ type_policy.c */

/* The adaptive policy's constants: the defaults, overridden by a dict's. */
int params_arg(PyObject *d, pol_params_t *out);
PyObject *params_dict(const pol_params_t *p);
/* One tier's adaptive policy, as numbers (status, metrics, tests). */
PyObject *policy_tier_stats(const policy_t *p);

#endif
