# fedmeet: `make repro` regenerates every table and figure; `make test` runs the tests.
# Both create the virtual environment on first use. torch is pinned to the local CPU wheel (see pyproject.toml).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# DVC stage commands call `python`: the project's venv must come first on PATH.
export PATH := $(abspath $(BIN)):$(PATH)
export FLWR_TELEMETRY_ENABLED := 0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false
export MLFLOW_ENABLE_TELEMETRY := false
export DO_NOT_TRACK := 1

.PHONY: setup repro test bench clean-cache preset mutants

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing below can pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

repro: setup
	$(BIN)/dvc repro

test: setup
	$(BIN)/python -m pytest -q

# Mutation testing of the core (not in CI; minutes per module on 2 cores): one module at a time, lowest CPU
# priority, verdicts kept in mutants/ between runs, so `make mutants MODULES=losses` runs a part. Then
# reports/mutation.md. MUTANTS=survivors re-runs only the mutants no test detected last time (after new tests).
MODULES ?= losses strategies compression partition_schemes scoring adapters sources federated
MUTANTS ?= all
mutants: setup
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install -q -e '.[mutation]'
	for m in $(MODULES); do \
	  if [ "$(MUTANTS)" = survivors ]; then names=$$($(BIN)/python -m pipeline.mutation_report --survivors $$m); \
	  else names="pipeline.$$m.*"; fi; \
	  [ -z "$$names" ] || FEDMEET_DATA_ROOT=$(abspath ..)/shared/data nice -n 19 $(BIN)/mutmut run --max-children 2 $$names || exit 1; \
	done
	$(BIN)/python -m pipeline.mutation_report

bench: setup
	$(BIN)/python -m benchmarks.run

# Apply a run profile as DVC experiment parameters: make preset PRESET=configs/cpu-study.yaml
preset: setup
	$(BIN)/python -m pipeline.presets run $(PRESET)

clean-cache:
	rm -rf data/cache
