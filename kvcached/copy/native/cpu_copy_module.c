/*
 * kvcached.copy._cpu_copy: the file setup.py builds cpu_copy.c into.
 *
 * The module itself is empty. kvcached/copy/cpu.py imports it only to find
 * the built file, then opens that file with ctypes.CDLL and calls
 * cpu_copy.c's C API (kvc_cpu_copy, kvc_cpu_engine_copy, ...): ctypes
 * releases the GIL for every call, which a call through the Python C API
 * would not do by itself. This init function is what lets setuptools build
 * and install the library like any extension module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyModuleDef_Slot module_slots[] = {
#ifdef Py_GIL_DISABLED
    {Py_mod_gil, Py_MOD_GIL_NOT_USED}, /* no Python state at all */
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_cpu_copy",
    "The native CPU copy library (cpu_copy.c), called through ctypes by kvcached.copy.cpu.",
    0, NULL, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu_copy(void) { return PyModuleDef_Init(&module_def); }
