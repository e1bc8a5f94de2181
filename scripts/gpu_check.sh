#!/usr/bin/env bash
# The one prepared check of kvcached's CUDA path, for a session lent a GPU
# machine (H200; torch with CUDA, numpy, pytest, nvcc; no pyzmq, no network).
# From the repository root, with a generous outer limit (the steps fit 480 s):
#
#   OUT=/some/dir scripts/gpu_check.sh
#
# Steps, each bounded in seconds, all within BUDGET_S (480) together: a step
# gets at most what is left of the budget.
#   env          20  the GPU, nvcc, a Python whose torch sees the GPU
#   build        65  python -m kvcached.copy.cuda --build (a cached build is reused)
#   build_tests  45  tests/copy/test_cuda_build.py (ptxas / PTX, validation, emulation)
#   hybrid       25  a hybrid model's pages as vLLM lays them (tests/copy/hybrid_pages.py:
#                    sliding-window, full-attention and Mamba groups over two regions of one
#                    allocation, 544-token pages) through every mode and through a transfer
#                    worker in another process, against the CPU oracle
#   gpu_tests   100  tests/copy/test_cuda_gpu.py but its big grid: ordering, both directions,
#                    a load inside the step layer by layer (per-layer events, the compute
#                    stream waiting on each, and on the copies enqueued when it gives up),
#                    > 4 GiB pools, a kernel fault, sleep/wakeup, create_cache, IPC, ...
#   gpu_grid     80  tests/copy/test_cuda_gpu.py's grid: dtype x size x count x mode vs indexed copy
#                    (every GPU step fails if any test is skipped)
#   sanitizer    70  compute-sanitizer --tool memcheck over the library-only kernel tests
#   bench        75  scripts/bench_cuda.py --budget-s 55 (modes, GEMM next to copies, sweep)
# Everything lands in $OUT as it happens: gpu_check.log (all output, a line per
# test), summary.txt (one line per finished step), build.json, <step>.xml (JUnit;
# a step that times out is interrupted with SIGINT, so pytest still writes what
# ran), bench.jsonl (one line per measurement). Exit 0 only if every step passed.
#
# Without a GPU it is a dry run: it checks the plan and that the GPU tests still
# import, says "no GPU", and exits 3.

set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/out/gpu_check}"
BUDGET_S="${BUDGET_S:-480}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export KVCACHED_CACHE_DIR="${KVCACHED_CACHE_DIR:-/tmp/kvcached-cache}"  # build once, reuse
: > "$OUT/summary.txt"
T0=$SECONDS
FAILED=0
# name:bound pairs, in order (the dry run checks that they fit the budget)
PLAN="env:20 build:65 build_tests:45 hybrid:25 gpu_tests:100 gpu_grid:80 sanitizer:70 bench:75"

stamp() { echo "=== $(date -u +%FT%TZ) +$((SECONDS - T0))s $*"; }
record() {  # record NAME RC [NOTE]
    echo "$1 rc=$2 t=$((SECONDS - T0))s${3:+ $3}" >> "$OUT/summary.txt"
    stamp "$1 finished rc=$2${3:+ ($3)}"
    [ "$2" -eq 0 ] || FAILED=1
}
bound_of() { for s in $PLAN; do [ "${s%%:*}" = "$1" ] && echo "${s##*:}"; done; }
limit_for() {  # the step's bound, or what is left of the budget if less
    local bound left
    bound=$(bound_of "$1")
    left=$((BUDGET_S - (SECONDS - T0)))
    [ "$left" -lt "$bound" ] && bound=$left
    echo "$bound"
}
run_step() {  # run_step NAME CMD... : bounded; returns its rc (124 = timed out)
    local name=$1 limit rc
    shift
    limit=$(limit_for "$name")
    local start=$SECONDS
    if [ "$limit" -lt 5 ]; then stamp "$name: no time left in the budget"; return 124; fi
    stamp "$name (limit ${limit}s): $*"
    # SIGINT first: pytest then still writes its JUnit XML of what ran.
    timeout -s INT -k 10 "$limit" "$@"
    rc=$?
    # timeout says 124; a pytest interrupted by its SIGINT says 2; a kill says 137.
    [ $((SECONDS - start)) -ge "$limit" ] && { stamp "$name TIMED OUT after ${limit}s"; rc=124; }
    return "$rc"
}
pytest_step() {  # pytest_step NAME ALLOW_SKIP_REGEX MIN_TESTS [PREFIX...] -- PYTEST_ARGS...
    local name=$1 allow=$2 min=$3 rc check
    shift 3
    local prefix=()
    while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do prefix+=("$1"); shift; done
    shift
    run_step "$name" "${prefix[@]}" "$PY" -m pytest -p no:cacheprovider --noconftest -rs \
        --junitxml="$OUT/$name.xml" "$@"
    rc=$?
    "$PY" scripts/_junit_check.py "$OUT/$name.xml" --min-tests "$min" \
        ${allow:+--allow-skip "$allow"}
    check=$?
    [ "$rc" -eq 0 ] && [ "$check" -ne 0 ] && rc=1  # a skipped GPU test did not run
    record "$name" "$rc"
}

# ------------------------------------------------------------------ 1. env
stamp "env"
uname -a
GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
    GPU=1
    timeout 10 nvidia-smi
    timeout 10 nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total \
        --format=csv
else
    echo "nvidia-smi lists no GPU"
fi
NVCC="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)"
if [ -n "$NVCC" ]; then "$NVCC" --version | tail -2; else echo "nvcc NOT FOUND"; fi
# A Python with numpy, pytest and a torch that sees the GPU; without a GPU, any
# with numpy, pytest and torch (for the dry run).
PY=""
PY_CUDA=0
SEEN=" "
for cand in ${PYTHON:-} python3 python /opt/torch/.venv/bin/python3 "$REPO/.venv/bin/python"; do
    path="$(command -v "$cand" 2>/dev/null)" || continue
    path="$(readlink -f "$path")"
    case "$SEEN" in *" $path "*) continue ;; esac
    SEEN="$SEEN$path "
    timeout 30 "$cand" -c 'import numpy, pytest, torch' >/dev/null 2>&1 || {
        echo "$cand: lacks numpy, pytest or torch"; continue; }
    if timeout 30 "$cand" -c 'import sys, torch; print("torch", torch.__version__, "cuda",
torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)'; then
        PY="$cand"; PY_CUDA=1; break
    fi
    [ -n "$PY" ] || PY="$cand"
done
echo "python: ${PY:-none} (torch sees a GPU: $PY_CUDA)" | tee -a "$OUT/summary.txt"

if [ "$GPU" -eq 0 ] || [ "$PY_CUDA" -eq 0 ]; then
    # ------------------------------------------------------------- dry run
    echo "no GPU: dry run (nvidia-smi GPU: $GPU, CUDA torch: $PY_CUDA); nothing was measured"
    total=0
    for s in $PLAN; do
        echo "  plan: ${s%%:*} <= ${s##*:}s"
        total=$((total + ${s##*:}))
    done
    echo "  plan total: ${total}s (budget ${BUDGET_S}s)"
    DRY=0
    [ "$total" -le "$BUDGET_S" ] || { echo "the plan exceeds the budget"; DRY=1; }
    for f in tests/copy/test_cuda_build.py tests/copy/test_cuda_gpu.py tests/copy/hybrid_pages.py \
             scripts/bench_cuda.py scripts/_junit_check.py; do
        [ -f "$f" ] || { echo "missing: $f"; DRY=1; }
    done
    if [ -n "$PY" ]; then  # the GPU tests still import and collect here
        timeout 120 "$PY" -m pytest -q --collect-only -p no:cacheprovider --noconftest \
            tests/copy/test_cuda_gpu.py >/dev/null || { echo "tests/copy/test_cuda_gpu.py does not import"; DRY=1; }
    fi
    record env 3 "no GPU: dry run, plan ${total}s, checks rc=$DRY"
    exit 3
fi
if [ -z "$NVCC" ]; then record env 1 "nvcc not found: the kernel cannot be built"; exit 1; fi
record env 0

# ------------------------------------------------------------------ 2. build
run_step build "$PY" -m kvcached.copy.cuda --build > "$OUT/build.json"
record build $?
cat "$OUT/build.json"

# ------------------------------------------------------- 3. build tests (CPU side)
# The "no GPU" tests of this file skip here by design; nothing else may.
pytest_step build_tests "a GPU is present" 100 -- -q tests/copy/test_cuda_build.py

# ------------------------------------------------------- 4. a hybrid model's pages
# The same round trip test_cuda_build.py emulated in step 3 (its CPU part), on the GPU.
pytest_step hybrid "" 4 -- -v tests/copy/test_cuda_gpu.py -k hybrid

# ------------------------------------------------------------------ 5. GPU tests
# The tests that prove most first; the big grid after (a timeout cuts the grid).
pytest_step gpu_tests "" 38 -- -v --durations=10 tests/copy/test_cuda_gpu.py \
    -k "not test_matches_indexed_copy and not hybrid"
pytest_step gpu_grid "" 84 -- -v --durations=10 tests/copy/test_cuda_gpu.py \
    -k test_matches_indexed_copy

# ------------------------------------------------------------- 6. compute-sanitizer
SAN="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
       /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null \
       | head -1 || true)"
if [ -z "$SAN" ]; then
    record sanitizer 1 "compute-sanitizer not found (looked on PATH and under /usr/local/cuda*)"
else
    # Library-only tests (no torch kernels): the copy kernel, the staged ids, the
    # direct and batch paths, aligned and 2-byte aligned planes.
    pytest_step sanitizer "" 12 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 20 \
        -- -q tests/copy/test_cuda_gpu.py -k lib_only
fi

# ------------------------------------------------------------------ 7. bench
run_step bench "$PY" scripts/bench_cuda.py --budget-s 55 --out "$OUT/bench.jsonl"
record bench $?

stamp "done: FAILED=$FAILED"
cat "$OUT/summary.txt"
exit "$FAILED"
