# isotrain: `make train` and `make test` create the environment when it is missing, then run.
# TORCH may carry pip options: make train TORCH="torch==2.13.0 --index-url URL"; every later
# pip call is constrained to the torch it installed (torch-pin.txt), so no extra pulls another.
# `make train` installs what training and its follow-ups need (plots, export); test, lint, docs
# and bench add the dev tools (the `docs` extra among them: mkdocs, material, mkdocstrings).
# `make docs` builds the guide and API reference into site/. `make sample|plot|report|export`
# act on RUN (default runs/default).
# `make train ARGS="--steps 2000"` passes flags through to `isotrain train`.
# `make lint`: ruff (style) and mypy (strict types on src/isotrain).
# `make test` runs one pytest-xdist worker per core (TEST_WORKERS=1 for one process), each
# test file whole in one worker, the cores shared out among them (tests/conftest.py).
TORCH ?= torch==2.13.0
TEST_WORKERS ?= auto
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
PIN := $(VENV)/torch-pin.txt
RUN ?= runs/default
ARGS ?=
ISOTRAIN := $(VENV)/bin/isotrain

.PHONY: train sample plot report export test lint bench docs clean

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(PIN)
	$(PY) -m pip install --quiet -c $(PIN) -e ".[plots,export]"
	touch $(RUN_STAMP)

$(DEV_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -c $(PIN) -e ".[dev]"
	touch $(DEV_STAMP)

train: $(RUN_STAMP)
	$(ISOTRAIN) train $(ARGS)

sample: $(RUN_STAMP)
	$(ISOTRAIN) sample $(RUN)

plot: $(RUN_STAMP)
	$(ISOTRAIN) plot $(RUN)

report: $(RUN_STAMP)
	$(ISOTRAIN) report $(RUN)

export: $(RUN_STAMP)
	$(ISOTRAIN) export $(RUN)

test: $(DEV_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src tests benchmarks examples tools
	$(VENV)/bin/mypy

bench: $(DEV_STAMP)
	$(PY) -m pip install --quiet -c $(PIN) -e ".[bench]"
	$(PY) benchmarks/run_all.py

docs: $(DEV_STAMP)
	$(PY) tools/build_docs.py

clean:
	rm -rf $(VENV) build dist site *.egg-info
