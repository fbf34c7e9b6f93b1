# fedweigh: `make demo` and `make test` do all the set-up (a .venv with the package) themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedweigh-installed
DEV_STAMP := $(VENV)/.fedweigh-dev-installed
# `make demo CPU=1` (also setup, test): torch's CPU-only wheel first, so that no CUDA library is
# installed; takes effect when the venv is created (a fresh clone, or after `rm -rf .venv`)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_CPU = $(if $(filter 1,$(CPU)),$(PY) -m pip install -q --disable-pip-version-check --index-url $(TORCH_CPU_INDEX) "torch>=2.4",@:)

.PHONY: setup dev demo test test-fast mutation mutation-stale lint jobs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(TORCH_CPU)
	$(PY) -m pip install -q --disable-pip-version-check -e .
	@touch $(STAMP)

# the test and lint tools, for `make test` and `make lint` only
dev: $(DEV_STAMP)

# one pip run for the package and its test tools (a second run would resolve every dependency again)
$(DEV_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(TORCH_CPU)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP) $(DEV_STAMP)

demo: setup
	$(VENV)/bin/fedweigh demo

# the whole suite (docs/testing.md): three workers on two cores, since the simulator and federation runs
# spend part of their time waiting (NVFlare's task polling, shutdown grace periods, the failure test's timeouts)
test: dev
	$(PY) -m pytest -q -n 3 --dist loadgroup --no-loadscope-reorder

# the unit tests only: no simulator, no provisioned federation, no multi-epoch training
test-fast: dev
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not slow"

# mutation score of the core modules against the fast tests (docs/testing.md, "Mutation testing"); not part
# of `make test`. First says which committed scores a change made stale (`make mutation-stale` alone).
# MODULES= one or more modules or folders (default: every module of [tool.mutmut] only_mutate)
MODULES ?=
mutation: dev mutation-stale
	PYTHONPATH=custom $(PY) benchmarks/mutation_score.py run $(MODULES)

mutation-stale: dev
	PYTHONPATH=custom $(PY) benchmarks/mutation_score.py stale

lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check custom tests benchmarks

jobs: setup
	$(VENV)/bin/fedweigh jobs export

clean:
	rm -rf workspaces .pytest_cache .ruff_cache build/mutation
