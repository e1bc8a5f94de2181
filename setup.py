"""Native extensions, compiled at install (``pip install .``; ``make`` does it).

Everything else about the package is in pyproject.toml. The native sources
live under ``kvcached/native/``: ``core/`` for the cache core, ``copy/`` for
the CPU copy engine, ``cuda/`` for the CUDA sources a built package ships.
Two extensions:

- ``kvcached.core._core``, the cache core (``kvcached/native/core/``). It
  uses the public, documented C API only, but not only the limited API:
  reading a token list's items in place (``PyList_GET_ITEM``) instead of
  through a call per token is ~20% of a resident request (measured:
  docs/benchmarks.md), more than one abi3 binary is worth, so it is built per
  interpreter (3.11 and up; on a free-threaded build the module declares it
  needs no GIL: every call into it holds the manager's lock).
- ``kvcached.copy._cpu_copy``, the CPU copy engine (``kvcached/native/copy/``):
  ``cpu_copy.c`` is the copy itself, plain C that never touches Python (it
  runs with the GIL released); ``module.c`` is the ``Engine`` type that
  kvcached.copy.cpu makes and calls. Like the core, per interpreter (it
  reads id lists in place) and without the GIL on free-threaded builds (an
  ``Engine`` never changes once made).

A missing C compiler or missing Python headers fail the install here, with a
message that names the fix: there is no slower fallback to hide it.

The CUDA copy library is not built here (most machines have no nvcc): its
sources stay in ``cuda/`` (where the project keeps CUDA code) and ``build_py``
copies them into the package (``kvcached/native/cuda/``), so a wheel
carries them and kvcached.cuda_lib builds them with nvcc where it is. An
editable install reads them from the checkout's ``cuda/``.
"""

import os
import shutil
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.command.build_py import build_py as _build_py

CFLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]

CORE_DIR = "kvcached/native/core"
core = Extension(
    "kvcached.core._core",
    sources=[f"{CORE_DIR}/{f}.c"
             for f in ("module", "type_core", "type_request", "type_policy", "hashing_module",
                       "convert", "tokens", "table", "pool", "lru", "policy", "hashing", "ops")],
    depends=[f"{CORE_DIR}/{f}.h" for f in ("module", "core", "hashing", "blake2b")],
    # Only PyInit__core is exported: the files' shared functions (parse_args,
    # core_free, ...) can then neither clash with nor be interposed by another
    # library's symbols of the same names, and calls between files skip the PLT.
    extra_compile_args=[*CFLAGS, "-fvisibility=hidden"],
)

COPY_DIR = "kvcached/native/copy"
cpu_copy = Extension(
    "kvcached.copy._cpu_copy",
    sources=[f"{COPY_DIR}/{f}.c" for f in ("module", "cpu_copy")],
    depends=[f"{COPY_DIR}/cpu_copy.h"],
    # Only PyInit__cpu_copy is exported, as for the core.
    extra_compile_args=[*CFLAGS, "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
)

# The CUDA sources, from the checkout's cuda/ into the package.
CUDA_SOURCES = ("cuda/kv_copy.cu", "cuda/kv_copy.h")
CUDA_PACKAGE_DIR = ("kvcached", "native", "cuda")


class build_ext(_build_ext):
    """Says what to install when the compiler or the Python headers are missing,
    instead of leaving it to a compiler error (or a traceback without one)."""

    def build_extensions(self):
        cmd = getattr(self.compiler, "compiler_so", None)
        if cmd and shutil.which(cmd[0]) is None:
            sys.exit(f"error: kvcached compiles native extensions at install, and the C "
                     f"compiler {cmd[0]!r} was not found. Install one (Debian/Ubuntu: "
                     f"apt-get install build-essential; Fedora/RHEL: dnf install gcc; "
                     f"macOS: xcode-select --install) or point CC at one, then install "
                     f"again.")
        include = sysconfig.get_paths()["include"]
        if not os.path.isfile(os.path.join(include, "Python.h")):
            v = f"{sys.version_info[0]}.{sys.version_info[1]}"
            sys.exit(f"error: kvcached compiles native extensions at install, and the Python "
                     f"headers are missing ({include}/Python.h). Install them (Debian/Ubuntu: "
                     f"apt-get install python{v}-dev; Fedora/RHEL: dnf install "
                     f"python{v.replace('.', '')}-devel or python3-devel), then install "
                     f"again.")
        super().build_extensions()


class build_py(_build_py):
    """Also copies the CUDA sources into the built package (a wheel carries them),
    and names them as sources (an sdist carries them)."""

    def run(self):
        super().run()
        if self.editable_mode:  # kvcached.cuda_lib reads the checkout's cuda/
            return
        missing = [s for s in CUDA_SOURCES if not os.path.isfile(s)]
        if missing:
            sys.exit(f"error: the CUDA sources {', '.join(missing)} are missing from this "
                     "source tree; they ship with kvcached (build from a full checkout "
                     "or sdist)")
        dest = os.path.join(self.build_lib, *CUDA_PACKAGE_DIR)
        self.mkpath(dest)
        for src in CUDA_SOURCES:
            self.copy_file(src, os.path.join(dest, os.path.basename(src)))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        dest = os.path.join(self.build_lib, *CUDA_PACKAGE_DIR)
        return [*outputs, *(os.path.join(dest, os.path.basename(s)) for s in CUDA_SOURCES)]

    def get_source_files(self):
        return [*super().get_source_files(), *CUDA_SOURCES]


setup(ext_modules=[core, cpu_copy],
      cmdclass={"build_ext": build_ext, "build_py": build_py})
