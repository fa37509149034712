"""Stage `evaluate`: each client's chosen local adapter summarises the client's own test set; ROUGE per example.

    python -m pipeline.evaluate run --experiment NAME      # the DVC stage (foreach over `experiments`)
    python -m pipeline.evaluate score --pred PRED.txt --ref REF.txt   # score any line-aligned files

Per experiment it writes ``reports/eval/<exp>/predictions.jsonl`` (one generated summary per test example),
``per_example.parquet`` (ROUGE F1 x 100 per example) and ``metrics.json`` (per client and mean over clients,
a DVC metric), and logs the scores into the experiment's MLflow run (the one training created). Generated text
stays on disk unless ``evaluate.log_text_to_mlflow`` is true (privacy: summaries are client data).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.config import from_dict, load_params
from pipeline.common.schema import DataError
from pipeline.datasets.subsampling import subsample_test_ids
from pipeline.modeling.adapter_io import client_adapter_path, load_local_adapter
from pipeline.modeling.backbone_record import backbone_name
from pipeline.modeling.generation import generate_summaries
from pipeline.results.scoring import ROUGE_TYPES, TABLE_ROUGE_L, Scorer, dumps_scores, mean_scores, score_files
from pipeline.results.stats import BootstrapConfig, mean_interval

EVAL_DIR = Path("reports/eval")
MODELS_DIR = Path("models")
EXAMPLES_PATH = Path("data/processed/examples.parquet")
PARTITIONS_DIR = Path("data/partitions")
BACKBONE_DIR = Path("models/backbone")


@dataclass
class EvaluateConfig:
    adapter: str = "best"
    batch_size: int = 4
    num_beams: int = 4
    max_target_length: int = 128
    min_target_length: int = 10
    no_repeat_ngram_size: int = 3
    length_penalty: float = 1.0
    max_source_length: int | None = None
    test_examples_per_client: int | None = None
    subsample_seed: int = 0
    log_text_to_mlflow: bool = False

    def __post_init__(self) -> None:
        if self.adapter not in ("best", "final"):
            raise ValueError(f"evaluate.adapter: expected 'best' or 'final', got {self.adapter!r}")
        for name in ("batch_size", "num_beams", "max_target_length"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"evaluate.{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.min_target_length < 0 or self.min_target_length > self.max_target_length:
            raise ValueError(
                f"evaluate.min_target_length: must be in [0, max_target_length={self.max_target_length}], "
                f"got {self.min_target_length!r}"
            )
        if self.test_examples_per_client is not None and self.test_examples_per_client < 1:
            raise ValueError(
                f"evaluate.test_examples_per_client: must be >= 1 or null (all), got {self.test_examples_per_client!r}"
            )

    def generation_kwargs(self) -> dict[str, Any]:
        return {
            "num_beams": self.num_beams,
            "max_new_tokens": self.max_target_length,
            "min_new_tokens": self.min_target_length,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "length_penalty": self.length_penalty,
            "early_stopping": True,
            "do_sample": False,
        }


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object ({what})")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Model


def model_config_of(experiment: dict[str, Any], where: Path):
    """The experiment's `model` group (adapter shape, max lengths) as pipeline.modeling.model.ModelConfig."""
    from pipeline.modeling.model import ModelConfig

    return from_dict(ModelConfig, experiment.get("model") or {}, f"{where}: model")


def load_model(model_cfg, backbone_dir: Path):
    """The frozen backbone with the experiment's adapter shape (adapters are filled per client later)."""
    from pipeline.modeling.model import AdapterSummarizer

    if not backbone_dir.is_dir():
        raise DataError(f"{backbone_dir}: backbone directory not found (run the backbone stage)")
    return AdapterSummarizer.from_pretrained(str(backbone_dir), model_cfg.adapter_config())


# ---------------------------------------------------------------------------------------------------------------
# MLflow


def run_tags(name: str, experiment: dict[str, Any], backbone: str | None) -> dict[str, str]:
    """Tags the MLflow compare view lines runs up by (the train stage sets the same ones)."""
    tags = {"experiment": name}
    for key in ("method", "partition", "seed", "study", "tau"):
        if experiment.get(key) is not None:
            tags[key] = str(experiment[key])
    if backbone:
        tags["backbone"] = backbone
    from pipeline.plan import record_hash
    from pipeline.results.tracking import dvc_tags, git_state

    return tags | {"plan_hash": record_hash(experiment)} | git_state() | dvc_tags()


def find_training_run(name: str, study: str, plan_hash: str | None = None) -> str | None:
    """The latest run the train stage made for experiment ``name`` (tag ``experiment``) in the study's MLflow
    experiment - with ``plan_hash``, the one that trained exactly this plan (two ablation points of one experiment
    share its name), else the latest without a plan hash (trained before runs carried one) - or None."""
    from mlflow.tracking import MlflowClient

    from pipeline.results.tracking import experiment_id, tracking_uri

    client = MlflowClient(tracking_uri=tracking_uri())
    runs = client.search_runs([experiment_id(study)], filter_string=f"tags.experiment = '{name}'",
                              order_by=["attributes.start_time DESC"], max_results=200)
    if plan_hash is None:
        return runs[0].info.run_id if runs else None
    for wanted in (plan_hash, None):
        for run in runs:
            if run.data.tags.get("plan_hash") == wanted:
                return run.info.run_id
    return None


# The tables' headline numbers under one "<prefix>/" name: MLflow's chart view groups such metrics into a section
# listed before the others, so the compare view opens on the client averages ranked across runs.
HEADLINE_PREFIX = "client_avg"
HEADLINE_KEYS = {"ROUGE-1": "rouge1", "ROUGE-2": "rouge2", "ROUGE-L": TABLE_ROUGE_L, "avg_ROUGE": "avg_rouge"}


def headline_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """``client_avg/<ROUGE-1|ROUGE-2|ROUGE-L|avg_ROUGE>`` (ROUGE-L as the tables use it) with ``_ci_low`` and
    ``_ci_high``: the bootstrap interval of the client average the evaluation computed (``mean_ci``)."""
    out = {}
    for label, key in HEADLINE_KEYS.items():
        out[f"{HEADLINE_PREFIX}/{label}"] = float(metrics["mean"][key])
        interval = (metrics.get("mean_ci") or {}).get(key)
        if interval:
            out[f"{HEADLINE_PREFIX}/{label}_ci_low"] = float(interval["low"])
            out[f"{HEADLINE_PREFIX}/{label}_ci_high"] = float(interval["high"])
    return out


def log_to_mlflow(name: str, experiment: dict[str, Any], metrics: dict[str, Any], eval_dir: Path,
                  cfg: EvaluateConfig) -> str:
    """Log evaluation scores into the experiment's MLflow run (the one training created; a new run in the
    study's MLflow experiment when the record has none). Metric names: ``eval.<client>.<rouge>``,
    ``eval.mean.<rouge>`` and the headline :func:`headline_metrics`. Generated text is logged only with ``log_text_to_mlflow``. Returns the run id."""
    from pipeline.results.tracking import RunLogger

    from pipeline.plan import record_hash

    run_id = experiment.get("mlflow_run_id") or find_training_run(name, str(experiment.get("study") or "main"),
                                                                  record_hash(experiment))
    if run_id:
        logger = RunLogger(run_id)
    else:
        logger = RunLogger.start(str(experiment.get("study") or "main"), name, {},
                                 run_tags(name, experiment, metrics.get("backbone")))
    values: dict[str, float] = {}
    for client, scores in metrics["clients"].items():
        for key in (*ROUGE_TYPES, "avg_rouge"):
            values[f"eval.{client}.{key}"] = float(scores[key])
    for key in (*ROUGE_TYPES, "avg_rouge"):
        values[f"eval.mean.{key}"] = float(metrics["mean"][key])
    values |= headline_metrics(metrics)
    logger.log_metrics(values, step=0)
    # Evaluation settings as tags, not params: MLflow forbids changing a param, and re-evaluating a trained run
    # with other decoding settings (`dvc exp run -S evaluate.num_beams=2`) logs into the same run.
    logger.set_tags({f"evaluate.{k}": v for k, v in asdict(cfg).items()}
                    | {"rouge_l_in_tables": TABLE_ROUGE_L}
                    | ({"backbone": metrics["backbone"]} if metrics.get("backbone") else {}))
    logger.log_artifact(eval_dir / "metrics.json", artifact_path="eval")
    if cfg.log_text_to_mlflow:
        logger.log_artifact(eval_dir / "predictions.jsonl", artifact_path="eval")
    if not run_id:
        logger.finish()
    return logger.run_id


# ---------------------------------------------------------------------------------------------------------------
# The stage


def evaluate_experiment(name: str, cfg: EvaluateConfig, *, models_dir: Path = MODELS_DIR,
                        eval_dir: Path = EVAL_DIR, examples_path: Path = EXAMPLES_PATH,
                        partitions_dir: Path = PARTITIONS_DIR, backbone_dir: Path = BACKBONE_DIR,
                        mlflow_logging: bool = True, bootstrap: BootstrapConfig | None = None) -> dict[str, Any]:
    """Generate and score every client's test subsample for experiment ``name``; returns metrics.json's content."""
    model_dir = models_dir / name
    exp_path = model_dir / "experiment.json"
    experiment = read_json(exp_path, "experiment record (written by the train stage)")
    for key in ("method", "partition"):
        if key not in experiment:
            raise DataError(f"{exp_path}: missing key {key!r}")
    part_path = partitions_dir / f"{experiment['partition']}.json"
    partition = read_json(part_path, "partition")
    clients = partition.get("clients")
    if not isinstance(clients, dict) or not clients:
        raise DataError(f"{part_path}: no 'clients' mapping")
    if not examples_path.is_file():
        raise DataError(f"{examples_path}: examples file not found (run the examples stage)")
    examples = pd.read_parquet(examples_path, columns=["example_id", "source", "target", "domain"])
    examples = examples.set_index("example_id", drop=False)

    model_cfg = model_config_of(experiment, exp_path)
    model = load_model(model_cfg, backbone_dir)
    max_src = cfg.max_source_length or model_cfg.max_source_length
    backbone = backbone_name(backbone_dir, str(model.backbone.config.model_type))
    scorer = Scorer(use_stemmer=True)

    out_dir = eval_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    per_client: dict[str, dict[str, Any]] = {}
    skipped_clients: dict[str, str] = {}
    for client in clients:  # every client of the partition, each with its own adapter, in partition order
        test_ids = list(clients[client].get("test", []))
        if not test_ids:
            skipped_clients[client] = f"no test examples in {part_path}"
            continue
        missing = [i for i in test_ids if i not in examples.index]
        if missing:
            raise DataError(f"{part_path}: client {client!r} test ids not in {examples_path}: {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
        chosen = subsample_test_ids(test_ids, client, cfg.test_examples_per_client, cfg.subsample_seed)
        load_local_adapter(model, client_adapter_path(model_dir, client, cfg.adapter))
        sub = examples.loc[chosen]
        predictions = generate_summaries(model, sub["source"].tolist(), cfg, max_src, desc=f"{name}/{client}")
        scores = scorer.score_pairs(predictions, sub["target"].tolist())
        for (ex_id, row), pred, sc in zip(sub.iterrows(), predictions, scores):
            rows.append({"experiment": name, "client": client, "example_id": ex_id, "domain": row["domain"],
                         **sc, "pred_words": len(pred.split()), "ref_words": len(row["target"].split())})
            records.append({"experiment": name, "client": client, "example_id": ex_id, "domain": row["domain"],
                            "prediction": pred, "reference": row["target"]})
        summary = mean_scores(scores)
        summary["n_test"] = len(test_ids)
        summary["skipped_by_subsampling"] = len(test_ids) - len(chosen)
        per_client[client] = summary
        print(f"[evaluate] {name} {client}: n={summary['n']}/{len(test_ids)} "
              + " ".join(f"{k}={summary[k]:.2f}" for k in (*ROUGE_TYPES, "avg_rouge")), file=sys.stderr)

    per_example = pd.DataFrame(rows, columns=["experiment", "client", "example_id", "domain", *ROUGE_TYPES,
                                              "pred_words", "ref_words"])
    per_example["avg_rouge"] = per_example[list(("rouge1", "rouge2", TABLE_ROUGE_L))].mean(axis=1)
    atomic.to_parquet(per_example, out_dir / "per_example.parquet", index=False)
    atomic.write_text(out_dir / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))

    if not per_client:
        raise DataError(f"{part_path}: no client has test examples; nothing to evaluate for {name}")
    # Mean over clients (unweighted, as the paper averages its per-client columns).
    mean = {k: sum(c[k] for c in per_client.values()) / len(per_client) for k in (*ROUGE_TYPES, "avg_rouge")}
    mean_ci, ci = client_average_intervals(per_example, bootstrap or BootstrapConfig())
    metrics = {
        "experiment": name,
        "method": experiment["method"],
        "partition": experiment["partition"],
        "seed": experiment.get("seed"),
        "study": experiment.get("study"),
        "backbone": backbone,
        "adapter": cfg.adapter,
        "decoding": {k: v for k, v in asdict(cfg).items() if k not in ("adapter", "log_text_to_mlflow")}
        | {"max_source_length": max_src},
        "rouge_l_in_tables": TABLE_ROUGE_L,
        "clients": per_client,
        "skipped_clients": skipped_clients,
        "mean": mean,
        "mean_ci": mean_ci,
        "ci": ci,
    }
    atomic.write_json(out_dir / "metrics.json", metrics)
    if mlflow_logging:
        metrics_run = log_to_mlflow(name, experiment, metrics, out_dir, cfg)
        print(f"[evaluate] logged to MLflow run {metrics_run}", file=sys.stderr)
    return metrics


def client_average_intervals(per_example: pd.DataFrame, cfg: BootstrapConfig) -> tuple[dict, dict]:
    """The bootstrap interval of each ROUGE's client average (test examples resampled within clients)."""
    groups = [g for _, g in per_example.groupby("client", sort=True)]
    intervals = {}
    for key in (*ROUGE_TYPES, "avg_rouge"):
        r = mean_interval([g[key].to_numpy()[None, :] for g in groups], cfg)
        intervals[key] = {"low": r.low, "high": r.high}
    return intervals, {"level": cfg.level, "n_resamples": cfg.n_resamples, "seed": cfg.seed,
                       "method": "percentile bootstrap of the client average, test examples resampled within "
                                 "clients (one seed: the choice of test examples only)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.evaluate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="evaluate one experiment (the DVC stage)")
    run.add_argument("--experiment", required=True, help="key of params.yaml `experiments`")
    run.add_argument("--params", default="params.yaml")
    run.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    score = sub.add_parser("score", help="ROUGE of line-aligned prediction/reference files, printed as JSON")
    score.add_argument("--pred", required=True, help="predictions, one summary per line")
    score.add_argument("--ref", required=True, help="references, one summary per line")
    args = parser.parse_args(argv)

    if args.command == "score":
        try:
            result = score_files(args.pred, args.ref)
        except DataError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(dumps_scores(result))
        return 0

    from pipeline.common.timing import stage_timer

    params = load_params(args.params)
    cfg = from_dict(EvaluateConfig, params.get("evaluate"), "evaluate")
    bootstrap = from_dict(BootstrapConfig, params.get("bootstrap"), "bootstrap")
    with stage_timer(f"evaluate-{args.experiment}"):
        evaluate_experiment(args.experiment, cfg, mlflow_logging=not args.no_mlflow, bootstrap=bootstrap)
    return 0


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    sys.exit(run_cli(main))
