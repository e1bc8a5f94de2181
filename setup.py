"""Native extensions, compiled at install (``pip install .``; ``make`` does it).

Everything else about the package is in pyproject.toml. The cache core is
built against the limited C API (one abi3 binary for CPython 3.11 and up);
a free-threaded CPython has no limited API yet, so there it is built for
that interpreter, and the module declares that it needs no GIL (every call
into it holds the manager's lock). A missing C compiler fails the install
here, with the compiler's error: there is no slower fallback to hide it.
"""

import sysconfig

from setuptools import Extension, setup

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
LIMITED = not FREE_THREADED
CFLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]

core = Extension(
    "kvcached.core._core",
    sources=[f"kvcached/core/native/{f}.c"
             for f in ("module", "table", "pool", "lru", "hashing", "ops")],
    depends=[f"kvcached/core/native/{f}.h" for f in ("core", "hashing", "blake2b")],
    define_macros=[("Py_LIMITED_API", "0x030B0000")] if LIMITED else [],
    py_limited_api=LIMITED,
    extra_compile_args=CFLAGS,
)

setup(
    ext_modules=[core],
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if LIMITED else {},
)
