# Each target does its own set-up: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m epifit.demo --out out

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check epifit tests benchmarks data
	$(BIN)/ruff format --check epifit tests benchmarks data

format: $(STAMP)
	$(BIN)/ruff check --fix epifit tests benchmarks data
	$(BIN)/ruff format epifit tests benchmarks data

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/forward.py --json out/bench_forward.json

clean:
	rm -rf $(VENV) out .pytest_cache
