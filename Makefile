# The two commands: `make run` (train: a server and two learners) and `make test`.
# Both create .venv and install on first use; later runs skip the install. `make test-slow`
# runs the slow tier (chaos runs, multi-shard restarts); CI runs both.

PYTHON ?= python3
VENV ?= .venv
# torch==$(TORCH_VERSION) from pip's configured index (PyPI's Linux x86_64 wheel carries CUDA).
# TORCH_SPEC replaces the requirement, PIP_EXTRA adds pip options; e.g. CPU only, or CUDA 12.8:
#   make run PIP_EXTRA='--index-url https://download.pytorch.org/whl/cpu'
#   make run TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url https://download.pytorch.org/whl/cu128'
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
PIP_EXTRA ?=
# The versions of every other package, pinned (constraints.txt): reproducible installs.
CONSTRAINTS ?= constraints.txt
RUN_SECONDS ?= 180
RUN_LEARNERS ?= 2

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install run test test-slow proto proto-check lint clean config-doc bench-quality \
	bench-quality-quick bench-quality-sweep compose-smoke wan-sim bench-decoupled bench-load \
	bench-scale bench bench-quick bench-wire sim fuzz

install: $(STAMP)

# Checks for pip, not python: a venv whose ensurepip failed (Debian without python3-venv)
# has a python but no pip, and is completed once the package is installed.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

run: $(STAMP)
	$(BIN)/python -m deploy.local_run --duration-s $(RUN_SECONDS) --learners $(RUN_LEARNERS)

# Unit and integration tests but the slow tier; pytest exits 5 (a failure) if none ran.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# docs/configuration.md, made from the settings' own docs (a test keeps it current).
config-doc: $(STAMP)
	$(BIN)/python -m common.config docs/configuration.md

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS) -e '.[dev,bench]'
	touch $@

bench-quality: $(BENCH_STAMP)
	$(BIN)/python -m bench.quality

bench-quality-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench.quality --quick

# The learning-rate sweeps behind bench/quality.py's settings, then the 1,000 vs 3,000 step trend
# of fp4 and the sparse row (docs/RESULTS.md).
bench-quality-sweep: $(BENCH_STAMP)
	$(BIN)/python -m bench.quality_sweep lr
	$(BIN)/python -m bench.quality_sweep trend --codecs fp4 sparse-2bit:0.015625

bench-decoupled: $(BENCH_STAMP)
	$(BIN)/python -m bench.decoupled

bench-load: $(STAMP)
	$(BIN)/python -m bench.load

# Aggregator shards (bench/scale.py): 537 M params over 1, 2 and 4 shards, 8 then 64
# learners; bench/results/scale.json. `--quick` (34 M params, < 3 min):
# bench/results/scale_quick.json.
bench-scale: $(STAMP)
	nice -n 19 $(BIN)/python -m bench.scale

# The performance suite (bench/perf.py): ratios against their ceilings, bench/results/perf.json.
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.perf

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench.perf --quick

# The hand-written wire framing against the protobuf library (bench/wire.py).
bench-wire: $(STAMP)
	$(BIN)/python -m bench.wire

# Property-based fuzzing of the real servicer and decoders (bench/fuzz.py), 10,000 cases.
fuzz: $(STAMP)
	$(BIN)/python -m bench.fuzz --cases 10000

# The planning simulator (bench/sim): Streaming DiLoCo Table 4 and goodput vs failure rate.
sim: $(BENCH_STAMP)
	$(BIN)/python -m bench.sim.cli all

# Needs a Docker engine and docker-compose (see deploy/compose_smoke.py); not run in CI.
compose-smoke: $(STAMP)
	$(BIN)/python -m deploy.compose_smoke

# Needs root (network namespaces, tc); writes bench/results/wan.json.
wan-sim: $(STAMP)
	$(BIN)/python -m deploy.wan_sim

proto: $(STAMP)
	$(BIN)/python -m common.protogen

proto-check: $(STAMP)
	$(BIN)/python -m common.protogen --check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
