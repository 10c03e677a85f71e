# Two entry points a fresh machine needs (see README):
#   make demo   set up, then run the tiny end-to-end job (data -> ZeRO-3 training on 2 CPU processes -> export -> eval)
#   make test   set up, then run the test suite
#   make container-test   build the image's CPU variant with buildah and train in it (root; docs/container.md)
# `make setup` is idempotent: it creates .venv and installs the pinned CPU stack.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# JIT-compiled DeepSpeed CPU ops (shm comm) are cached here between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
export DS_ACCELERATOR ?= cpu
# Where torch comes from (README, "Install by hand"): empty = pip's default index (this project's CI
# machines find the CPU wheel on local disk); https://download.pytorch.org/whl/cpu elsewhere for CPU.
TORCH_INDEX_URL ?=

.PHONY: setup system-deps container-deps container-test demo test lint

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: anything unpinned would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints/cpu.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# Debian packages the tests need: SLURM (real clusters are started by the tests: one node, and four
# nodes in network namespaces made with iproute2's `ip netns`; shellcheck lints slurm/*.sh) and chromium
# (a headless browser opens a run in the MLflow UI, tests/distributed/test_tracking_trainer.py).
system-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v shellcheck >/dev/null && command -v ip >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge shellcheck iproute2 chromium >/dev/null; \
	else echo "note: slurm-wlm/munge/shellcheck/iproute2/chromium not installed and not root: SLURM and browser tests will be skipped"; fi

# What `make container-test` needs: buildah and debootstrap (Debian packages), as root.
container-deps:
	@if command -v buildah >/dev/null && command -v debootstrap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap >/dev/null; \
	else echo "container-test: buildah/debootstrap not installed and not root: apt-get install buildah debootstrap as root" >&2; exit 1; fi

# The image's CPU variant from the same Dockerfile: base image from Debian packages, buildah build, then
# in the image the pin check and the demo through the entry point (docker/container_test.sh).
container-test: container-deps
	bash docker/container_test.sh

demo: setup
	$(PY) launch/quickstart.py

test: setup system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	# Two passes: the one-process tests (one thread each) on both cores at once, then the multi-process
	# ones (2 ranks each already use both cores, some time kills and SLURM requeues) one at a time.
	# Each pass's wall time is printed; one test's setup or call above a ceiling fails (tests/phase_ceiling.py).
	@start=$$(date +%s); $(VENV)/bin/python -m pytest -q -n 2 --durations=15 tests/unit tests/gpu; rc=$$?; \
	  echo "make test: one-process pass $$(( $$(date +%s) - start )) s"; exit $$rc
	@start=$$(date +%s); $(VENV)/bin/python -m pytest -q --durations=15 tests/distributed tests/faults tests/slurm; rc=$$?; \
	  echo "make test: multi-process pass $$(( $$(date +%s) - start )) s"; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
