#!/usr/bin/env bash
# The GPU check: one command on one H200, <= 6 minutes by its estimate (430 s budget inside the
# 480 s of benchmarks/gpu_check/device_run.json), a verdict and figures per phase.
#
#   benchmarks/gpu_check.sh OUT [--cpu-dry-run]
#
# OUT receives at most 4 files: gpu_check.json (written before the set-up, after each set-up
# part and before and after every phase, so a kill or a failed set-up keeps what ran and what
# failed), gpu_check_logs.tar.gz (every log, <= 16 MiB) and the benchmark JSONs
# (bench_trust_ratio.json, overlap.json). Everything else (logs, run directories, TMPDIR,
# CuPy's cache, the unpacked MNIST, the MPI runtime installed from the carried wheels) lives
# in a short scratch folder outside OUT ($GPU_CHECK_SCRATCH, else /tmp/gc.XXXXXX), removed at
# exit. The phases, their order (of value) and estimates: benchmarks/gpu_check/check.py and
# phases.py; the set-up: staging.py; the call (prepare, command, carry, timeout):
# benchmarks/gpu_check/device_run.json; docs/gpus.md. Exit 0 only when every phase ran and passed (a skipped phase is not a pass).
#
# --cpu-dry-run runs the same phases on the CPU with the project's stand-ins (device cpu, a
# data subset, the kernel's CPU emulator); `make test` runs it through device_run.json
# (tests/test_gpu_call.py).
set -uo pipefail
usage="usage: benchmarks/gpu_check.sh OUT [--cpu-dry-run]"
out="${1:?$usage}"
if [ -n "${2:-}" ] && [ "$2" != "--cpu-dry-run" ] || [ $# -gt 2 ]; then echo "$usage" >&2; exit 2; fi
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
scratch="$(mktemp -d "${GPU_CHECK_SCRATCH:-/tmp}/gc.XXXXXX")" || exit 2
case "$scratch/" in "$out"/*) echo "gpu_check: scratch $scratch is inside OUT $out" >&2; exit 2;; esac
cleanup() { [ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$scratch"; }
trap cleanup EXIT
PYTHON="$PY" "$PY" benchmarks/gpu_check/check.py "$out" "$scratch" ${2:+"$2"} &
child=$!
trap 'kill -TERM $child 2>/dev/null' INT TERM
wait $child; rc=$?
[ $rc -gt 128 ] && { wait $child; rc=$?; }   # a trapped signal interrupted the first wait
exit $rc
