# Evenflow. `make demo` and `make test` set everything up themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# GPU hosts: make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.evenflow-installed

.PHONY: setup demo test lint typecheck pytest jstest bench browser-deps clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's metadata changes; torch first so a CPU machine never pulls CUDA
# wheels, then held at that version (Lightning, transformers and Accelerate would otherwise move it).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	touch $(STAMP)

# The dashboard's JS tooling (eslint), pinned by package-lock.json; the pages themselves need no build.
NODE_STAMP := node_modules/.evenflow-installed
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

demo: setup
	$(BIN)/evenflow demo

# Debian's chromium (for the browser tests) and docker-compose (to validate docker-compose.yml
# without an engine). Installed when missing and when we are root; otherwise those tests say why they skip.
browser-deps:
	@command -v chromium >/dev/null && command -v docker-compose >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium docker-compose >/dev/null) || echo "note: could not install chromium/docker-compose"; }

lint: setup $(NODE_STAMP)
	$(BIN)/ruff check contract server agent evenflow frontend migrations tests bench examples
	$(BIN)/ruff format --check contract server agent evenflow frontend migrations tests bench examples
	npx --no-install eslint frontend/static tests/js eslint.config.js

# The dashboard's pure modules (no DOM) under node's own test runner.
jstest:
	node --test tests/js/*.test.js

typecheck: setup
	$(BIN)/mypy contract server agent evenflow bench examples

pytest: setup browser-deps
	$(BIN)/pytest -q

test: lint typecheck jstest pytest

# Each prints its figures; together they take about 20 minutes on 2 cores.
bench: setup browser-deps
	$(BIN)/python bench/planner.py
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/training.py
	$(BIN)/python bench/stragglers.py
	$(BIN)/python bench/live.py

clean:
	rm -rf $(VENV) node_modules build *.egg-info .pytest_cache .mypy_cache .ruff_cache
