"""Lazy, cached builds of the CUDA copy library (kvcached.cuda_lib, with nvcc).

The C extensions are compiled at install (setup.py); the CUDA library is not,
since most machines that install kvcached have no nvcc. It is compiled on
first use into a cache directory (``$KVCACHED_CACHE_DIR``, else
``~/.cache/kvcached``). The file name carries a hash of the sources, the
headers they include, the flags and the compiler, so an edited source or
another compiler gets a fresh build while an unchanged one is reused without
running the compiler. The build writes a temp file and renames it into place:
processes that build at the same time never load a half-written library
(each may compile once; the last rename wins with identical bytes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600.0  # nvcc on a large kernel can take minutes

# Compiler runs in this process; tests read it to prove a cached build is reused.
compile_count = 0


class CompilerNotFound(RuntimeError):
    """The compiler named is not on PATH."""


class BuildError(RuntimeError):
    """The compiler ran and failed; the message carries its command and output."""


def cache_dir() -> Path:
    """Where built libraries live: ``$KVCACHED_CACHE_DIR`` or ``~/.cache/kvcached``."""
    env = os.environ.get("KVCACHED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcached"


def build_shared_library(name: str, sources: Sequence[str | os.PathLike],
                         compiler_cmd: Sequence[str] | str, flags: Sequence[str],
                         headers: Sequence[str | os.PathLike] = ()) -> Path:
    """Compile ``sources`` into ``<cache>/<name>-<hash>.so`` unless already built; return it.

    ``compiler_cmd`` is the compiler and any leading arguments (``["nvcc"]``);
    ``flags`` must make a shared library (``-shared`` and what else the
    compiler needs). ``headers`` the sources include are part of the hash (not
    compiled), so an edited header rebuilds too. Raises CompilerNotFound when
    the compiler is not on PATH, BuildError (with the compiler output) when
    the build fails, FileNotFoundError when a source or header is missing.
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


def _resolve_compiler(compiler_cmd: Sequence[str] | str) -> list[str]:
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
