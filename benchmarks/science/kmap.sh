#!/usr/bin/env bash
# Where LEGW breaks (docs/science.md): the B0 inputs of each workload's prediction, then the
# k-maps, each resumable (a recorded point is skipped, a cut one resumes from its checkpoint).
# `make science-kmap STEP=name` runs one step; with no STEP, all in order.
#   noise-<w>    the B0 recipe with --noise-scale on 2 ranks (hpclb advise reads it)
#   probe-<w>    hpclb advise --lr-probe on that run: the largest LR that trains at B0 (1 process)
#   predict      hpclb advise --json for every workload with both: results/science/predictions.json
#   kmap-<w>     LEGW at the k-map's batches, seeds 0-2 (PTB: seed 0, then seeds 1-2 where seed 0
#                is within twice the tolerance). Refused until the workload's prediction is in a
#                commit of this repository: the prediction is registered before any point.
# Workloads <w>: mnist-adam, mnist-momentum, cnn, ptb.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MPIRUN=${MPIRUN:-$(dirname "$PY")/mpirun}
RUNS=${RUNS:-runs/science}
RES=${RES:-results/science}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe

recipe_of() { case $1 in mnist-*) echo mnist-lstm;; cnn) echo fashion-resnet8;;
                         ptb) echo ptb-small;; *) echo "unknown workload $1" >&2; exit 2;; esac; }
optimizer_of() { case $1 in mnist-adam) echo adam;; mnist-momentum) echo momentum;;
                            cnn) echo lars;; ptb) echo sgd;; esac; }
noise_dir() { echo "$RUNS/noise/$1-b0"; }

noise() {  # the B0 recipe, 2 ranks, --noise-scale; resumes a cut run
    "$MPIRUN" -n 2 --bind-to none -x OMP_NUM_THREADS -x HPCLB_DATA "$PY" -m hpclb train \
        "$(recipe_of "$1")" --optimizer "$(optimizer_of "$1")" --noise-scale --seed 0 \
        --expect-world-size 2 --no-tensorboard --progress-every 600 \
        --out "$(noise_dir "$1")" --resume auto
}
probe() {
    test -f "$(noise_dir "$1")/lr_probe/lr_probe.json" ||
        "$PY" -m hpclb advise "$(noise_dir "$1")" --lr-probe > /dev/null
}
predict() {
    "$PY" benchmarks/science/predictions.py "$RES/predictions.json" \
        mnist-adam="$(noise_dir mnist-adam)" mnist-momentum="$(noise_dir mnist-momentum)" \
        cnn="$(noise_dir cnn)" ptb="$(noise_dir ptb)"
}
registered() {  # the workload's prediction is in HEAD's predictions.json
    git show "HEAD:$RES/predictions.json" 2>/dev/null | "$PY" -c \
        "import json,sys; sys.exit(0 if '$1' in json.load(sys.stdin)['workloads'] else 1)" || {
        echo "kmap-$1: no prediction for $1 in a commit ($RES/predictions.json at HEAD): run" \
             "the noise, probe and predict steps and commit it first" >&2; exit 2; }
}
sweep() { "$PY" -m hpclb sweep "$@" --runs-dir "$RUNS"; }
kmap() {
    registered "$1"
    case $1 in
    mnist-*) opt=$(optimizer_of "$1")
        sweep mnist-lstm --optimizer "$opt" --batch-sizes 128,2048,4096 --schemes legw \
            --seeds 0,1,2 --out-dir "$RES/mnist-lstm-$opt";;
    cnn) sweep fashion-resnet8 --batch-sizes 128,512,1024,2048 --schemes legw --seeds 0,1,2 \
            --micro-batch 128 --out-dir "$RES/fashion-resnet8";;
    ptb) sweep ptb-small --batch-sizes 20,80,160,320 --schemes legw --seeds 0 \
            --out-dir "$RES/ptb-small"
        for b in $("$PY" benchmarks/science/predictions.py --near-b0 "$RES/ptb-small/ptb-small.json" \
                   80,160,320); do
            sweep ptb-small --batch-sizes "20,$b" --schemes legw --seeds 0,1,2 \
                --out-dir "$RES/ptb-small"
        done;;
    esac
}

all="noise-mnist-adam noise-mnist-momentum noise-cnn probe-mnist-adam probe-mnist-momentum
     probe-cnn probe-ptb noise-ptb predict kmap-mnist-adam kmap-mnist-momentum kmap-cnn kmap-ptb"
for s in ${STEP:-$all}; do
    echo "== k-map step $s ($(date -u +%FT%TZ))"
    case $s in
    noise-*) noise "${s#noise-}";;
    probe-*) probe "${s#probe-}";;
    predict) predict;;
    kmap-*) kmap "${s#kmap-}";;
    *) echo "unknown step $s" >&2; exit 2;;
    esac
done
