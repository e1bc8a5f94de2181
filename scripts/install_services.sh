#!/usr/bin/env bash
# Install what the storage tier's tests and benchmark need on a Debian machine:
#   Debian: redis-server (+ redis-cli), libibverbs1 (Mooncake's transfer engine),
#           iproute2 + util-linux (ip, unshare: Mooncake tests run in a private netns)
#   Python (into the venv given as $1, default .venv): redis, xxhash,
#           mooncake-transfer-engine-non-cuda (best effort: its tests skip without it)
# Idempotent: installs only what is missing, runs apt-get update at most once,
# and exits 0 when everything is already there.
set -euo pipefail

VENV="${1:-.venv}"
PY="$VENV/bin/python"
REDIS_PKG="redis>=5.0"
XXHASH_PKG="xxhash>=3.0"
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

log() { echo "install_services: $*"; }

apt_missing=()
command -v redis-server >/dev/null 2>&1 || apt_missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || apt_missing+=(redis-tools)
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    apt_missing+=(libibverbs1)
fi
command -v ip >/dev/null 2>&1 || apt_missing+=(iproute2)
command -v unshare >/dev/null 2>&1 || apt_missing+=(util-linux)

if ((${#apt_missing[@]})); then
    if [ "$(id -u)" = 0 ]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        log "need root (or sudo) to install: ${apt_missing[*]}" >&2
        exit 1
    fi
    log "apt-get install ${apt_missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
else
    log "Debian packages already installed"
fi

if [ ! -x "$PY" ]; then
    log "no Python interpreter at $PY: create the virtualenv first (or pass its path)" >&2
    exit 1
fi

pip_missing=()
"$PY" -c "import redis" >/dev/null 2>&1 || pip_missing+=("$REDIS_PKG")
"$PY" -c "import xxhash" >/dev/null 2>&1 || pip_missing+=("$XXHASH_PKG")
if ((${#pip_missing[@]})); then
    log "pip install ${pip_missing[*]}"
    "$PY" -m pip install -q "${pip_missing[@]}"
fi

if "$PY" -c "import mooncake.store" >/dev/null 2>&1; then
    log "mooncake already installed"
elif "$PY" -m pip install -q "$MOONCAKE_PKG"; then
    "$PY" -c "import mooncake.store" >/dev/null 2>&1 \
        || log "warning: mooncake installed but does not import; its tests will skip" >&2
else
    # No wheel for this platform / Python: the Mooncake tests skip and say why.
    log "warning: could not install $MOONCAKE_PKG; Mooncake tests will skip" >&2
fi
log "done"
