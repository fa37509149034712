"""Real federation (SuperLink + SuperNodes): what the deployed ServerApp records, and federated evaluation.

The in-process and Ray engines run inside the `train` stage, which records the run (pipeline.train). A deployed
ServerApp runs inside a SuperLink, so ``pipeline.federation.deployment:server_app`` calls :func:`serve`, which records the
same things from what the server receives - and nothing else, since the clients' data and adapters stay on
their own disks:

- server side (relative to the SuperLink's working directory: the run directory ``data/cache/runs/<exp>-<key>/``
  while it runs, ``models/<exp>/`` once finished, and ``reports/train/<exp>/``): ``rounds.json`` and ``metrics.json`` (the train stage's writers: pipeline.training.history and .summary),
  ``global_adapter.safetensors`` (the final aggregate), an MLflow run (parameters, per-round per-client
  metrics, bytes, the global adapter, test ROUGE);
- client side (node config ``client-dir`` / ``checkpoint-dir``; by default the run directory's ``clients/<client>/``
  and ``checkpoint/clients/<client>/``): best and final local adapters, the gate log, round checkpoints (pipeline.federation.client_app.client_evaluate);
- federated evaluation: after the last round (and every ``evaluate-every`` rounds) the server sends
  ``query.summarize``; each client summarises its own test set with its own adapter (the evaluate stage's
  sub-sampling, generation and ROUGE: pipeline.datasets.subsampling, pipeline.modeling.generation) and replies only ROUGE means and counts. The server writes them as
  ``reports/eval/<exp>/metrics.json`` (the evaluate stage's layout, without per-example files: the
  summaries never leave the clients); the evaluations every ``evaluate-every`` rounds go to
  ``reports/eval/<exp>/rounds.json`` (and MLflow).

A client that failed in every round it was sampled in (a hung node: no reply within the round timeout) fails the
run after its rounds are recorded, so ``flwr ls`` reports it (:func:`never_contributed`).

Run config keys (``flwr run . --run-config "..."``): ``plan`` (required), ``params`` (file whose ``evaluate``
group sets decoding, and whose run-time settings give the round timeout; default params.yaml; a file that is not
there is an error, never the defaults), ``evaluate`` (bool, default true),
``evaluate-every`` (int, 0 = only at the end), ``mlflow`` (bool, default true), ``round-timeout-s`` (float, how
long the server waits for a round's replies; 0 = that params file's ``train.round_timeout_s``),
``admission-timeout-s`` (float, how long it waits for every client the plan declares to join; 0 = that params
file's ``train.admission_timeout_s``).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from pipeline.common import atomic
from pipeline.common.config import from_dict, load_params
from pipeline.experiments import load_run_settings
from pipeline.paths import PATHS
from pipeline.results.evaluation import EvaluateConfig, log_to_mlflow
from pipeline.federation.run_checks import SERVER_KEYS, check_run_config
from pipeline.federation.protocol import CONFIG_KEY, METRICS_KEY, load_plan, plan_path_of
from pipeline.federation.server_app import load_server_checkpoint, run_server
from pipeline.modeling.adapter_io import save_adapter
from pipeline.modeling.backbone_record import backbone_name
from pipeline.experiments import Plan
from pipeline.results.scoring import ROUGE_TYPES, TABLE_ROUGE_L
from pipeline.training import checkpoints
from pipeline.training import checkpoints as publish
from pipeline.training.history import write_rounds
from pipeline.training.history import TrainRecorder
from pipeline.training.shared_model import model_config, shared_model
from pipeline.training.summary import (convergence_tags, final_run_metrics, prepare_outputs, run_identity_tags,
                                       summarize, write_metrics)

log = logging.getLogger("fedmeet.deployment")

SUMMARIZE = "query.summarize"
SCORE_KEYS = (*ROUGE_TYPES, "avg_rouge")
GLOBAL_ADAPTER = "global_adapter.safetensors"
ROUNDS_EVAL = "rounds.json"  # reports/eval/<exp>/: the federated evaluation every evaluate-every rounds


def _flag(value: Any, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def round_timeout_s(run_config: dict[str, Any], experiment: str, key: str = "round-timeout-s") -> float:
    """Run config ``round-timeout-s`` (``admission-timeout-s``) when set (> 0), else the run-time setting of the
    params file (run config ``params``): a site chooses its timeouts when it starts the run, and the plan (the
    result) does not change."""
    given = float(run_config.get(key) or 0)
    if given > 0:
        return given
    settings = load_run_settings(str(run_config.get("params") or "params.yaml"), experiment)
    return settings.round_timeout_s if key == "round-timeout-s" else settings.admission_timeout_s


def evaluate_config(run_config: dict[str, Any]) -> EvaluateConfig:
    """The evaluate stage's decoding settings: ``params.yaml``'s ``evaluate`` group (run config ``params``)."""
    path = Path(str(run_config.get("params") or "params.yaml"))
    if not path.exists():
        raise FileNotFoundError(f"{path}: params file not found (run config 'params': its `evaluate` group sets the "
                                f"federated evaluation's decoding)")
    params = load_params(path)
    return from_dict(EvaluateConfig, params.get("evaluate"), f"{path}: evaluate")


# ================================================================================================ server side
def federated_evaluate(grid: Grid, plan: Plan, plan_path: str, cfg: EvaluateConfig,
                       timeout: float) -> dict[str, Any]:
    """Ask every connected client for its test ROUGE; returns metrics.json's content (evaluate's layout)."""
    node_ids = sorted(grid.get_node_ids())
    config = ConfigRecord({"plan": plan_path, "evaluate": json.dumps(asdict(cfg))})
    msgs = [Message(RecordDict({CONFIG_KEY: config}), dst_node_id=n, message_type=SUMMARIZE)
            for n in node_ids]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    received: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for reply in replies:
        if reply.has_error():
            failed[f"node {reply.metadata.src_node_id}"] = reply.error.reason.splitlines()[0]
            continue
        name = str(reply.content["identity"]["client-name"])
        m = dict(reply.content[METRICS_KEY])
        received[name] = {k: (int(v) if k in ("n", "n_test", "skipped_by_subsampling") else float(v))
                          for k, v in m.items()}
    answered = {r.metadata.src_node_id for r in replies}
    for n in node_ids:
        if n not in answered:
            failed[f"node {n}"] = f"no reply within {timeout:.0f}s"
    # The evaluate stage's order (the partition's, as the plan declares it), so means add up in the same order; a
    # plan without declared clients: names as the clients gave them (the server holds no partition file).
    order = list(plan.clients) if plan.clients else sorted(received)
    per_client: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name in order + sorted(set(received) - set(order)):
        if name not in received:
            continue
        if received[name].get("n", 0) == 0:
            skipped[name] = "no test examples on the client"
            continue
        per_client[name] = {**{k: received[name][k] for k in SCORE_KEYS}, "n": received[name]["n"],
                            "n_test": received[name]["n_test"],
                            "skipped_by_subsampling": received[name]["skipped_by_subsampling"]}
    mean = ({k: sum(c[k] for c in per_client.values()) / len(per_client) for k in SCORE_KEYS}
            if per_client else {k: None for k in SCORE_KEYS})
    return {
        "experiment": plan.experiment,
        "method": plan.method,
        "partition": plan.partition,
        "seed": plan.seed,
        "study": plan.study,
        "backbone": _backbone(plan),
        "adapter": cfg.adapter,
        "decoding": {k: v for k, v in asdict(cfg).items() if k not in ("adapter", "log_text_to_mlflow")}
        | {"max_source_length": cfg.max_source_length or model_config(plan).max_source_length},
        "rouge_l_in_tables": TABLE_ROUGE_L,
        "clients": per_client,
        "skipped_clients": skipped,
        "mean": mean,
        "evaluated_on": "clients",  # federated: each client scored its own test set; no text reached the server
        "failed_clients": failed,
    }


def _backbone(plan: Plan) -> str:
    """As the evaluate stage reports it: the recorded name, else the model type."""
    return backbone_name(plan.paths["backbone"], str(shared_model(plan).backbone.config.model_type))


def never_contributed(history: list[dict[str, Any]]) -> dict[str, str]:
    """Clients sampled at least once whose every sampled round failed (no reply within the round timeout, an
    error, an undecodable reply): client -> its last error. Such a run has trained nothing of theirs."""
    sampled: dict[str, list[dict[str, Any]]] = {}
    for row in history:
        if row.get("sampled"):
            sampled.setdefault(row["client"], []).append(row)
    return {c: str(rows[-1].get("error") or "failed") for c, rows in sampled.items()
            if all(r.get("failed") for r in rows)}


def write_eval_metrics(plan: Plan, metrics: dict[str, Any], eval_dir: Path = PATHS.eval_reports,
                       keep: tuple[str, ...] = ()) -> Path:
    """metrics.json in a folder holding only this run's files (``keep``): an earlier evaluate stage's
    per-example files would otherwise sit beside scores they do not belong to."""
    out = Path(eval_dir) / plan.experiment
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file() and stale.name not in keep:
            stale.unlink()
    path = out / "metrics.json"
    atomic.write_json(path, metrics)
    return path


class DeploymentRecorder:
    """The train stage's recorder (rounds files, MLflow per round) plus the federated evaluation every N rounds."""

    def __init__(self, train_recorder, grid: Grid, plan_path: str, cfg: EvaluateConfig | None, every: int,
                 timeout: float):
        self.inner = train_recorder
        self.grid, self.plan_path, self.cfg, self.every, self.timeout = grid, plan_path, cfg, every, timeout
        self.per_round: list[dict[str, Any]] = []

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        self.inner.started(plan, clients, start_round)

    def round_done(self, plan: Plan, entry, history: list[dict[str, Any]]) -> None:
        self.inner.round_done(plan, entry, history)
        if self.cfg is not None and self.every > 0 and entry.round % self.every == 0 \
                and entry.round < plan.train.rounds:
            metrics = federated_evaluate(self.grid, plan, self.plan_path, self.cfg, self.timeout)
            # on disk too, so the scores are kept without MLflow (run config mlflow=false)
            self.per_round.append({"round": entry.round, "clients": metrics["clients"], "mean": metrics["mean"],
                                   "failed_clients": metrics["failed_clients"]})
            out = PATHS.eval_dir(plan.experiment) / ROUNDS_EVAL
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(out, {"experiment": plan.experiment, "rounds": self.per_round})
            if self.inner.logger is not None:
                self.inner.logger.log_metrics({f"eval.{c}.{k}": v[k] for c, v in metrics["clients"].items()
                                               for k in SCORE_KEYS}, step=entry.round)

    def close(self) -> None:
        self.inner.close()


def serve(grid: Grid, context: Context) -> dict[str, Any]:
    """The deployed ServerApp: train (resuming after the last checkpointed round), record, evaluate on the
    clients. Returns {"train": train metrics, "eval": eval metrics or None}."""
    rc = dict(context.run_config)
    check_run_config(rc, SERVER_KEYS, "run config")  # `flwr run` lets any value of a known key through
    plan_path = plan_path_of(None, context)
    plan = load_plan(plan_path)
    prepare_outputs(plan)
    out_dir = Path(plan.paths["out_dir"])
    checkpoint = load_server_checkpoint(plan)
    resuming = checkpoint is not None
    # `flwr run --stream` shows the ServerApp's output: the manual recipe's operator sees where the run starts
    print(f"{plan.experiment}: " + (f"resuming from round {int(checkpoint['round']) + 1} of {plan.train.rounds} "
                                    f"(server checkpoint)" if resuming else f"starting at round 1 of "
                                                                            f"{plan.train.rounds}"), flush=True)

    logger = None
    if _flag(rc.get("mlflow"), True):
        from pipeline.results.tracking import RunLogger

        run_id_file = checkpoints.mlflow_run_id_path(plan)
        resume_id = run_id_file.read_text().strip() if resuming and run_id_file.exists() else None
        logger = RunLogger.start(plan.study, plan.experiment, plan.to_json_dict(), run_identity_tags(plan, "deployment"),
                                 resume_run_id=resume_id)
        run_id_file.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(run_id_file, logger.run_id)

    cfg = evaluate_config(rc) if _flag(rc.get("evaluate"), True) else None
    train_recorder = TrainRecorder(plan, logger)
    timeout = round_timeout_s(rc, plan.experiment)
    recorder = DeploymentRecorder(train_recorder, grid, plan_path, cfg, int(rc.get("evaluate-every") or 0), timeout)
    try:
        arrays, history = run_server(grid, plan, plan_path, recorder, timeout,
                                     round_timeout_s(rc, plan.experiment, "admission-timeout-s"))
    except BaseException:
        recorder.close()
        if logger is not None:
            logger.finish("KILLED")  # a rerun of the same plan resumes this run from the server checkpoint
        raise
    recorder.close()

    write_rounds(plan, history)
    metrics = summarize(plan, history, train_recorder.round_seconds)
    write_metrics(plan, metrics)
    silent = never_contributed(history)
    if silent:  # a hung or broken node: recorded round by round, but the run has no result for that client
        if logger is not None:
            logger.finish("FAILED")
        checkpoints.server_checkpoint_path(plan).unlink(missing_ok=True)  # a rerun starts over
        checkpoints.mlflow_run_id_path(plan).unlink(missing_ok=True)
        name, error = next(iter(silent.items()))
        raise RuntimeError(f"{plan.experiment}: client(s) {sorted(silent)} failed in every round they were sampled "
                           f"in ({name}: {error}); {out_dir / 'rounds.json'} has each round's error")
    save_adapter(out_dir / GLOBAL_ADAPTER, arrays.to_torch_state_dict(),
                 {"experiment": plan.experiment, "round": str(metrics["stopped_round"])})

    eval_metrics = None
    if cfg is not None:
        eval_metrics = federated_evaluate(grid, plan, plan_path, cfg, timeout)
        kept = (ROUNDS_EVAL,) if recorder.per_round or resuming else ()  # this run's evaluations every N rounds
        eval_path = write_eval_metrics(plan, eval_metrics, keep=kept)
        log.info("%s: federated evaluation %s -> %s", plan.experiment,
                 {c: round(v["avg_rouge"], 2) for c, v in eval_metrics["clients"].items()}, eval_path)
    if logger is not None:
        logger.log_metrics(final_run_metrics(metrics), step=metrics["stopped_round"])
        logger.set_tags(convergence_tags(metrics))
        for f in (out_dir / GLOBAL_ADAPTER, out_dir / "metrics.json", out_dir / "rounds.json",
                  out_dir / "experiment.json"):
            logger.log_artifact(f)
        if eval_metrics is not None:
            log_to_mlflow(plan.experiment, plan.to_json_dict() | {"mlflow_run_id": logger.run_id}, eval_metrics,
                          PATHS.eval_dir(plan.experiment), cfg)
        logger.finish("FINISHED")
    # Finished: the outputs go to models/<exp>/ (with the clients' adapters when they share this disk), and the
    # next run of this plan starts over (client checkpoints stay on the clients' disks).
    publish.publish_outputs(plan)
    checkpoints.server_checkpoint_path(plan).unlink(missing_ok=True)
    checkpoints.mlflow_run_id_path(plan).unlink(missing_ok=True)
    return {"train": metrics, "eval": eval_metrics}


# The ServerApp `flwr run` / a SuperLink loads (pyproject.toml [tool.flwr.app.components]): the plan comes from the
# run config (`[tool.flwr.app.config] plan = "models/plans/<exp>.json"` or `flwr run . --run-config "plan='...'"`).
server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    serve(grid, context)
