# Every target sets up .venv itself; torch is pinned to the CPU build through
# constraints.txt so that no multi-GB CUDA build is downloaded.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
WORLD   ?= 2

.PHONY: test test-slow lint demo bench docs notebooks clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.test-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test,dev,frameworks]"
	touch $@

$(VENV)/.demo-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[demo]"
	touch $@

$(VENV)/.bench-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[bench]"
	touch $@

$(VENV)/.docs-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[docs]"
	touch $@

$(VENV)/.notebooks-installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e ".[notebooks]"
	touch $@

lint: $(VENV)/.test-installed
	$(BIN)/ruff check conftest.py zerofn adapters tests benchmarks examples testbed notebooks/*.py
	$(BIN)/ruff format --check conftest.py zerofn adapters tests benchmarks examples testbed notebooks/*.py
	$(BIN)/mypy

# make test: lint, then everything but the soaks and the runs that kill or stall
# real ranks, property tests drawing a quarter of their examples (minutes).
# make test-slow: those soaks and runs, and every property test drawing all of
# its examples (tests/_draws.py). CI runs both.
test: lint
	$(BIN)/pytest -q -m "not slow" --durations=10

test-slow: $(VENV)/.test-installed
	ZEROFN_DRAWS=thorough $(BIN)/pytest -q -m "slow or hypothesis" --durations=10

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/demo.py --world-size $(WORLD)

# Every benchmark in one run; rewrites docs/benchmarks.md and docs/img/benchmarks.png.
# BENCH_ARGS=--quick: a smoke run (CI) that writes under benchmarks/out/ instead.
BENCH_ARGS ?=
bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

docs: $(VENV)/.docs-installed
	$(BIN)/mkdocs build --strict --site-dir site

# Executes every notebook (cells time out after 300 s) and fails on any error; the
# committed .ipynb files stay output-free, executed copies go to notebooks/out/.
notebooks: $(VENV)/.notebooks-installed
	$(BIN)/python notebooks/run_notebooks.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
