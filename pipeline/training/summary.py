"""What a finished training run reports: ``metrics.json``, the merged gate log and the final MLflow metrics, written
the same way by the train stage and by the deployed ServerApp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.integrity import backbone_name
from pipeline.common.schema import read_parquet
from pipeline.common.timing import peak_rss_mb
from pipeline.experiments.plans import Plan
from pipeline.training.checkpoints import round_files
from pipeline.training.client_training import empty_gate_log
from pipeline.training.history import write_rounds
from pipeline.training.privacy_hooks import PRIVACY as privacy
from pipeline.training.stopping import convergence


def prepare_outputs(plan: Plan) -> None:
    """``experiment.json`` (the plan) in ``models/<exp>/`` (every output is written whole: its folder is made then)."""
    atomic.write_json(Path(plan.paths["out_dir"]) / "experiment.json", plan.to_json_dict(), sort_keys=True)


def run_identity_tags(plan: Plan, engine: str) -> dict[str, str]:
    """The tags that say what an experiment's MLflow run is (the train stage adds where it came from)."""
    return {
        "method": plan.method,
        "partition": plan.partition,
        "seed": str(plan.seed),
        "backbone": backbone_name(plan.paths["backbone"], str(plan.paths["backbone"])),
        "study": plan.study,
        "experiment": plan.experiment,
        "engine": engine,
    }


def merge_gate_logs(plan: Plan) -> None:
    """Concatenate the clients' per-round gate logs (rounds 1..R) into models/<exp>/gate_log.parquet (the parts
    stay until the run's checkpoint is gone: pipeline.train.run_experiment)."""
    out_dir = Path(plan.paths["out_dir"])
    logs = out_dir.glob("clients/*/gate_log")
    files = sorted(f for d in logs for r, f in round_files(d, ".parquet").items() if r <= plan.train.rounds)
    parts = [read_parquet(f, "gate log part") for f in files]
    path = out_dir / "gate_log.parquet"
    atomic.to_parquet(pd.concat(parts, ignore_index=True) if parts else empty_gate_log(), path, index=False)


def summarize(plan: Plan, history: list[dict[str, Any]], round_seconds: list[float]) -> dict[str, Any]:
    clients: dict[str, dict[str, Any]] = {}
    counters = ("rounds_trained", "rounds_failed", "bytes_sent", "bytes_received")
    for row in history:
        c = clients.setdefault(row["client"], {"best_round": 0, "best_val_loss": None} | dict.fromkeys(counters, 0))
        if (val := row.get("val_loss")) is not None:
            c["final_val_loss"] = val
            c["best_round"] = row["best_round"]  # the round the client's adapter_best is of, by its own losses
        c["rounds_trained"] += int(row.get("sampled", 0) and not row.get("failed", 0))
        c["rounds_failed"] += int(row.get("failed", 0))
        c["bytes_sent"] += int(row.get("bytes_down", 0))  # server -> client
        c["bytes_received"] += int(row.get("bytes_up", 0))  # client -> server
        if row.get("n_examples") is not None:
            c["n_train_examples"] = row["n_examples"]  # trained per round (capped in the CPU profile)
        if row.get("weight") is not None:
            c["fedavg_weight"] = row["weight"]  # |D_i| (train.weight_by: full) or the trained count
    received = {(r["client"], r["round"]): r["val_loss"] for r in history if r.get("val_loss") is not None}
    for name, c in clients.items():
        c["best_val_loss"] = received.get((name, c["best_round"]))  # None: that round's reply was lost or late
        upto = [r for r in history if r["client"] == name and r["round"] <= c["best_round"] and r.get("n_tokens")]
        tokens = sum(r["n_tokens"] for r in upto)
        kd_tokens = sum(r["n_tokens"] * r.get("kd_fraction", 0.0) for r in upto)
        c["kd_fraction_to_best"] = kd_tokens / tokens if tokens else None  # no token trained by then: undefined
    vals = [c["best_val_loss"] for c in clients.values() if c["best_val_loss"] is not None]
    record = privacy.run_record(plan, history, clients)  # clients.<c>.privacy, the run's privacy and SecAgg+
    return {
        "experiment": plan.experiment,
        "method": plan.method,
        "study": plan.study,
        "partition": plan.partition,
        "seed": plan.seed,
        "rounds": plan.train.rounds,
        # train.stop: the round it stopped at, its best round by client-average validation loss, converged or not
        **convergence(history, plan.train.stop, plan.train.new_client if plan.spec.new_client == "post" else None),
        "clients": clients,
        "mean_best_val_loss": sum(vals) / len(vals) if 0 < len(vals) == len(clients) else None,  # one unknown: none
        "bytes_sent": sum(c["bytes_sent"] for c in clients.values()),
        "bytes_received": sum(c["bytes_received"] for c in clients.values()),
        "seconds_per_round": sum(round_seconds) / len(round_seconds) if round_seconds else None,
        "peak_rss_mb": peak_rss_mb(),
        **record,  # "privacy" (None without), then "secure_aggregation" only under SecAgg+
    }


def record_run(plan: Plan, history: list[dict[str, Any]], round_seconds: list[float]) -> dict[str, Any]:
    """A finished run's ``rounds.json`` (pipeline.training.history.write_rounds) and its :func:`summarize` metrics as
    ``metrics.json`` in ``reports/train/<exp>/`` (the DVC metric) and in ``models/<exp>/``; returns the metrics."""
    write_rounds(plan, history)
    metrics = summarize(plan, history, round_seconds)
    atomic.write_json(Path(plan.paths["reports_dir"]) / "metrics.json", metrics)
    atomic.write_json(Path(plan.paths["out_dir"]) / "metrics.json", metrics)
    return metrics


def log_run_outputs(
    logger, plan: Plan, metrics: dict[str, Any], artifacts: list[tuple[Path, str | None]], global_adapter: Path | None
) -> None:
    """A finished run's closing MLflow record: :func:`final_run_metrics` (once per run: a run killed after this point,
    uploading the artifacts, resumes here), :func:`convergence_tags`, ``artifacts`` ((file, artifact folder) pairs)
    and the run's metrics.json, rounds.json and experiment.json, then the adapters as LoggedModels."""
    out_dir = Path(plan.paths["out_dir"])
    if not logger.metric_history("bytes_sent_total"):
        logger.log_metrics(final_run_metrics(metrics), step=metrics["stopped_round"])
    logger.set_tags(convergence_tags(metrics))
    run_files = [(out_dir / f, None) for f in ("metrics.json", "rounds.json", "experiment.json")]
    for f, artifact_path in artifacts + run_files:
        logger.log_artifact(f, artifact_path)
    logger.log_adapter_models(out_dir, global_adapter=global_adapter)


def convergence_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """The run's stop outcome as MLflow tags (``converged`` true|false, ``stopped_round``, ``best_round``; not those
    that are None: no stop rule, no validation loss)."""
    return {k: str(metrics[k]).lower() for k in ("converged", "stopped_round", "best_round") if metrics[k] is not None}


def final_run_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The run's closing MLflow metrics (logged at its last round): each client's best validation loss,
    the bytes in total, the peak memory, the DP-SGD reports."""
    clients = metrics["clients"]
    best = {f"{c}.best_val_loss": v["best_val_loss"] for c, v in clients.items() if v["best_val_loss"] is not None}
    totals = {
        "bytes_sent_total": metrics["bytes_sent"],
        "bytes_received_total": metrics["bytes_received"],
        "peak_rss_mb": metrics["peak_rss_mb"],
    }
    return best | totals | privacy.mlflow_metrics(metrics)
