/* The CPython face of the library: an empty extension module, so that setuptools builds and
 * installs it like any extension. Python calls the tw_* functions through ctypes on this file
 * (kernels/cpu_binding.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef twcpu_module = {
    PyModuleDef_HEAD_INIT, "_twcpu",
    "turbowire CPU codec (C); called through ctypes by turbowire.kernels.cpu_binding", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__twcpu(void) { return PyModule_Create(&twcpu_module); }
