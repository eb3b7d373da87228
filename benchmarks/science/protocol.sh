#!/usr/bin/env bash
# The protocol of docs/science.md, step by step; every step resumes where it was cut (points
# already recorded are skipped, a cut point resumes from its checkpoint). One process, one
# torch thread. `make science STEP=name` runs one step; with no STEP, all in order.
#   tune-momentum   MNIST-LSTM SGD+momentum: peak LR at B0 = 128 only (seed 0)
#   mnist-adam      MNIST-LSTM, Adam: B in {128, 8192, 1024} x legw/sqrt/goyal/none x seeds 0-2
#   mnist-momentum  the same with SGD+momentum at its tuned B0 LR
#   tune-cnn        Fashion-MNIST ResNet-8, LARS: global LR at B0 = 128 only (seed 0)
#   cnn             Fashion-MNIST ResNet-8, LARS: B0 and 32*B0 x legw/goyal/sqrt x seeds 0-2
#                   (4096 = 32 micro-batches of 128: BatchNorm as on 32 ranks)
#   ptb             PTB-small (full data, 13 epochs): B0 and legw@640 seeds 0-2; the
#                   baselines @640 seed 0, then seeds 1-2 (each is within 2 sigma of legw)
set -euo pipefail
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs/science}
RES=${RES:-results/science}
export OMP_NUM_THREADS=1
sweep() { "$PY" -m hpclb sweep "$@" --runs-dir "$RUNS"; }

step_tune_momentum() {
    "$PY" benchmarks/science/tune_b0.py mnist-lstm --optimizer momentum \
        --lrs 0.05,0.1,0.2,0.5 --out "$RES/tuning/mnist-lstm-momentum.json" \
        --runs-dir "$RUNS/tuning"
}
step_mnist() {  # $1: optimizer; the largest k first: the claim is tested there
    for b in 128,8192 128,1024; do
        sweep mnist-lstm --optimizer "$1" --batch-sizes "$b" --schemes legw,sqrt,goyal,none \
            --seeds 0,1,2 --out-dir "$RES/mnist-lstm-$1"
    done
}
# A tuned arm runs only once its recipe holds the LR its B0 tuning chose (the rule: tune_b0.py)
tuned() {  # $1 recipe, $2 optimizer, $3 tuning JSON
    "$PY" - "$@" <<'PYEOF'
import json, sys
from hpclb.config import load_recipe
recipe, opt, path = sys.argv[1:4]
try:
    best = json.load(open(path))["best_lr"]
except (OSError, ValueError, KeyError):
    sys.exit(f"{path}: no B0 tuning recorded yet: run the tuning step first")
lr = load_recipe(recipe)["optimizers"][opt]["lr"]
if best is None:
    sys.exit(f"{path}: the B0 tuning has not run its whole grid yet: run the tuning step first")
if abs(lr - best) > 1e-12 * best:
    sys.exit(f"{recipe}: optimizers.{opt}.lr is {lr}, the B0 tuning chose {best} ({path}): "
             f"write it (and the grid) into the recipe's lr and tuning, then run this step")
PYEOF
}
step_mnist_adam() { step_mnist adam; }
step_mnist_momentum() {
    tuned mnist-lstm momentum "$RES/tuning/mnist-lstm-momentum.json"
    step_mnist momentum
}
step_tune_cnn() {
    "$PY" benchmarks/science/tune_b0.py fashion-resnet8 --optimizer lars --lrs 2,4,8,16 \
        --out "$RES/tuning/fashion-resnet8-lars.json" --runs-dir "$RUNS/tuning"
}
step_cnn() {
    tuned fashion-resnet8 lars "$RES/tuning/fashion-resnet8-lars.json"
    sweep fashion-resnet8 --batch-sizes 128,4096 --schemes legw,goyal,sqrt --seeds 0,1,2 \
        --micro-batch 128 --out-dir "$RES/fashion-resnet8"
}
step_ptb() {
    sweep ptb-small --batch-sizes 20,640 --schemes legw --seeds 0,1,2 --out-dir "$RES/ptb-small"
    sweep ptb-small --batch-sizes 20,640 --schemes legw,sqrt,goyal,none --seeds 0 \
        --out-dir "$RES/ptb-small"
    sweep ptb-small --batch-sizes 640 --schemes none,goyal,sqrt --seeds 1,2 \
        --out-dir "$RES/ptb-small"
}

steps=${STEP:-tune_momentum mnist_adam mnist_momentum tune_cnn cnn ptb}
for s in $steps; do
    echo "== protocol step ${s//_/-} ($(date -u +%FT%TZ))"
    "step_${s//-/_}"
done
