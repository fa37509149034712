"""Real federation (SuperLink + SuperNodes): the deployed apps (pyproject.toml ``[tool.flwr.app.components]``) and
the federated evaluation (``query.summarize``, added here: out of the train stage's import closure); docs/federation.md.
"""

# ruff: noqa: E402 -- the imports come after gc.disable(), on purpose
from __future__ import annotations

import gc
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

gc.disable()  # Flower loads this in a fresh process per message: no full collection over the ~500k objects it imports
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from pydantic import Field

from pipeline.common import atomic
from pipeline.common.cli import freeze_collected
from pipeline.common.config import ConfigError, NonNegative, NonNegativeInt, config, from_dict
from pipeline.common.integrity import backbone_name
from pipeline.experiments.plans import Plan
from pipeline.experiments.settings import RunSettings
from pipeline.federation.admission import connected_nodes
from pipeline.federation.client_app import client_app, client_dir, client_name, served_plan
from pipeline.federation.protocol import (
    CONFIG_KEY,
    COUNT,
    METRICS_KEY,
    PLAN_HASH,
    error_line,
    load_plan,
    metrics_row,
    plan_path_of,
    replies_by_node,
    unanswered,
)
from pipeline.federation.server_app import load_server_checkpoint, run_server
from pipeline.modeling.adapters import adapter_file, load_adapter, save_adapter
from pipeline.paths import PATHS
from pipeline.results.evaluation import (
    SCORE_KEYS,
    EvaluateConfig,
    generate_per_run,
    log_to_mlflow,
    metrics_record,
    test_subsample,
)
from pipeline.results.scoring import client_scores
from pipeline.results.tracking import RunLogger, delete_run
from pipeline.training import checkpoints
from pipeline.training.client_data import read_examples, read_partition
from pipeline.training.history import TrainRecorder, log_missing_rounds
from pipeline.training.shared_model import shared_model
from pipeline.training.summary import log_run_outputs, prepare_outputs, record_run, run_identity_tags

freeze_collected()  # ~1.4 s CPU of each message's ~5 s (docs/performance.md)

__all__ = ["client_app", "server_app"]  # pyproject's components (Flower looks for an imported one in __all__)

log = logging.getLogger("fedmeet.deployment")

GLOBAL_ADAPTER = "global_adapter.safetensors"
ROUNDS_EVAL = "rounds.json"  # reports/eval/<exp>/: the federated evaluation every evaluate-every rounds
# a summarize reply's metrics (protocol.metrics_row's spec): its scores (ROUGE F1 x 100, in [0, 100]) and its counts
SUMMARY_METRICS = {k: (k, float, 0, 100) for k in SCORE_KEYS} | {
    k: (k, *COUNT) for k in ("n", "n_test", "skipped_by_subsampling")
}
ROUND_KEYS = ("clients", "skipped_clients", "mean", "failed_clients")  # rounds.json's: kept without MLflow too


@config
class ServerRunConfig:
    """What the ServerApp reads from its run config, under the keys pyproject.toml's [tool.flwr.app.config] declares
    with defaults of these types (tests/test_run_checks.py); a count or a duration is never negative (0 = the default /
    "only at the end"). An integer passes for a number; a boolean is no number."""

    plan: str = ""
    decoding: str = ""
    evaluate: bool = True
    evaluate_every: NonNegativeInt = Field(0, alias="evaluate-every")
    mlflow: bool = True
    round_timeout_s: NonNegative = Field(0.0, alias="round-timeout-s")
    admission_timeout_s: NonNegative = Field(0.0, alias="admission-timeout-s")
    # the ClientApps' run-time settings (pipeline.federation.protocol.client_cache_config)
    cache_dir: str = Field("", alias="cache-dir")
    cache_max_gb: NonNegative = Field(0.0, alias="cache-max-gb")

    def timeouts(self) -> tuple[float, float]:
        """(round, admission) timeouts; 0: the run-time settings' defaults."""
        return (
            self.round_timeout_s or RunSettings.round_timeout_s,
            self.admission_timeout_s or RunSettings.admission_timeout_s,
        )

    def evaluate_config(self) -> EvaluateConfig:
        """The federated evaluation's decoding: ``decoding``, the evaluate group as JSON ("": defaults)."""
        try:
            return from_dict(EvaluateConfig, json.loads(self.decoding or "{}"), "run config 'decoding'")
        except json.JSONDecodeError as err:
            raise ConfigError(f"run config 'decoding': not JSON ({err}): {self.decoding!r}") from None


def federated_evaluate(
    grid: Grid,
    plan: Plan,
    plan_path: str,
    cfg: EvaluateConfig,
    timeout: float,
    nodes: dict[int, str] | None = None,
    clients: list[str] | None = None,
) -> dict[str, Any]:
    """Ask every connected client (of ``nodes``, the run's node -> client map, when given: a node of another
    experiment naming a client of the plan is not asked; a new node naming one of ``clients``, the run's, takes its
    place) for its test ROUGE; returns metrics.json's content."""
    connected = None if nodes is None else connected_nodes(grid, plan_path, nodes, timeout, clients)
    node_ids = sorted(grid.get_node_ids() if connected is None else connected)
    config = ConfigRecord({"plan": plan_path, PLAN_HASH: plan.hash, "evaluate": json.dumps(asdict(cfg))})
    queries = [
        Message(RecordDict({CONFIG_KEY: config}), dst_node_id=n, message_type="query.summarize") for n in node_ids
    ]
    replies = replies_by_node(grid, queries, timeout)
    failed = {f"node {n}": error_line(r) for n, r in replies.items() if r.has_error()}
    received: dict[str, dict[str, Any] | None] = {}  # client -> its scores (None: no test examples)
    for n, r in [(n, r) for n, r in replies.items() if not r.has_error()]:
        try:  # a reply that cannot be read is its node's failure: no client reply ends the server's run
            name, scores = _summary(r)
        except ValueError as exc:
            failed[f"node {n}"] = f"it cannot be decoded: {exc}"
            continue
        # under --auth a SuperNode restarted with another client-name keeps its node id, and with it its admitted client
        if nodes is not None and nodes.get(n, name) != name:
            failed[f"node {n}"] = f"it answers as client {name!r}, admitted as {nodes[n]!r}"
        else:
            received[name] = scores
    failed |= {f"node {n}": f"no reply within {timeout:.0f}s" for n in unanswered(queries, replies)}
    # The plan's clients only (a refused node answers too), in the evaluate stage's (partition's) order so means add
    # up alike; a plan without declared clients: names as the clients gave them (the server holds no partition file).
    order = list(plan.clients) if plan.clients else sorted(received)
    skipped = {c: "no score: its node is gone or failed (failed_clients)" for c in order if c not in received}
    if skipped or failed:  # the client average is over the others; a failed node is named even when its client is not
        said = [f"no score of {sorted(skipped)}" if skipped else "", f"failed: {failed}" if failed else ""]
        log.warning("%s: federated evaluation: %s", plan.experiment, "; ".join(filter(None, said)))
    skipped |= {c: "no test examples on the client" for c in order if c in received and received[c] is None}
    per_client = {c: received[c] for c in order if received.get(c) is not None}
    # as the evaluate stage reports the backbone: the recorded name, else the model type
    backbone = backbone_name(plan.paths["backbone"], str(shared_model(plan).backbone.config.model_type))
    return metrics_record(plan, backbone, cfg, per_client, skipped) | {
        "evaluated_on": "clients",  # federated: each client scored its own test set; no text reached the server
        "failed_clients": failed,
    }


def _summary(reply: Message) -> tuple[str, dict[str, Any] | None]:
    """A summarize reply's client and its scores as metrics.json's (None: no test examples, ``n`` 0, or no ``n`` and
    ``n_test`` 0 as client_summarize sends it); a reply without its records or SUMMARY_METRICS raises ValueError."""
    name = reply.content.config_records.get("identity", {}).get("client-name")
    if name is None or (metrics := reply.content.metric_records.get(METRICS_KEY)) is None:
        raise ValueError(f"it lacks an identity ConfigRecord of a client-name or a MetricRecord {METRICS_KEY!r}")
    return str(name), None if metrics.get("n", metrics.get("n_test")) == 0 else metrics_row(metrics, SUMMARY_METRICS)


@client_app.query("summarize")
def client_summarize(msg: Message, context: Context) -> Message:
    """Federated evaluation, the client's side: ROUGE of the client's own adapter on its own test set, as the
    evaluate stage computes it; replies numbers only (the summaries never leave the client)."""
    plan = served_plan(msg, context)
    name = client_name(context)
    cfg = from_dict(EvaluateConfig, json.loads(str(msg.content[CONFIG_KEY]["evaluate"])), "query.summarize: evaluate")
    partition = read_partition(plan.paths["partition"], name)
    test_ids = [str(i) for i in partition["clients"][name].get("test", [])]
    metrics: dict[str, float | int] = {"n_test": len(test_ids)}
    if test_ids:
        adapter = load_adapter(adapter_file(client_dir(plan, name, context), cfg.adapter))
        where = f"{plan.paths['partition']}, {plan.paths['examples']}"
        sub = test_subsample(read_examples(plan.paths["examples"]), test_ids, name, cfg, where)
        max_src = cfg.max_source_length or plan.model_config.max_source_length
        desc = f"{plan.experiment}/{name}"
        [predictions] = generate_per_run(shared_model(plan), [adapter], [sub["source"].tolist()], cfg, max_src, desc)
        metrics.update(client_scores(predictions, sub, len(test_ids))[1])
    records = {"identity": ConfigRecord({"client-name": name}), METRICS_KEY: MetricRecord(metrics)}
    return Message(RecordDict(records), reply_to=msg)


def never_contributed(history: list[dict[str, Any]]) -> dict[str, str]:
    """Clients sampled at least once whose every sampled round failed (no reply within the round timeout, an
    error, an undecodable reply): client -> its last error. Such a run has trained nothing of theirs."""
    sampled = [row for row in history if row.get("sampled")]
    last_error = {row["client"]: str(row.get("error") or "failed") for row in sampled}  # each client's last row
    contributed = {row["client"] for row in sampled if not row.get("failed")}
    return {c: error for c, error in last_error.items() if c not in contributed}


def write_eval_metrics(plan: Plan, metrics: dict[str, Any], keep: tuple[str, ...] = ()) -> Path:
    """metrics.json in a folder holding only this run's files (``keep``): an earlier evaluate stage's
    per-example files would otherwise sit beside scores they do not belong to."""
    out = PATHS.eval_dir(plan.experiment)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file() and stale.name not in keep:
            stale.unlink()
    atomic.write_json(out / "metrics.json", metrics)
    return out / "metrics.json"


class DeploymentRecorder(TrainRecorder):
    """The train stage's recorder (rounds files, MLflow per round) plus the federated evaluation every N rounds."""

    def __init__(self, logger, grid: Grid, plan_path: str, cfg: EvaluateConfig | None, every: int, timeout: float):
        super().__init__(logger)
        self.grid, self.plan_path, self.cfg, self.every, self.timeout = grid, plan_path, cfg, every, timeout
        self.per_round: list[dict[str, Any]] = []
        self.nodes: dict[int, str] | None = None  # the run's node -> client map (run_server sets it)
        self.clients: list[str] | None = None

    def started(self, plan: Plan, clients: list[str], start_round: int) -> None:
        super().started(plan, clients, start_round)
        self.clients = clients  # the run's: a node the server forgot (misnamed) may come back as one
        saved = PATHS.eval_dir(plan.experiment) / ROUNDS_EVAL
        if start_round == 1:  # an earlier run's evaluations, which a resumed run of this one would take for its own
            saved.unlink(missing_ok=True)
        elif saved.exists():  # resumed: kept
            self.per_round = [r for r in json.loads(saved.read_text())["rounds"] if r["round"] < start_round]

    def round_done(self, plan: Plan, entry, history: list[dict[str, Any]]) -> None:
        super().round_done(plan, entry, history)
        if self.cfg is None or self.every <= 0 or entry.round % self.every or entry.round >= plan.train.rounds:
            return
        metrics = federated_evaluate(self.grid, plan, self.plan_path, self.cfg, self.timeout, self.nodes, self.clients)
        self.per_round.append({"round": entry.round} | {k: metrics[k] for k in ROUND_KEYS})
        atomic.write_json(
            PATHS.eval_dir(plan.experiment) / ROUNDS_EVAL, {"experiment": plan.experiment, "rounds": self.per_round}
        )
        if self.logger is not None:
            self.logger.log_metrics(
                {f"eval.{c}.{k}": v[k] for c, v in metrics["clients"].items() for k in SCORE_KEYS}, step=entry.round
            )


def start_mlflow_run(plan: Plan, fresh: bool, run_id_file: Path):
    """The server's MLflow run: the one ``run_id_file`` names when resuming, else a new one (its id written there),
    with a child run per client the plan declares (the train stage's: per client of the partition it holds)."""
    if fresh and run_id_file.exists():
        # the MLflow run of an earlier attempt without a checkpointed round (a failed admission, a ServerApp
        # killed in round 1) holds no round: deleted, so the runs table keeps no dead attempts
        try:
            delete_run(run_id_file.read_text().strip())
        except Exception as exc:  # noqa: BLE001 -- a run already gone (another store, deleted by hand) is no error
            log.info("earlier MLflow run not deleted: %s", exc)
        run_id_file.unlink()
    tags, clients = run_identity_tags(plan, "deployment"), tuple(plan.clients or ())
    return RunLogger.start(plan.study, plan.experiment, plan.to_json_dict(), tags, run_id_file, clients=clients)


# The ServerApp `flwr run` / a SuperLink loads (pyproject.toml [tool.flwr.app.components]); the plan comes from the
# run config. Flower ignores what serve returns.
server_app = ServerApp()


@server_app.main()
def serve(grid: Grid, context: Context) -> dict[str, Any]:
    """Train (resuming after the last checkpointed round), record, evaluate on the clients: {"train", "eval"}."""
    # `flwr run` lets any value of a known key through
    run = from_dict(ServerRunConfig, dict(context.run_config), "run config")
    cfg = run.evaluate_config() if run.evaluate else None  # refused before anything starts (an MLflow run)
    plan_path = plan_path_of(None, context)
    plan = load_plan(plan_path)
    prepare_outputs(plan)
    out_dir = Path(plan.paths["out_dir"])
    checkpoint = load_server_checkpoint(plan)
    # `flwr run --stream` shows the ServerApp's output: the operator sees where the run starts
    where = f"resuming from round {int(checkpoint['round']) + 1}" if checkpoint else "starting at round 1"
    source = " (server checkpoint)" if checkpoint else ""
    print(f"{plan.experiment}: {where} of {plan.train.rounds}{source}", flush=True)
    run_id_file = checkpoints.mlflow_run_id_path(plan)
    logger = start_mlflow_run(plan, checkpoint is None, run_id_file) if run.mlflow else None

    round_timeout, admission_timeout = run.timeouts()
    recorder = DeploymentRecorder(logger, grid, plan_path, cfg, run.evaluate_every, round_timeout)
    ending = "KILLED"  # a rerun resumes it from the server checkpoint, or deletes it if none
    try:
        state, history = run_server(grid, plan_path, recorder, round_timeout, admission_timeout, ckpt=checkpoint)
        metrics = record_run(plan, history, recorder.round_seconds)
        silent = never_contributed(history)
        if silent:  # a hung or broken node: recorded round by round, but the run has no result for that client
            ending = "FAILED"
            checkpoints.server_checkpoint_path(plan).unlink(missing_ok=True)  # a rerun starts over
            run_id_file.unlink(missing_ok=True)
            name, error = next(iter(silent.items()))
            raise RuntimeError(
                f"{plan.experiment}: client(s) {sorted(silent)} failed in every round they were sampled "
                f"in ({name}: {error}); {out_dir / 'rounds.json'} has each round's error"
            )
        adapter = out_dir / GLOBAL_ADAPTER
        save_adapter(adapter, state, {"experiment": plan.experiment, "round": str(metrics["stopped_round"])})

        eval_metrics = None
        if cfg is not None:
            eval_metrics = federated_evaluate(
                grid, plan, plan_path, cfg, round_timeout, recorder.nodes, recorder.clients
            )
            kept = (ROUNDS_EVAL,) if recorder.per_round or checkpoint else ()  # this run's evaluations every N rounds
            eval_path = write_eval_metrics(plan, eval_metrics, keep=kept)
            scores = {c: round(v["avg_rouge"], 2) for c, v in eval_metrics["clients"].items()}
            log.info("%s: federated evaluation %s -> %s", plan.experiment, scores, eval_path)
        if logger is not None:
            log_missing_rounds(logger, history)  # a kill between a round's checkpoint and its logging: logged here
            # the aggregate as an artifact and as a LoggedModel
            log_run_outputs(logger, plan, metrics, [(adapter, None)], adapter)
            if eval_metrics is not None:
                run_info = plan.to_json_dict() | {"mlflow_run_id": logger.run_id}
                log_to_mlflow(run_info, eval_metrics, PATHS.eval_dir(plan.experiment), cfg)
            logger.finish("FINISHED")
    except BaseException:  # also after the rounds: while the run is evaluated, recorded and uploaded
        if logger is not None:
            logger.finish(ending)
        raise
    finally:
        recorder.close()
    # Finished: the outputs go to models/<exp>/ (with the clients' adapters when they share this disk), and the
    # next run of this plan starts over (client checkpoints stay on the clients' disks until its admission).
    checkpoints.publish_outputs(plan)
    checkpoints.server_checkpoint_path(plan).unlink(missing_ok=True)
    (checkpoints.checkpoint_dir(plan) / checkpoints.DP_RELEASES).unlink(missing_ok=True)  # a next run: its own
    run_id_file.unlink(missing_ok=True)
    return {"train": metrics, "eval": eval_metrics}
