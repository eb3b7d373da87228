#!/usr/bin/env bash
# The paper's sweeps at their full budgets on one GPU (issue #14), through `hpclb sweep`.
#
#   benchmarks/gpu_sweeps.sh OUT [--smoke] [--kmap]
#
# Prints its plan with an estimated time first, then runs, within GPU_SWEEPS_BUDGET_S (default
# 540 s = 9 minutes), as many points as fit, in this order, and says what it skipped:
#   mnist-lstm    20 epochs:  batch 128, 1024, 8192          x legw, linear, sqrt, none
#   ptb-small     13 epochs:  batch 20, 80, 160, 640          x legw, sqrt, linear, none
#   fashion-resnet (LARS), 20 epochs: batch 128, 1024, 4096, 8192 x legw, sqrt, linear, none
# --kmap: instead, the MNIST-LSTM k-map of docs/science.md ("Where LEGW breaks"): LEGW at batch
# 128, 1024, 2048, 4096, 8192, seeds 0-2, with Adam and with SGD + momentum (30 points, ~6 min on
# one H200 by the 2026-12-04 timings: B0 30 s, 8192 4 s); its tables and points go to OUT/sweeps
# and, packed, OUT/kmap.tar.gz (what a lent GPU machine sends back).
# Each experiment runs from a derived recipe `<experiment>-gpu` (the packaged recipe with
# `device: cuda`, `precision: bf16`), so the tables land in results/sweeps/<experiment>-gpu.
# {json,md,png}, every row with its device, precision, wall time and time to target. `hpclb
# sweep` is resumable: run the same command again (a second 9-minute invocation) and it goes on
# where the first stopped; points already recorded are skipped.
#
# --smoke: the same script on the CPU with a few steps per point (data subsets, one or two
# batches and schemes per experiment), results under OUT/sweeps; tests/test_gpu_scripts.py runs
# it (with --kmap too).
# The data: $HPCLB_DATA when set; else the GPU check's bundle ($GPU_CHECK_BUNDLE, else
# shared-data/, as benchmarks/gpu_check/prepare.py lays it out: mnist/*.gz, which hpclb's MNIST
# reader reads as they are) when it holds MNIST; else data/ (make data). An experiment whose data
# set the reader cannot read there (not staged: the bundle carries MNIST only) is skipped, and
# the plan says why.
set -uo pipefail

usage="usage: benchmarks/gpu_sweeps.sh OUT [--smoke] [--kmap]"
out="${1:?$usage}"
shift
smoke=0 kmap=0
for a in "$@"; do
    case "$a" in --smoke) smoke=1;; --kmap) kmap=1;; *) echo "$usage" >&2; exit 2;; esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
repo="$PWD"
PY="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HPCLB_KERNELS_DIR="$repo/kernels"
bundle="${GPU_CHECK_BUNDLE:-$repo/shared-data}"
if [ -n "${HPCLB_DATA:-}" ]; then data="$HPCLB_DATA"
elif [ -d "$bundle/mnist" ]; then data="$bundle"
else data="$repo/data"; fi
budget=${GPU_SWEEPS_BUDGET_S:-540}
start=$(date +%s)

# The plan: one line per experiment, "<name> <recipe.yaml> <batches> <schemes> <est. s/point>",
# with the derived recipes written under OUT/recipes.
"$PY" - "$out" "$smoke" "$data" "$kmap" >"$out/plan.txt" <<'PY' || exit 2
import sys
from pathlib import Path
import yaml
from hpclb.config import load_recipe
from hpclb.data.registry import dataset
from hpclb.errors import DataError

out, smoke, data = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
kmap = sys.argv[4] == "1"
schemes_all = "legw,linear,sqrt,none"
# experiment: (batches, schemes, seconds per point on one H200 (estimate), smoke: recipe
# changes, batches, schemes). The smoke keeps every code path (each experiment, B0 and a larger
# batch where evaluation is cheap) within about a minute on 2 CPU cores; PTB evaluates on the
# full valid/test streams, so its smoke is one point.
plan = {
    "mnist-lstm": ([128, 1024, 8192], schemes_all, 25,
                   ({"data": {"name": "mnist", "train_samples": 2048, "test_samples": 256},
                     "epochs": 1, "warmup_epochs": 0.05}, [128, 1024], "legw,none")),
    "ptb-small": ([20, 80, 160, 640], "legw,sqrt,linear,none", 60,
                  ({"epochs": 0.002, "warmup_epochs": 0.0005}, [20], "legw")),
    "fashion-resnet": ([128, 1024, 4096, 8192], schemes_all, 45,
                       ({"data": {"name": "fashion-mnist", "train_samples": 512,
                                  "test_samples": 128}, "epochs": 1, "warmup_epochs": 0.1},
                        [128, 256], "legw")),
}
mnist_smoke = plan["mnist-lstm"][3]
if kmap:  # name: (recipe, batches, schemes, s/point, smoke; optimizer, seeds)
    plan = {f"mnist-kmap-{opt}": ([128, 1024, 2048, 4096, 8192], "legw", 12,
                                  (mnist_smoke[0], [128, 1024], "legw"), opt, "0,1,2")
            for opt in ("adam", "momentum")}
else:
    plan = {exp: (*v, "-", "0") for exp, v in plan.items()}
(out / "recipes").mkdir(parents=True, exist_ok=True)
total = 0
for name, (batches, schemes, est, (changes, smoke_batches, smoke_schemes), opt, seeds) in \
        plan.items():
    exp = "mnist-lstm" if kmap else name
    recipe = load_recipe(exp)
    try:  # staged = hpclb's reader reads it there (raw or gzip files, as the sweep will)
        dataset(recipe["data"]["name"]).load(str(data), recipe["data"])
    except DataError as e:
        print(f"# {exp}: skipped, {recipe['data']['name']} not staged in {data}: "
              f"{str(e).splitlines()[0][:160]}")
        continue
    recipe.pop("path", None)
    tag = f"{name}-gpu" if kmap else f"{exp}-gpu"
    if smoke:
        batches, schemes, est = smoke_batches, smoke_schemes, 3
        recipe.update(changes, name=f"{tag}-smoke")
    else:
        recipe.update(name=tag, device="cuda", precision="bf16")
    path = out / "recipes" / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    # k = 1 runs once for all schemes
    n = (len(batches) * len(schemes.split(",")) - (len(schemes.split(",")) - 1)) * \
        len(seeds.split(","))
    total += n * est
    print(name, path, ",".join(map(str, batches)), schemes, est, n, opt, seeds)
print(f"# estimated {total} s for all points")
PY
echo "gpu_sweeps: $([ $smoke = 1 ] && echo 'SMOKE (CPU, a few steps per point)' || echo 'full budgets, one GPU'), budget $budget s, data $data"
echo "plan:"
while read -r exp recipe batches schemes est n opt seeds; do
    case "$exp" in
        "#") echo "  $recipe $batches $schemes $est $n $opt $seeds" | sed 's/ *$//';;
        *) echo "  $exp: batches $batches x $schemes$([ "$opt" != - ] && echo " ($opt)") x seeds $seeds = $n run(s), ~$est s each";;
    esac
done <"$out/plan.txt"

if [ $smoke = 1 ] || [ $kmap = 1 ]; then results="$out/sweeps"; else results="$repo/results/sweeps"; fi
runs="$out/runs"
status=0
while read -r exp recipe batches schemes est n opt seeds; do
    [ "$exp" = "#" ] && continue
    left=$(( budget - ($(date +%s) - start) ))
    if [ "$left" -lt "$est" ]; then
        echo "gpu_sweeps: $exp skipped: $left s left, a point takes ~$est s; run the same command again to continue"
        continue
    fi
    echo "== $exp ($left s left)"
    timeout "$left" "$PY" -m hpclb sweep "$recipe" --batch-sizes "$batches" --schemes "$schemes" \
        --seeds "$seeds" $([ "$opt" != - ] && echo "--optimizer $opt") \
        --data-dir "$data" --out-dir "$results" --runs-dir "$runs"
    rc=$?
    if [ $rc -eq 124 ]; then
        echo "gpu_sweeps: $exp stopped at the time budget; run the same command again to resume it"
    elif [ $rc -ne 0 ]; then
        echo "gpu_sweeps: $exp failed (exit $rc)"; status=1
    fi
done <"$out/plan.txt"
if [ $kmap = 1 ] && [ -d "$results" ]; then
    tar czf "$out/kmap.tar.gz" -C "$out" sweeps && echo "gpu_sweeps: k-map packed in $out/kmap.tar.gz"
fi
echo "gpu_sweeps: done in $(( $(date +%s) - start )) s; tables in $results"
exit $status
