# Two commands for users: `make demo` and `make test`. Both run `make setup`
# first, which builds everything into .venv and is a no-op the second time.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hvrep-setup-done
# The fused kernels' build record; rebuilt (from the cache when it can) when a kernel source changes.
KERNELS := hvrep/_lib/build.json
KERNEL_SOURCES := $(shell find kernels -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \
	-o -name '*.py' -o -name '*.txt' \) 2>/dev/null)
NP ?= 2
# Open MPI refuses to run as root unless told; CI and containers are root.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

SETUP_INPUTS := requirements.txt setup.py $(wildcard hvrep/compat/*.py hvrep/compat/*.cc) \
	$(shell find hvrep/compat/include -type f 2>/dev/null)

.PHONY: help setup demo test lint docs docs-serve check-gpu-build clean clean-cache

help:
	@echo "make demo   - set up, then train the demo preset on $(NP) ranks (horovodrun --gloo) and report"
	@echo "make test   - set up, then lint and run the whole test suite (the docs build and their examples included)"
	@echo "make docs   - build the documentation site into site/ (mkdocs build --strict: a broken link fails)"
	@echo "make docs-serve - preview the documentation at http://127.0.0.1:8000 while editing docs/"
	@echo "make setup  - create .venv with the pinned stack, Horovod, the DALI plugin and hvrep's kernels"
	@echo "make check-gpu-build - build Horovod with CUDA/NCCL in a throwaway env (slow, GBs)"

setup: $(STAMP) $(KERNELS)

$(STAMP): $(SETUP_INPUTS)
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || \
		{ echo "hvrep needs Python 3.11 (TensorFlow 2.21 + Horovod 0.28.1); found $(PYTHON). Fix: make PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# tensorflow-cpu on CPU machines, tensorflow[and-cuda] where a GPU answers.
	if nvidia-smi -L 2>/dev/null | grep -q GPU; then \
		sed 's/^tensorflow-cpu==/tensorflow[and-cuda]==/' requirements.txt > $(VENV)/requirements.txt; \
	else cp requirements.txt $(VENV)/requirements.txt; fi
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r $(VENV)/requirements.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m hvrep.compat.build_horovod
	$(BIN)/python -m hvrep.compat.build_dali_plugin
	$(BIN)/hvrep doctor --require tensorflow,horovod,mpi,gloo,dali > $(VENV)/doctor.txt 2>&1 || \
		{ cat $(VENV)/doctor.txt; exit 1; }
	touch $(STAMP)

# C++ ops with TensorFlow's flags, CUDA kernels and the harness where nvcc is;
# a failure leaves hvrep on its pure-TF path (`hvrep doctor` says which).
$(KERNELS): $(STAMP) $(KERNEL_SOURCES)
	$(BIN)/python kernels/build.py

# The main job: the demo preset on $(NP) ranks, two short 1-rank runs of the same
# configuration for the scaling baselines, then a report. Fair protocol: every
# rank, and the baselines, get one core of their own (train.threads=1: TF's and
# tf.data's pools; train.bind_cores=true: rank k's threads on core k, as mpirun
# binds and horovodrun --gloo does not), so the scaling figure compares like with like. Baselines:
# -1rank keeps each rank's batch (64 / $(NP) images: weak scaling, the usual
# definition), -1rank-gb64 the global batch of 64 (strong scaling).
DEMO_RUN ?= runs/demo
DEMO_THREADS ?= 1
# Binding needs NP x DEMO_THREADS cores; on a smaller machine the demo runs unbound.
DEMO_BIND ?= $(shell [ $$(nproc) -ge $$(( $(NP) * $(DEMO_THREADS) )) ] && echo true || echo false)
DEMO_BASELINE_EPOCHS ?= 5
demo: setup
	rm -rf $(DEMO_RUN) $(DEMO_RUN)-1rank $(DEMO_RUN)-1rank-gb64 $(DEMO_RUN)-report
	$(BIN)/hvrep train --config demo output_dir=$(DEMO_RUN)-1rank train.epochs=$(DEMO_BASELINE_EPOCHS) \
		train.global_batch=$$((64 / $(NP))) train.threads=$(DEMO_THREADS) train.bind_cores=$(DEMO_BIND)
	$(BIN)/hvrep train --config demo output_dir=$(DEMO_RUN)-1rank-gb64 train.epochs=$(DEMO_BASELINE_EPOCHS) \
		train.threads=$(DEMO_THREADS) train.bind_cores=$(DEMO_BIND)
	$(BIN)/horovodrun -np $(NP) -H localhost:$(NP) --gloo $(BIN)/hvrep train --config demo output_dir=$(DEMO_RUN) \
		train.threads=$(DEMO_THREADS) train.bind_cores=$(DEMO_BIND)
	$(BIN)/python -m hvrep.perf.summary $(DEMO_RUN) $(DEMO_RUN)-1rank $(DEMO_RUN)-1rank-gb64
	$(BIN)/hvrep report $(DEMO_RUN)-1rank $(DEMO_RUN) --out $(DEMO_RUN)-report

lint: setup
	$(BIN)/ruff check .

# Two pytest-xdist workers on the 2-core CI machine, then the few tests that need the machine alone (marked
# serial). Most of the suite's time is spent waiting for launched jobs (TensorFlow's import, rendezvous, a
# watchdog's timeout), which a second worker fills. Not three: with three, the CI's cores were always busy and the
# mpirun launches of the multi-rank cases ran 4-5 times as long as the horovodrun ones (403 s of cases against 88 s),
# past their time limit: a rank waiting in Open MPI polls, so on a loaded machine it takes CPU from the very ranks
# it waits for (2026-11-26; those test ranks busy-polled: `python -m mpi4py` started MPI before hvrep could ask it to
# yield, which tests/multirank/harness.py's MPIRUN_FLAGS now do; three workers were not tried again since).
# A test file runs whole on one worker (its module and session fixtures, e.g. one launch for many
# cases, are made once); what files share outside pytest (caches under ~/.cache/hvrep, Slurm clusters on free
# ports) is safe to use from two at once. Files start longest first (tests/conftest.py, LONGEST_FIRST; xdist's
# own reorder is off). Tests marked slow (minutes on namespace hosts: tests/multihost/test_elastic_bed.py; the
# one-node Slurm sweep, which test_slurm_multinode.py runs across nodes) run only when asked:
# `.venv/bin/python -m pytest -m slow`.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial and not slow" --durations=30 $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m "serial and not slow" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/). The API reference is read from the sources without importing
# them, so this needs no TensorFlow; `make test` builds it too (tests/unit/docs/test_site.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

check-gpu-build: setup
	$(BIN)/python -m hvrep.compat.check_gpu_build

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache hvrep/_lib site

clean-cache:
	rm -rf "$${HVREP_CACHE_DIR:-$$HOME/.cache/hvrep}"
