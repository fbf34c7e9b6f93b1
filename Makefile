# fedweigh: `make demo` and `make test` do all the set-up (a .venv with the package) themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fedweigh-installed

.PHONY: setup demo test test-fast lint jobs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/fedweigh demo

# the whole suite on two workers (docs/testing.md): the simulator and federation runs spread over both
test: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder

# the unit tests only: no simulator, no provisioned federation, no multi-epoch training
test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check custom tests benchmarks

jobs: setup
	$(VENV)/bin/fedweigh jobs export

clean:
	rm -rf workspaces .pytest_cache .ruff_cache
