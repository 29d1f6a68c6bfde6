# isotrain: `make train` and `make test` create the environment when it is missing, then run.
# TORCH may carry pip options: make train TORCH="torch==2.13.0 --index-url URL"
TORCH ?= torch==2.13.0
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/isotrain train

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src tests benchmarks examples tools

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/run_all.py

docs: $(STAMP)
	$(PY) tools/build_docs.py -o docs

clean:
	rm -rf $(VENV) build dist docs *.egg-info
