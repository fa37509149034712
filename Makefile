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

.PHONY: setup data-sources repro test reliability bench clean-cache preset grid exp-show mutants

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing below can pull a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The datasets are DVC imports of ../shared/data (data/raw/*.dvc, frozen): `dvc update` checks each against its
# source (a no-op when unchanged; a changed mirror gets a new hash, so ingest reruns) and checks it out, also on a
# fresh clone with an empty cache. Without the mirror (a second machine), the imports come from the DVC remote.
data-sources: setup
	$(BIN)/dvc update -q data/raw/*.dvc || $(BIN)/dvc pull data/raw/*.dvc

repro: data-sources
	$(BIN)/dvc repro

test: setup
	$(BIN)/python -m pytest -q

# Faults tried on purpose (issue 15): damaged inputs, bad parameters, killed writes, concurrent MLflow writers,
# damaged caches and backbone, a federated run killed at seven points; writes reports/reliability.md.
RELIABILITY_TESTS := tests/test_reliability_*.py \
	tests/test_cache.py::test_damaged_entry_is_counted_removed_and_recomputed_exactly \
	tests/test_federated.py::test_killed_run_resumes_at_the_next_round \
	tests/test_federated.py::test_killed_run_resumes_from_every_kill_point_to_the_uninterrupted_result
reliability: setup
	PYTHONPATH=tests $(BIN)/python -m pytest -q -p no:cacheprovider -p reliability_report \
		--reliability-report reports/reliability.md $(RELIABILITY_TESTS)

# Mutation testing of the core (not in CI; minutes to hours per module on 2 cores): one module at a time, verdicts
# kept between runs, so `make mutants MODULES=modeling.losses` runs a part. Then reports/mutation.md. mutmut keeps its
# verdicts in mutants/ (git-ignored, gone with the machine); they are also kept in git, in
# reports/mutation-verdicts.json: restored into mutants/ before a run, merged back by the report after it.
# MUTANTS=survivors re-runs only the mutants no test detected last time (after new tests), MUTANTS=unfinished those
# and the ones not run yet (with NAMES: of those functions only). MUTANTS_JOBS parallel
# mutants, at MUTANTS_NICE (a shared machine: the defaults leave a core to everything else). Each run's module,
# command, start and wall seconds go to reports/mutation-runs.tsv, which the report cites. NAMES='<pattern> ...' runs only
# the mutants matching mutmut name patterns (e.g. one function's: pipeline.datasets.readers.x__parse_span__*).
MODULES ?= modeling.adapters results.scoring federation.strategies federation.compression partitioning.schemes \
	datasets.sources datasets.readers modeling.losses federation.protocol training.rounds training.client_training \
	federation.client_app federation.server_app
MUTANTS ?= all
MUTANTS_JOBS ?= 1
MUTANTS_NICE ?= 10
mutants: setup
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install -q -e '.[mutation]'
	mkdir -p mutants
	$(BIN)/python -m pipeline.mutation_report --restore
	for m in $(MODULES); do \
	  if [ "$(MUTANTS)" = survivors ]; then names=$$($(BIN)/python -m pipeline.mutation_report --survivors $$m) || exit 1; \
	  elif [ "$(MUTANTS)" = unfinished ]; then names=$$($(BIN)/python -m pipeline.mutation_report --unfinished $$m $(if $(NAMES),--match $(NAMES))) || exit 1; \
	  elif [ -n "$(NAMES)" ]; then names="$(NAMES)"; else names="pipeline.$$m.*"; fi; \
	  [ -n "$$names" ] || continue; \
	  start=$$(date -u +%s); \
	  FEDMEET_DATA_ROOT=$(abspath ..)/shared/data nice -n $(MUTANTS_NICE) $(BIN)/mutmut run --max-children $(MUTANTS_JOBS) $$names || exit 1; \
	  printf '%s\t%s\t%s\t%s\tnice -n $(MUTANTS_NICE) mutmut run --max-children $(MUTANTS_JOBS)\t%s\n' "$$m" "$(if $(NAMES),$(if $(filter unfinished,$(MUTANTS)),unfinished )$(NAMES),$(MUTANTS))" \
	    "$$start" "$$(( $$(date -u +%s) - start ))" "$$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- pipeline tests || echo +changes)" >> reports/mutation-runs.tsv; \
	done
	$(BIN)/python -m pipeline.mutation_report

bench: setup
	$(BIN)/python -m benchmarks.run

# Apply a run profile as DVC experiment parameters: make preset PRESET=configs/cpu-study.yaml
preset: setup
	$(BIN)/python -m pipeline.presets run $(PRESET)

# Ablation grid: DVC's own sweep over the top-level tau and seed (every experiment inherits the seed), one queued
# DVC experiment per point, run by $(JOBS) queue workers (README, "Working with it").
GRID_TAUS  ?= 2,3,4,5
GRID_SEEDS ?= 0,1,2
JOBS       ?= 2
grid: data-sources
	$(BIN)/dvc exp run --queue -S 'tau=$(GRID_TAUS)' -S 'seed=$(GRID_SEEDS)'
	$(BIN)/dvc queue start -j $(JOBS)

# The experiments side by side with only the headline columns (reports/metrics.json), tau and the seed;
# plain `dvc exp show` also lists every param and dependency hash (~350 columns).
EXP_SHOW_KEEP := ^(Experiment|Created|State|Executor)$$|(.*:)?tau$$|(.*:)?seed$$|(.*:)?(main|kd_usage)\.
exp-show: setup
	$(BIN)/dvc exp show --drop '.*' --keep '$(EXP_SHOW_KEEP)' $(EXP_SHOW_ARGS)

clean-cache:
	rm -rf data/cache
