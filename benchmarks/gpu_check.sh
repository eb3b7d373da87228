#!/usr/bin/env bash
# The GPU check of issue #10: one script, at most 9 minutes on one H200, one verdict per phase.
#
#   benchmarks/gpu_check.sh OUT [--cpu-dry-run]
#
# Phases (each bounded by `timeout`; the verdicts go to OUT/gpu_check.json and a copy to
# results/gpu_check.json; the exit status is non-zero when any phase fails):
#   preflight       CUDA (torch), CuPy, mpi4py and an mpirun present
#   kernel          the GPU kernel tests + `hpclb bench trust-ratio` with the targets asserted:
#                   >= 90 % of the measured device-copy bandwidth on the ResNet-50 and BERT-large
#                   parameter sets, >= 3x torch._foreach_norm, >= 20x a per-layer loop
#   mnist_lstm      `hpclb train mnist-lstm --batch-size 1024 --device cuda --precision bf16`
#                   (LEGW) to >= 98.0 % test accuracy; time and samples/s recorded
#   lars_cupy_torch one LARS epoch of MNIST-LSTM with the fused CuPy trust ratios and one with
#                   HPCLB_TRUST_BACKEND=torch: the final parameters agree within tolerance
#   share_gpu       two ranks on one GPU (`--share-gpu`) through `--backend mpi` (staged through
#                   pinned host memory) and `--backend torch` (Gloo for CUDA tensors): a short
#                   `hpclb train` each, and a GradientSync run whose parameter checksums agree
#   stream_order    the staged allreduce waits for the stream that produced the tensor: the
#                   producer is delayed with torch.cuda._sleep, the sum must see its values
#   overlap         if time remains: `hpclb bench` overlap of backward and allreduce, if present
# --cpu-dry-run: the phases that need a GPU are reported "skipped: no GPU", the others run
# (tests/test_gpu_scripts.py runs it so the script cannot rot without a GPU).
#
# The GPU machine has no network: the MNIST files travel in the tree (copy data/mnist to
# shared-data/mnist before the run; $HPCLB_DATA wins, then shared-data/, then data/), and so does
# an Open MPI when its python3 has none on PATH ($MPIRUN names it). Nothing is installed: the
# checkout runs from PYTHONPATH.
set -uo pipefail

usage="usage: benchmarks/gpu_check.sh OUT [--cpu-dry-run]"
out="${1:?$usage}"
dry=0
if [ "${2:-}" = "--cpu-dry-run" ]; then dry=1; elif [ -n "${2:-}" ]; then echo "$usage" >&2; exit 2; fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
repo="$PWD"
PY="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HPCLB_KERNELS_DIR="$repo/kernels"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
if [ -n "${HPCLB_DATA:-}" ]; then data="$HPCLB_DATA"
elif [ -d shared-data/mnist ]; then data="$repo/shared-data"
else data="$repo/data"; fi
MPIRUN="${MPIRUN:-$(command -v mpirun || echo "$(dirname "$(command -v "$PY")")/mpirun")}"
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}   # 9 minutes
start=$(date +%s)
verdicts="$out/phases.jsonl"
: >"$verdicts"
hpclb() { "$PY" -m hpclb "$@"; }
elapsed() { echo $(( $(date +%s) - start )); }

# verdict PHASE STATUS DETAIL [SECONDS]: STATUS is pass, fail or "skipped: why"
verdict() {
    "$PY" - "$verdicts" "$1" "$2" "$3" "${4:-0}" <<'PY'
import json, sys
path, phase, status, detail, secs = sys.argv[1:]
with open(path, "a") as f:
    f.write(json.dumps({"phase": phase, "status": status, "detail": detail,
                        "seconds": float(secs)}) + "\n")
print(f"== {phase}: {status}" + (f" ({detail})" if detail else ""), flush=True)
PY
}
gpu_or_skip() {  # gpu_or_skip PHASE: 0 when the phase may use the GPU, else records the skip
    if [ "$dry" = 1 ]; then verdict "$1" "skipped: no GPU" "--cpu-dry-run"; return 1; fi
    return 0
}
fits() {  # fits PHASE SECONDS: 0 when SECONDS still fit the budget, else records the skip
    local left=$(( BUDGET_S - $(elapsed) ))
    if [ "$left" -lt "$2" ]; then verdict "$1" "skipped: no time" "needs ~$2 s, $left s left"; return 1; fi
    return 0
}

phase_preflight() {
    local t0=$SECONDS
    "$PY" - "$dry" "$MPIRUN" >"$out/env.txt" 2>&1 <<'PY'
import json, os, platform, shutil, sys
dry, mpirun = sys.argv[1] == "1", sys.argv[2]
found, problems = {"python": platform.python_version()}, []
try:
    import torch
    found["torch"], found["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        found["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    elif not dry:
        problems.append("torch sees no CUDA device")
except Exception as e:
    problems.append(f"torch: {e}")
try:
    import cupy
    found["cupy"] = cupy.__version__
except Exception as e:
    if not dry:
        problems.append(f"CuPy: {e}")
try:
    import mpi4py
    found["mpi4py"] = mpi4py.__version__
except Exception as e:
    problems.append(f"mpi4py: {e}")
if not (os.access(mpirun, os.X_OK) or shutil.which(mpirun)):
    problems.append(f"no mpirun at {mpirun} (set MPIRUN)")
print(json.dumps(found))
print("PROBLEMS " + "; ".join(problems) if problems else "OK")
PY
    local rc=$?
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$out/env.txt" 2>&1
    fi
    cat "$out/env.txt"
    if [ $rc -eq 0 ] && grep -q "^OK$" "$out/env.txt"; then
        verdict preflight pass "$(head -1 "$out/env.txt")" $((SECONDS - t0))
    else
        verdict preflight fail "$(grep PROBLEMS "$out/env.txt" || tail -1 "$out/env.txt")" $((SECONDS - t0))
    fi
}

phase_kernel() {
    gpu_or_skip kernel || return 0
    fits kernel 200 || return 0
    local t0=$SECONDS
    timeout 120 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_kernel_gpu.py \
        >"$out/kernel_tests.log" 2>&1
    local tests_rc=$?
    timeout 90 "$PY" -m hpclb.bench.trust_ratio --no-cpu --out "$out/bench_trust_ratio.json" \
        >"$out/kernel_bench.log" 2>&1
    local bench_rc=$?
    local detail
    detail=$("$PY" - "$out/bench_trust_ratio.json" <<'PY'
import json, sys
try:
    g = json.load(open(sys.argv[1]))["gpu"]
except Exception as e:
    print(f"FAIL no GPU benchmark result ({e})"); raise SystemExit
bad, parts = [], []
for s in ("resnet50", "bert_large"):
    v = g["sets"][s]
    f, a, b = v["fraction_of_copy_bandwidth"], v["speedup_vs_foreach"], v["speedup_vs_loop"]
    parts.append(f"{s}: {100 * f:.0f}% of copy bw, {a:.1f}x foreach, {b:.0f}x loop")
    bad += [f"{s} {n}" for n, ok in (("bandwidth < 90%", f >= 0.9), ("< 3x foreach", a >= 3),
                                     ("< 20x loop", b >= 20)) if not ok]
print(("FAIL " + ", ".join(bad) + "; " if bad else "") + "; ".join(parts))
PY
)
    if [ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [[ "$detail" != FAIL* ]] && \
            grep -qE "[1-9][0-9]* passed" "$out/kernel_tests.log"; then
        verdict kernel pass "$detail" $((SECONDS - t0))
    else
        verdict kernel fail "tests rc $tests_rc, bench rc $bench_rc: $detail" $((SECONDS - t0))
    fi
}

summary_field() {  # summary_field RUN_DIR KEY
    "$PY" -c "import json,sys; print(json.load(open(sys.argv[1] + '/summary.json')).get(sys.argv[2]))" "$1" "$2" 2>/dev/null
}

phase_mnist() {
    gpu_or_skip mnist_lstm || return 0
    fits mnist_lstm 180 || return 0
    local t0=$SECONDS run="$out/mnist_lstm_b1024"
    rm -rf "$run"
    timeout 170 "$PY" -m hpclb train mnist-lstm --batch-size 1024 --scaling legw --device cuda \
        --precision bf16 --data-dir "$data" --out "$run" >"$out/mnist_lstm.log" 2>&1
    local rc=$?
    local acc sps wall
    acc=$(summary_field "$run" final_test_accuracy)
    wall=$(summary_field "$run" wall_time_s)
    sps=$(grep -o "samples/s *[0-9,]*" "$out/mnist_lstm.log" | tail -1 | tr -d ',' | awk '{print $2}')
    local detail="exit $rc, test accuracy ${acc:-none}, wall ${wall:-?} s, last epoch ${sps:-?} samples/s"
    if [ $rc -eq 0 ] && "$PY" -c "import sys; sys.exit(0 if float(sys.argv[1]) >= 0.98 else 1)" "${acc:-0}" 2>/dev/null; then
        verdict mnist_lstm pass "$detail" $((SECONDS - t0))
    else
        verdict mnist_lstm fail "$detail (target 98.0 %)" $((SECONDS - t0))
    fi
}

phase_lars() {
    gpu_or_skip lars_cupy_torch || return 0
    fits lars_cupy_torch 100 || return 0
    local t0=$SECONDS rc=0
    for b in cupy torch; do
        rm -rf "$out/lars_$b"
        if [ $b = torch ]; then export HPCLB_TRUST_BACKEND=torch; else unset HPCLB_TRUST_BACKEND; fi
        timeout 45 "$PY" -m hpclb train mnist-lstm --optimizer lars --batch-size 1024 --epochs 1 \
            --device cuda --precision fp32 --data-dir "$data" --out "$out/lars_$b" \
            >"$out/lars_$b.log" 2>&1 || rc=$?
    done
    unset HPCLB_TRUST_BACKEND
    local detail
    detail=$("$PY" - "$out/lars_cupy/checkpoint.pt" "$out/lars_torch/checkpoint.pt" "$out/lars_cupy.log" <<'PY'
import sys, torch
try:
    a, b = (torch.load(p, map_location="cpu", weights_only=True)["model"] for p in sys.argv[1:3])
except Exception as e:
    print(f"FAIL no checkpoints ({e})"); raise SystemExit
worst = max(float(((a[k].double() - b[k].double()).abs().max() /
                   b[k].double().abs().max().clamp_min(1e-12))) for k in a)
fused = "cupy" in open(sys.argv[3]).read().lower()
print(("" if worst <= 1e-3 and fused else "FAIL ") +
      f"max relative parameter difference {worst:.2e} (tolerance 1e-3); fused kernel logged: {fused}")
PY
)
    if [ $rc -eq 0 ] && [[ "$detail" != FAIL* ]]; then verdict lars_cupy_torch pass "$detail" $((SECONDS - t0))
    else verdict lars_cupy_torch fail "exit $rc: $detail" $((SECONDS - t0)); fi
}

SHARE_PY='
import sys, torch
from torch import nn
from hpclb.dist.world import get_communicator
from hpclb.sync.agree import broadcast_parameters
from hpclb.sync.gradients import GradientSync
comm = get_communicator(sys.argv[1])
dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(comm.rank)  # different initial weights: the broadcast must fix them
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10)).to(dev)
broadcast_parameters(model, comm)
sync = GradientSync(model, comm)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator(device="cpu").manual_seed(100 + comm.rank)  # each rank its own data
for _ in range(5):
    opt.zero_grad(set_to_none=False)
    x = torch.randn(32, 64, generator=g).to(dev)
    model(x).pow(2).mean().backward()
    sync.synchronize()
    opt.step()
sums = comm.allgather_object(float(sum(p.double().sum() for p in model.parameters())))
print("CHECKSUMS", sys.argv[1], dev, sums, flush=True)
sys.exit(0 if len(set(sums)) == 1 else 1)
'

phase_share() {
    fits share_gpu 120 || return 0
    local t0=$SECONDS ok=1 parts=()
    local dev_args=(--device cuda --share-gpu)
    [ "$dry" = 1 ] && dev_args=()
    for backend in mpi torch; do
        timeout 50 "$MPIRUN" -n 2 --bind-to none "$PY" -c "$SHARE_PY" "$backend" \
            >"$out/share_${backend}_sync.log" 2>&1 || ok=0
        parts+=("$backend: $(grep -o 'CHECKSUMS.*' "$out/share_${backend}_sync.log" | head -1 || echo 'no checksums')")
        if [ "$dry" = 0 ]; then
            rm -rf "$out/share_$backend"
            timeout 60 "$MPIRUN" -n 2 --bind-to none "$PY" -m hpclb train mnist-lstm \
                --batch-size 1024 --epochs 0.5 --backend "$backend" "${dev_args[@]}" \
                --data-dir "$data" --out "$out/share_$backend" >"$out/share_$backend.log" 2>&1 || ok=0
            parts+=("train exit $? ($(summary_field "$out/share_$backend" final_test_accuracy))")
        fi
    done
    local detail
    detail="$(printf '%s; ' "${parts[@]}")"
    [ "$dry" = 1 ] && detail="CPU stand-in (no GPU): $detail"
    if [ $ok = 1 ]; then verdict share_gpu pass "$detail" $((SECONDS - t0))
    else verdict share_gpu fail "$detail" $((SECONDS - t0)); fi
}

STREAM_PY='
import sys, torch
from hpclb.dist.world import get_communicator
comm = get_communicator("mpi")
torch.cuda.set_device(0)
n = 1 << 20
t = torch.zeros(n, device="cuda")
producer = torch.cuda.Stream()
with torch.cuda.stream(producer):
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the values exist
    t.fill_(comm.rank + 1.0)
    h = comm.iallreduce_(t, op="sum")
h.wait()
torch.cuda.synchronize()
want = comm.world_size * (comm.world_size + 1) / 2
got = float(t.min()), float(t.max())
print("STREAM", comm.rank, got, "want", want, flush=True)
sys.exit(0 if got == (want, want) else 1)
'

phase_stream() {
    gpu_or_skip stream_order || return 0
    fits stream_order 60 || return 0
    local t0=$SECONDS
    HPCLB_SHARE_GPU=1 timeout 50 "$MPIRUN" -n 2 --bind-to none "$PY" -c "$STREAM_PY" \
        >"$out/stream_order.log" 2>&1
    local rc=$?
    local detail
    detail="$(grep STREAM "$out/stream_order.log" | tr '\n' ' ')"
    if [ $rc -eq 0 ]; then verdict stream_order pass "$detail" $((SECONDS - t0))
    else verdict stream_order fail "exit $rc: ${detail:-$(tail -2 "$out/stream_order.log" | tr '\n' ' ')}" $((SECONDS - t0)); fi
}

phase_overlap() {
    gpu_or_skip overlap || return 0
    fits overlap 90 || return 0
    if ! "$PY" -m hpclb bench --help 2>/dev/null | grep -q overlap; then
        verdict overlap "skipped: not in this tree" "no \`hpclb bench overlap\`"
        return 0
    fi
    local t0=$SECONDS
    timeout 85 "$PY" -m hpclb bench overlap --device cuda --share-gpu --np 2 \
        --out "$out/bench_overlap.json" >"$out/overlap.log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then verdict overlap pass "$(tail -1 "$out/overlap.log")" $((SECONDS - t0))
    else verdict overlap fail "exit $rc: $(tail -1 "$out/overlap.log")" $((SECONDS - t0)); fi
}

echo "gpu_check: out $out, data $data, mpirun $MPIRUN, budget $BUDGET_S s$([ $dry = 1 ] && echo ', CPU dry run')"
phase_preflight
phase_kernel
phase_mnist
phase_lars
phase_share
phase_stream
phase_overlap

"$PY" - "$verdicts" "$out/gpu_check.json" "$dry" "$(elapsed)" <<'PY'
import json, socket, sys, time
path, dest, dry, secs = sys.argv[1:]
phases = [json.loads(l) for l in open(path)]
failed = [p["phase"] for p in phases if p["status"] == "fail"]
result = {"check": "gpu_check", "host": socket.gethostname(),
          "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_dry_run": dry == "1",
          "seconds": int(secs), "passed": not failed, "failed": failed, "phases": phases}
open(dest, "w").write(json.dumps(result, indent=1) + "\n")
print(f"gpu_check: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)} in {secs} s -> {dest}")
PY
if [ "$dry" = 0 ]; then mkdir -p results && cp "$out/gpu_check.json" results/gpu_check.json; fi
! grep -q '"status": "fail"' "$verdicts"
