"""What a finished training run reports: ``metrics.json`` (per client: best round and validation loss, rounds
trained and failed, bytes, FedAvg weight, DP-SGD report; the run's means; SecAgg+ settings and dropouts), the
merged gate log, and the final MLflow metrics. Written the same way by the train stage and by the deployed
ServerApp."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from pipeline.common import atomic
from pipeline.common.config import to_dict
from pipeline.common.timing import peak_rss_mb
from pipeline.modeling.backbone_record import backbone_name
from pipeline.experiments import Plan
from pipeline.training.client_training import empty_gate_log

# A client's DP-SGD report in metrics.json and MLflow (pipeline.privacy; None = unbounded)
PRIVACY_FIELDS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "clipped_fraction")
# privacy.mode client: the run's report (one guarantee for every client), in metrics.json's `privacy` and MLflow
CLIENT_LEVEL_FIELDS = ("epsilon", "delta", "noise_multiplier", "clipping_norm", "clipped_fraction")


def prepare_outputs(plan: Plan) -> None:
    """The experiment's output directories, and ``experiment.json`` (the plan) in ``models/<exp>/``."""
    out_dir, reports_dir = Path(plan.paths["out_dir"]), Path(plan.paths["reports_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "experiment.json", plan.to_json_dict(), sort_keys=True)


def run_identity_tags(plan: Plan, engine: str) -> dict[str, str]:
    """The tags that say what an experiment's MLflow run is (the train stage adds where it came from)."""
    return {"method": plan.method, "partition": plan.partition, "seed": str(plan.seed),
            "backbone": backbone_name(plan.paths["backbone"], str(plan.paths["backbone"])), "study": plan.study,
            "experiment": plan.experiment, "engine": engine}


def merge_gate_logs(plan: Plan) -> Path:
    """Concatenate the clients' per-round gate logs (rounds 1..R) into models/<exp>/gate_log.parquet (the parts
    stay until the run's checkpoint is gone: pipeline.train.run_experiment)."""
    out_dir = Path(plan.paths["out_dir"])
    parts = []
    for f in sorted(out_dir.glob("clients/*/gate_log/round*.parquet")):
        if int(f.stem[len("round"):]) <= plan.train.rounds:
            parts.append(pd.read_parquet(f))
    df = pd.concat(parts, ignore_index=True) if parts else empty_gate_log()
    path = out_dir / "gate_log.parquet"
    atomic.to_parquet(df, path, index=False)
    return path


def summarize(plan: Plan, history: list[dict[str, Any]], round_seconds: list[float]) -> dict[str, Any]:
    clients: dict[str, dict[str, Any]] = {}
    for row in history:
        c = clients.setdefault(row["client"], {"best_round": 0, "best_val_loss": None, "rounds_trained": 0,
                                               "rounds_failed": 0, "bytes_sent": 0, "bytes_received": 0})
        if row.get("val_loss") is not None and (c["best_val_loss"] is None or row["val_loss"] < c["best_val_loss"]):
            c["best_val_loss"], c["best_round"] = row["val_loss"], row["round"]
        if row.get("val_loss") is not None:
            c["final_val_loss"] = row["val_loss"]
        c["rounds_trained"] += int(row.get("sampled", 0) and not row.get("failed", 0))
        c["rounds_failed"] += int(row.get("failed", 0))
        c["bytes_sent"] += int(row.get("bytes_down", 0))  # server -> client
        c["bytes_received"] += int(row.get("bytes_up", 0))  # client -> server
        if row.get("n_examples") is not None:
            c["n_train_examples"] = row["n_examples"]  # trained per round (capped in the CPU profile)
        if row.get("weight") is not None:
            c["fedavg_weight"] = row["weight"]  # |D_i| (train.weight_by: full) or the trained count
    for name, c in clients.items():
        dp_rows = [r for r in history if r["client"] == name and "dp_steps" in r]
        if dp_rows:  # epsilon after the client's last training round (the accountant composes every step)
            last = max(dp_rows, key=lambda r: r["dp_steps"])
            examples = sum(r["dp_examples"] for r in dp_rows)
            c["privacy"] = {
                "epsilon": last["epsilon"], "delta": last["delta"], "noise_multiplier": last["noise_multiplier"],
                "max_grad_norm": last["max_grad_norm"],
                "clipped_fraction": sum(r["dp_clipped"] for r in dp_rows) / examples if examples else 0.0,
                "steps": last["dp_steps"], "sample_rate": last["sample_rate"],
            }
        upto = [r for r in history if r["client"] == name and r["round"] <= c["best_round"] and r.get("n_tokens")]
        tokens = sum(r["n_tokens"] for r in upto)
        kd_tokens = sum(r["n_tokens"] * r.get("kd_fraction", 0.0) for r in upto)
        c["kd_fraction_to_best"] = kd_tokens / tokens if tokens else 0.0
    vals = [c["best_val_loss"] for c in clients.values() if c["best_val_loss"] is not None]
    privacy = None
    if plan.privacy is not None and plan.privacy.mode == "client":
        privacy = client_level_summary(plan, history, clients)
    elif plan.privacy is not None and plan.privacy.enabled:
        eps = [c["privacy"]["epsilon"] for c in clients.values() if "privacy" in c]
        privacy = {"mode": plan.privacy.mode, "accountant": plan.privacy.accountant, "sampling": "poisson",
                   "target_epsilon": plan.privacy.target_epsilon,
                   "epsilon_max": None if (not eps or None in eps) else max(eps)}
    secure = secure_aggregation_summary(plan, history)
    return {
        "experiment": plan.experiment,
        "method": plan.method,
        "study": plan.study,
        "partition": plan.partition,
        "seed": plan.seed,
        "rounds": plan.train.rounds,
        "clients": clients,
        "mean_best_val_loss": sum(vals) / len(vals) if vals else None,
        "bytes_sent": sum(c["bytes_sent"] for c in clients.values()),
        "bytes_received": sum(c["bytes_received"] for c in clients.values()),
        "seconds_per_round": sum(round_seconds) / len(round_seconds) if round_seconds else None,
        "peak_rss_mb": peak_rss_mb(),
        "privacy": privacy,
        **({"secure_aggregation": secure} if secure is not None else {}),  # runs without it keep their layout
    }


def client_level_summary(plan: Plan, history: list[dict[str, Any]], clients: dict[str, dict[str, Any]]
                         ) -> dict[str, Any]:
    """privacy.mode client: the run's guarantee after its last released round (the same for every client), and
    each client's share of clipped updates (``clients.<c>.privacy``; under SecAgg+ the server knows only each
    round's count: the rows carry the round's fraction, and a client's own share is not reported)."""
    released = [r for r in history if "update_clipped" in r]
    secure = plan.privacy.secure_aggregation
    for name, c in clients.items():
        own = [r["update_clipped"] for r in released if r["client"] == name]
        if own:
            c["privacy"] = {"updates_aggregated": len(own)} | (
                {} if secure else {"clipped_fraction": sum(own) / len(own)})
    last = max(released, key=lambda r: r["round"]) if released else None
    cfg = plan.privacy
    epsilon = last["epsilon"] if last else 0.0  # None: noise multiplier 0, no bound
    return {"mode": "client", "accountant": cfg.accountant,
            # Flower samples a fixed number without replacement; the accountant's Poisson rate is its approximation
            "sampling": "poisson approximation of fixed-size sampling without replacement",
            "clipping": cfg.clipping, "clipping_side": cfg.clipping_side, "target_epsilon": cfg.target_epsilon,
            "epsilon": epsilon, "epsilon_max": epsilon, "delta": last["delta"] if last else None,
            "noise_multiplier": last["noise_multiplier"] if last else None,
            "clipping_norm": last["clipping_norm"] if last else None,
            "clipped_fraction": sum(r["update_clipped"] for r in released) / len(released) if released else 0.0,
            "sample_rate": last["sample_rate"] if last else None,
            "rounds_released": len({r["round"] for r in released}), "updates_aggregated": len(released)}


def secure_aggregation_summary(plan: Plan, history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Under privacy.secure_aggregation: the SecAgg+ settings, the rounds whose sum was unmasked, the sampled
    clients left out of a sum (dropped, or the whole round when it could not be unmasked), and the upload
    coordinates SecAgg+ clipped (0 keeps the aggregate within its quantisation bound)."""
    if plan.privacy is None or not plan.privacy.secure_aggregation:
        return None
    sampled = [r for r in history if r.get("sampled")]
    dropped: dict[str, int] = {}
    for r in sampled:
        if r.get("failed"):
            dropped[r["client"]] = dropped.get(r["client"], 0) + 1
    return {"protocol": "SecAgg+ (flwr SecAggPlusWorkflow)", **to_dict(plan.privacy.secagg),
            "rounds_aggregated": len({r["round"] for r in sampled if not r.get("failed")}),
            "dropped": dropped, "clipped_coordinates": sum(int(r.get("secagg_clipped", 0)) for r in sampled)}


def write_metrics(plan: Plan, metrics: dict[str, Any]) -> None:
    """``metrics.json`` in ``reports/train/<exp>/`` (the DVC metric) and in ``models/<exp>/``."""
    text = json.dumps(metrics, indent=2) + "\n"
    atomic.write_text(Path(plan.paths["reports_dir"]) / "metrics.json", text)
    atomic.write_text(Path(plan.paths["out_dir"]) / "metrics.json", text)


def privacy_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of the clients' DP-SGD reports (``<client>.epsilon`` ...; unbounded values left out), or
    under privacy.mode client the run's (``epsilon``, ``delta``, ...); and those of secure aggregation
    (``secagg.*``; its settings are the run's parameters ``privacy.secagg.*``)."""
    run = metrics.get("privacy") or {}
    if run.get("mode") == "client":
        out = {k: float(run[k]) for k in CLIENT_LEVEL_FIELDS + ("epsilon_max",) if run.get(k) is not None}
    else:
        out = {f"{c}.{k}": v["privacy"][k] for c, v in metrics["clients"].items() if "privacy" in v
               for k in PRIVACY_FIELDS if v["privacy"][k] is not None}
        if run and run["epsilon_max"] is not None:
            out["epsilon_max"] = run["epsilon_max"]
    if metrics.get("secure_aggregation"):
        sa = metrics["secure_aggregation"]
        out |= {"secagg.rounds_aggregated": sa["rounds_aggregated"], "secagg.dropped": sum(sa["dropped"].values()),
                "secagg.clipped_coordinates": sa["clipped_coordinates"]}
    return out


def final_run_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The run's closing MLflow metrics (logged at step ``train.rounds``): each client's best validation loss,
    the bytes in total, the peak memory, the DP-SGD reports."""
    return {f"{c}.best_val_loss": v["best_val_loss"] for c, v in metrics["clients"].items()
            if v["best_val_loss"] is not None} | {
        "bytes_sent_total": metrics["bytes_sent"], "bytes_received_total": metrics["bytes_received"],
        "peak_rss_mb": metrics["peak_rss_mb"]} | privacy_metrics(metrics)
