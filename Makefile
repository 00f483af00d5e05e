# Every target sets up .venv itself; torch is pinned to the CPU build through
# constraints.txt so that no multi-GB CUDA build is downloaded.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
WORLD   ?= 2

.PHONY: test lint demo bench docs notebooks clean

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
	$(BIN)/ruff check conftest.py zerofn adapters tests benchmarks examples notebooks/*.py
	$(BIN)/ruff format --check conftest.py zerofn adapters tests benchmarks examples notebooks/*.py
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

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
