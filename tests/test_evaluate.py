"""The evaluate stage end to end on a tiny BART saved with save_tiny and a synthetic experiment directory."""

from __future__ import annotations

import contextlib
import json

import pandas as pd
import pytest

from pipeline.common.schema import DataError
from pipeline.paths import PATHS, ProjectPaths
from pipeline.results import evaluation
from pipeline.results.evaluation import EvaluateConfig
from pipeline.results.experiment_evaluation import evaluate_experiments
from pipeline.results.scoring import ROUGE_TYPES, Scorer
from tests.tiny_models import save_tiny

CLIENTS = ("Academic", "Committee")
MODEL = {"top_k": 2, "bottleneck": 16, "max_source_length": 64, "max_target_length": 16}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core box: intra-op threads only add synchronisation cost (x50 per op)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """backbone + examples + partition + a trained-looking experiment (adapters saved from the model itself)."""
    from safetensors.torch import save_file

    from pipeline.common.config import from_dict
    from pipeline.modeling.model import AdapterSummarizer, adapter_config
    from pipeline.planning import ModelGroup

    root = tmp_path_factory.mktemp("evalws")
    backbone = save_tiny("bart", root / "models" / "backbone")
    rows = []
    for client in CLIENTS:
        for i in range(5):
            rows.append(
                {
                    "example_id": f"qmsum/{client}/test/m{i}/q0",
                    "domain": client,
                    "source": f"What did they decide? #SEP# Project Manager: the team met about the budget {i}.",
                    "target": f"The team agreed on the budget {i}. They will meet again.",
                }
            )
    paths = ProjectPaths(root)  # the project's layout: evaluate reads its examples and partitions at PATHS
    paths.examples.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(paths.examples)
    partition = {
        "scheme": "domain",
        "seed": 0,
        "params": {},
        "excluded": {"count": 0, "by_reason": {}, "example_ids": []},
        "clients": {
            c: {
                "train": [f"qmsum/{c}/train/m0/q0"],
                "valid": [],
                "test": [r["example_id"] for r in rows if r["domain"] == c],
            }
            for c in CLIENTS
        },
    }
    paths.partition("domain/seed0").parent.mkdir(parents=True)
    paths.partition("domain/seed0").write_text(json.dumps(partition))

    model = AdapterSummarizer.from_pretrained(backbone, adapter_config(from_dict(ModelGroup, MODEL)))
    exp_dir = root / "models" / "exp1"
    for client in CLIENTS:
        d = exp_dir / "clients" / client
        d.mkdir(parents=True)
        state = {k: v.contiguous() for k, v in model.adapter_state("local").items()}
        save_file(state, str(d / "adapter_best.safetensors"))
        save_file(state, str(d / "adapter_final.safetensors"))
    (exp_dir / "experiment.json").write_text(
        json.dumps(
            {
                "experiment": "exp1",
                "study": "main",
                "method": "fedselectkd",
                "partition": "domain/seed0",
                "seed": 0,
                "model": MODEL,
                "tau": 5.0,  # a plan of selective KD has its tau, and every plan its train group (read_plan checks)
                "train": {},
            }
        )
    )
    return root


def run(workspace, cfg: EvaluateConfig, name: str = "exp1"):
    with contextlib.chdir(workspace):  # PATHS, relative to the working directory
        return evaluate_experiments(
            [name], cfg, models_dir=workspace / "models", eval_dir=workspace / "eval", mlflow_logging=False
        )[name]


def test_evaluate_stage_end_to_end(workspace):
    cfg = EvaluateConfig(
        batch_size=2,
        num_beams=2,
        max_target_length=8,
        min_target_length=2,
        test_examples_per_client=3,
        subsample_seed=0,
    )
    metrics = run(workspace, cfg)
    out = workspace / "eval" / "exp1"
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert on_disk["rouge_l_in_tables"] == "rougeL"
    assert set(on_disk["clients"]) == set(CLIENTS)
    for client in CLIENTS:
        c = on_disk["clients"][client]
        assert c["n"] == 3 and c["n_test"] == 5 and c["skipped_by_subsampling"] == 2

    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 6
    per_example = pd.read_parquet(out / "per_example.parquet")
    assert len(per_example) == 6 and set(ROUGE_TYPES) <= set(per_example.columns)

    # The per-example scores are the scorer's on the written predictions, and the metrics their means.
    scorer = Scorer()
    for rec, (_, row) in zip(preds, per_example.iterrows()):
        assert rec["example_id"] == row["example_id"]
        assert scorer.score(rec["prediction"], rec["reference"])["rouge1"] == pytest.approx(row["rouge1"])
    for client in CLIENTS:
        sub = per_example[per_example["client"] == client]
        assert on_disk["clients"][client]["rouge1"] == pytest.approx(sub["rouge1"].mean())
    assert on_disk["mean"]["rouge2"] == pytest.approx(
        sum(on_disk["clients"][c]["rouge2"] for c in CLIENTS) / len(CLIENTS)
    )

    # Identical configuration -> identical predictions (beam search, seeded subsample).
    again = run(workspace, cfg)
    assert again == metrics


def test_subsample_is_seeded_per_client_and_keeps_order():
    ids = [f"e{i}" for i in range(10)]

    def draw(client: str, k: int | None, seed: int = 0) -> list[str]:
        cfg = EvaluateConfig(test_examples_per_client=k, subsample_seed=seed)
        return list(evaluation.test_subsample(pd.DataFrame(index=ids), ids, client, cfg, "here").index)

    a = draw("Academic", 4)
    assert a == draw("Academic", 4)
    # the draw fixes which examples a recorded score was computed on: random.Random("evaluate:<seed>:<client>")
    # sampling 4 of the sorted ids, listed in partition order, for seed 0 and Academic / Product
    assert a == ["e3", "e7", "e8", "e9"] and draw("Product", 4) == ["e2", "e3", "e7", "e9"]
    assert len(a) == 4 and a == [i for i in ids if i in a]
    assert draw("Academic", None) == ids
    assert draw("Academic", 50) == ids
    assert any(draw("Academic", 4, s) != a for s in range(1, 5))


def test_missing_adapter_is_a_clear_error(workspace):
    cfg = EvaluateConfig(
        adapter="final", test_examples_per_client=1, num_beams=1, max_target_length=4, min_target_length=0
    )
    (workspace / "models" / "exp1" / "clients" / "Committee" / "adapter_final.safetensors").rename(
        workspace / "models" / "exp1" / "clients" / "Committee" / "moved.safetensors"
    )
    try:
        with pytest.raises(DataError, match="Committee.*adapter_final.safetensors"):
            run(workspace, cfg)
    finally:
        (workspace / "models" / "exp1" / "clients" / "Committee" / "moved.safetensors").rename(
            workspace / "models" / "exp1" / "clients" / "Committee" / "adapter_final.safetensors"
        )


def test_bad_config_rejected():
    with pytest.raises(
        ValueError, match="EvaluateConfig.adapter='middle' is out of range; allowed: one of 'best' or 'final'"
    ):
        EvaluateConfig(adapter="middle")
    with pytest.raises(ValueError, match="min_target_length"):
        EvaluateConfig(min_target_length=50, max_target_length=10)


def test_a_test_id_missing_from_the_examples_is_one_error_naming_both_files_and_the_client(workspace):
    cfg = EvaluateConfig(test_examples_per_client=1, num_beams=1, max_target_length=4, min_target_length=0)
    path = ProjectPaths(workspace).partition("domain/seed0")
    original = path.read_text()
    partition = json.loads(original)
    partition["clients"]["Committee"]["test"].append("qmsum/Committee/test/gone/q0")
    path.write_text(json.dumps(partition))
    try:
        with pytest.raises(DataError) as err:
            run(workspace, cfg)
    finally:
        path.write_text(original)
    message = str(err.value)
    assert "\n" not in message and str(PATHS.partition("domain/seed0")) in message and str(PATHS.examples) in message
    assert "'Committee'" in message and "qmsum/Committee/test/gone/q0" in message


def test_a_damaged_examples_table_is_one_error_naming_it(workspace):
    cfg = EvaluateConfig(test_examples_per_client=1, num_beams=1, max_target_length=4, min_target_length=0)
    path = ProjectPaths(workspace).examples
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])  # a copy cut short
    try:
        with pytest.raises(DataError) as err:
            run(workspace, cfg)
    finally:
        path.write_bytes(original)
    assert str(err.value).startswith(f"{PATHS.examples}: not a readable examples table (") and "\n" not in str(
        err.value
    )


@pytest.mark.parametrize("rows_a_call", [2, 1024], ids=["one-adapter-a-call", "all-adapters-a-call"])
def test_experiments_evaluated_together_give_each_what_it_gives_alone(workspace, tmp_path, monkeypatch, rows_a_call):
    """Two experiments (other adapters) in one call: one backbone load, their four client adapters stacked in the
    generate calls (or one a call), and each experiment's predictions and scores are those it gets alone."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.results import evaluation
    from pipeline.results.experiment_evaluation import evaluate_experiments

    models = tmp_path / "models"
    shutil.copytree(workspace / "models", models)
    shutil.copytree(models / "exp1", models / "exp2")
    record = json.loads((models / "exp2" / "experiment.json").read_text()) | {"experiment": "exp2", "seed": 1}
    (models / "exp2" / "experiment.json").write_text(json.dumps(record))
    generator = torch.Generator().manual_seed(0)
    for f in (models / "exp2" / "clients").glob("*/adapter_*.safetensors"):
        state = load_file(str(f))
        save_file({k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in state.items()}, str(f))
    cfg = EvaluateConfig(batch_size=2, num_beams=2, max_target_length=8, min_target_length=2)
    monkeypatch.chdir(workspace)  # its examples, partitions and backbone at PATHS
    paths = {"models_dir": models, "mlflow_logging": False}
    alone = {n: evaluate_experiments([n], cfg, eval_dir=tmp_path / "alone", **paths)[n] for n in ("exp1", "exp2")}
    monkeypatch.setattr(evaluation, "GENERATE_ROWS", rows_a_call)
    together = evaluate_experiments(["exp1", "exp2"], cfg, eval_dir=tmp_path / "together", **paths)
    assert list(together) == ["exp1", "exp2"]
    for name in ("exp1", "exp2"):
        assert together[name]["clients"] == alone[name]["clients"]
        same = (tmp_path / "together" / name / "predictions.jsonl").read_text()
        assert same == (tmp_path / "alone" / name / "predictions.jsonl").read_text()
    exp1 = (tmp_path / "alone" / "exp1" / "predictions.jsonl").read_text()
    assert exp1 != (tmp_path / "alone" / "exp2" / "predictions.jsonl").read_text().replace("exp2", "exp1")


@pytest.mark.parametrize("group, key, value", [("bootstrap", "level", "high"), ("evaluate", "num_beams", 0)])
def test_a_bad_evaluate_or_bootstrap_value_names_the_params_file_it_came_from(tmp_path, group, key, value):
    # `python -m pipeline.evaluate run --params <file>`: a bad value names <file>, not a bare '<group>.<key>' that
    # reads as the repository's params.yaml
    import yaml

    from pipeline.common.config import ConfigError
    from pipeline.evaluate import main as evaluate_main
    from tests.errors import names

    params = tmp_path / "study-params.yaml"
    params.write_text(yaml.safe_dump({"experiments": {}, group: {key: value}}))
    with pytest.raises(ConfigError) as err:
        evaluate_main(["run", "--experiment", "x", "--params", str(params)])
    names(err.value, str(params), f"{group}.{key}", str(value))
