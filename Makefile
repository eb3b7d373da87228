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

.PHONY: install data train test test-unit test-mpi clean
.DEFAULT_GOAL := train

$(VENV)/.installed: setup.cfg pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no python3 found; install Python 3.11 (apt-get install python3 python3-venv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

install: $(VENV)/.installed

$(HPCLB_DATA)/mnist/.verified: | $(VENV)/.installed
	$(PY) -m hpclb data fetch mnist --data-dir $(HPCLB_DATA)

data: $(HPCLB_DATA)/mnist/.verified

# The main job: MNIST-LSTM with LEGW at global batch $(BATCH) (8 x B0) on $(NP) MPI ranks.
train: install data
	$(MPIRUN) $(MPIRUN_FLAGS) $(PY) -m hpclb train $(EXPERIMENT) --batch-size $(BATCH) \
	    --scaling $(SCALING) --expect-world-size $(NP) --out $(OUT)

test: install data
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-mpi

test-unit: install data
	$(PY) -m pytest -q

test-mpi: install data
	HPCLB_EXPECT_WORLD_SIZE=$(NP) $(MPIRUN) $(MPIRUN_FLAGS) -x HPCLB_EXPECT_WORLD_SIZE \
	    $(PY) -m pytest -q --with-mpi --only-mpi -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info hpclb.egg-info .pytest_cache runs
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
