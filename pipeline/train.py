"""Stage `train`: one experiment (a DVC `foreach` over params.yaml `experiments`) from its plan file.

    python -m pipeline.train --experiment fedselectkd-domain

Federated methods run Flower's ServerApp/ClientApp (pipeline.federation.apps; in-process engine by default, Ray with
``train.engine: ray``); `single` (each client alone) and `centralized` (all clients' train data pooled) run the
same local trainer without a server. Every round each client's validation loss picks its best adapter.

Outputs (``models/<exp>/``): ``clients/<client>/adapter_{best,final}.safetensors``, ``gate_log.parquet``
(client, round, example_id, position, token_id, entropy, kd_applied; empty for CE-only methods),
``rounds.json`` (one row per round and client), ``metrics.json``, ``experiment.json`` (the plan).
``reports/train/<exp>/metrics.json`` (DVC metrics) and ``rounds.json`` (DVC plots: one row per round, a column
per client and quantity). One MLflow run per experiment (MLflow experiment = the entry's study) with every
parameter, per-round per-client metrics, bytes sent/received and the adapters as artifacts, named by the settings
that differ from the baseline's plan and tagged with its origin (pipeline.results.tracking). A killed run resumes after its
last completed round when rerun (``models/<exp>/checkpoint/``, removed at the end), in the same MLflow run.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from pipeline.common import atomic
from pipeline.training import client as client_training
from pipeline.plan import PLANS_DIR, Plan, plan_hash, read_plan
from pipeline.common.timing import peak_rss_mb, stage_timer

log = logging.getLogger("fedmeet.train")

ROUND_FIELDS = ("train_loss", "ce", "kd", "kd_fraction", "val_loss", "bytes_up", "bytes_down", "weight_share",
                "epsilon", "clipped_fraction")  # the last two under privacy.mode example only
# A client's DP-SGD report in metrics.json and MLflow (pipeline.training.privacy; None = unbounded)
PRIVACY_FIELDS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "clipped_fraction")


# ----------------------------------------------------------------------------------------------- recording
def round_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One round's MLflow metrics from its rows (one per client)."""
    metrics: dict[str, float] = {}
    for row in rows:
        for key in ROUND_FIELDS + ("failed",):
            if row.get(key) is not None:
                metrics[f"{row['client']}.{key}"] = float(row[key])
    metrics["bytes_sent"] = float(sum(r.get("bytes_down", 0) for r in rows))
    metrics["bytes_received"] = float(sum(r.get("bytes_up", 0) for r in rows))
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    if vals:
        metrics["val_loss_mean"] = sum(vals) / len(vals)
    return metrics


def log_missing_rounds(logger, history: list[dict[str, Any]]) -> list[int]:
    """Log the rounds of ``history`` the MLflow run lacks: a kill between a round's checkpoint and its logging
    leaves that round to the resumed run, which does not train it again. Returns the rounds logged."""
    logged = {m.step for m in logger.metric_history("bytes_sent")}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        by_round.setdefault(int(row["round"]), []).append(row)
    missing = sorted(set(by_round) - logged)
    for rnd in missing:
        logger.log_metrics(round_metrics(by_round[rnd]), step=rnd)
    return missing


class TrainRecorder:
    """Per-round bookkeeping shared by both paths: rounds files, MLflow metrics, progress on the console."""

    def __init__(self, plan: Plan, logger=None):
        self.plan = plan
        self.logger = logger
        self.round_seconds: list[float] = []
        self.out_dir = Path(plan.paths["out_dir"])
        self.reports_dir = Path(plan.paths["reports_dir"])
        self._bar = None

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=plan.train.rounds, initial=start_round - 1, desc=f"{plan.experiment} rounds",
                         unit="round")
        log.info("%s (%s): clients %s, starting at round %d of %d", plan.experiment, plan.method, clients,
                 start_round, plan.train.rounds)

    def round_done(self, plan: Plan, entry, history: list[dict[str, Any]]) -> None:
        self.round_seconds.append(entry.seconds)
        write_rounds(plan, history)
        if self.logger is not None:
            self.logger.log_metrics({"round_seconds": entry.seconds} | round_metrics(entry.rows), step=entry.round)
        if self._bar is not None:
            summary = " ".join(f"{r['client']}={r['val_loss']:.3f}" for r in entry.rows if r.get("val_loss") is not None)
            self._bar.set_postfix_str(f"val {summary}")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def write_rounds(plan: Plan, history: list[dict[str, Any]]) -> None:
    out_dir, reports_dir = Path(plan.paths["out_dir"]), Path(plan.paths["reports_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "rounds.json", history, indent=1)
    wide: dict[int, dict[str, Any]] = {}
    for row in history:
        w = wide.setdefault(row["round"], {"round": row["round"]})
        for key in ROUND_FIELDS:
            if row.get(key) is not None:
                w[f"{row['client']}/{key}"] = row[key]
    for w in wide.values():
        vals = [v for k, v in w.items() if k.endswith("/val_loss")]
        w["val_loss_mean"] = sum(vals) / len(vals) if vals else None
    atomic.write_json(reports_dir / "rounds.json", [wide[r] for r in sorted(wide)], indent=1)


# ----------------------------------------------------------------------------------------------- no server
def _local_checkpoint_path(plan: Plan) -> Path:
    return Path(plan.paths["out_dir"]) / "checkpoint" / "local.pt"


def run_local(plan: Plan, recorder: TrainRecorder | None = None) -> dict[str, Any]:
    """`single` (one adapter per client, own data) and `centralized` (one adapter on the pooled data, tested on
    every client): the same trainer and the same round structure (a round = ``local_epochs`` epochs)."""
    from pipeline.federation.apps import RoundLog

    spec = plan.spec
    names = client_training.client_names(plan)
    datas = {n: client_training.client_data(plan, n) for n in names}
    model = client_training.shared_model(plan)
    cache = client_training.prefix_cache_for(plan, model)
    if spec.pooled:
        units = {"pooled": pd.concat([datas[n].train for n in names], ignore_index=True)}
        unit_of = {n: "pooled" for n in names}
    else:
        units = {n: datas[n].train for n in names}
        unit_of = {n: n for n in names}
    for n in names:
        if len(datas[n].valid) == 0:
            raise ValueError(f"{plan.paths['partition']}: client {n!r} has no valid examples: no best round")

    ckpt_path = _local_checkpoint_path(plan)
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    if ckpt is not None and ckpt.get("plan_hash") == plan_hash(plan):
        start, adapters, progress, history = ckpt["round"] + 1, ckpt["adapters"], ckpt["progress"], ckpt["history"]
        log.info("%s: resuming after round %d", plan.experiment, start - 1)
    else:
        start, history = 1, []
        initial = client_training.initial_adapter_state(plan)
        adapters = {u: {k: v.clone() for k, v in initial.items()} for u in units}
        progress = {n: {"best-val-loss": math.inf, "best-round": 0} for n in names}
    if recorder:
        recorder.started(plan, names, start)

    for rnd in range(start, plan.train.rounds + 1):
        t0 = time.perf_counter()
        trained: dict[str, dict[str, Any]] = {}
        for unit, train_df in units.items():
            model.load_adapter_state("local", adapters[unit])
            res = client_training.train_local(model, plan, train_df, client=unit, rnd=rnd, cache=cache)
            adapters[unit] = model.adapter_state("local")
            trained[unit] = {"n_examples": res.n_examples, "n_steps": res.n_steps, "n_tokens": res.n_tokens,
                             "train_loss": res.train_loss, "ce": res.ce, "kd": res.kd,
                             "kd_fraction": res.kd_fraction}
        rows = []
        for n in names:
            unit = unit_of[n]
            model.load_adapter_state("local", adapters[unit])
            val, val_tokens = client_training.validation_loss(model, plan, datas[n].valid, cache=cache)
            out = Path(plan.paths["out_dir"]) / "clients" / n
            meta = {"experiment": plan.experiment, "client": n, "round": str(rnd), "val_loss": f"{val:.6f}"}
            if val < progress[n]["best-val-loss"]:
                progress[n] = {"best-val-loss": val, "best-round": rnd}
                client_training.save_adapter(out / "adapter_best.safetensors", adapters[unit], meta)
            client_training.save_adapter(out / "adapter_final.safetensors", adapters[unit], meta)
            rows.append({"round": rnd, "client": n, "sampled": 1, "failed": 0, "bytes_down": 0, "bytes_up": 0,
                         **trained[unit], "val_loss": val, "val_tokens": val_tokens,
                         "best_round": progress[n]["best-round"]})
        history.extend(rows)
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        atomic.torch_save({"plan_hash": plan_hash(plan), "round": rnd, "adapters": adapters, "progress": progress,
                           "history": history}, ckpt_path)
        if recorder:
            recorder.round_done(plan, RoundLog(rnd, time.perf_counter() - t0, rows, True), history)
    return {"history": history}


# ----------------------------------------------------------------------------------------------- outputs
def _has_valid_checkpoint(plan: Plan) -> bool:
    out = Path(plan.paths["out_dir"]) / "checkpoint"
    for name in ("server.pt", "local.pt"):
        p = out / name
        if p.exists():
            try:
                return torch.load(p, weights_only=False).get("plan_hash") == plan_hash(plan)
            except Exception:  # unreadable (killed mid-write before the atomic rename cannot happen, but be safe)
                return False
    return False


def merge_gate_logs(plan: Plan) -> Path:
    """Concatenate the clients' per-round gate logs (rounds 1..R) into models/<exp>/gate_log.parquet (the parts
    stay until the run's checkpoint is gone: :func:`run_experiment`)."""
    out_dir = Path(plan.paths["out_dir"])
    parts = []
    for f in sorted(out_dir.glob("clients/*/gate_log/round*.parquet")):
        if int(f.stem[len("round"):]) <= plan.train.rounds:
            parts.append(pd.read_parquet(f))
    df = pd.concat(parts, ignore_index=True) if parts else client_training.empty_gate_log()
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
        dp_rows = [r for r in history if r["client"] == name and "noise_multiplier" in r]
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
    if plan.privacy is not None and plan.privacy.enabled:
        eps = [c["privacy"]["epsilon"] for c in clients.values() if "privacy" in c]
        privacy = {"mode": plan.privacy.mode, "accountant": plan.privacy.accountant, "sampling": "poisson",
                   "target_epsilon": plan.privacy.target_epsilon,
                   "epsilon_max": None if (not eps or None in eps) else max(eps)}
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
    }


def privacy_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of the clients' DP-SGD reports (``<client>.epsilon`` ...; unbounded values left out)."""
    out = {f"{c}.{k}": v["privacy"][k] for c, v in metrics["clients"].items() if "privacy" in v
           for k in PRIVACY_FIELDS if v["privacy"][k] is not None}
    if metrics.get("privacy") and metrics["privacy"]["epsilon_max"] is not None:
        out["epsilon_max"] = metrics["privacy"]["epsilon_max"]
    return out


def _backbone_name(plan: Plan) -> str:
    record = Path(plan.paths["backbone"]) / "fedmeet_backbone.json"
    if record.exists():
        try:
            return str(json.loads(record.read_text()).get("name", plan.paths["backbone"]))
        except json.JSONDecodeError:
            pass
    return str(plan.paths["backbone"])


def run_tags(plan: Plan, params_path: Path = Path("params.yaml")) -> dict[str, str]:
    """Tags of the experiment's MLflow run: what it is, and where it came from (commit, dirty tree, DVC experiment,
    plan hash, preset), so a run can be matched to its `dvc exp show` row."""
    from pipeline.common.config import ConfigError, load_params
    from pipeline.results.tracking import dvc_tags, git_state, preset_name

    tags = {"method": plan.method, "partition": plan.partition, "seed": str(plan.seed),
            "backbone": _backbone_name(plan), "study": plan.study, "experiment": plan.experiment,
            "engine": plan.train.engine if plan.spec.federated else "none", "plan_hash": plan_hash(plan)}
    try:
        tags["preset"] = preset_name(load_params(params_path))
    except ConfigError:
        tags["preset"] = "unknown"  # run outside a project root (no params.yaml)
    return tags | git_state() | dvc_tags()


def tracked_run_name(plan: Plan, plan_path: str | Path) -> str:
    """The experiment name plus the plan settings that differ from the base commit's plan of the same experiment
    (the DVC experiment's baseline, else HEAD), e.g. ``fedselectkd-domain tau=3``."""
    from pipeline.results.tracking import base_params, base_plan, run_name

    current = json.loads(Path(plan_path).read_text())
    return run_name(plan.experiment, current, base_plan(plan.experiment, base_params()))


def run_experiment(plan_path: str | Path, *, track: bool = True) -> dict[str, Any]:
    """Train one experiment end to end (resuming when a checkpoint of this plan exists); returns metrics."""
    plan_path = str(plan_path)
    plan = read_plan(plan_path)
    out_dir, reports_dir = Path(plan.paths["out_dir"]), Path(plan.paths["reports_dir"])
    if out_dir.exists() and not _has_valid_checkpoint(plan):
        shutil.rmtree(out_dir)  # outputs of another configuration or a finished run: start clean
    out_dir.mkdir(parents=True, exist_ok=True)
    reports_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "experiment.json", plan.to_json_dict(), sort_keys=True)

    logger = None
    if track:
        from pipeline.results.tracking import RunLogger

        # The run id lives beside the checkpoint: a resumed training continues its MLflow run.
        run_id_file = out_dir / "checkpoint" / "mlflow_run_id"
        logger = RunLogger.start(plan.study, tracked_run_name(plan, plan_path), plan.to_json_dict(),
                                 run_tags(plan),
                                 resume_run_id=run_id_file.read_text().strip() if run_id_file.exists() else None)
        run_id_file.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(run_id_file, logger.run_id)

    recorder = TrainRecorder(plan, logger)
    try:
        if plan.spec.federated:
            from pipeline.federation.apps import run_federated

            result = run_federated(plan_path, recorder)
        else:
            result = run_local(plan, recorder)
    except BaseException:
        recorder.close()
        if logger is not None:
            logger.finish("KILLED")  # resumable: the rerun reopens this run
        raise
    recorder.close()

    history = result["history"]
    write_rounds(plan, history)
    merge_gate_logs(plan)
    metrics = summarize(plan, history, recorder.round_seconds)
    text = json.dumps(metrics, indent=2) + "\n"
    atomic.write_text(reports_dir / "metrics.json", text)
    atomic.write_text(out_dir / "metrics.json", text)
    if logger is not None:
        log_missing_rounds(logger, history)
        # Once per run: a run killed after this point (uploading the artifacts) resumes here.
        if not logger.metric_history("bytes_sent_total"):
            logger.log_metrics({f"{c}.best_val_loss": v["best_val_loss"] for c, v in metrics["clients"].items()
                                if v["best_val_loss"] is not None} | {
                "bytes_sent_total": metrics["bytes_sent"], "bytes_received_total": metrics["bytes_received"],
                "peak_rss_mb": metrics["peak_rss_mb"]} | privacy_metrics(metrics), step=plan.train.rounds)
        # Adapters and summaries only: the gate log holds client token ids and stays out of the tracking store.
        for client_dir in sorted((out_dir / "clients").iterdir()):
            for f in sorted(client_dir.glob("adapter_*.safetensors")):
                logger.log_artifact(f, f"adapters/{client_dir.name}")
        for f in (out_dir / "metrics.json", out_dir / "rounds.json", out_dir / "experiment.json"):
            logger.log_artifact(f)
        logger.finish("FINISHED")
    shutil.rmtree(out_dir / "checkpoint", ignore_errors=True)
    # The per-round gate logs were only needed to survive a restart; removed after the checkpoint, since a run
    # killed after the merge resumes from the checkpoint and merges them again.
    for d in out_dir.glob("clients/*/gate_log"):
        shutil.rmtree(d)
    return metrics


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", required=True, help="a key of params.yaml `experiments`")
    ap.add_argument("--plans", default=str(PLANS_DIR), help="directory of the plan files (stage `plan`)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM (a scheduler's or `kill`'s stop) unwinds like Ctrl-C, so the MLflow run is closed as KILLED at once
    # (SIGKILL cannot be caught: the next start of the experiment closes that run).
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with stage_timer(f"train-{args.experiment}"):
            metrics = run_experiment(Path(args.plans) / f"{args.experiment}.json", track=not args.no_mlflow)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps({c: {k: v[k] for k in ("best_round", "best_val_loss")} for c, v in metrics["clients"].items()}))


if __name__ == "__main__":
    from pipeline.common.cli import run as run_cli

    raise SystemExit(run_cli(main))
