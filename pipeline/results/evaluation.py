"""An evaluation as the evaluate stage and the deployed clients' federated evaluation make it: the decoding
settings (the `evaluate` params) and the evaluation's MLflow record (the client averages as headline metrics, the
training run it belongs to, records computed elsewhere imported)."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import model_validator

from pipeline.common.config import NonNegativeInt, PositiveInt, config, from_dict
from pipeline.common.schema import DataError
from pipeline.results.readers import read_json
from pipeline.results.scoring import ROUGE_TYPES, TABLE_ROUGE_L


@config
class EvaluateConfig:
    adapter: Literal["best", "final"] = "best"
    batch_size: PositiveInt = 8
    num_beams: PositiveInt = 1
    max_target_length: PositiveInt = 96
    min_target_length: NonNegativeInt = 10
    no_repeat_ngram_size: int = 3
    length_penalty: float = 1.0
    max_source_length: int | None = None
    test_examples_per_client: PositiveInt | None = 8  # null = all
    subsample_seed: int = 0
    log_text_to_mlflow: bool = False

    @model_validator(mode="after")
    def _min_below_max(self) -> EvaluateConfig:
        if self.min_target_length > self.max_target_length:
            raise ValueError(f"min_target_length={self.min_target_length} must be <= max_target_length="
                             f"{self.max_target_length}")
        return self

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


def run_tags(name: str, experiment: dict[str, Any], backbone: str | None) -> dict[str, str]:
    """Tags the MLflow compare view lines runs up by (the train stage sets the same ones)."""
    tags = {"experiment": name}
    for key in ("method", "partition", "seed", "study", "tau"):
        if experiment.get(key) is not None:
            tags[key] = str(experiment[key])
    if backbone:
        tags["backbone"] = backbone
    from pipeline.experiments import record_hash
    from pipeline.results.run_identity import dvc_tags, git_state

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
                  cfg: EvaluateConfig, converged: bool | None = None, test_sets: dict[str, Any] | None = None) -> str:
    """Log evaluation scores into the experiment's MLflow run (the one training created; a new run in the study's
    MLflow experiment when the record has none): the headline :func:`headline_metrics` into it, each client's
    ROUGE (``rouge1`` ... ``avg_rouge``) into the client's run, linked to the client's adapter model and to its
    ``test_sets`` dataset (pipeline.results.tracking.split_dataset) when given. Generated text is logged only with
    ``log_text_to_mlflow``. Returns the run id. ``converged`` (pipeline.results.convergence.run_converged of the
    training records) becomes the tag ``converged``: "false" when some client's best validation round was its last,
    so the scores hold for that round budget only (filter with ``tags.converged = 'false'``)."""
    from pipeline.experiments import record_hash
    from pipeline.results.studies import study_description
    from pipeline.results.tracking import RunLogger, experiment_id

    study = str(experiment.get("study") or "main")
    experiment_id(study, study_description(study))  # the study's description, which training does not set
    run_id = experiment.get("mlflow_run_id") or find_training_run(name, study, record_hash(experiment))
    logger = RunLogger(run_id) if run_id else RunLogger.start(study, name, {}, run_tags(name, experiment, metrics.get(
        "backbone")), clients=tuple(metrics["clients"]))
    logger.log_metrics(headline_metrics(metrics), step=0)
    models = logger.adapter_models() if cfg.adapter == "best" else {}  # the logged models are the best adapters
    for client, scores in metrics["clients"].items():
        logger.log_metrics({f"{client}.{k}": scores[k] for k in (*ROUGE_TYPES, "avg_rouge")}, 0, models.get(client),
                           (test_sets or {}).get(client))
    # Evaluation settings as tags, not params: MLflow forbids changing a param, and re-evaluating a trained run
    # with other decoding settings (`dvc exp run -S evaluate.num_beams=2`) logs into the same run.
    logger.set_tags({f"evaluate.{k}": v for k, v in asdict(cfg).items()}
                    | {"rouge_l_in_tables": TABLE_ROUGE_L}
                    | ({"backbone": metrics["backbone"]} if metrics.get("backbone") else {})
                    | ({} if converged is None else {"converged": str(bool(converged)).lower()}))
    logger.log_artifact(eval_dir / "metrics.json", artifact_path="eval")
    if cfg.log_text_to_mlflow:
        logger.log_artifact(eval_dir / "predictions.jsonl", artifact_path="eval")
    if not run_id:
        logger.finish()
    return logger.run_id


def import_evaluations(paths: list[Path], study: str | None = None,
                       converged_of: Callable[[Path, str], bool | None] | None = None) -> list[str]:
    """Log evaluation records (``reports/.../eval/<exp>/metrics.json``) into the store, each into its training run
    when the store has it, else into a new run of the study's experiment (e.g. results computed with
    ``--no-mlflow`` on another machine). Generated text is never logged. ``converged_of(record path, experiment)``:
    the run's ``converged`` tag (see :func:`log_to_mlflow`). Returns the run ids."""
    fields = {f.name for f in dataclasses.fields(EvaluateConfig)} - {"log_text_to_mlflow"}
    run_ids = []
    for path in paths:
        metrics = read_json(Path(path), "evaluation record (reports/eval/<exp>/metrics.json)")
        missing = [k for k in ("experiment", "clients", "mean") if k not in metrics]
        if missing:
            raise DataError(f"{path}: not an evaluation record (missing {missing})")
        record = {k: metrics.get(k) for k in ("method", "partition", "seed")}
        record["study"] = study or metrics.get("study") or "main"
        settings = {k: v for k, v in (metrics.get("decoding") or {}).items() if k in fields}
        cfg = from_dict(EvaluateConfig, settings | {"adapter": metrics.get("adapter", "best")}, f"{path}: decoding")
        converged = converged_of(Path(path), str(metrics["experiment"])) if converged_of else None
        run_ids.append(log_to_mlflow(str(metrics["experiment"]), record, metrics, Path(path).parent, cfg, converged))
    return run_ids
