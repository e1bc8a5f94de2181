"""The engine's config in its run directory, as its workers read it.

The engine writes its current config to ``run_dir/config.json`` (at start and
before every runtime change); spawned workers, restarted ones and those of
`kvcached launch` read it there. Credentials stay out of it: a
``storage_url`` with a password (``redis://user:PASSWORD@host:port``) is
written as ``redis://user:***@host:port``, and the real URL goes to
``run_dir/credentials.json``, mode 0600, written first (a reader that sees the
new config finds its credentials). :func:`read_run_config` puts the URL back
when the credentials belong to the redacted URL the config names. The run
directory is 0700 either way; the split keeps the password out of what gets
shown, copied into bug reports or printed: ``config.json``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from kvcached.storage.base import redact_url
from kvcached.transfer.endpoints import CONFIG_FILE

logger = logging.getLogger(__name__)

CREDENTIALS_FILE = "credentials.json"


def write_run_config(run_dir, cfg) -> None:
    """Write ``cfg`` (a CacheConfig) to ``run_dir/config.json`` without its
    password, and the password's URL to ``credentials.json`` (removed when the
    URL has none). Each file is replaced atomically."""
    run_dir = Path(run_dir)
    values = cfg.to_dict()
    url = values.get("storage_url") or ""
    shown = redact_url(url)
    cred = run_dir / CREDENTIALS_FILE
    if shown != url:
        _write_atomic(cred, json.dumps({"storage_url": url}), 0o600)
        values["storage_url"] = shown
    else:
        cred.unlink(missing_ok=True)
    _write_atomic(run_dir / CONFIG_FILE, json.dumps(values), 0o644)


def read_run_config(run_dir) -> dict[str, Any]:
    """The config dict in ``run_dir/config.json``, its ``storage_url`` with the
    password from ``credentials.json`` (see the module docstring). Raises OSError
    or ValueError as reading or parsing the file does."""
    run_dir = Path(run_dir)
    values = json.loads((run_dir / CONFIG_FILE).read_text())
    url = values.get("storage_url") or ""
    if isinstance(url, str) and redact_url(url) == url and ":***@" in url:
        try:
            raw = (run_dir / CREDENTIALS_FILE).read_text()
        except FileNotFoundError:
            return values  # none written: the password is "***" itself
        try:
            real = json.loads(raw)["storage_url"]
        except (ValueError, KeyError, TypeError):
            real = None
        if isinstance(real, str) and redact_url(real) == url:
            values["storage_url"] = real
        else:
            logger.warning("%s in %s is not for the storage_url %s names: storage calls "
                           "may fail to authenticate", CREDENTIALS_FILE, run_dir, CONFIG_FILE)
    return values


def _write_atomic(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
