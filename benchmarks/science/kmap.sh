#!/usr/bin/env bash
# Where LEGW breaks (docs/science.md): the B0 inputs of each workload's prediction, then the
# k-maps, each resumable (a recorded point is skipped, a cut one resumes from its checkpoint).
# `make science-kmap STEP=name` runs one step; with no STEP, all in order.
#   noise-<w>    the B0 recipe with --noise-scale on 2 ranks (hpclb advise reads it)
#   probe-<w>    hpclb advise --lr-probe on that run: the largest LR that trains at B0 (1 process)
#   predict      hpclb advise --json for every workload with both: results/science/predictions.json
#   register     predict, then commit predictions.json and the inputs (git): before any k-map point
#   kmap-<w>     LEGW at the k-map's batches, seeds 0-2 (PTB: seed 0, then seeds 1-2 where seed 0
#                is within twice the tolerance). Refused until the workload's prediction is in a
#                commit of this repository: the prediction is registered before any point.
#   diag-budget  diagnostic (tunes above B0, outside the claim): MNIST-LSTM Adam at 8192 with
#                LEGW's peak x 0.5, 2, 4 and with a base warmup of 0.05 epochs, seed 0; the best
#                on seeds 1-2
#   diag-stable-<cnn|ptb>  diagnostic: LEGW at 4096 / 640 from the largest grid eta0 whose
#                sqrt(k) multiple is under the B0 probe's stable LR, seed 0
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

is_registered() {  # quietly: the workload's prediction is in HEAD's predictions.json
    git show "HEAD:$RES/predictions.json" 2>/dev/null | "$PY" -c \
        "import json,sys; sys.exit(0 if '$1' in json.load(sys.stdin)['workloads'] else 1)"
}
noise() {  # the B0 recipe, 2 ranks, --noise-scale; resumes a cut run; not once registered
    is_registered "$1" && { echo "noise-$1: its prediction is registered; skipped"; return; }
    "$MPIRUN" -n 2 --bind-to none -x OMP_NUM_THREADS -x HPCLB_DATA "$PY" -m hpclb train \
        "$(recipe_of "$1")" --optimizer "$(optimizer_of "$1")" --noise-scale --seed 0 \
        --expect-world-size 2 --no-tensorboard --progress-every 600 \
        --out "$(noise_dir "$1")" --resume auto
}
probe() {
    is_registered "$1" && { echo "probe-$1: its prediction is registered; skipped"; return; }
    test -f "$(noise_dir "$1")/lr_probe/lr_probe.json" ||
        "$PY" -m hpclb advise "$(noise_dir "$1")" --lr-probe > /dev/null
}
predict() {
    "$PY" benchmarks/science/predictions.py "$RES/predictions.json" \
        mnist-adam="$(noise_dir mnist-adam)" mnist-momentum="$(noise_dir mnist-momentum)" \
        cnn="$(noise_dir cnn)" ptb="$(noise_dir ptb)"
}
register() {  # predict, then commit what it added: the registration comes before any point
    predict
    git add -- "$RES/predictions.json" "$RES/b0-noise"
    git diff --cached --quiet -- "$RES/predictions.json" || git commit -q -m \
        "science: k_max predictions registered ($(git diff --cached --name-only -- \
        "$RES/b0-noise" | cut -d/ -f4 | sort -u | tr '\n' ' ')) before their k-map points" \
        -- "$RES/predictions.json" "$RES/b0-noise"
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

# Diagnostics (outside the claim: they change the LR or warmup above B0, which the protocol
# forbids; results/science/diagnostics/<name>/, each a plain `hpclb train` run, resumable).
diag_run() {  # name, then hpclb train arguments
    local name=$1; shift
    local keep="$RES/diagnostics/$name"
    [ -f "$keep/summary.json" ] && { echo "$name: recorded, skipped"; return; }
    "$PY" -m hpclb train "$@" --no-tensorboard --progress-every 600 \
        --out "$RUNS/diagnostics/$name" --resume auto || echo "$name: exit $?"
    mkdir -p "$keep"
    for f in summary.json metrics.jsonl config.json; do
        [ -f "$RUNS/diagnostics/$name/$f" ] && cp "$RUNS/diagnostics/$name/$f" "$keep/"
    done
    [ -f "$keep/config.json" ] && "$PY" -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); \
c['data_root']='data'; c['out']=None; json.dump(c,open(p,'w'),indent=2)" "$keep/config.json"
}
base_warmup_recipe() {  # $1 recipe, $2 warmup epochs: a copy with that B0 warmup
    local out="$RUNS/diagnostics/recipes/$1-w$2.yaml"
    mkdir -p "$(dirname "$out")"
    "$PY" -c "import sys,yaml; from hpclb.config import load_recipe; r=load_recipe(sys.argv[1]); \
r['warmup_epochs']=float(sys.argv[2]); r['name']=sys.argv[1]+'-w'+sys.argv[2]; \
open(sys.argv[3],'w').write(yaml.safe_dump(r,sort_keys=False))" "$1" "$2" "$out"
    echo "$out"
}
diag_budget() {  # MNIST-LSTM Adam at 8192 (k = 64): does any LR rule reach B0 in 160 steps?
    local s
    for m in 0.5:0.001 2:0.004 4:0.008; do  # LEGW's peak x m: eta0 = 0.002 m
        diag_run "mnist-adam-b8192-peak-x${m%%:*}-s0" mnist-lstm --optimizer adam \
            --batch-size 8192 --lr "${m#*:}" --seed 0
    done
    diag_run "mnist-adam-b8192-w0.05-s0" "$(base_warmup_recipe mnist-lstm 0.05)" \
        --optimizer adam --batch-size 8192 --seed 0
    for s in 1 2; do  # the best of the four (by seed 0) on seeds 1-2
        best=$("$PY" benchmarks/science/predictions.py --best "$RES/diagnostics" mnist-adam-b8192-)
        case $best in
        *w0.05*) diag_run "mnist-adam-b8192-w0.05-s$s" "$(base_warmup_recipe mnist-lstm 0.05)" \
                     --optimizer adam --batch-size 8192 --seed "$s";;
        *peak-x*) m=${best#*peak-x}; m=${m%-s0}
            diag_run "mnist-adam-b8192-peak-x$m-s$s" mnist-lstm --optimizer adam \
                --batch-size 8192 --lr "$("$PY" -c "print(0.002 * $m)")" --seed "$s";;
        esac
    done
}
diag_stable() {  # LEGW from a B0 LR whose sqrt(k) multiple stays under the probe's stable LR
    local w=$1 batch=$2 extra=${3:-}
    local lr
    lr=$("$PY" benchmarks/science/predictions.py --stable-eta0 \
         "$RES/b0-noise/$w/lr_probe.json" "$batch")
    diag_run "$w-b$batch-stable-eta0-s0" "$(recipe_of "$w")" --optimizer "$(optimizer_of "$w")" \
        --batch-size "$batch" --lr "$lr" --seed 0 $extra
}

all="noise-mnist-adam noise-mnist-momentum probe-mnist-adam probe-mnist-momentum register
     kmap-mnist-adam kmap-mnist-momentum noise-cnn probe-cnn noise-ptb probe-ptb register
     kmap-cnn kmap-ptb
     diag-budget diag-stable-cnn diag-stable-ptb"
for s in ${STEP:-$all}; do
    echo "== k-map step $s ($(date -u +%FT%TZ))"
    case $s in
    noise-*) noise "${s#noise-}";;
    probe-*) probe "${s#probe-}";;
    predict) predict;;
    register) register;;
    kmap-*) kmap "${s#kmap-}";;
    diag-budget) diag_budget;;
    diag-stable-cnn) diag_stable cnn 4096 "--accumulation-steps 32";;
    diag-stable-ptb) diag_stable ptb 640;;
    *) echo "unknown step $s" >&2; exit 2;;
    esac
done
