"""Lazy, cached builds of kvcached's small native libraries (C now, nvcc later).

A library is compiled on first use with the system compiler into a cache
directory (``$KVCACHED_CACHE_DIR``, else ``~/.cache/kvcached``). The file name
carries a hash of the sources, the flags and the compiler, so an edited source
or another compiler gets a fresh build while an unchanged one is reused
without running the compiler. The build writes a temp file and renames it
into place: processes that build at the same time never load a half-written
library (each may compile once; the last rename wins with identical bytes).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

DEFAULT_FLAGS: tuple[str, ...] = ("-O3", "-shared", "-fPIC", "-Wall", "-Werror", "-pthread")
COMPILER_CANDIDATES: tuple[str, ...] = ("cc", "gcc")
BUILD_TIMEOUT_S = 600.0  # nvcc on a large kernel can take minutes

# Compiler runs in this process; tests read it to prove a cached build is reused.
compile_count = 0


class CompilerNotFound(RuntimeError):
    """No usable compiler: callers fall back to a non-native path."""


class BuildError(RuntimeError):
    """The compiler ran and failed; the message carries its command and output."""


def cache_dir() -> Path:
    """Where built libraries live: ``$KVCACHED_CACHE_DIR`` or ``~/.cache/kvcached``."""
    env = os.environ.get("KVCACHED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcached"


def find_compiler(candidates: Sequence[str] = COMPILER_CANDIDATES) -> str | None:
    """Absolute path of the first compiler found (``$CC`` first), or None."""
    env_cc = os.environ.get("CC")
    for name in ([env_cc] if env_cc else []) + list(candidates):
        path = shutil.which(name)
        if path:
            return path
    return None


def build_shared_library(name: str, sources: Sequence[str | os.PathLike],
                         compiler_cmd: Sequence[str] | str | None = None,
                         flags: Sequence[str] = DEFAULT_FLAGS,
                         headers: Sequence[str | os.PathLike] = ()) -> Path:
    """Compile ``sources`` into ``<cache>/<name>-<hash>.so`` unless already built; return it.

    ``headers`` the sources include are part of the hash (not compiled), so an
    edited header rebuilds too.

    ``compiler_cmd`` is the compiler and any leading arguments (``["nvcc"]``,
    ``"gcc"``); None picks ``$CC``, ``cc`` or ``gcc``. Raises CompilerNotFound
    when there is no compiler, BuildError (with the compiler output) when the
    build fails, FileNotFoundError when a source is missing.
    """
    cmd = _resolve_compiler(compiler_cmd)
    srcs = [Path(s).resolve() for s in sources]
    hdrs = [Path(h).resolve() for h in headers]
    for s in (*srcs, *hdrs):
        if not s.is_file():
            raise FileNotFoundError(f"native source {s} does not exist")
    out_dir = cache_dir()
    target = out_dir / f"{name}-{_build_key(cmd, [*srcs, *hdrs], flags)}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    _compile(cmd, srcs, flags, target)
    return target


def import_extension(module: str, source: str | os.PathLike | Sequence[str | os.PathLike],
                     stem: str, headers: Sequence[str | os.PathLike] = ()) -> ModuleType:
    """Build ``source`` (a CPython extension whose ``PyInit_`` matches the last part
    of ``module``; or a list of the files that make it up, with the ``headers``
    they share) into ``<cache>/<stem><abi>-<hash>.so`` unless already built, and
    load it. Raises like ``build_shared_library``, and CompilerNotFound when the
    Python headers are missing, ImportError when the library does not load."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise CompilerNotFound(f"Python headers not found ({include}/Python.h); install the "
                               f"python{sys.version_info[0]}.{sys.version_info[1]}-dev package "
                               f"to build {stem}")
    flags = ["-O3", "-shared", "-fPIC", "-Wall", "-Werror", "-fvisibility=hidden", f"-I{include}"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]
    # The ABI tag goes into the file name: another Python gets its own build.
    tag = (sysconfig.get_config_var("EXT_SUFFIX") or ".so").removesuffix(".so")
    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    path = build_shared_library(f"{stem}{tag}", sources, flags=flags, headers=headers)
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path} as {module}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def native_disabled() -> bool:
    """True when ``KVCACHED_NO_NATIVE`` asks every native piece for its fallback."""
    return os.environ.get("KVCACHED_NO_NATIVE", "").strip().lower() in ("1", "true", "yes", "on")


def try_import_extension(module: str, source: str | os.PathLike | Sequence[str | os.PathLike],
                         stem: str, what: str, headers: Sequence[str | os.PathLike] = ()
                         ) -> tuple[ModuleType | None, str | None]:
    """``(import_extension(...), None)``, or ``(None, why)`` when ``KVCACHED_NO_NATIVE``
    is set or the build or load fails; a failure is logged once, as a warning
    that names ``what`` falls back to its Python path."""
    if native_disabled():
        return None, "disabled by KVCACHED_NO_NATIVE"
    try:
        return import_extension(module, source, stem, headers), None
    except (OSError, RuntimeError, ImportError) as e:
        why = f"{type(e).__name__}: {e}"
        logger.warning("%s unavailable, using the slower Python path (same results): %s",
                       what, why)
        return None, why


def _resolve_compiler(compiler_cmd: Sequence[str] | str | None) -> list[str]:
    if compiler_cmd is None:
        found = find_compiler()
        if found is None:
            raise CompilerNotFound(
                f"no C compiler found (tried $CC, {', '.join(COMPILER_CANDIDATES)}); "
                "install gcc or set CC to build the native copy library")
        return [found]
    cmd = [compiler_cmd] if isinstance(compiler_cmd, str) else list(compiler_cmd)
    if not cmd:
        raise ValueError("compiler_cmd must name a compiler, got an empty command")
    path = shutil.which(cmd[0])
    if path is None:
        raise CompilerNotFound(f"compiler {cmd[0]!r} not found on PATH")
    return [path, *cmd[1:]]


def _build_key(cmd: list[str], srcs: list[Path], flags: Sequence[str]) -> str:
    """Hash of everything that changes the output; the compiler's identity is
    its resolved path, size and mtime (cheaper than running ``--version``)."""
    h = hashlib.blake2b(digest_size=8)
    real = Path(os.path.realpath(cmd[0]))
    st = real.stat()
    for part in (str(real), str(st.st_size), str(st.st_mtime_ns), *cmd[1:], "\0", *flags):
        h.update(part.encode() + b"\0")
    for s in srcs:
        h.update(s.name.encode() + b"\0")
        h.update(s.read_bytes())
    return h.hexdigest()


def _compile(cmd: list[str], srcs: list[Path], flags: Sequence[str], target: Path) -> None:
    global compile_count
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    full = [*cmd, *flags, "-o", tmp, *map(str, srcs)]
    logger.info("building %s: %s", target.name, " ".join(full))
    try:
        proc = subprocess.run(full, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        compile_count += 1
        if proc.returncode != 0:
            raise BuildError(
                f"building {target.name} failed (exit {proc.returncode}): {' '.join(full)}\n"
                f"{proc.stdout}{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: readers see no file or the whole library
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"building {target.name} timed out after {BUILD_TIMEOUT_S:.0f} s: "
                         f"{' '.join(full)}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
