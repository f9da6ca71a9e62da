# The two commands: `make run` sets up and serves the examples; `make test` sets up and tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
REPOSITORY ?= var/repository
# Where the stack listens: the front door's HTTP and gRPC ports (0: no gRPC), and its address
# (127.0.0.1; 0.0.0.0 for every interface, and then the admin routes need ADMIN_TOKEN).
HOST ?= 127.0.0.1
PORT ?= 8080
GRPC_PORT ?= 8081
# Worker processes (empty: one per core).
WORKERS ?=
ADMIN_TOKEN ?=
# a Redis for the result cache's L2 and the ranker's feature store (empty: none; the ranker is
# then not served, it reads its inputs from the store)
REDIS_URL ?=

.PHONY: run test setup setup-dev browser lint bench chaos compare clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# (--no-compile: a module is compiled when first imported, not every file of every package
# at install; it takes the dev install from about a minute to twenty seconds.)
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -e '.[lightgbm,examples,grpc,client]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	touch $@ $(VENV)/.installed

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

# The dashboard's test drives a headless Chromium: Debian's package, installed where missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
	  { echo "make test needs Chromium for the dashboard test: apt-get install chromium" >&2; exit 1; }

$(REPOSITORY)/churn/model.yaml: | $(VENV)/.installed
	$(BIN)/tailserve examples $(REPOSITORY)

UP_FLAGS = --repository $(REPOSITORY) --host $(HOST) --port $(PORT) --grpc-port $(GRPC_PORT) \
	$(if $(WORKERS),--workers $(WORKERS)) $(if $(REDIS_URL),--redis-url $(REDIS_URL))

run: setup $(REPOSITORY)/churn/model.yaml
ifneq ($(REDIS_URL),)
	$(BIN)/tailserve examples $(REPOSITORY) --features-only --redis-url $(REDIS_URL)
endif
	TAILSERVE_ADMIN_TOKEN=$(ADMIN_TOKEN) exec $(BIN)/tailserve up $(UP_FLAGS)

# After ruff, two lanes at once (tests/phases.py): the examples trained, then the tests that rest
# on time (marked serial in tests/conftest.py) one at a time; beside them at a lower priority
# mypy, the import layers and the other tests two at a time (pytest-xdist); each test run names
# its ten slowest.
test: setup-dev browser
	$(BIN)/ruff check src tests benchmarks deploy
	$(BIN)/ruff format --check src tests benchmarks deploy
	$(BIN)/python tests/phases.py $(BIN)

lint: setup-dev
	$(BIN)/ruff check src tests benchmarks deploy
	$(BIN)/ruff format --check src tests benchmarks deploy
	$(BIN)/mypy
	$(BIN)/lint-imports

# The fuzz tests' long profile: FUZZ_EXAMPLES cases a route and a property (docs/testing.md).
FUZZ_EXAMPLES ?= 500
fuzz: setup-dev
	TAILSERVE_FUZZ=long TAILSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider tests/fuzz

bench: setup-dev
	$(BIN)/python benchmarks/worker_vs_baseline.py

# The chaos suite (docs/stack.md, "Chaos"): a stack under load while workers, Redis and the front
# door fail; the table goes to var/chaos.
chaos: setup-dev
	$(BIN)/python benchmarks/chaos.py --out var/chaos

# tailserve beside LitServe, MLServer, Ray Serve, BentoML and FastAPI + uvicorn on the same
# model (benchmarks/peers.py; needs wrk2, and installs each peer into its own environment under
# ~/.cache/tailserve-peers).
# The Ray and BentoML environments take about 1.1 GB on first use.
compare: setup-dev
	$(BIN)/python benchmarks/peers.py --quick

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
