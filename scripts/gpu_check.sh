#!/usr/bin/env bash
# One prepared GPU check of kvcached's CUDA copy engine, for a machine with a GPU
# and no internet (16 cores, H200). Run from anywhere:
#
#   OUT=/some/dir scripts/gpu_check.sh
#
# Steps (each one runs even if an earlier one failed; every line is timestamped):
#   1. environment: nvidia-smi, nvcc, which python has numpy / a CUDA torch
#   2. build the kernel library (python -m kvcached.copy.cuda --build)
#   3. tests/test_cuda_build.py   (validation + emulated kernel, now with a real driver)
#   4. tests/test_cuda_gpu.py     (kernel/direct vs indexed copy, events, IPC; needs CUDA torch)
#   5. scripts/bench_cuda.py      (bandwidth JSON)
# Writes to $OUT: gpu_check.log (all output), summary.txt (step rc), build.json,
# bench.json, test_cuda_build.xml, test_cuda_gpu.xml. Exit status: 0 if every step passed.

set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/out/gpu_check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PS4='+ $(date -u +%H:%M:%S) '
set -x

cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export KVCACHED_CACHE_DIR="${KVCACHED_CACHE_DIR:-/tmp/kvcached-cache}"  # build once, reuse
: > "$OUT/summary.txt"
FAILED=0

stamp() { echo "=== $(date -u +%FT%TZ) $*"; }
record() {  # record NAME RC
    echo "$1 rc=$2" >> "$OUT/summary.txt"
    stamp "$1 finished rc=$2"
    [ "$2" -eq 0 ] || FAILED=1
}

# ---------------------------------------------------------------- 1. environment
stamp "environment"
uname -a
nvidia-smi || echo "nvidia-smi failed: no driver or no GPU visible"
NVCC="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)"
if [ -n "$NVCC" ]; then "$NVCC" --version; else echo "nvcc NOT FOUND: the kernel cannot be built"; fi

# A python with numpy and torch (kvcached imports it) is required; one whose
# torch sees the GPU is preferred (without it the GPU tests skip, and that is
# reported, not hidden).
PY=""
PY_TORCH_CUDA=0
for cand in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3 "$REPO/.venv/bin/python" python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    "$cand" -c 'import numpy, torch' >/dev/null 2>&1 || { echo "$cand: no numpy or torch"; continue; }
    if "$cand" -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)'; then
        PY="$cand"; PY_TORCH_CUDA=1; break
    fi
    echo "$cand: no CUDA-enabled torch (or no GPU visible to it)"
    [ -n "$PY" ] || PY="$cand"
done
if [ -z "$PY" ]; then
    echo "NO PYTHON WITH NUMPY AND TORCH FOUND: nothing below can run"
    record environment 1
    exit 1
fi
echo "using python: $PY ($("$PY" --version 2>&1)); CUDA torch: $PY_TORCH_CUDA" | tee -a "$OUT/summary.txt"
[ "$PY_TORCH_CUDA" -eq 1 ] || echo "WARNING: no Python with a CUDA build of torch: tests/test_cuda_gpu.py will SKIP; the build, validation tests and the benchmark (which need only a CPU torch) still run" | tee -a "$OUT/summary.txt"
"$PY" -m pytest --version || echo "pytest missing for $PY: test steps will fail"
record environment 0

# ------------------------------------------------------------------- 2. build
stamp "build"
timeout 600 "$PY" -m kvcached.copy.cuda --build > "$OUT/build.json"
record build $?
cat "$OUT/build.json"

# --------------------------------------------------------------- 3. build tests
# --noconftest: the suite's conftest imports the whole manager (zmq, ...), which
# this image may lack; these two files need only kvcached.copy / cuda_ipc.
stamp "tests/test_cuda_build.py"
timeout 300 "$PY" -m pytest -q -rs --noconftest -p no:cacheprovider \
    --junitxml="$OUT/test_cuda_build.xml" tests/test_cuda_build.py
record test_cuda_build $?

# ----------------------------------------------------------------- 4. GPU tests
stamp "tests/test_cuda_gpu.py"
timeout 420 "$PY" -m pytest -v -rs --noconftest -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/test_cuda_gpu.xml" tests/test_cuda_gpu.py
record test_cuda_gpu $?

# -------------------------------------------------------------------- 5. bench
stamp "scripts/bench_cuda.py"
timeout 300 "$PY" scripts/bench_cuda.py --out "$OUT/bench.json"
record bench $?

stamp "done: FAILED=$FAILED"
cat "$OUT/summary.txt"
exit "$FAILED"
