"""Opening a storage backend by kind and url: ``file``, ``redis`` or ``mooncake``.

Remote backends are imported only when asked for, so their client packages
are optional (extras ``redis`` and ``mooncake``).
"""

from __future__ import annotations

import re
from typing import Any

from kvcached.storage.base import StorageBackend

BACKEND_KINDS = ("file", "redis", "mooncake")
_HOSTPORT = re.compile(r"^(?:mooncake://)?([A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$")


def open_backend(kind: str, url: str, **opts: Any) -> StorageBackend:
    """Open a backend: ``file`` (directory), ``redis`` (redis://host:port), ``mooncake``
    (host:port of the master). ``opts`` go to the backend's constructor.

    Raises ValueError for an unknown kind, a malformed url or unknown options;
    an unreachable Redis / Mooncake server is not an error here (calls miss).
    """
    if kind == "file":
        from kvcached.storage.file import FileBackend as cls
        args = (_file_url(url),)
    elif kind == "redis":
        from kvcached.storage.redis_backend import RedisBackend as cls
        _check_redis_url(url)
        args = (url,)
    elif kind == "mooncake":
        from kvcached.storage.mooncake_backend import MooncakeBackend as cls
        args = (_mooncake_url(url),)
    else:
        raise ValueError(f"storage backend must be one of {', '.join(BACKEND_KINDS)}; "
                         f"got {kind!r}")
    _check_opts(kind, cls, opts)
    return cls(*args, **opts)


def _check_opts(kind: str, cls: type, opts: dict) -> None:
    import inspect

    allowed = list(inspect.signature(cls.__init__).parameters)[2:]  # after self, url
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for storage backend {kind!r}; "
                         f"allowed: {allowed}")


def _file_url(url: str) -> str:
    path = url[len("file://"):] if url.startswith("file://") else url
    if not path:
        raise ValueError(f"storage_url for file must be a directory path, got {url!r}")
    return path


def _check_redis_url(url: str) -> None:
    from urllib.parse import urlparse

    ok = False
    try:
        u = urlparse(url)
        ok = u.scheme in ("redis", "rediss") and bool(u.hostname) and u.port is not None
    except ValueError:
        pass
    if not ok:
        from kvcached.storage.base import redact_url
        raise ValueError("storage_url for redis must look like redis://127.0.0.1:6379 "
                         "(redis://user:password@host:port with a password, rediss:// "
                         f"over TLS), got {redact_url(url)!r}")


def _mooncake_url(url: str) -> str:
    m = _HOSTPORT.match(url or "")
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError("storage_url for mooncake must look like 127.0.0.1:50051 "
                         f"(the Mooncake master's address), got {url!r}")
    return f"{m.group(1)}:{m.group(2)}"
