#!/usr/bin/env bash
# An environment of its own for LMCache, the peer that scripts/bench_vllm.py
# measures kvcached against (not part of `make test`):
#
#   bash scripts/setup_lmcache_env.sh [DIR]      # default /work/lmcache-venv
#   python scripts/bench_vllm.py --lmcache-python DIR/bin/python
#
# LMCache 0.5.6 runs on vLLM's CPU build only in its multi-process mode: its
# server (python -m lmcache.v1.multiprocess.http_server) beside vLLM's
# LMCacheMPConnector. Its wheel requires CUDA-only packages (cupy-cuda13x,
# cuda-python, cufile-python, nvtx: installed, never loaded on CPU) and
# numpy<=2.2.6, which would downgrade the project's numpy: hence a venv apart.
# torch is installed first, pinned to the project's (the CPU build where the
# pip configuration offers it, as on this machine; elsewhere pass
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), so that pip keeps
# it instead of pulling CUDA's build, and LMCache's native modules (built
# against torch) load in vLLM's processes too.
#
# vLLM's side needs the lmcache package importable (the connector imports
# lmcache.integration.vllm and the client modules it uses). bench_vllm gives
# vLLM's processes a PYTHONPATH entry holding only a link to this venv's
# lmcache package, nothing else of this venv: every module lmcache's client
# imports beyond it (zmq, msgspec, blake3, ...) is already in vLLM's own env.
set -euo pipefail

DIR=${1:-/work/lmcache-venv}
PY=${PYTHON:-python3.11}          # lmcache 0.5.6 ships wheels for CPython 3.10-3.13
TORCH=${TORCH:-torch==2.13.0}     # the project's torch (Makefile's TORCH)
LMCACHE=${LMCACHE:-lmcache==0.5.6}

test -x "$DIR/bin/python" || "$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q "$TORCH"
"$DIR/bin/python" -m pip install -q "$LMCACHE" "$TORCH"
# The server starts (it needs no accelerator) and reports its version.
LMCACHE_TRACK_USAGE=false "$DIR/bin/python" -c \
    "import torch, lmcache.v1.multiprocess.http_server as _; from importlib.metadata import version as v; print('lmcache', v('lmcache'), 'torch', torch.__version__)" \
    2>/dev/null | tail -1
echo "bench: python scripts/bench_vllm.py --lmcache-python $DIR/bin/python"
