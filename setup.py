"""Native extensions, compiled at install (``pip install .``; ``make`` does it).

Everything else about the package is in pyproject.toml. The cache core uses
the public, documented C API only, but not only the limited API: reading a
token list's items in place (``PyList_GET_ITEM``) instead of through a call
per token is ~20% of a resident request (measured: docs/benchmarks.md), more
than one abi3 binary is worth, so it is built per interpreter (3.11 and up;
on a free-threaded build the module declares it needs no GIL: every call
into it holds the manager's lock). A missing C compiler fails the install
here, with the compiler's error: there is no slower fallback to hide it.
"""

from setuptools import Extension, setup

CFLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]

core = Extension(
    "kvcached.core._core",
    sources=[f"kvcached/core/native/{f}.c"
             for f in ("module", "table", "pool", "lru", "hashing", "ops")],
    depends=[f"kvcached/core/native/{f}.h" for f in ("core", "hashing", "blake2b")],
    extra_compile_args=CFLAGS,
)

setup(ext_modules=[core])
