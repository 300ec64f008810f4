# Two commands on a fresh machine: `make run` and `make test`. Both install into .venv when
# pyproject.toml is newer than the last install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?=

.PHONY: run test test-full lint typecheck bench fake-upstream clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,local]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sluice serve $(if $(CONFIG),--config $(CONFIG),)

lint: $(STAMP)
	$(BIN)/ruff check proxy inference tests
	$(BIN)/ruff format --check proxy inference tests

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -m "not slow" -q

test-full: lint typecheck
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m proxy.bench

fake-upstream: $(STAMP)
	$(BIN)/sluice fake-upstream --port 9000

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
