"""Fault injection on the parameters: every stage validates its params group before any work, and a bad key,
type or value is one line naming the key and what is allowed (issue 15, item 2).

Each case runs the stage in an empty directory holding only the edited params.yaml: a stage that read an input
before checking its parameters would fail on the missing input (a traceback) instead of the expected line."""

from __future__ import annotations

import copy
import importlib
import json
import re

import pytest
import yaml
from reliability import REPO_ROOT, run_inprocess

from pipeline.common.cli import EXIT_USAGE

BASE = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())

# (stage, arguments, key path in params.yaml, bad value, what the line must say: the key ... the allowed values)
CASES = [
    (
        "ingest",
        ["--dataset", "qmsum"],
        "ingest.bogus",
        1,
        r"ingest: unknown key\(s\) \['bogus'\]; allowed: \[.*'datasets'",
    ),
    (
        "ingest",
        ["--dataset", "qmsum"],
        "ingest.datasets",
        ["qmsum", "x"],
        r"ingest.datasets\[1\]: unknown dataset 'x'; allowed: \['ami'",
    ),
    (
        "ingest",
        ["--dataset", "qmsum"],
        "ingest.allow_absent_splits",
        "qmsum/*",
        r"ingest.allow_absent_splits: expected a list",
    ),
    ("examples", [], "examples.bogus", 1, r"examples: unknown key\(s\) \['bogus'\]; allowed: \["),
    # the examples stage reads ingest.datasets: a group that is not a mapping was an AttributeError traceback
    ("examples", [], "ingest", [5], r"params.yaml ingest: expected a mapping of keys, got list \[5\]"),
    (
        "partition",
        ["--scheme", "domain", "--seed", "0"],
        "partition.schemes",
        ["domain", "x"],
        r"partition.schemes: unknown value\(s\) \['x'\]; allowed: 'domain'",
    ),
    (
        "partition",
        ["--scheme", "iid", "--seed", "0"],
        "partition.iid.n_clients",
        0,
        r"partition.iid.n_clients=0 is out of range; allowed: >= 1",
    ),
    (
        "partition",
        ["--scheme", "quantity", "--seed", "0"],
        "partition.quantity.beta",
        0,
        r"partition.quantity.beta=0(\.0)? is out of range; allowed: > 0",
    ),
    (
        "partition",
        ["--scheme", "cluster", "--seed", "0"],
        "partition.cluster.batch_size",
        0,
        r"partition.cluster.batch_size=0 is out of range; allowed: >= 1",
    ),
    # numpy's generator refuses a negative seed (a ValueError traceback from the scheme, after the params passed)
    (
        "partition",
        ["--scheme", "iid", "--seed", "-1"],
        "partition.seeds",
        [-1],
        r"partition.seeds\[0\]=-1 is out of range; allowed: >= 0",
    ),
    (
        "partition",
        ["--scheme", "iid", "--seed", "0"],
        "partition.iid.n_clients",
        2.5,
        r"partition.iid.n_clients: expected an integer, got float 2.5",
    ),
    (
        "backbone",
        [],
        "backbone.name",
        "no/such-model",
        r"backbone.name='no/such-model' is a Hugging Face hub id but it cannot be downloaded.*offline recipe",
    ),
    ("backbone", [], "backbone.warmup.batch_size", 0, r"backbone.warmup.batch_size=0 is out of range; allowed: >= 1"),
    (
        "backbone",
        [],
        "backbone.warmup.dataset",
        "x",
        r"backbone.warmup.dataset='x' is not ingested; allowed: one of ingest.datasets \['qmsum'",
    ),
    (
        "backbone",
        [],
        "backbone.generation.num_beams",
        0,
        r"backbone.generation.num_beams=0 is out of range; allowed: >= 1",
    ),
    ("postag", [], "postag.batch_size", 0, r"postag.batch_size=0 is out of range; allowed: >= 1"),
    ("postag", [], "model.max_target_length", "96", r"model.max_target_length: expected an integer, got str"),
    ("plan", [], "tau", 0, r"params.yaml tau=0 is out of range; allowed: > 0"),
    ("plan", [], "tau", -1.5, r"params.yaml tau=-1.5 is out of range; allowed: > 0"),
    ("plan", [], "seed", -1, r"params.yaml seed=-1 is out of range; allowed: >= 0"),
    (
        "plan",
        [],
        "experiments.centralized-domain.seed",
        -2,
        r"centralized-domain.seed=-2 is out of range; allowed: >= 0",
    ),
    # client-level DP needs only the plan's clients (3): refused by the plan stage, not when the training starts
    (
        "plan",
        [],
        "experiments.fedavg-domain.privacy",
        {"mode": "client", "noise_multiplier": 1.0, "clipping": "adaptive"},  # count noise: 3 sampled / 20
        r"experiments.fedavg-domain: privacy.noise_multiplier 1 .*clipped_count_stddev > it \(now 0.15;",
    ),
    (
        "plan",
        [],
        "experiments.fedavg-domain.privacy",
        {"mode": "client", "noise_multiplier": 1.0, "clipping_norm": 1.0, "delta": 0.5},
        r"experiments.fedavg-domain: privacy.delta 0.5 >= 1/3 ",
    ),
    ("plan", [], "model.bottleneck", 0, r"model.bottleneck=0 is out of range; allowed: >= 1"),
    ("plan", [], "model.adapter_init_std", -0.02, r"model.adapter_init_std=-0.02 is out of range; allowed: >= 0"),
    ("plan", [], "model.top_k", 0, r"model.top_k=0 is out of range; allowed: >= 1"),
    ("plan", [], "model.cache_dtype", "int4", r"model.cache_dtype='int4' is out of range; allowed: one of 'float32'"),
    # a list (an unhashable value) was a TypeError traceback from the dtype lookup
    (
        "plan",
        [],
        "model.cache_dtype",
        ["float16"],
        r"model.cache_dtype=\['float16'\] is out of range; allowed: one of 'float32'",
    ),
    ("plan", [], "train.batch_size", 0, r"train.batch_size=0 is out of range; allowed: >= 1"),
    ("plan", [], "train.lr", "fast", r"train.lr: expected a number, got str 'fast'"),
    # torch's AdamW refuses these at the first step, numpy's sampler a negative cap, and a cap of 0 trains nothing
    ("plan", [], "train.lr", -1.0, r"train.lr=-1.0 is out of range; allowed: >= 0"),
    ("plan", [], "train.weight_decay", -0.01, r"train.weight_decay=-0.01 is out of range; allowed: >= 0"),
    (
        "plan",
        [],
        "train.max_train_examples_per_client",
        -3,
        r"max_train_examples_per_client=-3 is out of range; allowed: >= 1",
    ),
    (
        "plan",
        [],
        "train.max_valid_examples_per_client",
        0,
        r"max_valid_examples_per_client=0 is out of range; allowed: >= 1",
    ),
    # an entry's run-time key: its train stage reads it (pipeline.experiments.settings), so planning checks it too
    (
        "plan",
        [],
        "experiments.fedavg-domain.round_timeout_s",
        -5,
        r"params.yaml experiments.fedavg-domain.round_timeout_s=-5 is out of range; allowed: > 0",
    ),
    # post_addition's new client must be able to join within its rounds (5, the entry's)
    (
        "plan",
        [],
        "train.join.max_round",
        6,
        r"experiments.post_addition: train.join.max_round 6 > rounds 5: the new client might never join",
    ),
    # the client that joins late must be one of its partition's (the server refused it only once training began)
    (
        "plan",
        [],
        "train.new_client",
        "samsum",
        r"experiments.post_addition: train.new_client='samsum'; allowed: one of \['Academic', 'Committee', 'Product', 'SAMSum'\]",
    ),
    ("plan", [], "train.bogus", 1, r"train: unknown key\(s\) \['bogus'\]; allowed: \["),
    (
        "plan",
        [],
        "experiments.fedavg-domain.method",
        "fedx",
        r"experiments.fedavg-domain.method='fedx' is out of range; allowed: one of 'centralized', 'fedavg', ",
    ),
    (
        "plan",
        [],
        "experiments.fedavg-domain.partition",
        "x/seed0",
        r"experiments.fedavg-domain.partition: unknown partition scheme 'x'; allowed: \['cluster'",
    ),
    (
        "evaluate",
        ["run", "--experiment", "fedavg-domain", "--no-mlflow"],
        "evaluate.batch_size",
        0,
        r"evaluate.batch_size=0 is out of range; allowed: >= 1",
    ),
    (  # -1 ("no limit") was an OverflowError traceback in the tokenizer, after the backbone had loaded
        "evaluate",
        ["run", "--experiment", "fedavg-domain", "--no-mlflow"],
        "evaluate.max_source_length",
        -1,
        r"evaluate.max_source_length=-1 is out of range; allowed: >= 2",
    ),
    (
        "evaluate",
        ["run", "--experiment", "fedavg-domain", "--no-mlflow"],
        "evaluate.max_source_length",
        1,  # below the special tokens, the tokenizer did not truncate at all
        r"evaluate.max_source_length=1 is out of range; allowed: >= 2",
    ),
    (  # a negative size silently blocked nothing (HF skips the processor below 1)
        "evaluate",
        ["run", "--experiment", "fedavg-domain", "--no-mlflow"],
        "evaluate.no_repeat_ngram_size",
        -3,
        r"evaluate.no_repeat_ngram_size=-3 is out of range; allowed: >= 0",
    ),
    (
        "evaluate",
        ["run", "--experiment", "fedavg-domain", "--no-mlflow"],
        "bootstrap.level",
        2,
        r"bootstrap.level=2(\.0)? is out of range; allowed: > 0.5 and < 1",
    ),
    (
        "analyze",
        [],
        "analyze.word_rule",
        "x",
        r"analyze.word_rule='x' is out of range; allowed: one of 'first', 'any', 'all' or 'majority'",
    ),
    ("report", [], "report.bogus", 1, r"report: unknown key\(s\) \['bogus'\]; allowed: \["),
    ("report", [], "bootstrap.n_resamples", 0, r"bootstrap.n_resamples=0 is out of range; allowed: >= 100"),
]


def edited_params(key: str, value) -> dict:
    params = copy.deepcopy(BASE)
    *parents, last = key.split(".")
    node = params
    i = 0
    while i < len(parents):  # experiment names contain no dot, but tolerate them by joining greedily
        node = node[parents[i]]
        i += 1
    node[last] = value
    return params


@pytest.mark.parametrize("stage, args, key, value, expected", CASES, ids=[f"{c[0]}-{c[2]}={c[3]!r}" for c in CASES])
def test_bad_parameter_is_one_line_naming_key_and_allowed_values(
    tmp_path, monkeypatch, stage, args, key, value, expected
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(edited_params(key, value)))
    module = importlib.import_module(f"pipeline.{stage}")
    outcome = run_inprocess(module.main, args + ["--params", "params.yaml"])
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert re.search(expected, outcome.lines[0]), outcome.lines[0]
    assert outcome.lines[0].startswith("error: ")
    # nothing written: the check came before any work
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["params.yaml"]


def test_the_unedited_params_pass_every_check(tmp_path):
    """The cases above fail because of the one edit: the plan stage accepts the shipped params.yaml."""
    from pipeline.planning import check_params, write_plans

    written = write_plans(check_params(copy.deepcopy(BASE)), tmp_path / "plans")
    assert {p.stem for p in written} == set(BASE["experiments"])


def test_train_stage_checks_its_plan_before_touching_outputs(tmp_path, monkeypatch):
    """The train stage's parameters come from its plan file: a bad model group there is one line, and neither the
    experiment's output directory nor an MLflow run is created."""
    from pipeline import train
    from pipeline.planning import check_params, write_plans

    monkeypatch.chdir(tmp_path)
    plans = tmp_path / "plans"
    write_plans(check_params(copy.deepcopy(BASE)), plans)
    path = plans / "fedavg-domain.json"
    plan = json.loads(path.read_text())
    plan["model"]["bottleneck"] = 0
    path.write_text(json.dumps(plan))
    outcome = run_inprocess(train.main, ["--experiment", "fedavg-domain", "--plans", str(plans)])
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert re.search(r"fedavg-domain.json: model.bottleneck=0 is out of range; allowed: >= 1", outcome.lines[-1]), (
        outcome.stderr
    )
    assert not (tmp_path / "models").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    "key, value, named",
    [
        # numpy's generators (AdaCentralized's round window) refuse a negative seed: it failed inside training
        ("seed", -1, r"seed=-1 is out of range"),
        ("seed", "0", r"seed: expected an integer"),
        ("tau", -1.0, r"tau=-1.0 is out of range"),  # the entropy gate never distilled: trained as fedavg's KD-less
        ("tau", None, r"tau"),  # selective KD without tau read it as inf: KD on every token, trained as fedkd
        ("train", None, r"train"),  # trained with the code's defaults (3 rounds, lr 2e-4, ...), not the plan's
        ("train", [1], r"train"),  # a TypeError traceback
        ("model", None, r"model"),  # the code's default model shape, not the plan's
    ],
)
def test_train_stage_refuses_a_plan_edited_by_hand_before_touching_outputs(tmp_path, monkeypatch, key, value, named):
    """Every value planning writes is checked again where the train stage reads its plan file (the first thing it
    does): a plan file edited by hand with a value planning refuses, or without one it needs, is one line naming the
    file and the key, and nothing is created. Before, each of these was read as given and trained (or failed later)."""
    from pipeline import train
    from pipeline.planning import check_params, write_plans

    monkeypatch.chdir(tmp_path)
    plans = tmp_path / "plans"
    write_plans(check_params(copy.deepcopy(BASE)), plans)
    path = plans / "fedselectkd-domain.json"
    plan = json.loads(path.read_text())
    plan[key] = value
    path.write_text(json.dumps(plan))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(BASE))  # its run-time settings
    outcome = run_inprocess(train.main, ["--experiment", "fedselectkd-domain", "--plans", str(plans)])
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and re.search(rf"^error: {re.escape(str(path))}: .*{named}", outcome.lines[0]), (
        outcome.stderr
    )
    assert not (tmp_path / "models").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "data").exists()  # nothing read past the plan (the partition, the examples)


def test_top_k_beyond_the_decoder_layers_names_the_allowed_range():
    """top_k's upper bound is the backbone's: checked when the model is built, before any training."""
    from tiny_models import tiny

    from pipeline.common.config import ConfigError
    from pipeline.modeling.adapters import AdapterConfig
    from pipeline.modeling.model import AdapterSummarizer

    backbone, tok = tiny("bart")
    n_layers = len(backbone.get_decoder().layers)
    with pytest.raises(
        ConfigError,
        match=rf"model.top_k={n_layers + 1} > {n_layers} decoder layers .*; "
        rf"allowed: 1..{n_layers}",
    ):
        AdapterSummarizer(backbone, tok, AdapterConfig(top_k=n_layers + 1, bottleneck=4))
    AdapterSummarizer(backbone, tok, AdapterConfig(top_k=n_layers, bottleneck=4))  # the bound itself is fine


@pytest.mark.parametrize(
    "stage, args, missing",
    [
        ("partition", ["--scheme", "domain", "--seed", "0"], "data/processed/examples.parquet"),
        ("examples", [], "data/interim/qmsum.parquet"),
        ("train", ["--experiment", "fedavg-domain"], "models/plans/fedavg-domain.json"),
    ],
)
def test_missing_upstream_output_is_one_line_naming_it(tmp_path, monkeypatch, stage, args, missing):
    """A stage run before the stage that makes its input (or with a wrong path) names the missing file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(BASE))
    outcome = run_inprocess(importlib.import_module(f"pipeline.{stage}").main, args)
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert re.match(rf"error: {re.escape(missing)}: .*not found", outcome.lines[0]), outcome.lines[0]


@pytest.mark.parametrize(
    "stage, args",
    [
        ("ingest", ["--dataset", "qmsum"]),
        ("examples", []),
        ("partition", ["--scheme", "domain", "--seed", "0"]),
        ("postag", []),
        ("backbone", []),
        ("plan", []),
        ("analyze", []),
        ("report", []),
        ("evaluate", ["run", "--experiment", "fedavg-domain"]),
        ("presets", ["check", "preset.yaml"]),
    ],
)
def test_a_params_path_that_is_a_folder_is_one_line_naming_it(tmp_path, monkeypatch, stage, args):
    """``--params`` naming a folder (a study folder for its params.yaml) passed load_params' exists() check and
    ended in an IsADirectoryError traceback at every stage that takes --params; one line naming the folder now."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study").mkdir()
    where = ["--params", "study"]
    argv = where + args if stage == "presets" else args + where  # presets: its options before the command
    outcome = run_inprocess(importlib.import_module(f"pipeline.{stage}").main, argv)
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.lines[0] == "error: study: not a readable parameter file (Is a directory)", outcome.lines[0]


def test_a_duplicated_key_in_params_is_one_line_naming_it(tmp_path, monkeypatch):
    """An experiment entry copied and left under the same name: plain YAML keeps the last one and drops the first
    silently (the plan stage wrote one plan, tau 2); it is refused, naming the file, the key and its line."""
    from pipeline import plan

    monkeypatch.chdir(tmp_path)
    entry = "    method: fedselectkd\n    partition: domain/seed0\n"
    text = yaml.safe_dump({k: v for k, v in BASE.items() if k != "experiments"})
    (tmp_path / "params.yaml").write_text(
        text + f"experiments:\n  tau-1:\n{entry}    tau: 1.0\n  tau-1:\n{entry}    tau: 2.0\n"
    )
    outcome = run_inprocess(plan.main, ["--params", "params.yaml", "--out", "plans"])
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert re.search(r"^error: params.yaml: not valid YAML \(duplicate key 'tau-1' .*line \d+", outcome.lines[0])
    assert not (tmp_path / "plans").exists()


def test_yaml_merge_keys_are_read_as_safe_load_reads_them(tmp_path):
    """Entries sharing keys through an anchor and merge keys (``<<: *base``) are valid YAML that yaml.safe_load
    reads; the duplicate-key check refused them as 'not valid YAML' (no constructor for the merge tag). A key
    written beside the merge overrides the merged one, as in safe_load; a key written twice is still refused."""
    from pipeline.common.config import ConfigError, load_params

    text = "base: &b\n  method: fedavg\n  seed: 0\nexperiments:\n  x:\n    <<: *b\n    seed: 1\n"
    (tmp_path / "merge.yaml").write_text(text)
    assert load_params(tmp_path / "merge.yaml") == yaml.safe_load(text)
    assert load_params(tmp_path / "merge.yaml")["experiments"]["x"] == {"method": "fedavg", "seed": 1}
    (tmp_path / "twice.yaml").write_text(text + "    seed: 2\n")
    with pytest.raises(ConfigError, match="duplicate key 'seed'"):
        load_params(tmp_path / "twice.yaml")


def test_an_unhashable_key_is_safe_loads_one_line_not_a_type_error(tmp_path):
    """``[lr]: 0.1`` (a flow sequence as a key) is safe_load's ConstructorError with its line; the duplicate-key
    check put the key into a set first: 'TypeError: unhashable type: list', a traceback naming no file."""
    from pipeline.common.config import ConfigError, load_params

    (tmp_path / "params.yaml").write_text("train:\n  [lr]: 0.1\n")
    with pytest.raises(ConfigError, match=r"params.yaml: not valid YAML \(.*found unhashable key.*line 2"):
        load_params(tmp_path / "params.yaml")


@pytest.mark.parametrize(
    "stage, args, key, value, problem",
    [
        # a model key the committed study params still hold (reports/cpu-study/params.yaml), no longer a params key
        ("plan", [], "model", {"teacher_cache_gb": 1}, r"model: unknown key\(s\) \['teacher_cache_gb'\]; allowed: \["),
        ("plan", [], "tau", 0, r"tau=0 is out of range; allowed: > 0"),
        ("plan", [], "train", [5], r"train: expected a mapping of keys, got list \[5\]"),
        ("plan", [], "train.round_timeout_s", -5, r"train.round_timeout_s=-5 is out of range; allowed: > 0"),
        ("plan", [], "train.lr", "1e-5", r"train.lr: expected a number, got str '1e-5'"),
        ("plan", [], "train.kd_gate", "entrpy", r"train.kd_gate 'entrpy' is not a KD gate"),
        # an entry's own train keys (resolve_plan's train_config): its line named no file
        (
            "plan",
            [],
            "experiments.single-domain.lr",
            "1e-5",
            r"experiments.single-domain train.lr: expected a number, got str '1e-5'",
        ),
        ("plan", [], "experiments.fedavg-domain.rounds", -1, r"experiments.fedavg-domain train.rounds=-1 is out of "),
        (
            "plan",
            [],
            "experiments.fedavg-domain.fraction_train",
            2.0,
            r"experiments.fedavg-domain train.fraction_train=2.0 is out of range; allowed: > 0 and <= 1",
        ),
        ("plan", [], "experiments.fedavg-domain.bogus", 1, r"experiments.fedavg-domain: unknown key\(s\) \['bogus'\]"),
        (
            "plan",
            [],
            "experiments.fedavg-domain.partition",
            "domain/seed9",
            r"experiments.fedavg-domain.partition: 'domain/seed9' is not produced by partition.schemes",
        ),
        # the partition group the plan stage reads (the partitions an entry may name, a plan's clients)
        ("plan", [], "partition.schemes", ["bogus"], r"partition.schemes: unknown value\(s\) \['bogus'\]; allowed: "),
        ("analyze", [], "seed", -1, r"seed=-1 is out of range; allowed: >= 0"),
        # an entry's run-time key, checked where the entry is parsed (as the train group's is, above): analyze let it by
        (
            "analyze",
            [],
            "experiments.fedavg-domain.round_timeout_s",
            -5,
            r"experiments.fedavg-domain.round_timeout_s=-5 is out of range; allowed: > 0",
        ),
        (
            "report",
            [],
            "experiments.fedavg-domain.bogus",
            1,
            r"experiments.fedavg-domain: unknown key\(s\) \['bogus'\]",
        ),
        # the top-level train group (the report's plans of AdaCentralized/AdaSingle read it): the line blamed an entry
        ("report", [], "train.lr", "1e-5", r"train.lr: expected a number, got str '1e-5'"),
        ("report", [], "train.round_timeout_s", -5, r"train.round_timeout_s=-5 is out of range; allowed: > 0"),
        # the claims command reads the study folder's params.yaml (no --params)
        ("report", ["claims", "study", "README.md"], "tau", 0, r"tau=0 is out of range; allowed: > 0"),
        # params' privacy group (Experiment.privacy_config), and the plans' SecAgg+ check (check_client_plans)
        ("plan", [], "privacy.mode", "bogus", r"privacy.mode='bogus' is out of range; allowed: one of 'none'"),
        # an entry's own privacy mapping: its line named no file at all
        (
            "plan",
            [],
            "experiments.fedavg-domain.privacy",
            {"mode": "bogus"},
            r"experiments.fedavg-domain privacy.mode='bogus' is out of range; allowed: one of 'none'",
        ),
        (
            "plan",
            [],
            "experiments.fedavg-domain.privacy",
            {"secure_aggregation": True, "secagg": {"reconstruction_threshold": 5}},
            r"experiments.fedavg-domain: privacy.secagg.reconstruction_threshold 5 > the 3 clients of a round's sum",
        ),
        # FedAvg in the tau sweep reads no tau (Experiment's check): refused by planning, not first by analyze
        *[
            (
                stage,
                [],
                "experiments.fedavg-domain.study",
                "tau_sweep",
                r"experiments.fedavg-domain: a tau-sweep experiment needs a method that reads tau; 'fedavg' reads none",
            )
            for stage in ("plan", "analyze")
        ],
        ("examples", [], "ingest.datasets", "qmsum", r"ingest.datasets: expected a list of dataset names, got 'qmsum'"),
        ("examples", [], "ingest", [5], r"ingest: expected a mapping of keys, got list \[5\]"),
        ("backbone", [], "ingest", [5], r"ingest: expected a mapping of keys, got list \[5\]"),
        ("backbone", [], "examples", [5], r"examples: expected a mapping of keys, got list \[5\]"),
        ("postag", [], "model", [5], r"model: expected a mapping of keys, got list \[5\]"),
        # the ingest and analyze stages' own groups: their lines named the group only (`ingest: ...`), not the file
        (
            "ingest",
            ["--dataset", "qmsum", "--params", "study/params.yaml"],
            "ingest.bogus",
            1,
            r"ingest: unknown key\(s\) \['bogus'\]",
        ),
        ("analyze", [], "analyze.word_rule", "x", r"analyze.word_rule='x' is out of range"),
        # the partition stage's group (a scheme and seed are its own arguments)
        (
            "partition",
            ["--scheme", "domain", "--seed", "0", "--params", "study/params.yaml"],
            "partition.seeds",
            [-1],
            r"partition.seeds",
        ),
    ],
)
def test_a_bad_key_of_a_params_file_elsewhere_is_named_in_that_file(
    tmp_path, monkeypatch, stage, args, key, value, problem
):
    """A params file other than ./params.yaml (a study folder's, read by the claims command, or one given with
    --params): the line named params.yaml, the project's, which holds no such value; it names the file read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "params.yaml").write_text(yaml.safe_dump(edited_params(key, value)))
    argv = args or ["--params", "study/params.yaml"]
    outcome = run_inprocess(importlib.import_module(f"pipeline.{stage}").main, argv)
    assert outcome.status == EXIT_USAGE, outcome.stderr
    assert len(outcome.lines) == 1 and "Traceback" not in outcome.stderr, outcome.stderr
    assert re.match(rf"error: study/params\.yaml {problem}", outcome.lines[0]), outcome.lines[0]


def test_the_federation_names_a_bad_evaluate_key_as_the_stages_do(tmp_path, monkeypatch):
    """`local --params` and `kit --params` read the evaluate group for the ServerApp's decoding: a bad value is
    "<file> evaluate.<key>" as in every stage's line, not "<file>: evaluate.<key>"."""
    from pipeline.common.config import ConfigError
    from pipeline.federation.localhost import server_run_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "params.yaml").write_text(yaml.safe_dump(edited_params("evaluate.num_beams", 0)))
    with pytest.raises(ConfigError, match=r"^study/params\.yaml evaluate\.num_beams"):
        server_run_config("study/params.yaml", "fedavg-domain")


def test_the_plan_stage_resolves_each_experiment_once(tmp_path, monkeypatch):
    """The stage checks the privacy of every resolved plan, then writes those same plans: resolving them a second
    time for the writing doubled the stage's work (every extension's source hashed twice)."""
    from pipeline import plan, planning

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(copy.deepcopy(BASE)))
    calls = []
    monkeypatch.setattr(planning, "resolve_plan", lambda *args, f=planning.resolve_plan: calls.append(1) or f(*args))
    outcome = run_inprocess(plan.main, ["--params", "params.yaml", "--out", "plans"])
    assert outcome.status == 0, outcome.stderr
    assert len(calls) == len(BASE["experiments"]) == len(list((tmp_path / "plans").glob("*.json")))
