"""Stages `plan` and `train`: what enters each plan file (so DVC reruns only what a change affects), and the
train CLI end to end (outputs, DVC metrics/plots files, MLflow run with adapters as artifacts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.common.config import ConfigError
from tests.errors import names
from tests.test_federated import MODEL, TRAIN, workspace, ws  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[1]

ALL_METHODS = [
    "single",
    "centralized",
    "fedavg",
    "fedkd",
    "fedselectkd",
    "fedprox",
    "fedopt",
    "fednova",
    "hardkd",
    "post_addition",
    "pre_addition",
]
TAU_METHODS = {"fedselectkd", "post_addition", "pre_addition"}


def _params(**top) -> dict:
    experiments = {m: {"method": m, "partition": "domain/seed0", "seed": 0, "study": "s"} for m in ALL_METHODS}
    experiments["post_addition"]["partition"] = "extreme/seed0"  # its new client (SAMSum) is one of the partition's
    experiments["tau-2"] = {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "tau", "tau": 2.0}
    params = {"tau": 5.0, "model": dict(MODEL), "train": dict(TRAIN), "experiments": experiments}
    params.update(top)
    return params


def _plans(tmp_path: Path, params: dict, sub: str) -> dict[str, str]:
    from pipeline.planning import check_params, write_plans

    out = tmp_path / sub
    write_plans(check_params(params), out)
    return {p.stem: p.read_text() for p in sorted(out.glob("*.json"))}


def test_plan_has_tau_only_where_the_result_depends_on_it(tmp_path):
    plans = _plans(tmp_path, _params(), "a")
    for name, text in plans.items():
        plan = json.loads(text)
        assert ("tau" in plan) == (plan["method"] in TAU_METHODS), name
    assert json.loads(plans["fedselectkd"])["tau"] == 5.0
    assert json.loads(plans["tau-2"])["tau"] == 2.0  # the entry's override wins over the top-level tau
    # `dvc exp run -S tau=4`: exactly the plans that use the top-level tau change, tau-2 keeps its own
    changed = _plans(tmp_path, _params(tau=4.0), "b")
    differs = {n for n in plans if plans[n] != changed[n]}
    assert differs == TAU_METHODS


def test_plan_leaves_out_settings_a_method_does_not_read(tmp_path):
    base = _plans(tmp_path, _params(), "a")
    prox = _plans(tmp_path, _params(train={**TRAIN, "proximal_mu": 0.5}), "b")
    assert {n for n in base if base[n] != prox[n]} == {"fedprox"}
    kd = _plans(tmp_path, _params(train={**TRAIN, "kd_lambda": 0.5}), "c")
    assert {n for n in base if base[n] != kd[n]} == {
        "fedkd",
        "fedselectkd",
        "hardkd",
        "post_addition",
        "pre_addition",
        "tau-2",
    }
    rounds = _plans(tmp_path, _params(train={**TRAIN, "rounds": 7}), "d")
    assert {n for n in base if base[n] != rounds[n]} == set(base)  # every method trains for `rounds`
    # the gate's scale is read by selective KD only; a portable scale needs every selective tau in (0, 1]
    assert "tau_scale" in json.loads(base["fedselectkd"])["train"]
    assert "tau_scale" not in json.loads(base["fedkd"])["train"]
    with pytest.raises(ConfigError) as err:
        _plans(tmp_path, _params(train={**TRAIN, "tau_scale": "max_entropy"}), "f")  # tau 5 is not a fraction
    names(err.value, "experiments.fedselectkd", "tau=5.0", "tau_scale 'max_entropy'")  # the entry, its value
    # the transfer encoding matters to every federated method, never to single/centralized
    federated = set(base) - {"single", "centralized"}
    int8 = _plans(tmp_path, _params(train={**TRAIN, "transfer_dtype": "int8"}), "e")
    assert {n for n in base if base[n] != int8[n]} == federated
    # delta encoding only matters for a lossy encoding (fp32 sends the weights exactly)
    delta32 = _plans(tmp_path, _params(train={**TRAIN, "transfer_delta": True}), "f")
    assert delta32 == base
    delta8 = _plans(tmp_path, _params(train={**TRAIN, "transfer_dtype": "int8", "transfer_delta": True}), "g")
    assert {n for n in int8 if int8[n] != delta8[n]} == federated
    # the FedAvg weighting only matters when a cap makes the trained count differ from |D_i|
    full = _plans(tmp_path, _params(train={**TRAIN, "weight_by": "full"}), "h")
    assert full == base
    capped = _plans(tmp_path, _params(train={**TRAIN, "max_train_examples_per_client": 8}), "i")
    capped_full = _plans(
        tmp_path, _params(train={**TRAIN, "max_train_examples_per_client": 8, "weight_by": "full"}), "j"
    )
    assert {n for n in capped if capped[n] != capped_full[n]} == federated


def test_the_centralized_step_rule_enters_the_centralized_plan_alone(tmp_path):
    # train.centralized_steps sizes the pooled training set's rounds: only AdaCentralized pools the clients' data
    # (METHOD.md section 6), so only its plan may change with it (pipeline.training.serverless reads it when pooled)
    base = _plans(tmp_path, _params(), "a")
    epoch = _plans(tmp_path, _params(train={**TRAIN, "centralized_steps": "epoch"}), "b")
    assert {n for n in base if base[n] != epoch[n]} == {"centralized"}


def test_the_new_client_enters_the_post_addition_plan_alone(tmp_path):
    # which client joins late matters only where one joins late (post-addition); pre-addition has every client from
    # round 1, so train.new_client cannot change its result
    base = _plans(tmp_path, _params(), "a")
    product = _plans(tmp_path, _params(train={**TRAIN, "new_client": "Product"}), "b")
    assert {n for n in base if base[n] != product[n]} == {"post_addition"}


def test_train_config_rejects_bad_transfer_and_weighting():
    from pipeline.experiments.train_config import TrainConfig

    for bad, message in [
        ({"transfer_dtype": "bf16"}, "transfer_dtype"),
        ({"weight_by": "tokens"}, "weight_by"),
        ({"transfer_delta": "yes"}, "transfer_delta"),
    ]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**bad)


def test_plan_rejects_bad_entries(tmp_path):
    from pipeline.planning import check_params, write_plans

    bad = [
        ({"method": "fedavg", "partition": "domain/seed0", "lr_typo": 1}, "unknown key"),
        ({"method": "fedavg", "partition": "domain/seed0", "tau": 3.0}, "does not use it"),
        ({"method": "fedmagic", "partition": "domain/seed0"}, r"method='fedmagic' is out of range; allowed: one of "),
        ({"method": "fedavg", "partition": "domain"}, "<scheme>/seed<k>"),
        ({"partition": "domain/seed0"}, "missing required key"),
    ]
    for entry, message in bad:
        with pytest.raises(ValueError, match=message):
            write_plans(
                check_params({"tau": 5.0, "model": MODEL, "train": TRAIN, "experiments": {"x": entry}}), tmp_path / "p"
            )
    with pytest.raises(ValueError, match="invalid experiment name"):
        write_plans(
            check_params(
                {
                    "tau": 5.0,
                    "train": TRAIN,
                    "experiments": {"plans": {"method": "fedavg", "partition": "domain/seed0"}},
                }
            ),
            tmp_path / "p",
        )


def test_default_experiments_resolve(tmp_path):
    """Every experiment of the repo's params.yaml makes a valid plan (method, partition, overrides)."""
    from pipeline.experiments.plans import read_plan
    from pipeline.planning import check_params, write_plans

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    written = write_plans(check_params(params), tmp_path / "plans")
    assert len(written) == len(params["experiments"]) >= 20
    studies = {read_plan(p).study for p in written}
    assert {"main", "iid", "noniid", "extreme", "sampling", "tau_sweep", "server", "new_client", "hardkd"} <= studies


@pytest.mark.slow
def test_train_cli_end_to_end(ws):
    import mlflow

    from pipeline import plan as plan_stage
    from pipeline import train as train_stage

    params = _params()
    params["experiments"] = {
        "cli-selectkd": {"method": "fedselectkd", "partition": "domain/seed0", "seed": 0, "study": "cli"}
    }
    Path("params.yaml").write_text(yaml.safe_dump(params))
    plan_stage.main(["--params", "params.yaml"])
    train_stage.main(["--experiment", "cli-selectkd"])

    metrics = json.loads(Path("reports/train/cli-selectkd/metrics.json").read_text())
    assert set(metrics["clients"]) == {"Academic", "Committee", "Product"}
    assert metrics["bytes_received"] > 0 and metrics["seconds_per_round"] > 0
    wide = json.loads(Path("reports/train/cli-selectkd/rounds.json").read_text())
    assert [r["round"] for r in wide] == [1, 2]
    assert {"Academic/val_loss", "Committee/kd_fraction", "Product/bytes_up", "val_loss_mean"} <= set(wide[0])
    gate = pd.read_parquet("models/cli-selectkd/gate_log.parquet")
    assert list(gate.columns) == ["client", "round", "example_id", "position", "token_id", "entropy", "kd_applied"]
    assert set(gate["round"]) == {1, 2}
    # KD applied exactly where the teacher's entropy is below tau (5.0)
    assert (gate["kd_applied"] == (gate["entropy"] < 5.0)).all()
    assert json.loads(Path("models/cli-selectkd/experiment.json").read_text())["tau"] == 5.0
    assert Path("reports/timing/train-cli-selectkd.json").exists()
    assert not Path("models/cli-selectkd/checkpoint").exists() and not any(
        Path("data/cache/runs").glob("cli-selectkd-*")
    )

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    runs = mlflow.search_runs(experiment_names=["cli"], output_format="list")
    run = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)  # the experiment's run
    children = {r.data.tags["client"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == run.info.run_id}
    assert set(children) == {"Academic", "Committee", "Product"}  # one child run per client
    client = mlflow.MlflowClient()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "adapters/Academic")}
    assert artifacts == {"adapters/Academic/adapter_best.safetensors", "adapters/Academic/adapter_final.safetensors"}
    history = client.get_metric_history(children["Committee"].info.run_id, "kd_fraction")
    assert [m.step for m in history] == [1, 2]
    assert run.data.params["train.kd_direction"] == "teacher_to_student"  # "(our default)" choices are logged
    # the gate log (client token ids) never goes to MLflow
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert not any("gate_log" in p for p in top)


# ------------------------------------------------------------------------------------------ optimizer details
def _batch(lengths: list[int]):
    import torch

    from pipeline.modeling.batching import IGNORE_INDEX, Batch

    width = max(lengths)
    labels = torch.full((len(lengths), width), IGNORE_INDEX)
    for i, n in enumerate(lengths):
        labels[i, :n] = 1
    return Batch(
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        labels=labels,
        example_ids=[str(i) for i in range(len(lengths))],
    )


def _weights(*args) -> list[float]:
    """Each batch's weight in its optimizer step (client_training.accumulation_steps), in batch order."""
    from pipeline.training.client_training import accumulation_steps

    return [w for step in accumulation_steps(*args) for _, w in step]


def test_accumulated_micro_batches_weigh_as_one_token_mean():
    """Window of 2 micro-batches with 6 and 2 target tokens: weights 6/8 and 2/8, so the accumulated gradient
    is the token mean over all 8 tokens; a trailing single batch forms its own step (weight 1)."""
    batches = [_batch([4, 2]), _batch([2]), _batch([3, 3, 1])]
    assert _weights(batches, 2, "tokens") == [6 / 8, 2 / 8, 1.0]
    assert _weights(batches, 1, "tokens") == [1.0, 1.0, 1.0]
    assert _weights(batches, 3, "sequences") == [2 / 6, 1 / 6, 3 / 6]
    from pipeline.training.client_training import accumulation_steps

    steps = accumulation_steps(batches, 2, "tokens")  # the steps are the batches in order, in windows of 2
    assert [len(step) for step in steps] == [2, 1] and all(b is c for (b, _), c in zip(sum(steps, []), batches))


def test_accumulation_gradient_equals_the_gradient_of_the_full_batch():
    """The identity the weights exist for: sum_b w_b * mean_b(l) == mean over the union of the batches."""
    import torch

    torch.manual_seed(0)
    theta = torch.randn(3, requires_grad=True)
    lengths = [[5, 1], [2]]
    xs = [torch.randn(sum(n), 3) for n in lengths]
    weights = _weights([_batch(n) for n in lengths], 2, "tokens")
    sum(w * (x @ theta).pow(2).mean() for w, x in zip(weights, xs)).backward()
    accumulated = theta.grad.clone()
    theta.grad = None
    (torch.cat(xs) @ theta).pow(2).mean().backward()
    assert torch.allclose(accumulated, theta.grad, atol=1e-6)


def test_adamw_decays_adapter_matrices_but_not_layernorm_or_bias():
    from pipeline.experiments.train_config import TrainConfig
    from pipeline.modeling.adapters import HoulsbyAdapter
    from pipeline.training.client_training import adamw_groups

    adapter = HoulsbyAdapter(8, 4, bias=True)
    groups = adamw_groups(adapter.parameters(), TrainConfig(weight_decay=0.01))
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in adapter.named_parameters():
        assert (id(p) in decayed) == (p.ndim == 2), name
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    every = adamw_groups(adapter.parameters(), TrainConfig(weight_decay=0.01, decay_norm_and_bias=True))
    assert len(every[0]["params"]) == len(list(adapter.parameters())) and not every[1]["params"]


@pytest.mark.parametrize("method", ["single", "centralized"])
def test_a_client_without_valid_examples_is_one_error_line_before_a_serverless_run(ws, capsys, method):
    """single/centralized pick each client's best round by its validation loss: a partition whose client has an
    empty valid split (read_partition asks only for a train split) was a ValueError traceback from the train stage
    (exit 1); the federated admission refuses it in one line."""
    from pipeline import train as train_stage
    from pipeline.common.cli import run
    from pipeline.training.client_data import read_partition
    from tests.test_federated import _write_partition, write_plan

    clients = read_partition("data/partitions/domain/seed0.json")["clients"]
    _write_partition(ws, "novalid", clients | {"Product": clients["Product"] | {"valid": []}})
    write_plan(f"novalid-{method}", method, partition="novalid/seed0")
    assert run(train_stage.main, ["--experiment", f"novalid-{method}", "--no-mlflow"]) == 2
    names(capsys.readouterr().err, "data/partitions/novalid/seed0.json", "'Product'", "no valid examples")


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda f, p: p.write_bytes(b"PAR1 cut short"), "not a readable"),
        (lambda f, p: f.drop(columns="target").to_parquet(p), "target"),  # named before too
        # a null target was a tokenizer TypeError naming no file; integer ids made every partition id "missing"
        (lambda f, p: f.assign(target=[None, "b"]).to_parquet(p), "column target is null in row 0"),
        (lambda f, p: f.assign(example_id=[1, 2]).to_parquet(p), "column example_id is int64"),
    ],
)
def test_a_damaged_examples_file_is_one_line_naming_it_when_training_reads_it(tmp_path, damage, problem):
    from pipeline.common.schema import DataError
    from pipeline.training.client_data import read_examples

    frame = pd.DataFrame({"example_id": ["e1", "e2"], "source": ["s", "t"], "target": ["a", "b"], "domain": "X"})
    frame.to_parquet(tmp_path / "valid.parquet", index=False)
    read = read_examples(tmp_path / "valid.parquet")  # every column, indexed by example id
    assert read.equals(frame.set_index("example_id", drop=False))
    damage(frame, path := tmp_path / "examples.parquet")
    with pytest.raises(DataError) as err:
        read_examples(path)
    names(err.value, str(path.resolve()), problem)
