"""Evaluating trained experiments: each client's chosen local adapter summarises the client's own test set (one
backbone load per adapter shape, every client adapter of the experiments stacked in the same generate calls), ROUGE
per example and per client, bootstrap intervals, ``reports/eval/<exp>/`` and the scores in the experiment's MLflow
run. The evaluate stage (pipeline/evaluate.py) and the GPU study call it."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from pipeline.common import atomic
from pipeline.common.integrity import backbone_name
from pipeline.common.schema import DataError, read_parquet
from pipeline.experiments.plans import Plan, read_plan
from pipeline.modeling.adapters import adapter_file, load_adapter
from pipeline.modeling.model import AdapterSummarizer, adapter_config
from pipeline.paths import PATHS
from pipeline.results.evaluation import EvaluateConfig, generate_per_run, log_to_mlflow, metrics_record, test_subsample
from pipeline.results.readers import run_converged
from pipeline.results.scoring import ROUGE_TYPES, SCORE_KEYS, TABLE_METRICS, client_scores
from pipeline.results.stats import BootstrapConfig, bootstrap_method, mean_interval, meetings
from pipeline.results.tracking import split_dataset
from pipeline.training.client_data import read_partition


@dataclass
class _Experiment:
    """An experiment ready to generate: its plan, its clients' test subsamples and adapters."""

    name: str
    plan: Plan
    part_path: Path
    chosen: dict[str, tuple[list[str], pd.DataFrame]]  # client -> its test ids and subsample
    adapters: list[dict]
    skipped_clients: dict[str, str]


def _prepare(name: str, examples: pd.DataFrame, cfg: EvaluateConfig, models_dir: Path, only: str | None) -> _Experiment:
    """The experiment ``name``'s plan, its clients' (or client ``only``'s) test subsamples and adapters."""
    exp_path = models_dir / name / "experiment.json"
    if not exp_path.is_file():
        raise DataError(f"{exp_path}: experiment record (written by the train stage) not found")
    plan = read_plan(exp_path)  # the plan the adapters were trained with
    part_path = PATHS.partition(plan.partition)
    clients = read_partition(part_path)["clients"]  # the partition's reader, as training and a deployed client's
    skipped_clients: dict[str, str] = {}
    chosen: dict[str, tuple[list[str], pd.DataFrame]] = {}
    for client in [only] if only else clients:  # every client of the partition, each with its own adapter, in order
        test_ids = list(clients.get(client, {}).get("test", []))
        if not test_ids:
            skipped_clients[client] = f"no test examples in {part_path}"
            continue
        chosen[client] = test_ids, test_subsample(examples, test_ids, client, cfg, f"{part_path}, {PATHS.examples}")
    if not chosen:
        raise DataError(f"{part_path}: no client has test examples; nothing to evaluate for {name}")
    adapters = [load_adapter(adapter_file(models_dir / name / "clients" / client, cfg.adapter)) for client in chosen]
    return _Experiment(name, plan, part_path, chosen, adapters, skipped_clients)


def evaluate_experiments(
    names: list[str],
    cfg: EvaluateConfig,
    *,
    models_dir: Path = PATHS.models,
    eval_dir: Path = PATHS.eval_reports,
    mlflow_logging: bool = True,
    bootstrap: BootstrapConfig | None = None,
    only: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Generate and score every client's (or client ``only``'s) test subsample of each of ``names`` (the project's
    examples, partitions and backbone: PATHS), with one backbone load per adapter shape and every client adapter of
    those experiments in the same generate calls (pipeline.results.evaluation.generate_per_run: each summary is what
    its adapter alone gives); metrics.json's content by experiment."""
    bootstrap = bootstrap or BootstrapConfig()
    columns = [pa.field(name, pa.string()) for name in ("example_id", "source", "target", "domain")]
    examples = read_parquet(PATHS.examples, "examples table", columns)
    examples = examples.set_index("example_id", drop=False)

    def score_and_write(exp: _Experiment, summaries: list[list[str]], backbone: str) -> dict[str, Any]:
        """The experiment's scores, per example and per client, its bootstrap intervals and its outputs."""
        name, plan, out_dir = exp.name, exp.plan, eval_dir / exp.name
        frames: list[pd.DataFrame] = []  # per test example: its row of the subsample, client, prediction and scores
        per_client: dict[str, dict[str, Any]] = {}
        test_sets = {}
        for (client, (test_ids, sub)), predictions in zip(exp.chosen.items(), summaries):
            scores, per_client[client] = client_scores(predictions, sub, len(test_ids))
            if mlflow_logging:  # an MLflow dataset: without MLflow logging, MLflow need not be installed
                test_sets[client] = split_dataset(plan.partition, client, "test", sub.index.tolist(), exp.part_path)
            rows = sub.reset_index(drop=True).assign(experiment=name, client=client, prediction=predictions)
            frames.append(rows.join(pd.DataFrame(scores)))  # in order: the ids are sub's column example_id
            means = " ".join(f"{k}={per_client[client][k]:.2f}" for k in SCORE_KEYS)
            print(f"[evaluate] {name} {client}: n={len(sub)}/{len(test_ids)} {means}", file=sys.stderr)

        done = pd.concat(frames, ignore_index=True).rename(columns={"target": "reference"})
        per_example = done.assign(
            pred_words=done["prediction"].str.split().str.len(),
            ref_words=done["reference"].str.split().str.len(),
            avg_rouge=done[list(TABLE_METRICS)].mean(axis=1),
        )[["experiment", "client", "example_id", "domain", *ROUGE_TYPES, "pred_words", "ref_words", "avg_rouge"]]
        atomic.to_parquet(per_example, out_dir / "per_example.parquet", index=False)
        records = done[["experiment", "client", "example_id", "domain", "prediction", "reference"]].to_dict("records")
        atomic.write_text(
            out_dir / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        )

        # each ROUGE's client average's bootstrap interval (test examples, or QMSum's meetings, resampled in clients)
        groups = [g for _, g in per_example.groupby("client", sort=True)]
        clusters = meetings(g["example_id"] for g in groups)
        mean_ci = {
            k: mean_interval([g[k].to_numpy()[None, :] for g in groups], bootstrap, clusters) for k in SCORE_KEYS
        }
        metrics = metrics_record(plan, backbone, cfg, per_client, exp.skipped_clients) | {
            # none where a client has one meeting or example (NaN: its spread is unknown)
            "mean_ci": {key: {"low": r.low, "high": r.high} for key, r in mean_ci.items() if not math.isnan(r.low)},
            "ci": {
                "level": bootstrap.level,
                "n_resamples": bootstrap.n_resamples,
                "seed": bootstrap.seed,
                "method": bootstrap_method(clusters),
            },
        }
        atomic.write_json(out_dir / "metrics.json", metrics)
        if mlflow_logging:
            converged = run_converged(models_dir, name)
            run_id = log_to_mlflow(plan.to_json_dict(), metrics, out_dir, cfg, converged, test_sets)
            print(f"[evaluate] logged to MLflow run {run_id}", file=sys.stderr)
        return metrics

    pending = [_prepare(n, examples, cfg, models_dir, only) for n in names]
    if not PATHS.backbone.is_dir():
        raise DataError(f"{PATHS.backbone}: backbone directory not found (run the backbone stage)")
    shapes: dict[tuple, list[_Experiment]] = {}
    for exp in pending:
        max_src = cfg.max_source_length or exp.plan.model_config.max_source_length
        shapes.setdefault((dataclasses.astuple(adapter_config(exp.plan.model_config)), max_src), []).append(exp)
    out: dict[str, dict[str, Any]] = {}
    for (_, max_src), same in shapes.items():
        # the frozen backbone with these experiments' adapter shape (each client's adapter is stacked in)
        model = AdapterSummarizer.from_pretrained(str(PATHS.backbone), adapter_config(same[0].plan.model_config))
        backbone = backbone_name(PATHS.backbone, str(model.backbone.config.model_type))
        sources = [sub["source"].tolist() for exp in same for _, sub in exp.chosen.values()]
        desc = same[0].name if len(same) == 1 else f"{len(same)} experiments"
        adapters = [a for exp in same for a in exp.adapters]
        summaries = iter(generate_per_run(model, adapters, sources, cfg, max_src, desc))
        for exp in same:
            out[exp.name] = score_and_write(exp, [next(summaries) for _ in exp.chosen], backbone)
    return {n: out[n] for n in names}
