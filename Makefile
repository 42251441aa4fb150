# Each target does its own set-up: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint format bench clean venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py --out out

# Two workers: the suite is dominated by XLA compilation, one core each.
PYTEST_ARGS ?= -n 2 --dist loadfile

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The site, into site/: EPIFIT_DOCS_EXECUTE=0 for a quick build that shows the
# tutorials without running them (by default they run, several minutes).
docs: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check epifit tests benchmarks data examples
	$(BIN)/ruff format --check epifit tests benchmarks data examples

format: $(STAMP)
	$(BIN)/ruff check --fix epifit tests benchmarks data examples
	$(BIN)/ruff format epifit tests benchmarks data examples

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/forward.py --dtype float32 --json out/bench_forward.json
	$(BIN)/python benchmarks/gradient.py --dtype float32 --json out/bench_gradient.json
	$(BIN)/python benchmarks/calibrate.py --json out/bench_calibrate.json
	if [ -f benchmarks/forecast.py ]; then \
	  $(BIN)/python benchmarks/forecast.py --json out/bench_forecast.json; fi
	$(BIN)/python benchmarks/coverage.py --json out/bench_coverage.json
	$(BIN)/python benchmarks/sample.py --json out/bench_sample.json
	$(BIN)/python benchmarks/cli.py --json out/bench_cli.json

clean:
	rm -rf $(VENV) out site .pytest_cache
