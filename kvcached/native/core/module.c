/* kvcached.core._core: the cache core as Python types.
 *
 *   Core     the tree, pools and leaf heaps of one manager (type_core.c)
 *   Request  one request's block hashes and path (type_request.c)
 *   Policy   the adaptive eviction policy alone (type_policy.c)
 *
 * and the hashing functions (hashing_module.c). module.h says what these
 * files share.
 *
 * Public, documented C API only (no object internals, no _Py or PyUnstable
 * calls): heap types, multi-phase init, per-module state. Built per
 * interpreter rather than as abi3 for one reason, the token read in
 * tokens.c (setup.py says why). The caller (the manager) holds one lock
 * around every call, which is also what lets the module run without the GIL
 * on free-threaded builds. */
#include "module.h"

#include "hashing.h"

/* Each type is made from its spec for this module (PyType_FromModuleAndSpec),
 * so its methods find the module state, and the other types, from self. */
static int add_type(PyObject *mod, PyType_Spec *spec, const char *name, PyTypeObject **out) {
    *out = (PyTypeObject *)PyType_FromModuleAndSpec(mod, spec, NULL);
    if (*out == NULL) return -1;
    return PyModule_AddObjectRef(mod, name, (PyObject *)*out);
}

static int module_exec(PyObject *mod) {
    module_state *st = PyModule_GetState(mod);
    hash_impl_select();
    if (add_type(mod, &core_spec, "Core", &st->core_type) < 0 ||
        add_type(mod, &request_spec, "Request", &st->request_type) < 0 ||
        add_type(mod, &policy_spec, "Policy", &st->policy_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(mod, "HASH_LEN", HASH_LEN) < 0) return -1;
    return 0;
}

static int module_traverse(PyObject *mod, visitproc visit, void *arg) {
    module_state *st = PyModule_GetState(mod);
    Py_VISIT(st->core_type);
    Py_VISIT(st->request_type);
    Py_VISIT(st->policy_type);
    return 0;
}

static int module_clear(PyObject *mod) {
    module_state *st = PyModule_GetState(mod);
    Py_CLEAR(st->core_type);
    Py_CLEAR(st->request_type);
    Py_CLEAR(st->policy_type);
    return 0;
}

static void module_free(void *mod) { module_clear((PyObject *)mod); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_core", "The kvcached cache core (see kvcached/native/core/core.h).",
    sizeof(module_state),  hashing_methods, module_slots, module_traverse, module_clear,
    module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&module_def); }
