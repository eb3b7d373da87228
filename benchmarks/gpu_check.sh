#!/usr/bin/env bash
# GPU check of the fused trust-ratio kernel: the GPU tests and the GPU benchmark, < 5 minutes.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Needs a machine with an NVIDIA GPU, torch (CUDA build) and CuPy (cupy-cuda13x, the `gpu`
# extra) importable by $PYTHON (default python3); pytest is optional (without it the GPU tests
# run through their own script runner). Runs from this checkout (no install needed) and writes
# into OUT_DIR: env.txt (GPU, driver, versions), gpu_tests.log (+ gpu_tests.xml with pytest),
# bench.log (the table) and bench_trust_ratio.json (the `gpu` object), summary.txt.
# Exit status 0 only when the tests and the benchmark both succeeded.
set -uo pipefail

out="${1:?usage: benchmarks/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HPCLB_KERNELS_DIR="$PWD/kernels"
start=$(date +%s)

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
  "$PY" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import cupy
    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as e:  # reported, the tests then skip and the benchmark says why
    print("cupy unavailable:", e)
PY
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== GPU tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 210 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_kernel_gpu.py \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log"
else
  timeout 210 "$PY" tests/test_kernel_gpu.py 2>&1 | tee "$out/gpu_tests.log"
fi
tests_rc=${PIPESTATUS[0]}
if grep -qE "skipped|all skipped" "$out/gpu_tests.log" && ! grep -qE "[1-9][0-9]* passed" "$out/gpu_tests.log"; then
  tests_rc=3   # nothing ran: no GPU or no CuPy
fi

echo "== GPU benchmark"
timeout 150 "$PY" -m hpclb.bench.trust_ratio --no-cpu --out "$out/bench_trust_ratio.json" \
  2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
if ! grep -q '"gpu"' "$out/bench_trust_ratio.json" 2>/dev/null; then
  bench_rc=${bench_rc/#0/4}   # no GPU numbers were written
fi

echo "tests rc=$tests_rc bench rc=$bench_rc seconds=$(( $(date +%s) - start ))" | tee "$out/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
