# fedmeet: `make repro` regenerates every table and figure; `make test` runs the fast test lane, `make test-all`
# every test (CI).
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

.PHONY: setup data-sources repro lint test test-all reliability bench clean-cache preset grid exp-show mutants

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

# `dvc repro` runs one stage at a time; DVC releases its repository lock while a stage's command runs, so
# independent stages run in parallel from separate `dvc repro` calls (DVC's parallel stage execution). make repro:
# the ingests; the backbone (the longest stage) beside the examples and partitions, which yield it the cores (nice);
# then each experiment's train and evaluate stages, REPRO_JOBS calls at a time (-s: a call checks only its own
# stages, not those a running one reads; --wait-for-lock: calls queue for the lock). Every stage keeps torch's thread
# count, so the outputs are those of one `dvc repro`, byte for byte; idle OpenMP threads sleep (PASSIVE) instead of
# spinning on the cores another stage needs. The last `dvc repro` runs analyze and report and checks that nothing
# is left.
REPRO_JOBS ?= 2
DVC_LANE := env OMP_WAIT_POLICY=PASSIVE $(BIN)/dvc --wait-for-lock repro -s
repro: data-sources
	$(BIN)/dvc repro ingest
	nice $(DVC_LANE) examples partition & $(DVC_LANE) backbone; s=$$?; wait $$! && exit $$s
	$(BIN)/dvc repro plan
	$(BIN)/dvc stage list --name-only | sed -n 's/^train@\(.*\)/train@\1 evaluate@\1/p' \
		| xargs -P $(REPRO_JOBS) -L 2 $(DVC_LANE)
	$(BIN)/dvc repro

# Two lanes (pyproject.toml [tool.pytest.ini_options] markers), both on every core (pytest-xdist; PYTEST_JOBS=1 for
# one process). `test`: unit and small integration tests, every change. `test-all`: also the end-to-end runs per
# method, SecAgg+, real deployments (SuperLink/SuperNode processes), the mlflow server, subprocess CLIs, tools.
# --dist loadgroup: the tests that start SuperLink/SuperNode processes run in xdist groups, one federation per group,
# dealt out first (tests/test_deployment.py, tests/conftest.py), so their waits on Flower's polls and timeouts overlap
# the other tests. test-all is CPU-bound (docs/performance.md): TEST_ALL_JOBS workers, no more than that needs.
FAST_LANE   := not slow and not deployment and not integration and not tools
PYTEST_JOBS ?= 2
TEST_ALL_JOBS ?= 3
# `lint`, before every test lane: the tree as ruff formats it (sizes are counted in formatted lines), its lint rules
# (pyproject.toml [tool.ruff]) and the package's layers (pyproject.toml [tool.importlinter], docs/ARCHITECTURE.md).
LINT_PATHS := pipeline tests benchmarks tools
lint: setup
	$(BIN)/ruff format --check -q $(LINT_PATHS)
	$(BIN)/ruff check -q $(LINT_PATHS)
	$(BIN)/lint-imports --no-cache

test: setup lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadgroup -m "$(FAST_LANE)"

test-all: setup lint
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_ALL_JOBS) --dist loadgroup

# Faults tried on purpose (issue 15): damaged inputs, bad parameters, killed writes, concurrent MLflow writers,
# damaged caches and backbone, a federated run killed at seven points; writes reports/reliability.md.
RELIABILITY_TESTS := tests/test_reliability_*.py \
	tests/test_cache.py::test_damaged_entry_is_counted_removed_and_recomputed_exactly \
	tests/test_federated.py::test_killed_run_resumes_at_the_next_round \
	tests/test_federated.py::test_killed_run_resumes_from_every_kill_point_to_the_uninterrupted_result
reliability: setup
	PYTHONPATH=tests $(BIN)/python -m pytest -q -p no:cacheprovider -p reliability_report \
		--reliability-report reports/reliability.md $(RELIABILITY_TESTS)

# Mutation testing of the numerical core (an occasional tool, not in CI; pyproject.toml [tool.mutmut]): mutmut runs
# the core's fast-lane tests against each mutant of MODULES, keeping its verdicts in the git-ignored mutants/ (a
# second run only re-runs what changed); then tools/mutation/report.py prints the score per module and every
# survivor's diff, for review (a missing test, or a mutant that cannot change behaviour), and writes the score
# table to reports/mutation.md. MUTANTS_JOBS parallel mutants at MUTANTS_NICE (leave a core to other work).
MODULES ?= modeling.losses federation.strategies federation.compression results.stats partitioning.schemes \
	training.stopping training.local_batch training.set_engine privacy.accounting privacy.client_dp
MUTANTS_JOBS ?= 1
MUTANTS_NICE ?= 10
mutants: setup
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/pip install -q -e '.[mutation]'
	# mutmut 3.8.1 copies an also_copy file into mutants/ without making its folder (a fresh clone's first run failed
	# on mutants/docs/privacy.md): the folders first
	$(BIN)/python -c "import pathlib, tomllib; [pathlib.Path('mutants', p).parent.mkdir(parents=True, exist_ok=True) \
		for p in tomllib.load(open('pyproject.toml', 'rb'))['tool']['mutmut']['also_copy']]"
	nice -n $(MUTANTS_NICE) $(BIN)/mutmut run --max-children $(MUTANTS_JOBS) $(foreach m,$(MODULES),'pipeline.$(m).*')
	$(BIN)/python -m tools.mutation.report --summary reports/mutation.md

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

# The experiments side by side with only the headline columns (reports/metrics.json), each evaluation's own
# client-average avg ROUGE (reports/eval/<exp>/metrics.json), tau and the seed;
# plain `dvc exp show` also lists every param and dependency hash (~380 columns) and every evaluation's metrics
# (~1,400; docs/experiments.md).
EXP_SHOW_KEEP := ^(Experiment|Created|State|Executor)$$|(.*:)?tau$$|(.*:)?seed$$|(.*:)?(main|kd_usage)\.|(.*:)?mean\.avg_rouge$$
exp-show: setup
	$(BIN)/dvc exp show --drop '.*' --keep '$(EXP_SHOW_KEEP)' $(EXP_SHOW_ARGS)

clean-cache:
	rm -rf data/cache
