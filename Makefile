# The two commands: `make run` sets up and serves the examples; `make test` sets up and tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REPOSITORY ?= var/repository
PORT ?= 8080
# a Redis for the result cache's L2 and the ranker's feature store (empty: none; the ranker is
# then not served, it reads its inputs from the store)
REDIS_URL ?=

.PHONY: run test setup setup-dev lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[lightgbm,examples,grpc]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

$(REPOSITORY)/churn/model.yaml: | $(VENV)/.installed
	$(BIN)/tailserve examples $(REPOSITORY)

run: setup $(REPOSITORY)/churn/model.yaml
ifneq ($(REDIS_URL),)
	$(BIN)/tailserve examples $(REPOSITORY) --features-only --redis-url $(REDIS_URL)
	$(BIN)/tailserve up --repository $(REPOSITORY) --port $(PORT) --redis-url $(REDIS_URL)
else
	$(BIN)/tailserve up --repository $(REPOSITORY) --port $(PORT)
endif

test: setup-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: setup-dev
	$(BIN)/python benchmarks/worker_vs_baseline.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
